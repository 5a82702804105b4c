"""Benchmark: steps lost per restore for pytorch/examples' own scripts, on the training-state API
against the same scripts as they ship (their own snapshot file), under ``ddpjob run`` with faults.

Scripts (fetched and patched by :mod:`tests.harness.pytorch_examples`): ``multinode`` (the DDP
tutorial series' ``multinode.py``: a DataLoader over DistributedSampler, a ``.mean()`` loss),
``multinode-accumulate`` (the same with 4 micro-batches a step under ``no_sync``) and ``mingpt``
(minGPT-ddp: 2 DataLoader workers, AMP's GradScaler, ``clip_grad_norm_``).

Faults (``ddpjob run --chaos``, one every ``--interval`` seconds, ±30 %, so at a random point of
a step): ``worker`` (one training process SIGKILLed, its pod lives), ``pod`` (a pod's whole
process tree SIGKILLed, replaced) and ``freeze`` (a pod SIGSTOPped whole, replaced as a lost node
after ``--node-lost-after`` seconds). Each run is a job of 3 pods (``minReplicas`` 1) that trains
until ``--faults`` faults are in and the job has had ``--settle`` seconds since the last, then is
stopped with SIGINT.

* ``api``: the script on ``ddpjob_worker.train`` (``<script>.patch``), with its audit
  (``DDPJOB_TRAIN_AUDIT``, :func:`ddpjob_worker.train.audit.check`): steps lost per restore (the
  newest step any rank committed before it, less the step it resumed at), every restore's ranks
  holding one model, the kept steps following each other with no sample of an epoch twice.
* ``baseline``: the script as it ships (``baseline/<script>.patch``: the CPU port only), which
  resumes from its own snapshot file (saved every epoch here, its best case), run through
  ``bench/steplog.py``: steps lost per restart = the optimizer steps the previous group took in
  the epochs the next one started again from.

Restores count every new group: after a fault, and after a replacement pod joins.

Usage: ``python bench/bench_scripts.py [--script multinode ...] [--fault pod ...] [--faults 10]
[--interval 12] [--json out.json]``; needs pytorch/examples (``DDPJOB_PYTORCH_EXAMPLES``, see
:mod:`tests.harness.pytorch_examples`) and, for ``mingpt``, ``pip install hydra-core fsspec
boto3``. Prints one row per script and fault: restores and steps lost (median, worst, mean) of
each mode, and the ratio of the baseline's mean to the API's.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from ddpjob_worker.train import audit  # noqa: E402
from tests.harness import pytorch_examples  # noqa: E402

DDPJOB = str(Path(sys.executable).parent / "ddpjob")
SCRIPTS = ("multinode", "multinode-accumulate", "mingpt")
FAULTS = {
    "worker": ("--chaos-kind", "worker"),
    "pod": ("--chaos-kind", "kill"),
    "freeze": ("--chaos-kind", "freeze"),
}
INJECTED = ("chaos: SIGKILL the process tree of", "chaos: SIGKILL the training process",
            "chaos: SIGSTOP the process tree of")  # fmt: skip
MINGPT = [
    "data_config.path=data/input.txt", "data_config.truncate=0.004", "data_config.block_size=32",
    "gpt_config.n_layer=2", "gpt_config.n_head=2", "gpt_config.n_embd=32",
    "trainer_config.batch_size=16", "trainer_config.max_epochs=100000",
    "trainer_config.data_loader_workers=2", "trainer_config.use_amp=True",
]  # fmt: skip


def command(script: str, baseline: bool) -> tuple[Path, list[str], int]:
    """The folder the script runs in (relative to its checkout), its argv and its dataset's
    size. The baseline snapshots every epoch; the API's script keeps no file."""
    if script == "mingpt":
        save = "trainer_config.save_every=" + ("1" if baseline else "100000")
        return Path("mingpt"), ["main.py", *MINGPT, save], 0
    return Path(), ["multinode.py", "100000", "1" if baseline else "100000"], 2048


def mingpt_size(folder: Path) -> int:
    text = (folder / "data" / "input.txt").read_text()
    return int(int(len(text) * 0.004) - 32) * 9 // 10  # train_split 0.9 of the truncated text


def manifest(folder: Path, argv: list[str], env: dict[str, str]) -> Path:
    document = {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": "bench"},
        "spec": {
            "replicas": 3,
            "minReplicas": 1,
            "maxReplicas": 3,
            "nprocPerNode": 1,
            "maxRestarts": 100,
            "backoffLimit": 100,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "unused-locally",
                            "command": ["ddpjob-agent"],
                            "args": argv,
                            "env": [{"name": k, "value": v} for k, v in env.items()],
                        }
                    ]
                }
            },
        },
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def run_job(job: Path, run_dir: Path, fault: str, faults: int, args: argparse.Namespace) -> str:
    """``ddpjob run`` with the faults; SIGINT once they are in and the job has settled."""
    chaos = ["--chaos", str(args.interval), *FAULTS[fault], "--chaos-faults", str(faults)]
    if fault == "freeze":
        chaos += ["--chaos-node-lost-after", str(args.node_lost_after)]
    argv = [DDPJOB, "run", str(job), "--plain", "--run-dir", str(run_dir), *chaos]
    process = subprocess.Popen(
        [*argv, "--seed", str(args.seed)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    last = [0.0]

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if any(mark in line for mark in INJECTED):
                last[0] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + args.interval * 1.4 * faults + 300
    while process.poll() is None and time.monotonic() < deadline:
        injected = sum(any(m in line for m in INJECTED) for line in lines)
        if injected >= faults and time.monotonic() - last[0] > args.settle:
            break
        time.sleep(1)
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # the second: SIGKILL everything
        process.wait(timeout=30)
    reader.join(timeout=10)
    return "".join(lines)


def baseline_lost(directory: Path) -> list[int]:
    """Steps done again at each restart: for each group (rank 0's processes in order), the
    optimizer steps the group before it took in the epochs this one started again from."""
    groups = []
    for path in directory.glob("rank0-*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        epochs = [r["epoch"] for r in records if "epoch" in r]
        if epochs:
            groups.append((records[0]["t"], epochs[0], [r["step"] for r in records if "step" in r]))
    groups.sort()
    lost = []
    for (_, _, before), (_, start, _) in itertools.pairwise(groups):
        lost.append(sum(1 for epoch in before if epoch >= start))
    return lost


def one(script: str, fault: str, baseline: bool, args: argparse.Namespace) -> dict[str, Any]:
    mode = "baseline" if baseline else "api"
    with tempfile.TemporaryDirectory(prefix=f"bench-scripts-{script}-") as tmp:
        root = args.keep / f"{script}-{fault}-{mode}" if args.keep else Path(tmp)
        folder = pytorch_examples.checkout(script, root / "src", baseline=baseline)
        where, argv, size = command(script, baseline)
        size = size or mingpt_size(folder / where)
        logs = root / "log"
        if baseline:
            env = {"STEPLOG": str(logs), "PYTHONPATH": str(REPO / "bench")}
            argv = ["-m", "steplog", *argv]
        else:
            env = {audit.DDPJOB_TRAIN_AUDIT: str(logs)}
        job = manifest(folder / where, argv, env)
        started = time.monotonic()
        faults = args.baseline_faults if baseline else args.faults
        out = run_job(job, root / "run", fault, faults, args)
        seconds = time.monotonic() - started
        injected = sum(any(m in line for m in INJECTED) for line in out.splitlines())
        row: dict[str, Any] = {"script": script, "fault": fault, "faults": injected,
                               "asked": faults, "seconds": round(seconds, 1)}  # fmt: skip
        if baseline:
            row["lost"] = baseline_lost(logs)
            return row
        found = audit.check(audit.read(logs), size)
        row["lost"] = found.lost[1:]  # the first "restore" is the job's start
        row["steps"] = found.steps
        row["problems"] = found.problems
        return row


def summary(lost: list[int]) -> str:
    if not lost:
        return "no restore"
    return (
        f"{len(lost):3d} restores, lost median {statistics.median(lost):g} worst {max(lost)} "
        f"mean {statistics.mean(lost):.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--script", action="append", choices=SCRIPTS)
    parser.add_argument("--fault", action="append", choices=sorted(FAULTS))
    parser.add_argument("--faults", type=int, default=10, help="faults per run (default 10)")
    parser.add_argument(
        "--baseline-faults", type=int, help="faults per baseline run (default: --faults)"
    )
    parser.add_argument("--interval", type=float, default=12.0, help="seconds between faults")
    parser.add_argument("--settle", type=float, default=25.0, help="seconds after the last fault")
    parser.add_argument("--node-lost-after", type=float, default=6.0)
    parser.add_argument("--no-baseline", action="store_true", help="the API's runs only")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--keep", type=Path, help="keep each run's files in DIR/<script>-<fault>-<mode>"
    )
    args = parser.parse_args(argv)
    if args.baseline_faults is None:
        args.baseline_faults = args.faults
    reason = pytorch_examples.unavailable()
    if reason is not None:
        print(f"bench_scripts: {reason}", file=sys.stderr)
        return 2
    rows = []
    failed = False
    for script in args.script or SCRIPTS:
        for fault in args.fault or sorted(FAULTS):
            for baseline in (False,) if args.no_baseline else (False, True):
                row = one(script, fault, baseline, args)
                row["mode"] = "baseline" if baseline else "api"
                rows.append(row)
                problems = row.get("problems", [])
                print(
                    f"{script:21s} {fault:7s} {row['mode']:8s} faults {row['faults']:2d} "
                    f"{summary(row['lost'])}"
                    + (f" steps {row['steps']}" if "steps" in row else "")
                    + (f" PROBLEMS {problems[:3]}" if problems else ""),
                    flush=True,
                )
                failed |= bool(problems) or row["faults"] < row["asked"]
    print("\nsteps lost per restore (mean): baseline / api")
    by: dict[tuple[str, str], dict[str, list[int]]] = collections.defaultdict(dict)
    for row in rows:
        by[(row["script"], row["fault"])][row["mode"]] = row["lost"]
    for (script, fault), modes in by.items():
        api, base = modes.get("api", []), modes.get("baseline", [])
        if not base:
            continue
        mean_api = statistics.mean(api) if api else float("nan")
        mean_base = statistics.mean(base)
        ratio = "inf (api lost 0)" if mean_api == 0 else f"{mean_base / mean_api:.1f}x"
        print(f"{script:21s} {fault:7s} {mean_base:8.2f} / {mean_api:.2f} = {ratio}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
