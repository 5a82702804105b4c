"""Benchmark: what the training-state API's DataLoader path costs a step, and what restarting
its loader workers adds to a recovery (issue 48's overhead goals).

One process, one rank (gloo, world 1), a DDP model with AdamW over a map-style dataset of random
rows, read by a ``torch.utils.data.DataLoader`` with ``--workers`` loader workers (2 by default),
trained two ways in alternating epochs so that both see the same machine:

* ``plain``: the script as people write it: ``DataLoader(dataset, batch_size=B,
  sampler=DistributedSampler(dataset))``, ``set_epoch`` each epoch, a ``.mean()`` loss;
* ``api``: the same loop on ``ddpjob_worker.train``: ``DataLoader(dataset,
  batch_sampler=ElasticSampler(len(dataset), batch_size=B))``, ``TrainState(model, optimizer,
  loader=...)``, ``state.epochs()`` and a ``state.step()`` block (snapshots in ``/dev/shm`` at the
  default cadence, the committed position kept apart from what the workers fetched ahead).

Each epoch builds its iterator anew (the loader workers start each epoch, in both modes); the
first epoch of each mode warms up and is not timed. It prints the mean step time of each mode
and their ratio (``api / plain``; the goal: at most 1.02).

Loader restart: what a restore adds for the loader workers. A restored worker builds its
DataLoader and takes its first batch: the seconds from ``iter()`` to the first batch with
``--workers`` workers, less the same with none (median of 5, in the training process, whose
size the workers' fork copies page tables of); the goal: at most 0.5 s.

Models: ``toy`` (16 -> 32 -> 1) and ``100m`` (six 4,096 x 4,096 linear layers: 100.7 M
parameters, 1.2 GB of state with AdamW's moments), as in ``bench_snapshot_overhead.py``.

``--shared`` has both modes train one model and optimizer, as in ``bench_snapshot_overhead.py``
(the plain mode's steps then pass the API's optimizer hook, a flag test, and its warning about a
step outside a step block is silenced).

Usage: ``python bench/bench_loader_overhead.py --model toy --model 100m [--epochs 4] [--shared]
[--json F]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "worker"))
from ddpjob_worker.train import ElasticSampler, TrainState  # noqa: E402

MODELS: dict[str, tuple[Callable[[], nn.Module], int, int, int]] = {
    # name: (model, input width, batch, steps per epoch)
    "toy": (lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)), 16, 64, 200),
    "100m": (
        lambda: nn.Sequential(
            *(layer for _ in range(6) for layer in (nn.Linear(4096, 4096), nn.ReLU()))
        ),
        4096,
        32,
        12,
    ),
}


class Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random rows and targets, fetched one at a time as a map-style dataset is."""

    def __init__(self, count: int, width: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, width, generator=generator)
        self.y = torch.randn(count, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class Model:
    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        self.ddp = DistributedDataParallel(MODELS[name][0]())
        self.optimizer = torch.optim.AdamW(self.ddp.parameters(), lr=1e-4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        out = self.ddp(x)
        loss = (out[:, :1] - y).pow(2).mean()  # a .mean() loss, as scripts write it
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


def plain(model: Model, data: Rows, batch: int, workers: int) -> Iterator[list[float]]:
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=1, rank=0, seed=0)
    loader = DataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        times = []
        started = time.perf_counter()
        for x, y in loader:
            model.step(x, y)
            now = time.perf_counter()
            times.append(now - started)
            started = now
        epoch += 1
        yield times


def api(
    model: Model, data: Rows, batch: int, workers: int, shm: Path, epochs: int
) -> Iterator[list[float]]:
    loader = DataLoader(
        data, batch_sampler=ElasticSampler(len(data), batch_size=batch), num_workers=workers
    )
    state = TrainState(model=model.ddp, optimizer=model.optimizer, loader=loader, path=shm / "snap")
    for _ in state.epochs(epochs):
        times = []
        started = time.perf_counter()
        for x, y in loader:
            with state.step():
                model.step(x, y)
            now = time.perf_counter()
            times.append(now - started)
            started = now
        state.flush()  # a background copy belongs to its epoch, not to the other mode's
        yield times


def first_batch(data: Rows, batch: int, workers: int) -> float:
    """Seconds from a new DataLoader's ``iter()`` to its first batch (the restore's cost)."""
    loader = DataLoader(
        data, batch_sampler=ElasticSampler(len(data), batch_size=batch), num_workers=workers
    )
    started = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    seconds = time.perf_counter() - started
    del iterator  # its workers stop
    return seconds


def measure(name: str, epochs: int, workers: int, shm: Path, *, shared: bool) -> dict[str, Any]:
    _, width, batch, steps = MODELS[name]
    data = Rows(batch * steps, width)
    one = Model(name)
    models = {"plain": one, "api": one if shared else Model(name)}
    loops = {
        "plain": plain(models["plain"], data, batch, workers),
        "api": api(models["api"], data, batch, workers, shm, epochs + 1),
    }
    for loop in loops.values():
        next(loop)  # warm-up epoch
    times: dict[str, list[float]] = {"plain": [], "api": []}
    for _ in range(epochs):
        for mode, loop in loops.items():
            times[mode] += next(loop)
    mean = {mode: statistics.fmean(values) for mode, values in times.items()}
    with_workers = statistics.median(first_batch(data, batch, workers) for _ in range(5))
    without = statistics.median(first_batch(data, batch, 0) for _ in range(5))
    return {
        "model": name,
        "params": sum(p.numel() for p in models["plain"].ddp.parameters()),
        "batch": batch,
        "workers": workers,
        "steps": len(times["api"]),
        "shared": shared,
        "plain_step_s": mean["plain"],
        "api_step_s": mean["api"],
        "api_vs_plain": mean["api"] / mean["plain"],
        "first_batch_workers_s": with_workers,
        "first_batch_inline_s": without,
        "loader_restart_s": with_workers - without,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(MODELS))
    parser.add_argument("--epochs", type=int, default=4, help="timed epochs of each mode")
    parser.add_argument("--workers", type=int, default=2, help="loader workers (default 2)")
    parser.add_argument(
        "--shared",
        action="store_true",
        help="both modes train one model and optimizer (for 100m: each mode's own 1.6 GB of "
        "state lands differently in memory, several percent between modes doing the same work)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if args.shared:  # the plain mode's optimizer.step() is outside a step block, on purpose
        logging.getLogger("ddpjob_worker.train").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    results = []
    try:
        for name in args.model or ["toy"]:
            with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="bench-loader-") as shm:
                result = measure(name, args.epochs, args.workers, Path(shm), shared=args.shared)
            results.append(result)
            print(
                f"{name:5s} {result['params']:>11,} params, batch {result['batch']}, "
                f"{result['workers']} loader workers, {result['steps']} steps each: "
                f"plain {result['plain_step_s'] * 1e3:.2f} ms, api "
                f"{result['api_step_s'] * 1e3:.2f} ms, api/plain {result['api_vs_plain']:.3f}; "
                f"loader restart {result['loader_restart_s']:.3f} s "
                f"(first batch {result['first_batch_workers_s']:.3f} s with workers, "
                f"{result['first_batch_inline_s']:.3f} s without)",
                flush=True,
            )
    finally:
        dist.destroy_process_group()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
