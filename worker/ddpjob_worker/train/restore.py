"""The restore: a pure choice of the step every rank resumes from, then the collectives that
carry it (:meth:`~ddpjob_worker.train.trainstate.TrainState.restore` runs it).

Every rank tells the others its newest good snapshot (step, generation, CRC); the source is the
rank with the highest step (ties: the lowest rank). In DDP every rank holds the same model after
a step, so the highest step anywhere is a valid state for all, and any older one would lose
steps. Ranks holding exactly the source's step and CRC load their own copy; the others (a
replacement process, a rank whose file is gone or one step behind) receive the source's bytes
by broadcast. No rank holds a snapshot: rank 0 reads the checkpoint on disk and sends it to the
others (on a cluster they may not see the same volume), or every rank starts fresh. Then all
ranks compare a checksum of their model state and fail loudly if they differ.

The collectives go over the default process group, as int64 and uint8 tensors (not
``all_gather_object``, which needs numpy to unpickle).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ddpjob_worker.train.payload import derived_seed, model_checksum, seed_rng, tensor_bytes
from ddpjob_worker.train.snapshot import Snapshot

logger = logging.getLogger("ddpjob_worker.train")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`TrainState.restore` did: the step, where it came from, its size."""

    step: int
    source: int | None
    """The rank whose snapshot was used; None for a checkpoint or a fresh start."""
    local: bool
    """This rank loaded its own copy (False: received by broadcast, or a fresh start)."""
    nbytes: int
    checkpoint: bool = False
    """It came from the checkpoint on disk (no rank held a snapshot)."""


@dataclasses.dataclass(frozen=True)
class Newest:
    """A rank's newest good snapshot, as it tells the others."""

    step: int
    generation: int
    checksum: int


@dataclasses.dataclass(frozen=True)
class Choice:
    """Where the ranks resume from: the source rank, its step, and which ranks hold exactly
    its step and bytes (they load their own copy; the others receive it)."""

    source: int
    step: int
    have: tuple[bool, ...]


def choose(held: Sequence[Newest | None]) -> Choice | None:
    """The source of the restore, from every rank's newest snapshot (None where a rank has
    none): the highest step, ties to the lowest rank; the ranks that hold the same step and
    CRC (not the generation: it is per node, and a scale-up does not change it). None when no
    rank holds a snapshot. Pure."""
    candidates = [(newest.step, -rank) for rank, newest in enumerate(held) if newest is not None]
    if not candidates:
        return None
    step, negative = max(candidates)
    target = held[-negative]
    assert target is not None  # a candidate's own entry
    have = tuple(
        newest is not None and (newest.step, newest.checksum) == (target.step, target.checksum)
        for newest in held
    )
    return Choice(source=-negative, step=step, have=have)


class Load(Protocol):
    """Load a snapshot's or a checkpoint's bytes (``rng``: its RNG states too); the step it
    holds."""

    def __call__(self, payload: bytes | memoryview, *, rng: bool) -> int: ...


def from_peers(local: Snapshot | None, load: Load, seed: int) -> Restored | None:
    """Resume from the newest step any rank holds (the module doc); None when no rank holds a
    snapshot. Collective: every rank calls it."""
    rank, world = rank_world()
    mine = [0, 0, 0, 0] if local is None else [1, local.step, local.generation, local.checksum]
    told = all_gather(mine, world)
    choice = choose([Newest(*info[1:]) if info[0] else None for info in told])
    if choice is None:
        return None
    own = choice.have[rank]
    payload: bytes | memoryview = local.payload if own and local is not None else b""
    if not all(choice.have):
        received = broadcast_bytes(payload if rank == choice.source else None, choice.source)
        payload = payload or received
    load(payload, rng=own)
    if not own:
        seed_rng(derived_seed(seed, rank, choice.step))
    logger.info(
        "rank %d: resumed at step %d from rank %d's snapshot (%s, %d bytes)",
        rank,
        choice.step,
        choice.source,
        "own copy" if own else "received",
        len(payload),
    )
    return Restored(step=choice.step, source=choice.source, local=own, nbytes=len(payload))


def from_checkpoint(checkpoint: Path | None, load: Load, seed: int) -> Restored:
    """No rank holds a snapshot: rank 0's checkpoint, sent to the others, or a fresh start.
    Collective when there is a checkpoint path."""
    rank, world = rank_world()
    fresh = Restored(step=0, source=None, local=False, nbytes=0)
    mine = b""
    failed = ""
    if rank == 0 and checkpoint is not None:
        try:
            mine = checkpoint.read_bytes()
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed = f"{checkpoint}: {exc}"
            logger.error("rank 0 cannot read the checkpoint %s", failed)
    # Every rank agrees before the broadcast (a rank alone in a collective waits forever):
    # each says whether it was given a checkpoint path, rank 0 whether it could read it.
    flags = all_gather([int(checkpoint is not None), int(bool(failed))], world)
    without = [r for r, flag in enumerate(flags) if not flag[0]]
    if len(without) not in (0, world):  # every rank sees the same flags: all raise
        raise RuntimeError(
            f"TrainState(checkpoint=...) must name the same file on every rank; rank(s) "
            f"{without} have none"
        )
    if flags[0][1]:
        raise RuntimeError(
            f"rank 0 cannot read the checkpoint ({failed or 'see rank 0'}): no rank holds a "
            "snapshot either; fix the file or remove it to start from step 0"
        )
    if checkpoint is None:
        return fresh
    payload = mine if world == 1 else broadcast_bytes(mine if rank == 0 else None, 0)
    if not payload:
        return fresh
    step = load(payload, rng=rank == 0)
    if rank != 0:
        seed_rng(derived_seed(seed, rank, step))
    logger.info(
        "rank %d: no rank holds a snapshot; resumed at step %d from the checkpoint %s",
        rank,
        step,
        checkpoint,
    )
    return Restored(step=step, source=None, local=rank == 0, nbytes=len(payload), checkpoint=True)


def check_same_model(model: torch.nn.Module, where: Path | None) -> None:
    """Every rank holds the same model state after the restore, or every rank raises.
    ``where``: the snapshot directory, named in the error."""
    rank, world = rank_world()
    sums = [values[0] for values in all_gather([model_checksum(model)], world)]
    if len(set(sums)) > 1:
        raise RuntimeError(
            f"rank {rank}: the ranks' models differ after the restore (checksums by rank: "
            f"{sums}); the snapshots are inconsistent: remove the job's snapshot directory "
            f"({where if where else 'none'}) to resume from a checkpoint"
        )


def rank_world() -> tuple[int, int]:
    """This process's rank and world size in the default group (0 and 1 without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather(values: list[int], world: int) -> list[list[int]]:
    """Every rank's ``values`` (the same number on each), as int64 tensors: not
    ``all_gather_object``, which needs numpy to unpickle."""
    if world == 1:
        return [values]
    mine = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [[int(v) for v in tensor.tolist()] for tensor in out]


def broadcast_bytes(payload: bytes | memoryview | None, source: int) -> bytes | memoryview:
    """``source``'s bytes on every rank: their length, then a flat uint8 tensor."""
    length = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64)
    dist.broadcast(length, source)
    if payload:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(buffer, source)
    return payload if payload is not None else tensor_bytes(buffer)
