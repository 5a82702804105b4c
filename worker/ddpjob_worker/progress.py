"""Each worker's progress, where its agent can read it at no cost: the step, the phase the
worker is in and since when, in a 32-byte shared-memory record per local rank. No torch.

Issue 36's hang detection starts here. The worker (the training-state API,
:mod:`ddpjob_worker.train`) marks each change of phase: ``COMPUTE`` when a step's batch is
handed out, ``COLLECTIVE`` when the step's gradients go to the all-reduce (DDP's
communication hook), ``COMMIT`` when it is done (``SNAPSHOT`` instead while a snapshot of it
is written), ``IDLE`` outside steps (the restore, the end). A mark is one
``struct.pack_into`` into an mmap, under a sequence number that is odd while the record is
written (a seqlock, as the snapshot slots have), so a reader in another process never takes a
torn record. The agent reads each local rank's record
with two ``pread`` calls (the record, then its sequence again), and the store host's hub
decides with :mod:`ddpjob_worker.hang`, from every rank's record, which one holds the others up.

The record is ``rank<local rank>.progress`` in the agent's snapshot directory
(:mod:`ddpjob_worker.snapdir`). Times are ``time.monotonic()`` seconds: a worker and its
agent share the node's clock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import mmap
import os
import time
from pathlib import Path
from struct import Struct

RECORD = Struct("<QqIdf")
"""seq, step, phase, since, threshold: 32 bytes."""
_SEQ = Struct("<Q")
READ_TRIES = 5


class Phase(enum.IntEnum):
    IDLE = 0
    """Not in a step: starting, restoring, done."""
    COMPUTE = 1
    """Forward and backward of a step, before its gradients are all-reduced."""
    COLLECTIVE = 2
    """Waiting in the step's all-reduce (the other ranks hold it up, or it runs)."""
    COMMIT = 3
    """The step is done (committed)."""
    SAVING = 4
    """Writing a checkpoint to disk (:meth:`ddpjob_worker.train.TrainState.save_checkpoint`):
    as long as the storage takes, never a hang (the agent lets a write finish)."""
    SNAPSHOT = 5
    """The step is done and its snapshot is being written (:mod:`ddpjob_worker.train.cadence`:
    not every step's)."""


@dataclasses.dataclass(frozen=True)
class Progress:
    step: int
    """The step the worker is in (the count of steps committed before it)."""
    phase: Phase
    since: float
    """When it entered this phase of this step (``time.monotonic()``)."""
    threshold: float = 0.0
    """How long this worker's steps say a wait may last before it is a hang (learned by the
    worker from its own step times: :class:`ddpjob_worker.hang.StepTimes`); 0: not known."""


def path_for(directory: Path, local_rank: int) -> Path:
    return directory / f"rank{local_rank}.progress"


class ProgressWriter:
    """The worker's side: one record, marked at each change of phase."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # No O_TRUNC: a restarted worker's record is never empty for its agent to read.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, RECORD.size)
            self._map = mmap.mmap(fd, RECORD.size)
        finally:
            os.close(fd)
        self._seq = 0
        self.mark(0, Phase.IDLE)

    def mark(
        self, step: int, phase: Phase, now: float | None = None, threshold: float = 0.0
    ) -> None:
        when = time.monotonic() if now is None else now
        self._seq += 1  # odd: being written
        _SEQ.pack_into(self._map, 0, self._seq)
        RECORD.pack_into(self._map, 0, self._seq, step, int(phase), when, threshold)
        self._seq += 1  # even: whole
        _SEQ.pack_into(self._map, 0, self._seq)

    def close(self) -> None:
        with contextlib.suppress(ValueError, BufferError):
            self._map.close()


def node_records(directory: Path, since: float) -> list[Progress]:
    """The records of this node's local ranks in ``directory`` written at or after ``since``
    (a worker of an earlier round left the others)."""
    found = (read(path) for path in sorted(directory.glob("rank*.progress")))
    return [record for record in found if record is not None and record.since >= since]


def read(path: Path) -> Progress | None:
    """The record at ``path`` (None: no such file, or never whole while we tried)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        for _ in range(READ_TRIES):
            data = os.pread(fd, RECORD.size, 0)
            if len(data) < RECORD.size:
                return None
            seq, step, phase, since, threshold = RECORD.unpack(data)
            if seq % 2 == 0 and os.pread(fd, _SEQ.size, 0) == data[: _SEQ.size]:
                try:
                    return Progress(step, Phase(phase), since, threshold)
                except ValueError:
                    return None
        return None
    finally:
        os.close(fd)
