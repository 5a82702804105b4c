"""A worker for ``test_stop_snapshot``: one rank of a gloo group (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` from the environment) on the training-state API with periodic
snapshots far apart, so that only the write at a stop can hold its newest step. Lines::

    STOP committed rank=<r> step=<s>
    STOP blocking rank=<r> step=<s> where=<before-backward|after-step>

``--block-at S --block-rank R --where before-backward``: rank R sleeps forever in step S before
its backward (the others wait for it in the all-reduce); ``after-step``: after its
``optimizer.step``, inside the block (a step that never commits). ``--own-handler``: the script
installs a SIGTERM handler of its own first: it says ``STOP handler rank=<r> step=<committed>``
and exits 7.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpjob_worker.train import ElasticSampler, TrainState

STATE: TrainState | None = None


def say(line: str) -> None:
    sys.stdout.write(f"STOP {line}\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", type=Path, required=True)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--block-at", type=int, default=-1)
    parser.add_argument("--block-rank", type=int, default=-1)
    parser.add_argument("--where", choices=("before-backward", "after-step"))
    parser.add_argument("--own-handler", action="store_true")
    args = parser.parse_args()
    if args.own_handler:

        def mine(signum: int, frame: FrameType | None) -> None:
            step = -1 if STATE is None else STATE.step_no
            say(f"handler rank={os.environ['RANK']} step={step}")
            sys.exit(7)

        signal.signal(signal.SIGTERM, mine)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model = DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    data = torch.randn(1024, 8, generator=torch.Generator().manual_seed(1))
    global STATE  # noqa: PLW0603 - the handler reports the step it ran at
    state = STATE = TrainState(
        model=model,
        optimizer=opt,
        sampler=ElasticSampler(len(data), batch_size=4, seed=0, epochs=100),
        path=args.path,
        snapshot_every=args.every,
    )
    for indices in state.batches():
        blocking = (state.step_no, rank) == (args.block_at, args.block_rank)
        with state.step():
            loss = model(data[indices]).pow(2).mean()
            if blocking and args.where == "before-backward":
                say(f"blocking rank={rank} step={state.step_no} where={args.where}")
                while True:
                    time.sleep(1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if blocking and args.where == "after-step":
                say(f"blocking rank={rank} step={state.step_no} where={args.where}")
                while True:
                    time.sleep(1)
            time.sleep(0.01)
        say(f"committed rank={rank} step={state.step_no}")


if __name__ == "__main__":
    main()
