"""A tiny DDP script on the training-state API (:mod:`ddpjob_worker.train`), for
``test_train_restore``. Parseable, flushed lines::

    SNAP start rank=<r> pid=<p> restart=<n> dir=<DDPJOB_SNAPSHOT_DIR>
    SNAP resumed rank=<r> step=<s> source=<rank|none> local=<0|1> sum=<state checksum>
    SNAP committed rank=<r> step=<s> ms=<snapshot write ms> sum=<state checksum>
    SNAP done rank=<r> step=<s> sum=<model checksum>

The state checksum (:func:`state_sum`) covers the model and the optimizer's state: a restored
step's must equal the one the job had when it committed that step.

``--drop-on-restart R``: on a restart, local rank R deletes its snapshot file first (it must
then receive the state from another rank).

``--hang-at S --hang-rank R --hang-marker PATH``: rank R hangs in step S, before its backward
(``SNAP hanging rank=<r> step=<s>``), once: the first to hang makes PATH, and a worker that
finds PATH made trains on.

``--snapshot-every N``: a periodic snapshot every N steps (default: learned; for this model's
0.05-0.1 s steps that is every step), so that a large N leaves the steps since the last one to
the write at the stop.

``--find-unused``: ``DistributedDataParallel(find_unused_parameters=True)``, whose buckets are
never rebuilt: with three ranks or more, the only way a restarted process sums the gradients
in the order the first one did, so that its run is bitwise the run without a restart.

``--background on|off``: copy the parameters and the optimizer's state on the snapshot's
background thread whatever their size, or never (default: by size; this model is small enough
to be written whole at the commit).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpjob_worker.train import (
    ElasticSampler,
    TrainState,
    model_checksum,
    snapshot_path,
)
from ddpjob_worker.train.payload import tensor_bytes


def say(line: str) -> None:
    sys.stdout.write(f"SNAP {line}\n")  # one write: the two workers share the log
    sys.stdout.flush()


def state_sum(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """CRC-32 of the model's state, then of the optimizer's (its entries in order)."""
    crc = model_checksum(model)
    for _, entry in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(entry.items()):
            crc = zlib.crc32(key.encode(), crc)
            data = tensor_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode()
            crc = zlib.crc32(data, crc)
    return crc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--drop-on-restart", type=int, default=-1)
    parser.add_argument("--ballast-mb", type=int, default=0, help="MB more state per snapshot")
    parser.add_argument("--hang-at", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-marker", type=Path)
    parser.add_argument("--background", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--snapshot-every", type=int, help="TrainState(snapshot_every=...)")
    parser.add_argument("--find-unused", action="store_true")
    args = parser.parse_args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    say(
        f"start rank={rank} pid={os.getpid()} restart={restart} "
        f"dir={os.environ.get('DDPJOB_SNAPSHOT_DIR', '')}"
    )
    if restart > 0 and local_rank == args.drop_on_restart:
        snapshot_path(os.environ).unlink(missing_ok=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    model = DistributedDataParallel(net, find_unused_parameters=args.find_unused)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.randn(4096, 16, generator=torch.Generator().manual_seed(1))
    ballast = {"ballast": torch.zeros(args.ballast_mb << 18)} if args.ballast_mb else {}
    state = TrainState(
        model=model,
        optimizer=opt,
        sampler=ElasticSampler(len(data), batch_size=8, seed=0),
        extra=ballast,
        background={"auto": None, "on": True, "off": False}[args.background],
        snapshot_every=args.snapshot_every,
    )
    for indices in state.batches():
        if state.restored is not None and state.step_no == state.restored.step:
            source = "none" if state.restored.source is None else state.restored.source
            say(
                f"resumed rank={rank} step={state.step_no} source={source} "
                f"local={int(state.restored.local)} sum={state_sum(model, opt)}"
            )
        if state.step_no >= args.steps:
            break
        with state.step():
            loss = model(data[indices]).pow(2).mean()
            if (state.step_no, rank) == (args.hang_at, args.hang_rank) and args.hang_marker:
                with contextlib.suppress(FileExistsError):
                    args.hang_marker.touch(exist_ok=False)
                    say(f"hanging rank={rank} step={state.step_no}")
                    while True:  # a deadlock in user code: its agent and peers live on
                        time.sleep(1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(args.step_sleep)
        say(
            f"committed rank={rank} step={state.step_no} ms={state.stats.snapshot_seconds * 1000:.2f} "
            f"sum={state_sum(model, opt)}"
        )
    say(f"done rank={rank} step={state.step_no} sum={model_checksum(model)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
