"""A worker's state after each committed step, in memory that outlives the worker. No torch.

Issue 36's first piece: where a step's state goes, not yet who writes it (the training-state
API) nor who reads it back (the restore from the survivors). A :class:`SnapshotFile` is one
file, normally in ``/dev/shm`` (memory: it survives the worker's process, not the pod), made by
the pod's agent and opened by its workers. It holds **two slots**: a write goes to the slot
that does not hold the newest good snapshot, so a worker killed in the middle of a copy
(SIGKILL, the OOM killer, a lost collective) loses at most that copy, never the snapshot before
it (DLRover's flash checkpoint keeps one buffer, and a crash mid-copy loses it).

Each slot has a descriptor in the file's header: a sequence number (odd while the slot is being
written, a seqlock), the step, the round's generation, the payload's length and its checksum.
The descriptor is written *after* the payload, and the sequence is made even last; a reader
takes a slot only if its sequence is even and unchanged around its read and its checksum
matches the payload it read. The newest good snapshot is the one with the highest
(generation, step). A write can be split (:meth:`SnapshotFile.begin`, then
:meth:`SnapshotFile.publish`): the training state's background copy fills the slot between
the two, on another thread, while the slot's sequence stays odd.

**The checksum** (version 2): the CRC-32 of the slot's *page sums*, each 4,096-byte page of the
payload read as little-endian 64-bit words (the last page zero-padded) and summed modulo
2**64, each sum 8 bytes little-endian. Version 1 took zlib's CRC-32 over the whole payload,
which runs at 4.3 GB/s on one core here (0.28 s for a 1.2 GB state, every step); the page sums
are one vectorised pass (28 GB/s on one core with torch: :func:`ddpjob_worker.train.flat.page_sums`)
and the CRC-32 over them reads 1/512 of the bytes. A torn slot (pages of two writes), a lost
or stale page, a flipped bit or pages out of place all change it; what it misses and CRC-32
over the bytes would catch is words permuted inside one page. This module's own
:func:`page_sums` is the reference (stdlib, slow: for small payloads and tests); a reader or
writer with torch passes the fast one.

Layout: a 4,096-byte header (magic, version, capacity, two 40-byte descriptors), then slot 0,
then slot 1, each ``capacity`` bytes. A file of another version is refused by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

from ddpjob_worker import snapdir
from ddpjob_worker.contract import DDPJOB_SNAPSHOT_DIR

MAGIC = b"DDPJSNAP"
VERSION = 2
HEADER_BYTES = 4096
PAGE = 4096
"""The checksum's page: each page's 64-bit words are summed (see the module doc)."""
_PREAMBLE = struct.Struct("<8sIQ")  # magic, version, capacity
_SLOT = struct.Struct("<QqqQI4x")  # seq, step, generation, length, checksum
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
    checksum: int = 0
    """The payload's checksum (checked)."""


@dataclasses.dataclass(frozen=True)
class _Descriptor:
    seq: int
    step: int
    generation: int
    length: int
    crc: int


PageSums = Callable[[memoryview], bytes]
"""What :func:`page_sums` computes, however fast."""


def page_sums(data: bytes | bytearray | memoryview) -> bytes:
    """Each :data:`PAGE` bytes of ``data`` read as little-endian unsigned 64-bit words (the
    last page zero-padded) and summed modulo 2**64, 8 bytes little-endian each: the reference
    (pure Python, about 1 GB in 4 s; :func:`ddpjob_worker.train.flat.page_sums` is the fast one)."""
    view = memoryview(data).cast("B")
    out = bytearray()
    for at in range(0, len(view), PAGE):
        page = bytes(view[at : at + PAGE])
        if len(page) % 8:
            page += bytes(8 - len(page) % 8)
        words = (
            memoryview(page).cast("Q") if _LITTLE else struct.unpack(f"<{len(page) // 8}Q", page)
        )
        out += struct.pack("<Q", sum(words) % 2**64)
    return bytes(out)


_LITTLE = struct.pack("=H", 1) == struct.pack("<H", 1)


def checksum(data: bytes | bytearray | memoryview, sums: PageSums | None = None) -> int:
    """A slot's checksum: the CRC-32 of ``data``'s page sums (see the module doc)."""
    view = memoryview(data).cast("B")
    return zlib.crc32((sums or page_sums)(view))


@dataclasses.dataclass
class Write:
    """A slot being written (:meth:`SnapshotFile.begin`): its sequence is odd until
    :meth:`SnapshotFile.publish`, so nobody reads it meanwhile."""

    slot: int
    view: memoryview
    """The slot's first ``nbytes`` bytes, to fill."""
    seq: int


def file_bytes(capacity: int) -> int:
    """The size of a snapshot file whose slots hold ``capacity`` bytes each (what ``/dev/shm``
    must have room for: a little more than twice the state)."""
    return HEADER_BYTES + SLOTS * capacity


class SnapshotFile:
    """Two slots of ``capacity`` bytes in one memory-mapped file (see the module doc).

    Single writer (the pod's local rank that commits), any number of readers; the agent creates
    the file (:meth:`create`), workers open it (:meth:`open`)."""

    def __init__(
        self, path: Path, mm: mmap.mmap, capacity: int, sums: PageSums | None = None
    ) -> None:
        self.path = path
        self._mm = mm
        self.capacity = capacity
        self.sums = sums
        """The page sums' implementation (None: :func:`page_sums`, the slow reference)."""
        self._newest: int | None = None
        """The slot this writer last filled (None: not known yet, read it once)."""
        self._writing: Write | None = None

    @classmethod
    def create(cls, path: Path, capacity: int, sums: PageSums | None = None) -> SnapshotFile:
        """A new, empty snapshot file at ``path`` (replacing one there)."""
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with tmp.open("wb") as out:
                out.truncate(file_bytes(capacity))
                # The slots' pages are reserved now: a tmpfs (/dev/shm) with no room left for
                # a page written through the mapping kills the writer with SIGBUS; here it is
                # an OSError (ENOSPC) that the caller reports, and training goes on.
                os.posix_fallocate(out.fileno(), 0, file_bytes(capacity))
                out.write(_PREAMBLE.pack(MAGIC, VERSION, capacity))
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        return cls.open(path, sums)

    @classmethod
    def open(cls, path: Path, sums: PageSums | None = None) -> SnapshotFile:
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
        if magic == MAGIC and version != VERSION:
            mm.close()
            raise SnapshotError(
                f"{path} is a version-{version} snapshot file and this ddpjob_worker reads "
                f"version {VERSION} only (another version wrote it): it is not used"
            )
        if magic != MAGIC or size != file_bytes(capacity):
            mm.close()
            raise SnapshotError(
                f"{path} is not a version-{VERSION} snapshot file "
                f"(magic {magic!r}, version {version}, {size} bytes)"
            )
        return cls(path, mm, capacity, sums)

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
        write = self.begin(nbytes)
        try:
            fill(write.view)
        except BaseException:
            self.abandon(write)
            raise
        return self.publish(write, step, generation)

    def begin(self, nbytes: int) -> Write:
        """Start a write of ``nbytes`` into the slot that does not hold the newest good
        snapshot: its sequence made odd (nobody reads it from now on), its bytes handed out to
        fill, on any thread; then :meth:`publish` (or :meth:`abandon`). One write at a time."""
        if nbytes > self.capacity:
            raise SnapshotTooLargeError(
                f"a step's state is {nbytes} bytes and a snapshot slot holds "
                f"{self.capacity}: give the job's snapshots more room"
            )
        if self._writing is not None:
            raise SnapshotError(
                f"{self.path}: a write is still in progress (slot "
                f"{self._writing.slot}); publish or abandon it first"
            )
        if self._newest is None:
            newest = self.latest()  # once per writer: a read of both slots, checksums checked
            self._newest = None if newest is None else newest.slot
        slot = 0 if self._newest is None else 1 - self._newest
        at = _SLOTS_AT + slot * _SLOT.size
        (seq,) = _SEQ.unpack_from(self._mm, at)
        begin = seq + 1 if seq % 2 == 0 else seq + 2  # odd: being written
        # The sequence first (odd), then the payload, then the descriptor, then the even sequence.
        _SEQ.pack_into(self._mm, at, begin)
        offset = self._offset(slot)
        self._writing = Write(slot, memoryview(self._mm)[offset : offset + nbytes], begin)
        return self._writing

    def publish(self, write: Write, step: int, generation: int) -> int:
        """Finish ``write`` (:meth:`begin`; its bytes filled): the checksum over them, the
        descriptor, then the even sequence; from then on readers take it. Which slot."""
        if write is not self._writing:
            raise SnapshotError(f"{self.path}: publish of a write that is not in progress")
        try:
            total = checksum(write.view, self.sums)
            nbytes = write.view.nbytes
        finally:
            self.abandon(write)
        at = _SLOTS_AT + write.slot * _SLOT.size
        _SLOT.pack_into(self._mm, at, write.seq, step, generation, nbytes, total)
        _SEQ.pack_into(self._mm, at, write.seq + 1)
        self._newest = write.slot
        return write.slot

    def abandon(self, write: Write) -> None:
        """Give up ``write``: its slot stays odd (never read) until a later write takes it."""
        write.view.release()
        if self._writing is write:
            self._writing = None

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
        if after != before or checksum(payload, self.sums) != before.crc:
            return None
        return Snapshot(
            step=before.step,
            generation=before.generation,
            payload=payload,
            slot=slot,
            checksum=before.crc,
        )

    def slot_memory(self, slot: int) -> memoryview:
        """All of slot ``slot``'s bytes, for a writer that keeps views of them from one write
        to the next (release it before :meth:`close`); write only between :meth:`begin` and
        :meth:`publish` of a write to that slot."""
        offset = self._offset(slot)
        return memoryview(self._mm)[offset : offset + self.capacity]

    def _offset(self, slot: int) -> int:
        return HEADER_BYTES + slot * self.capacity


def snapshot_path(env: Mapping[str, str], base: Path = snapdir.SHM) -> Path:
    """This local rank's snapshot file: in the agent's directory (``DDPJOB_SNAPSHOT_DIR``), or
    under plain torchrun in ``/dev/shm/ddpjob-torchrun_<run id>`` (nobody removes that one)."""
    name = f"rank{int(env.get('LOCAL_RANK', '0'))}.snap"
    directory = env.get(DDPJOB_SNAPSHOT_DIR)
    if directory:
        return Path(directory) / name
    run = snapdir.safe_run_id(env.get("TORCHELASTIC_RUN_ID", ""))
    return base / f"{snapdir.PREFIX}torchrun_{run}" / name


def newest(snaps: SnapshotFile) -> Snapshot | None:
    """The snapshot with the highest step (then generation), not :meth:`SnapshotFile.latest`'s
    generation first: the restore picks by step (the generation is per node, and a scale-up
    restart does not change it)."""
    found = [s for s in (snaps.read(slot) for slot in range(SLOTS)) if s is not None]
    return max(found, key=lambda s: (s.step, s.generation), default=None)
