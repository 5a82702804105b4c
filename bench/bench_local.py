"""Benchmark `ddpjob run` against stock torchrun on the same job, in the same run.

For each of n rounds it runs, one after the other:

* torchrun: two local agents (`--nnodes=2`, c10d rendezvous on 127.0.0.1), the same
  examples/train.py with the same arguments as examples/quickstart.yaml;
* `ddpjob run examples/quickstart.yaml` (2 pods x 1 worker);
* `ddpjob run --chaos S` on the same manifest (pods SIGKILLed mid-training).

It prints wall times (min / median / max) and the ratios ddpjob/torchrun and chaos/no-chaos.
Target: ddpjob/torchrun <= 1.10 without chaos. Usage: python bench/bench_local.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MANIFEST = ROOT / "examples" / "quickstart.yaml"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def train_args() -> list[str]:
    job = yaml.safe_load(MANIFEST.read_text())
    return list(job["spec"]["template"]["spec"]["containers"][0]["args"])


def timed(commands: list[list[str]], env: dict[str, str], cwd: Path) -> tuple[float, bool]:
    started = time.monotonic()
    processes = [
        subprocess.Popen(c, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for c in commands
    ]
    codes = [p.wait(timeout=600) for p in processes]
    return time.monotonic() - started, all(code == 0 for code in codes)


def torchrun(tmp: Path) -> tuple[float, bool]:
    port = free_port()
    args = train_args()
    env = {**os.environ, "DDPJOB_CKPT_DIR": str(tmp / "torchrun-ckpt"), "PYTHONUNBUFFERED": "1"}
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=bench",
            "--max-restarts=3",
            f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
            *args,
        ]
        for node in range(2)
    ]
    return timed(commands, env, MANIFEST.parent)


def ddpjob(tmp: Path, *extra: str) -> tuple[float, bool]:
    run_dir = tempfile.mkdtemp(dir=tmp)
    command = [str(BIN / "ddpjob"), "run", str(MANIFEST), "--plain", "--run-dir", run_dir, *extra]
    return timed([command], dict(os.environ), ROOT)


def summary(times: list[float]) -> str:
    return f"{min(times):.1f} / {statistics.median(times):.1f} / {max(times):.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chaos", type=float, default=8.0, help="seconds between chaos kills")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"torchrun": [], "ddpjob run": [], "ddpjob run --chaos": []}
    failures: dict[str, int] = dict.fromkeys(results, 0)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        for round_ in range(args.rounds):
            chaos_flags = ("--chaos", str(args.chaos), "--seed", str(round_))
            for name, times in results.items():
                if name == "torchrun":
                    seconds, ok = torchrun(tmp)
                else:
                    seconds, ok = ddpjob(tmp, *(chaos_flags if "chaos" in name else ()))
                print(
                    f"round {round_ + 1}: {name}: {seconds:.1f}s {'ok' if ok else 'FAILED'}",
                    flush=True,
                )
                if ok:
                    times.append(seconds)
                else:
                    failures[name] += 1
            shutil.rmtree(tmp / "torchrun-ckpt", ignore_errors=True)
    print(f"\n| Scenario (n={args.rounds}) | wall s, min / median / max | failed runs |")
    print("|---|---|---|")
    for name, times in results.items():
        print(f"| {name} | {summary(times) if times else 'n/a'} | {failures[name]} |")
    base, ours, chaos = (results[k] for k in results)
    if base and ours:
        ratio = statistics.median(ours) / statistics.median(base)
        print(f"\nddpjob run / torchrun (median): {ratio:.2f}  (target <= 1.10)")
    if ours and chaos:
        ratio = statistics.median(chaos) / statistics.median(ours)
        print(f"chaos / no chaos (median): {ratio:.2f}  (the cost of recovery)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
