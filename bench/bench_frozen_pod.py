"""Benchmark: one pod of N frozen, with real agents (``ddpjob run``), this checkout against a
baseline checkout (say, the version before the hub) in the same run.

Each run is one ``ddpjob run`` of a DDPJob of ``--pods`` pods (minReplicas N/2, warm spares
off), whose workers do not train: each prints its world size and sleeps (no torch in the
worker, so N agents fit on two cores; each agent still imports torch, as a pod's does). Once
every pod's worker has printed world N, one pod (not pod 0) is frozen whole (SIGSTOP of its
agent and worker: a machine lost without a reset), and the time is measured from the freeze to
every survivor's new worker printing world N-1. The frozen pod is killed at the end of the run.

The baseline runs the same ``ddpjob run`` with ``PYTHONPATH`` pointing at another checkout's
``operator`` and ``worker``, so its agents are that checkout's. Prints a table and the ratio
of medians.

Usage: ``python bench/bench_frozen_pod.py --pods 24 --runs 3 --baseline /path/to/checkout``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
DDPJOB = Path(sys.executable).parent / "ddpjob"
WORKER = """
import os, sys, time
print("WORLD", os.environ["WORLD_SIZE"], "RANK", os.environ["RANK"], flush=True)
while True:
    time.sleep(1)
"""
WORLD = re.compile(r"^WORLD (\d+) RANK \d+$", re.MULTILINE)
CAP_SECONDS = 120.0


def manifest(root: Path, pods: int) -> Path:
    worker = root / "worker.py"
    worker.write_text(WORKER)
    document = {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": "frozen"},
        "spec": {
            "replicas": pods,
            "minReplicas": max(1, pods // 2),
            "maxReplicas": pods,
            "nprocPerNode": 1,
            "maxRestarts": 100,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "unused-locally",
                            "command": ["ddpjob-agent"],
                            "args": [str(worker)],
                            "env": [{"name": "DDPJOB_WARM_WORKERS", "value": "0"}],
                        }
                    ]
                }
            },
        },
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def worlds(run_dir: Path, since: float) -> dict[int, int]:
    """Each pod's last world size printed by a worker whose log changed after ``since``."""
    found: dict[int, int] = {}
    for log in (run_dir / "logs").glob("frozen-worker-*.log"):
        with contextlib.suppress(OSError):
            if log.stat().st_mtime < since:
                continue
            sizes = WORLD.findall(log.read_text(errors="replace"))
            if sizes:
                index = int(log.name.split("-")[2].split(".")[0])
                found[index] = int(sizes[-1])
    return found


def pod_tree(runner: int, index: int) -> list[psutil.Process]:
    for child in psutil.Process(runner).children():
        with contextlib.suppress(psutil.Error):
            if child.environ().get("DDPJOB_POD_INDEX") == str(index):
                return [child, *child.children(recursive=True)]
    raise RuntimeError(f"pod {index} is not running")


def wait(what: str, check: Callable[[], bool], cap: float) -> float:
    deadline = time.monotonic() + cap
    while time.monotonic() < deadline:
        if check():
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(what)


def run_once(pods: int, code: Path | None, root: Path) -> float | str:
    tmp = Path(tempfile.mkdtemp(dir=root))
    run_dir = tmp / "run"
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(code / "operator"), str(code / "worker")])
    out = (tmp / "ddpjob-run.out").open("w")
    runner = subprocess.Popen(
        [str(DDPJOB), "run", str(manifest(tmp, pods)), "--plain", "--run-dir", str(run_dir)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    frozen: list[psutil.Process] = []
    tree: list[psutil.Process] = []
    try:
        started = time.time()

        def formed() -> bool:
            w = worlds(run_dir, started)
            return len(w) == pods and set(w.values()) == {pods}

        wait("every pod at world N", formed, 600)
        time.sleep(3.0)  # a round that has run a while
        victim = pods - 1
        frozen = pod_tree(runner.pid, victim)
        at = time.time()
        t0 = time.monotonic()
        for process in frozen:
            with contextlib.suppress(psutil.Error):
                process.suspend()
        survivors = set(range(pods)) - {victim}

        def recovered() -> bool:
            w = worlds(run_dir, at)
            return survivors <= set(w) and all(w[i] == pods - 1 for i in survivors)

        try:
            return wait("every survivor at world N-1", recovered, CAP_SECONDS) - t0
        except TimeoutError:
            return f"timeout {CAP_SECONDS:g}s"
    finally:
        with contextlib.suppress(psutil.Error):
            tree = psutil.Process(runner.pid).children(recursive=True)
        for process in [*tree, *frozen]:
            with contextlib.suppress(psutil.Error):
                process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)
        runner.wait()


def summary(values: list[float | str]) -> str:
    ok = sorted(v for v in values if isinstance(v, float))
    failed = len(values) - len(ok)
    text = f"{ok[0]:.2f} / {statistics.median(ok):.2f} / {ok[-1]:.2f}" if ok else "-"
    return text + (f" ({failed} of {len(values)} did not recover)" if failed else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=24)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout to compare")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-frozen-"))
    results: dict[str, list[float | str]] = {"this checkout": [], "baseline": []}
    for run in range(args.runs):
        order = [("this checkout", None), ("baseline", args.baseline)]
        for name, code in order if run % 2 == 0 else order[::-1]:
            value = run_once(args.pods, code, root)
            results[name].append(value)
            print(f"{name}: {value}", file=sys.stderr, flush=True)
    print(f"\n| {args.pods} pods, one frozen -> survivors at world N-1 (s) | min / median / max |")
    print("|---|---|")
    for name, values in results.items():
        print(f"| {name} | {summary(values)} |")
    ours = [v for v in results["this checkout"] if isinstance(v, float)]
    base = [v for v in results["baseline"] if isinstance(v, float)]
    if ours and base:
        ratio = statistics.median(ours) / statistics.median(base)
        print(f"\nthis checkout / baseline (medians): {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
