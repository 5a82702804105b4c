"""A worker's state after each committed step, in memory that outlives the worker. No torch.

Issue 36's first piece: where a step's state goes, not yet who writes it (the training-state
API) nor who reads it back (the restore from the survivors). A :class:`SnapshotFile` is one
file, normally in ``/dev/shm`` (memory: it survives the worker's process, not the pod), made by
the pod's agent and opened by its workers. It holds **two slots**: a write goes to the slot
that does not hold the newest good snapshot, so a worker killed in the middle of a copy
(SIGKILL, the OOM killer, a lost collective) loses at most that copy, never the snapshot before
it (DLRover's flash checkpoint keeps one buffer, and a crash mid-copy loses it).

Each slot has a descriptor in the file's header: a sequence number (odd while the slot is being
written, a seqlock), the step, the round's generation, the payload's length and its CRC-32.
The descriptor is written *after* the payload, and the sequence is made even last; a reader
takes a slot only if its sequence is even and unchanged around its read and its CRC matches
the payload it read. The newest good snapshot is the one with the highest (generation, step).

Layout: a 4,096-byte header (magic, version, capacity, two 40-byte descriptors), then slot 0,
then slot 1, each ``capacity`` bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

MAGIC = b"DDPJSNAP"
VERSION = 1
HEADER_BYTES = 4096
_PREAMBLE = struct.Struct("<8sIQ")  # magic, version, capacity
_SLOT = struct.Struct("<QqqQI4x")  # seq, step, generation, length, crc32
_SEQ = struct.Struct("<Q")  # a slot descriptor's first field
_SLOTS_AT = _PREAMBLE.size
SLOTS = 2


class SnapshotError(Exception):
    """A snapshot file that cannot be used (the message says which and why)."""


class SnapshotTooLargeError(SnapshotError):
    """A step's state does not fit a slot."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One good snapshot: the step, the round's generation it was taken in, and the bytes."""

    step: int
    generation: int
    payload: bytes
    slot: int


@dataclasses.dataclass(frozen=True)
class _Descriptor:
    seq: int
    step: int
    generation: int
    length: int
    crc: int


def file_bytes(capacity: int) -> int:
    """The size of a snapshot file whose slots hold ``capacity`` bytes each (what ``/dev/shm``
    must have room for: a little more than twice the state)."""
    return HEADER_BYTES + SLOTS * capacity


class SnapshotFile:
    """Two slots of ``capacity`` bytes in one memory-mapped file (see the module doc).

    Single writer (the pod's local rank that commits), any number of readers; the agent creates
    the file (:meth:`create`), workers open it (:meth:`open`)."""

    def __init__(self, path: Path, mm: mmap.mmap, capacity: int) -> None:
        self.path = path
        self._mm = mm
        self.capacity = capacity
        self._newest: int | None = None
        """The slot this writer last filled (None: not known yet, read it once)."""

    @classmethod
    def create(cls, path: Path, capacity: int) -> SnapshotFile:
        """A new, empty snapshot file at ``path`` (replacing one there)."""
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with tmp.open("wb") as out:
            out.truncate(file_bytes(capacity))
            out.write(_PREAMBLE.pack(MAGIC, VERSION, capacity))
        os.replace(tmp, path)
        return cls.open(path)

    @classmethod
    def open(cls, path: Path) -> SnapshotFile:
        """Open the snapshot file at ``path``; :class:`SnapshotError` if it is not one."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise SnapshotError(f"cannot open the snapshot file {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise SnapshotError(f"{path} is not a snapshot file ({size} bytes)")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, capacity = _PREAMBLE.unpack_from(mm, 0)
        if magic != MAGIC or version != VERSION or size != file_bytes(capacity):
            mm.close()
            raise SnapshotError(
                f"{path} is not a version-{VERSION} snapshot file "
                f"(magic {magic!r}, version {version}, {size} bytes)"
            )
        return cls(path, mm, capacity)

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._mm.close()

    # -- writing --------------------------------------------------------------------------------

    def write(self, step: int, generation: int, payload: bytes | bytearray | memoryview) -> int:
        """Store ``payload`` as the state after ``step`` in round ``generation``, in the slot
        that does not hold the newest good snapshot; which slot it went to."""
        data = memoryview(payload).cast("B")

        def copy(view: memoryview) -> None:
            view[:] = data

        return self.write_with(step, generation, data.nbytes, copy)

    def write_with(
        self, step: int, generation: int, nbytes: int, fill: Callable[[memoryview], None]
    ) -> int:
        """:meth:`write`, with the payload written in place by ``fill`` (handed the slot's
        first ``nbytes`` bytes): no copy of the state outside the file first."""
        if nbytes > self.capacity:
            raise SnapshotTooLargeError(
                f"a step's state is {nbytes} bytes and a snapshot slot holds "
                f"{self.capacity}: give the job's snapshots more room"
            )
        if self._newest is None:
            newest = self.latest()  # once per writer: a read of both slots, CRCs checked
            self._newest = None if newest is None else newest.slot
        slot = 0 if self._newest is None else 1 - self._newest
        at = _SLOTS_AT + slot * _SLOT.size
        (seq,) = _SEQ.unpack_from(self._mm, at)
        begin = seq + 1 if seq % 2 == 0 else seq + 2  # odd: being written
        # The sequence first (odd), then the payload, then the descriptor, then the even sequence.
        _SEQ.pack_into(self._mm, at, begin)
        offset = self._offset(slot)
        with memoryview(self._mm) as whole, whole[offset : offset + nbytes] as view:
            fill(view)
            crc = zlib.crc32(view)
        _SLOT.pack_into(self._mm, at, begin, step, generation, nbytes, crc)
        _SEQ.pack_into(self._mm, at, begin + 1)
        self._newest = slot
        return slot

    # -- reading --------------------------------------------------------------------------------

    def latest(self, generation: int | None = None) -> Snapshot | None:
        """The newest good snapshot (highest generation, then step), or only those of
        ``generation``; None if there is none (a fresh file, or only torn or corrupt slots)."""
        found = [self.read(slot) for slot in range(SLOTS)]
        good = [
            s for s in found if s is not None and (generation is None or s.generation == generation)
        ]
        return max(good, key=lambda s: (s.generation, s.step), default=None)

    def read(self, slot: int) -> Snapshot | None:
        """Slot ``slot``'s snapshot if it is whole and its CRC matches, else None."""
        at = _SLOTS_AT + slot * _SLOT.size
        before = _Descriptor(*_SLOT.unpack_from(self._mm, at))
        if before.seq == 0 or before.seq % 2 or before.length > self.capacity:
            return None
        offset = self._offset(slot)
        payload = bytes(self._mm[offset : offset + before.length])
        after = _Descriptor(*_SLOT.unpack_from(self._mm, at))
        if after != before or zlib.crc32(payload) != before.crc:
            return None
        return Snapshot(step=before.step, generation=before.generation, payload=payload, slot=slot)

    def _offset(self, slot: int) -> int:
        return HEADER_BYTES + slot * self.capacity
