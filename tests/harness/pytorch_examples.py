"""Scripts of pytorch/examples, fetched (not copied into this repository) and patched onto the
training-state API with the patches in ``examples/pytorch-examples``.

Each script has up to three patches, applied in order: ``<script>.base.patch`` (what a user
wrote before the API, where the script is not pytorch/examples' own: gradient accumulation),
``<script>.patch`` (the training-state API: the lines a user changes, counted in the docs) and
``<script>.cpu.patch`` (the port to gloo on CPU that this machine needs: no device, no NCCL; a
GPU user does not apply it). ``baseline/<script>.patch`` is the script without the API, its base
and CPU port in one (the benchmarks' baseline, ``bench/bench_scripts.py``).

The source is a git repository holding :data:`COMMIT`: ``$DDPJOB_PYTORCH_EXAMPLES`` (a clone,
or a bare mirror), else ``.cache/pytorch-examples``, cloned from GitHub when it is missing and
the network allows. :func:`checkout` writes the scripts' folders at that commit into a
directory and applies a patch; :func:`unavailable` says why it cannot (no source, no network).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "examples" / "pytorch-examples"
URL = "https://github.com/pytorch/examples"
COMMIT = "77f55b912142e11fcfdf5b530231fb9c52f181e8"
"""pytorch/examples' main of 2025-07-14, the commit the patches apply to."""
FOLDERS = {
    "multinode": "distributed/ddp-tutorial-series",
    "multinode-accumulate": "distributed/ddp-tutorial-series",
    "mingpt": "distributed/minGPT-ddp",
}


def source() -> Path:
    configured = os.environ.get("DDPJOB_PYTORCH_EXAMPLES")
    return Path(configured) if configured else ROOT / ".cache" / "pytorch-examples"


def _git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )


def unavailable() -> str | None:
    """Why the scripts cannot be had here, or None (cloning them first where they are missing)."""
    where = source()
    if _git("-C", str(where), "cat-file", "-e", f"{COMMIT}^{{commit}}").returncode == 0:
        return None
    if os.environ.get("DDPJOB_PYTORCH_EXAMPLES"):
        return f"DDPJOB_PYTORCH_EXAMPLES={where} does not hold pytorch/examples at {COMMIT}"
    try:
        cloned = subprocess.run(
            ["git", "clone", "--quiet", "--filter=blob:none", "--no-checkout", URL, str(where)],
            capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        cloned = subprocess.CompletedProcess([], 1, "", "no answer in 120 s")
    if cloned.returncode != 0:
        shutil.rmtree(where, ignore_errors=True)
        return (
            f"pytorch/examples could not be cloned from {URL} ({cloned.stderr.strip()[-200:]}): "
            "set DDPJOB_PYTORCH_EXAMPLES to a clone of it"
        )
    return None


def checkout(script: str, target: Path, *, baseline: bool = False) -> Path:
    """The folder of ``script`` (a key of :data:`FOLDERS`) at :data:`COMMIT` in ``target``,
    with its patches applied (:func:`patches`); the folder's path. ``baseline``: the script
    without the API instead, as the user had it, ported to CPU (``baseline/<script>.patch``)."""
    folder = FOLDERS[script]
    target.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(source()), "archive", "--format=tar", COMMIT, folder],
        capture_output=True,
        timeout=600,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    for patch in [PATCHES / "baseline" / f"{script}.patch"] if baseline else patches(script):
        applied = _git("apply", str(patch), cwd=target)
        if applied.returncode != 0:
            raise RuntimeError(f"{patch.name} does not apply: {applied.stderr}")
    return target / folder


def patches(script: str, *, cpu: bool = True) -> list[Path]:
    """The patches of ``script``, in the order they apply (the CPU port last, unless not ``cpu``)."""
    names = [f"{script}.base.patch", f"{script}.patch"] + ([f"{script}.cpu.patch"] if cpu else [])
    return [PATCHES / name for name in names if (PATCHES / name).exists()]


def changed_lines(script: str) -> tuple[int, int]:
    """The added and removed lines of the API's patch (``<script>.patch``, not the CPU port)."""
    added = removed = 0
    for line in (PATCHES / f"{script}.patch").read_text(encoding="utf-8").splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed
