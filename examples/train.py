"""A small real DDP training job: an MLP on seeded synthetic data, on CPU with gloo (or GPU).

Run it under ``ddpjob-agent`` (or torchrun), or alone. It resumes from the latest checkpoint and
prints parseable, flushed lines that the tests and the benchmark read. With ``--snapshots`` it
runs on the training-state API (:mod:`ddpjob_worker.train`, :func:`train_on_state`): every
committed step is kept in memory and a restart resumes from the newest step any rank holds,
the checkpoint on disk being the fallback when none does::

    DDPJOB resume step=<s> rank=<r> world=<w> restart=<TORCHELASTIC_RESTART_COUNT>
        [from=<snapshot|checkpoint|none>]       (from=: with --snapshots)
    DDPJOB step=<s> rank=<r> world=<w> loss=<f>
    DDPJOB ckpt step=<s>
    DDPJOB sigterm rank=<r>
    DDPJOB sigterm-done rank=<r>      (only with --sigterm-delay, after the delay)
    DDPJOB crash pod=<p> step=<s>     (--crash-once-on-pod)
    DDPJOB abort-at-exit pod=<p>      (--abort-at-exit-once-on-pod, after the done line)
    DDPJOB done steps=<n> rank=<r>

``step=<s>`` in a ``ckpt`` or ``resume`` line is the number of steps completed.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpjob_worker import init_distributed, saving
from ddpjob_worker.train import ElasticSampler, TrainState

CKPT_NAME = "latest.pt"
STATE_CKPT_NAME = "state.pt"
FEATURES = 32
BATCH = 64
SAMPLES = 8192
"""The synthetic dataset's size with ``--snapshots`` (64 steps an epoch at world 2)."""


def say(line: str) -> None:
    sys.stdout.write(f"DDPJOB {line}\n")  # one write: the workers of a node share the log
    sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100, help="total steps")
    parser.add_argument(
        "--ckpt-dir",
        default=os.environ.get("DDPJOB_CKPT_DIR", "./ckpt"),
        help="checkpoint directory (default: $DDPJOB_CKPT_DIR or ./ckpt)",
    )
    parser.add_argument("--ckpt-every", type=int, default=10, help="checkpoint every K steps")
    parser.add_argument(
        "--ckpt-write-seconds",
        type=float,
        default=0.0,
        help="spend this long writing each checkpoint (a large one), in 0.1 s chunks",
    )
    parser.add_argument("--step-sleep", type=float, default=0.0, help="sleep per step (s)")
    parser.add_argument(
        "--crash-always", action="store_true", help="exit 1 at step 0 on every rank"
    )
    parser.add_argument(
        "--crash-once-on-pod",
        type=int,
        default=None,
        metavar="P",
        help="on the pod whose DDPJOB_POD_INDEX is P, exit 1 at --crash-step, once per job "
        "(a marker file in the checkpoint directory remembers it)",
    )
    parser.add_argument("--crash-step", type=int, default=5, help="step of --crash-once-on-pod")
    parser.add_argument(
        "--crash-delay",
        type=float,
        default=0.0,
        help="wait this long before that crash: the other ranks are then blocked in the step's "
        "collective and fail within milliseconds of it",
    )
    parser.add_argument(
        "--raise-at-step",
        type=int,
        default=None,
        metavar="S",
        help="raise --raise-message (a RuntimeError) at step S on every rank, uncaught",
    )
    parser.add_argument("--raise-message", default="a bug in the training script")
    parser.add_argument(
        "--abort-at-exit-once-on-pod",
        type=int,
        default=None,
        metavar="P",
        help="on pod P, abort (SIGABRT) after the last step and the done line, once per job: "
        "what gloo does when a peer's socket closes during teardown",
    )
    parser.add_argument(
        "--sigterm-delay",
        type=float,
        default=0.0,
        help="on SIGTERM, take this long to exit (a slow checkpoint); further SIGTERMs wait too",
    )
    parser.add_argument(
        "--stuck-at-step",
        type=int,
        default=None,
        help="at this step, rank 0 sleeps in uninterruptible kernel state (D) for --stuck-seconds "
        "(a vfork whose child sleeps: Linux only), like a worker wedged on a device",
    )
    parser.add_argument("--stuck-seconds", type=float, default=5.0)
    parser.add_argument(
        "--snapshots",
        action="store_true",
        help="train on the training-state API: the committed step kept in memory (every few "
        "steps, and whenever a worker stops or its step fails), a restart resumes from the "
        "newest step any rank holds (the checkpoint is the fallback); the fault flags above "
        "but --crash-once-on-pod and --raise-at-step are not supported here",
    )
    args = parser.parse_args(argv)
    if args.snapshots:
        unsupported = [
            flag
            for flag, value in (
                ("--crash-always", args.crash_always),
                ("--abort-at-exit-once-on-pod", args.abort_at_exit_once_on_pod is not None),
                ("--stuck-at-step", args.stuck_at_step is not None),
                ("--ckpt-write-seconds", args.ckpt_write_seconds),
            )
            if value
        ]
        if unsupported:
            parser.error(f"{', '.join(unsupported)}: not supported with --snapshots")
    return args


def crash_marker(ckpt_dir: str, pod: int) -> Path:
    return Path(ckpt_dir) / f"crashed-once-pod-{pod}"


def stuck_in_kernel(seconds: float) -> None:
    """Sit in uninterruptible sleep (state D): vfork, and let the child sleep before exiting."""
    import ctypes  # noqa: PLC0415

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.vfork() == 0:  # the child shares our memory: only plain libc calls here
        libc.usleep(int(seconds * 1_000_000))
        libc._exit(0)


def inject_faults(args: argparse.Namespace, pod: str | None, step: int) -> None:
    """Before ``step``: ``--crash-once-on-pod`` (exit 1, once per job) and ``--raise-at-step``."""
    if args.crash_once_on_pod is not None and pod == str(args.crash_once_on_pod):
        marker = crash_marker(args.ckpt_dir, args.crash_once_on_pod)
        if step >= args.crash_step and not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            try:  # once per job: of a pod's local ranks, the first to get here
                marker.touch(exist_ok=False)
            except FileExistsError:
                return
            time.sleep(args.crash_delay)
            say(f"crash pod={pod} step={step}")
            os._exit(1)
    if args.raise_at_step == step:
        raise RuntimeError(args.raise_message)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per (step, rank), so a resumed run sees the same data."""
    gen = torch.Generator().manual_seed(step * 100_003 + rank)
    x = torch.randn(BATCH, FEATURES, generator=gen)
    y = x[:, :4].sum(dim=1, keepdim=True)
    return x, y


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    if not path.exists():
        return 0
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    write_seconds: float = 0.0,
) -> None:
    """Write atomically (a temporary file, then ``os.replace``): a reader sees the old
    checkpoint or the new one, never a torn file. ``saving()`` lets the write finish before
    ddpjob-agent stops this worker and holds a SIGTERM until then."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    with saving():
        torch.save(state, tmp)
        for _ in range(round(write_seconds / 0.1)):  # a large checkpoint's write
            time.sleep(0.1)
        os.replace(tmp, path)
    say(f"ckpt step={step}")


def dataset(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``--snapshots``' data: SAMPLES seeded samples, the same in every process."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    return x.to(device), x[:, :4].sum(dim=1, keepdim=True).to(device)


def train_on_state(args: argparse.Namespace, info: Any) -> int:
    """The loop on :class:`ddpjob_worker.train.TrainState`: a few changed lines from
    :func:`main`'s. The sampler splits what is left of an epoch over the ranks of any world
    size, so a change of world size neither skips nor repeats a sample."""
    rank, world = info.rank, info.world_size
    model = build_model().to(info.device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    state = TrainState(
        model=ddp,
        optimizer=optimizer,
        sampler=ElasticSampler(SAMPLES, batch_size=BATCH, seed=0, epochs=1_000_000),
        checkpoint=Path(args.ckpt_dir) / STATE_CKPT_NAME,
    )
    x, y = dataset(info.device)
    pod = os.environ.get("DDPJOB_POD_INDEX")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    said = False
    for indices in state.batches():  # restores first
        step = state.step_no
        if not said and state.restored is not None:
            restored = state.restored
            origin = "snapshot" if restored.source is not None else "none"
            origin = "checkpoint" if restored.checkpoint else origin
            say(f"resume step={step} rank={rank} world={world} restart={restart} from={origin}")
            said = True
        if step >= args.steps:
            break
        inject_faults(args, pod, step)
        with state.step():  # a clean exit commits the step and snapshots it
            optimizer.zero_grad()
            # A sum over the global batch, not a mean: a rank may get no sample at an epoch's
            # tail, and must still take part in the all-reduce.
            loss = (ddp(x[indices]) - y[indices]).pow(2).sum() / BATCH
            loss.backward()
            optimizer.step()
        say(f"step={step} rank={rank} world={world} loss={loss.item():.6f}")
        done = state.step_no
        if (done % args.ckpt_every == 0 or done == args.steps) and state.save_checkpoint():
            say(f"ckpt step={done}")
        if args.step_sleep:
            time.sleep(args.step_sleep)
    dist.barrier()
    say(f"done steps={state.step_no} rank={rank}")
    del ddp, state
    gc.collect()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank_hint = os.environ.get("RANK", "0")

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        say(f"sigterm rank={rank_hint}")
        if args.sigterm_delay:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(args.sigterm_delay)
            say(f"sigterm-done rank={rank_hint}")
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    info = init_distributed()
    if args.snapshots:
        return train_on_state(args, info)
    rank, world = info.rank, info.world_size
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    model = build_model().to(info.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = Path(args.ckpt_dir) / CKPT_NAME
    start = load(ckpt, model, optimizer)
    # Rank 0's checkpoint is the truth: other ranks may not see the same file (no shared volume
    # on a cluster). DDP copies rank 0's weights at construction; the step must follow them.
    # (The optimizer is plain SGD, so it has no state to copy.)
    agreed = torch.tensor([start], dtype=torch.long, device=info.device)
    dist.broadcast(agreed, src=0)
    start = int(agreed.item())
    ddp = DistributedDataParallel(model)
    say(f"resume step={start} rank={rank} world={world} restart={restart}")
    if args.crash_always:
        print(f"rank {rank}: --crash-always", file=sys.stderr, flush=True)
        return 1
    loss_fn = nn.MSELoss()
    pod = os.environ.get("DDPJOB_POD_INDEX")
    for step in range(start, args.steps):
        inject_faults(args, pod, step)
        if args.stuck_at_step == step and rank == 0:
            stuck_in_kernel(args.stuck_seconds)
        x, y = batch(step, rank)
        optimizer.zero_grad()
        loss = loss_fn(ddp(x.to(info.device)), y.to(info.device))
        loss.backward()
        optimizer.step()
        say(f"step={step} rank={rank} world={world} loss={loss.item():.6f}")
        done = step + 1
        if rank == 0 and (done % args.ckpt_every == 0 or done == args.steps):
            save(ckpt, model, optimizer, done, args.ckpt_write_seconds)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    dist.barrier()
    say(f"done steps={args.steps} rank={rank}")
    if args.abort_at_exit_once_on_pod is not None and pod == str(args.abort_at_exit_once_on_pod):
        marker = Path(args.ckpt_dir) / f"aborted-at-exit-once-pod-{pod}"
        if not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            say(f"abort-at-exit pod={pod}")
            os.abort()
    # DDP first, then the group. DDP's Reducer holds the process group, and the Reducer's
    # binding destroys it with the GIL held, while a gloo thread may still need the GIL to free
    # the last step's work: at exit, both wait for each other forever (the worker printed
    # "done" and never exits; seen with torch 2.13 under load). With DDP gone first, the group's
    # last reference is the ProcessGroup's own, whose destructor lets the GIL go.
    del ddp
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
