"""Benchmark: what the snapshots cost a training step (issue 36's overhead goal).

One process, one rank (gloo, world 1), a DDP model with AdamW and random data, trained five
ways in alternating blocks of ``--block`` steps so that all see the same machine: the bare loop
(``plain``: a fixed batch, no sampler at all), the plain loop as a script writes it (``sampler``:
torch's ``DistributedSampler`` in a ``BatchSampler`` hands it each step's indices), the same
loop on ``ddpjob_worker.train.TrainState`` with ``snapshots=False`` (``nosnap``: ddpjob without
snapshots, its sampler and the step's bookkeeping only), with a snapshot in ``/dev/shm`` after
every committed step (``every``: the previous version) and with the default cadence (``auto``:
a snapshot as often as ``ddpjob_worker.train.cadence`` allows, the steps in between written at a
stop). No mode uses its indices (the batch is the same tensor), so what differs is the
bookkeeping. It prints the mean step time of each (a snapshot every few steps shows only in
the mean), the ratios of ``auto`` to the baselines, and the snapshot's own times: what the
commit took on the training thread and the background copy's.

Models: ``toy`` (``tests/harness/snap_train.py``'s: 16 -> 32 -> 1, Adam's state included a
few KB), ``100m`` (six 4,096 x 4,096 linear layers with biases: 100.7 M parameters, about
1.2 GB of state with AdamW's two moments). ``--batch`` sets the rows per step: the snapshot's
cost is fixed by the model's size, the step's grows with the batch.

``--shared`` has all modes train one model and optimizer: for ``100m`` each mode's own 1.6 GB
of state lands differently in memory, which shows as several percent between modes doing the
same work; shared, the TrainStates' optimizer hooks run in every mode (microseconds, which
matter for ``toy`` only).

``--threads N`` sets ``torch.set_num_threads(N)`` for the training (default: torch's own, one
per core): ``--threads 1`` on this 2-core machine leaves a core free, as a GPU node's CPUs are
while its GPU trains.

Usage: ``python bench/bench_snapshot_overhead.py --model toy --model 100m [--steps 40]
[--batch 64] [--threads N] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DistributedSampler

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "worker"))
from ddpjob_worker.train import ElasticSampler, TrainState, cadence  # noqa: E402

MODELS: dict[str, Callable[[], nn.Module]] = {
    "toy": lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)),
    "100m": lambda: nn.Sequential(
        *(layer for _ in range(6) for layer in (nn.Linear(4096, 4096), nn.ReLU()))
    ),
}


def width(model: nn.Module) -> int:
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return int(first.in_features)


MODES = ("plain", "sampler", "nosnap", "every", "auto")


class Run:
    """One mode's model and optimizer: its own, so that no mode pays another's optimizer
    hooks (a TrainState with snapshots registers one) and each goes on from its own last step;
    with ``--shared`` one for all modes."""

    def __init__(self, name: str, data: torch.Tensor) -> None:
        torch.manual_seed(0)
        self.model = DistributedDataParallel(MODELS[name]())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.data = data

    def step(self) -> None:
        loss = self.model(self.data).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


def measure(
    name: str, steps: int, block: int, batch: int, shm: Path, *, shared: bool = False
) -> dict[str, Any]:
    data = torch.randn(batch, width(MODELS[name]()))
    samples = batch * (steps + 2 * block + 4 + cadence.FIRST_INTERVAL)
    if shared:
        one = Run(name, data)
        runs = dict.fromkeys(MODES, one)
    else:
        runs = {mode: Run(name, data) for mode in MODES}

    def make(mode: str, **kwargs: Any) -> TrainState:
        return TrainState(
            model=runs[mode].model,
            optimizer=runs[mode].optimizer,
            sampler=ElasticSampler(samples, batch_size=batch, seed=0),
            **kwargs,
        )

    states = {
        "nosnap": make("nosnap", snapshots=False),
        "every": make("every", path=shm / f"{name}.every.snap", snapshot_every=1),
        "auto": make("auto", path=shm / f"{name}.auto.snap"),
    }
    loops = {mode: state.batches() for mode, state in states.items()}
    # The plain loop as a script writes it: torch's own sampler hands it the step's indices.
    batches = iter(
        BatchSampler(
            # It reads only len() of its dataset: a range stands for one.
            DistributedSampler(range(samples), num_replicas=1, rank=0, seed=0),  # type: ignore[arg-type]
            batch,
            drop_last=True,
        )
    )

    def settle() -> None:
        # Between blocks, outside the timings: a background copy still running belongs to
        # the block that started it, not to the next block's first step.
        for state in states.values():
            state.flush()

    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    written: dict[str, list[float]] = {"every": [], "auto": []}
    background: dict[str, list[float]] = {"every": [], "auto": []}
    # Warm every path up: allocations, AdamW's state, and both slots of each snapshot file (a
    # slot's first fill faults its pages in, 2-4 s for 100m's 2.3 GB: once in a job's life,
    # not its steady state; in the timed steps it added about 30 ms to 100m's mean).
    for mode in MODES:
        state = states.get(mode)
        if state is None:
            runs[mode].step()
            continue
        while True:
            next(loops[mode])
            with state.step():
                runs[mode].step()
            if state.stats.snapshots_written >= 2 or mode == "nosnap":
                break
    settle()
    while len(times["auto"]) < steps:
        for mode in MODES:
            state = states.get(mode)
            one_step = runs[mode].step
            for _ in range(block):
                count = 0 if state is None else state.stats.snapshots_written
                started = time.perf_counter()
                if state is None:
                    if mode == "sampler":
                        next(batches)
                    one_step()
                else:
                    next(loops[mode])
                    with state.step():
                        one_step()
                times[mode].append(time.perf_counter() - started)
                if state is not None and mode in written and state.stats.snapshots_written > count:
                    written[mode].append(state.stats.snapshot_seconds)
            settle()
            if state is not None and mode in background:
                background[mode].append(state.stats.background_seconds)  # the block's last copy
    params = sum(p.numel() for p in runs["plain"].model.parameters())
    # Means, not medians: a snapshot every few steps shows in the mean only.
    mean = {mode: statistics.fmean(times[mode]) for mode in MODES}
    auto = states["auto"]
    return {
        "model": name,
        "params": params,
        "batch": batch,
        "threads": torch.get_num_threads(),
        "shared": shared,
        "steps": len(times["auto"]),
        **{f"{mode}_step_s": mean[mode] for mode in MODES},
        "every_vs_plain": mean["every"] / mean["plain"],
        "auto_vs_plain": mean["auto"] / mean["plain"],
        "auto_vs_sampler": mean["auto"] / mean["sampler"],
        "auto_vs_nosnap": mean["auto"] / mean["nosnap"],
        "auto_vs_every": mean["auto"] / mean["every"],
        "auto_interval": auto.stats.snapshot_interval,
        "auto_snapshots": len(written["auto"]),
        "snapshot_s": statistics.median(written["every"] or [0.0]),
        "background_s": statistics.median(background["every"] or [0.0]),
        "snapshot_file_bytes": (shm / f"{name}.every.snap").stat().st_size,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=40, help="steps of each kind, per model")
    parser.add_argument(
        "--block", type=int, default=20, help="steps of one kind in a row (the modes alternate)"
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for the training")
    parser.add_argument(
        "--shared",
        action="store_true",
        help="all modes train one model and optimizer (each mode's own 1.6 GB of state for "
        "100m lands differently in memory, which shows as several percent; shared, the "
        "TrainStates' optimizer hooks run in every mode: microseconds)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    results = []
    with tempfile.TemporaryDirectory(prefix="ddpjob-bench-", dir="/dev/shm") as shm:
        for name in args.model or ["toy", "100m"]:
            result = measure(
                name, args.steps, args.block, args.batch, Path(shm), shared=args.shared
            )
            print(json.dumps(result), flush=True)
            results.append(result)
    dist.destroy_process_group()
    print()
    print(
        "| model | params | threads | plain | plain + torch's sampler | no snapshots "
        "| every step | auto (interval) | every step vs plain | **auto vs plain** "
        "| **auto vs plain + sampler** | auto vs no snapshots | snapshot at the commit "
        "| in the background | file |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ms = {k: r[k] * 1000 for k in r if k.endswith("_s")}
        print(
            f"| {r['model']} | {r['params']:,} | {r['threads']} "
            f"| {ms['plain_step_s']:.3f} ms | {ms['sampler_step_s']:.3f} ms "
            f"| {ms['nosnap_step_s']:.3f} ms "
            f"| {ms['every_step_s']:.3f} ms | {ms['auto_step_s']:.3f} ms "
            f"({r['auto_interval']}) | {r['every_vs_plain']:.3f}x | **{r['auto_vs_plain']:.3f}x** "
            f"| **{r['auto_vs_sampler']:.3f}x** | {r['auto_vs_nosnap']:.3f}x "
            f"| {ms['snapshot_s']:.2f} ms "
            f"| {ms['background_s']:.2f} ms | {r['snapshot_file_bytes'] / 2**20:.0f} MiB |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
