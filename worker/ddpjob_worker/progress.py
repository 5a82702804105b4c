"""Each worker's progress, where its agent can read it at no cost: the step, the phase the
worker is in and since when, in a 32-byte shared-memory record per local rank. No torch.

Issue 36's hang detection starts here. The worker (the training-state API,
:mod:`ddpjob_worker.train`) marks each change of phase: ``COMPUTE`` when a step's batch is
handed out, ``COLLECTIVE`` when the step's gradients go to the all-reduce (DDP's
communication hook), ``COMMIT`` while the step's snapshot is written, ``IDLE`` outside steps
(the restore, the end). A mark is one ``struct.pack_into`` into an mmap, under a sequence
number that is odd while the record is written (a seqlock, as the snapshot slots have), so a
reader in another process never takes a torn record. The agent reads each local rank's record
with one ``pread`` and :mod:`ddpjob_worker.hang` decides, from every rank's record, which one
holds the others up.

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

RECORD = Struct("<QqId4x")
"""seq, step, phase, since: 32 bytes."""
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
    """The step is done; its snapshot is being written."""


@dataclasses.dataclass(frozen=True)
class Progress:
    step: int
    """The step the worker is in (the count of steps committed before it)."""
    phase: Phase
    since: float
    """When it entered this phase of this step (``time.monotonic()``)."""


def path_for(directory: Path, local_rank: int) -> Path:
    return directory / f"rank{local_rank}.progress"


class ProgressWriter:
    """The worker's side: one record, marked at each change of phase."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, RECORD.size)
            self._map = mmap.mmap(fd, RECORD.size)
        finally:
            os.close(fd)
        self._seq = 0
        self.mark(0, Phase.IDLE)

    def mark(self, step: int, phase: Phase, now: float | None = None) -> None:
        when = time.monotonic() if now is None else now
        self._seq += 1  # odd: being written
        _SEQ.pack_into(self._map, 0, self._seq)
        RECORD.pack_into(self._map, 0, self._seq, step, int(phase), when)
        self._seq += 1  # even: whole
        _SEQ.pack_into(self._map, 0, self._seq)

    def close(self) -> None:
        with contextlib.suppress(ValueError, BufferError):
            self._map.close()


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
            seq, step, phase, since = RECORD.unpack(data)
            if seq % 2 == 0 and _SEQ.unpack(os.pread(fd, _SEQ.size, 0))[0] == seq:
                try:
                    return Progress(step=step, phase=Phase(phase), since=since)
                except ValueError:
                    return None
        return None
    finally:
        os.close(fd)
