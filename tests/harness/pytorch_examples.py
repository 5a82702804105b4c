"""Scripts of pytorch/examples, fetched (not copied into this repository) and patched onto the
training-state API with the patches in ``examples/pytorch-examples``.

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


def checkout(script: str, target: Path) -> Path:
    """The folder of ``script`` (a key of :data:`FOLDERS`) at :data:`COMMIT` in ``target``,
    with its patch applied; the folder's path."""
    folder = FOLDERS[script]
    target.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(source()), "archive", "--format=tar", COMMIT, folder],
        capture_output=True,
        timeout=600,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    applied = _git("apply", str(PATCHES / f"{script}.patch"), cwd=target)
    if applied.returncode != 0:
        raise RuntimeError(f"{script}.patch does not apply: {applied.stderr}")
    return target / folder


def changed_lines(script: str) -> tuple[int, int]:
    """The patch's added and removed lines."""
    added = removed = 0
    for line in (PATCHES / f"{script}.patch").read_text(encoding="utf-8").splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    return added, removed
