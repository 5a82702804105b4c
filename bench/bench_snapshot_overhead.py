"""Benchmark: what a snapshot after every step costs a training step (issue 36's overhead goal).

One process, one rank (gloo, world 1), a DDP model with AdamW and random data, trained two ways
in alternating blocks of ``--block`` steps so that both see the same machine: the plain loop
(the baseline), and the same loop on ``ddpjob_worker.train.TrainState`` with a snapshot in
``/dev/shm`` after every committed step. It prints the median step time of each, their ratio,
and the snapshot's own time and size.

Models: ``toy`` (``tests/integration/snap_train.py``'s: 16 -> 32 -> 1, Adam's state included a
few KB), ``100m`` (six 4,096 x 4,096 linear layers with biases: 100.7 M parameters, about
1.2 GB of state with AdamW's two moments). ``--batch`` sets the rows per step: the snapshot's
cost is fixed by the model's size, the step's grows with the batch.

Usage: ``python bench/bench_snapshot_overhead.py --model toy --model 100m [--steps 40]
[--batch 64] [--json out.json]``
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "worker"))
from ddpjob_worker.train import ElasticSampler, TrainState  # noqa: E402

MODELS: dict[str, Callable[[], nn.Module]] = {
    "toy": lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)),
    "100m": lambda: nn.Sequential(
        *(layer for _ in range(6) for layer in (nn.Linear(4096, 4096), nn.ReLU()))
    ),
}


def width(model: nn.Module) -> int:
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return int(first.in_features)


def measure(name: str, steps: int, block: int, batch: int, shm: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    net = MODELS[name]()
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(batch, width(net))
    state = TrainState(
        model=model,
        optimizer=opt,
        sampler=ElasticSampler(batch * (steps + 2 * block + 4), batch_size=batch, seed=0),
        path=shm / f"{name}.snap",
    )

    def one_step() -> None:
        loss = model(data).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    plain: list[float] = []
    snapped: list[float] = []
    snapshot_s: list[float] = []
    batches = state.batches()
    one_step()  # warm both paths up: allocations, AdamW's state
    next(batches)
    with state.step():
        one_step()
    while len(snapped) < steps:
        for _ in range(block):
            started = time.perf_counter()
            one_step()
            plain.append(time.perf_counter() - started)
        for _ in range(block):
            started = time.perf_counter()
            next(batches)
            with state.step():
                one_step()
            snapped.append(time.perf_counter() - started)
            snapshot_s.append(state.snapshot_seconds)
    params = sum(p.numel() for p in net.parameters())
    size = (shm / f"{name}.snap").stat().st_size
    base, ours = statistics.median(plain), statistics.median(snapped)
    return {
        "model": name,
        "params": params,
        "batch": batch,
        "steps": len(snapped),
        "plain_step_s": base,
        "snapshot_step_s": ours,
        "ratio": ours / base,
        "overhead_pct": 100 * (ours - base) / base,
        "snapshot_s": statistics.median(snapshot_s),
        "snapshot_file_bytes": size,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", action="append", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=40, help="steps of each kind, per model")
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    results = []
    with tempfile.TemporaryDirectory(prefix="ddpjob-bench-", dir="/dev/shm") as shm:
        for name in args.model or ["toy", "100m"]:
            result = measure(name, args.steps, args.block, args.batch, Path(shm))
            print(json.dumps(result), flush=True)
            results.append(result)
    dist.destroy_process_group()
    print()
    print("| model | params | batch | plain step | with snapshots | ratio | snapshot | file |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['model']} | {r['params']:,} | {r['batch']} | {r['plain_step_s'] * 1000:.2f} ms "
            f"| {r['snapshot_step_s'] * 1000:.2f} ms | {r['ratio']:.2f}x "
            f"| {r['snapshot_s'] * 1000:.2f} ms | {r['snapshot_file_bytes'] / 2**20:.0f} MiB |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
