"""Writing a training state's snapshots: the big copy overlaps the next step (issue 36).

A snapshot after every committed step, written synchronously, cost a 100 M-parameter model with
AdamW 0.37 s of a 0.83 s step on this 2-core machine (1.2 GB: the copy 70 ms, zlib's CRC-32
280 ms). Most of the state does not change until the next ``optimizer.step``: the parameters
and the optimizer's state. So a :class:`SnapshotWriter` writes a step's snapshot in two parts:

* **at the commit, on the training thread**: the pickle of the state's skeleton (the step, the
  sampler's position, the RNG states, the scheduler's and the user's ``extra``, the optimizer's
  param groups), and every tensor that is neither a parameter nor the optimizer's state: the
  model's buffers (BatchNorm's running statistics, which the next forward changes), the RNG
  state, tensors in ``extra``;
* **on a background thread**, while the next step's forward and backward run: the parameters
  and the optimizer's state (torch's copy releases the GIL), the slot's checksum, and the
  descriptor that makes the slot readable. The next ``optimizer.step`` waits for the copy
  (:meth:`SnapshotWriter.wait_copied`, from the optimizer's step pre-hook), and the next
  snapshot, a checkpoint, a restore and the process's normal exit wait for all of it
  (:meth:`SnapshotWriter.flush`; the thread is joined at exit, so a finished script's last
  snapshot is whole).

A state whose tensors are small (below :data:`BACKGROUND_FROM` bytes in all) is written whole
at the commit: handing it to a thread costs more than the copy, and it then loses no step.

**Steps lost.** Until a step's background copy has been published, the slot it goes to is
odd (unreadable) and the newest readable snapshot is the step before. A worker killed in step
k+1 before step k's copy ended therefore resumes from k-1 if no other rank holds k: one
committed step lost, where the synchronous write lost none. The copy takes about a tenth of
the step it overlaps here, so in practice the survivors (which wait in the next step's
all-reduce for the dead rank, long after their copy ended) hold k.

**What the overlap asks of a script**: nothing but ``optimizer.step`` may change parameters or
the optimizer's state between a step's commit and the next ``optimizer.step`` (changing them
inside the step block, before the commit, is fine; so is ``zero_grad``). A change made in
place through the tensors themselves is caught (their version counters moved while the copy
ran): that snapshot is not published and the next wait raises :class:`SnapshotError`. A change
through ``.data`` is not seen: call :meth:`ddpjob_worker.train.TrainState.flush` first, or use
``TrainState(background=False)``.

A failed background write (an error while copying, the slot's file gone) is logged at once
and raised at the next wait, as :class:`SnapshotError`: it never drops snapshots in silence.
Its slot stays odd, so nobody reads it, and the snapshot before it stays the newest.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ddpjob_worker.train import flat
from ddpjob_worker.train.snapshot import SLOTS, SnapshotError, SnapshotFile, Write

logger = logging.getLogger("ddpjob_worker.train.snapwriter")

BACKGROUND_FROM = 1 << 20
"""A state whose tensors hold fewer bytes than this is written whole at the commit."""
MIN_CAPACITY = 64 * 1024
"""The smallest slot we make: a tiny state still gets room to grow."""
HEADROOM = 2
"""A slot holds this many times the first state: an optimizer's state grows after its first
step (Adam's moments appear), and a file made to fit exactly would be remade at once."""
PAGE = 4096


@dataclasses.dataclass
class _Job:
    """One step's snapshot, its parameters and optimizer state still being copied."""

    step: int
    copied: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None
    future: concurrent.futures.Future[None] | None = None


class SnapshotWriter:
    """Writes each committed step's state into the snapshot file at ``path`` (see the module
    doc). ``background``: True copies the parameters and optimizer state on a background
    thread whatever their size, False never does, None (the default) does from
    :data:`BACKGROUND_FROM` bytes of state."""

    def __init__(self, path: Path, *, background: bool | None = None) -> None:
        self.path = path
        self.background = background
        self.file: SnapshotFile | None = None
        self.seconds = 0.0
        """How long the last snapshot took on the training thread."""
        self.background_seconds = 0.0
        """How long the last finished background part took (copy, checksum, publish)."""
        self.background_cpu_seconds = 0.0
        """The CPU time it took (its thread's: the copy runs on one core), what it took from
        the training: a copy that shares the cores with it takes longer than that."""
        self.deferred = False
        self.first_fill = False
        """The last snapshot went to a slot of a new file: its pages were faulted in (3.9 s
        for a 2.3 GB slot here), a cost the slot's later snapshots do not pay."""
        self._unfilled: set[int] = set()
        """The last snapshot has a background part (its time is :attr:`background_seconds`
        once it is not :attr:`busy`)."""
        self.waited = 0.0
        """How long the training thread has waited for background copies since the owner last
        set this to 0 (:class:`ddpjob_worker.train.TrainState` does, once a step)."""
        self._targets: dict[int, flat.Target] = {}
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._job: _Job | None = None

    # -- writing --------------------------------------------------------------------------------

    def write(
        self,
        step: int,
        generation: int,
        state: Mapping[str, Any],
        later: Callable[[], set[int]],
    ) -> bool:
        """Snapshot ``state`` as step ``step``'s. ``later()``: the data pointers of the tensors
        that only ``optimizer.step`` changes (the parameters and the optimizer's state), which
        may be copied in the background. Whether a snapshot was started (False: no file could
        be made; a warning said why). Raises :class:`SnapshotError` for the previous
        snapshot's background failure."""
        self.flush()
        started = time.perf_counter()
        laid = flat.plan(state)
        snaps = self._room(laid.nbytes)
        if snaps is None:
            return False
        now, deferred = laid.tensors, []
        if self.background or (self.background is None and laid.nbytes >= BACKGROUND_FROM):
            pointers = later()
            now = [placed for placed in laid.tensors if placed[0].data_ptr() not in pointers]
            deferred = [placed for placed in laid.tensors if placed[0].data_ptr() in pointers]
        write = snaps.begin(laid.nbytes)
        self.deferred = bool(deferred)
        self.first_fill = write.slot in self._unfilled
        self._unfilled.discard(write.slot)
        try:
            target = self._target(snaps, write.slot)
            target.head(laid)
            target.copy(now)
            if not deferred:
                self._publish(snaps, write, step, generation)
            else:
                job = _Job(step)
                versions = [_version(tensor) for tensor, _ in deferred]
                job.future = self._pool().submit(
                    self._finish, job, snaps, write, target, deferred, versions, generation
                )
                self._job = job
        except BaseException:
            if self._job is None or self._job.step != step:
                snaps.abandon(write)  # not handed to the thread: nobody will publish it
            raise
        self.seconds = time.perf_counter() - started
        return True

    def _finish(
        self,
        job: _Job,
        snaps: SnapshotFile,
        write: Write,
        target: flat.Target,
        deferred: list[flat.Placed],
        versions: list[int],
        generation: int,
    ) -> None:
        """The background part: copy, check nothing moved meanwhile, publish."""
        started = time.perf_counter()
        cpu_started = time.thread_time()
        try:
            try:
                target.copy(deferred)
                moved = [
                    ref.shape
                    for (tensor, ref), version in zip(deferred, versions, strict=True)
                    if _version(tensor) != version
                ]
            finally:
                job.copied.set()
            if moved:
                raise SnapshotError(
                    f"{len(moved)} parameter or optimizer-state tensor(s) (shapes "
                    f"{moved[:3]}) changed while step {job.step}'s snapshot copied them: "
                    "change them only in optimizer.step or inside the step block, or call "
                    "TrainState.flush() first, or use TrainState(background=False)"
                )
            self._publish(snaps, write, job.step, generation)
        except BaseException as exc:
            snaps.abandon(write)
            job.error = exc
            logger.error(
                "the snapshot of step %d failed in the background (%s): the slot is left "
                "unreadable, the step before stays the newest snapshot",
                job.step,
                exc,
            )
            raise
        self.background_seconds = time.perf_counter() - started
        self.background_cpu_seconds = time.thread_time() - cpu_started

    def _publish(self, snaps: SnapshotFile, write: Write, step: int, generation: int) -> None:
        snaps.publish(write, step, generation)
        if snaps.path != self.path:
            # A new file, moved over the old one only once it holds this step: the old
            # one's snapshot stayed good until now.
            os.replace(snaps.path, self.path)
            snaps.path = self.path

    # -- waiting --------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """The last snapshot's background part is still running."""
        job = self._job
        return job is not None and job.future is not None and not job.future.done()

    def wait_copied(self) -> None:
        """Return once the pending snapshot no longer reads the parameters and the optimizer's
        state (``optimizer.step`` may change them); raise its failure if it failed."""
        job = self._job
        if job is None:
            return
        if not job.copied.is_set():
            started = time.perf_counter()
            job.copied.wait()
            self.waited += time.perf_counter() - started
        if job.error is not None:
            self.flush()

    def flush(self) -> None:
        """Return once the pending snapshot is published (readable), or raise its failure as
        :class:`SnapshotError`."""
        job = self._job
        if job is None or job.future is None:
            return
        self._job = None
        started = time.perf_counter()
        try:
            job.future.result()
        except Exception as exc:
            raise SnapshotError(f"the snapshot of step {job.step} failed: {exc}") from exc
        finally:
            self.waited += time.perf_counter() - started

    def close(self) -> None:
        """Flush, then stop the thread and release the file."""
        try:
            self.flush()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            self._drop_file()

    # -- the file -------------------------------------------------------------------------------

    def open_existing(self) -> SnapshotFile | None:
        """The snapshot file at :attr:`path` as it is (for the restore), or None if there is
        none or it is not usable (a warning says why)."""
        self.flush()
        if not self.path.exists():
            return None
        self._drop_file()
        try:
            self.file = SnapshotFile.open(self.path, flat.page_sums)
        except SnapshotError as exc:
            logger.warning("ignoring this rank's snapshot: %s", exc)
            return None
        return self.file

    def _room(self, nbytes: int) -> SnapshotFile | None:
        """The snapshot file, or a new one at a temporary name when there is none or it has no
        room for ``nbytes`` (moved to its name once it holds a snapshot: :meth:`_publish`)."""
        path = self.path
        if self.file is None and path.exists():
            try:
                self.file = SnapshotFile.open(path, flat.page_sums)
            except SnapshotError as exc:
                logger.warning("replacing an unusable snapshot file: %s", exc)
        if self.file is not None and nbytes <= self.file.capacity:
            return self.file
        capacity = -(-max(MIN_CAPACITY, HEADROOM * nbytes) // PAGE) * PAGE
        if self.file is not None:
            logger.info(
                "a step's state grew to %d bytes, past the snapshot slots' %d: remaking %s "
                "with %d-byte slots",
                nbytes,
                self.file.capacity,
                path,
                capacity,
            )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fresh = SnapshotFile.create(
                path.with_name(path.name + ".new"), capacity, flat.page_sums
            )
        except OSError as exc:
            logger.warning(
                "no in-memory snapshots for this worker (%s): a restart resumes from the last "
                "checkpoint only",
                exc,
            )
            return None
        self._drop_file()
        self.file = fresh
        self._unfilled = set(range(SLOTS))
        return fresh

    def _target(self, snaps: SnapshotFile, slot: int) -> flat.Target:
        target = self._targets.get(slot)
        if target is None:
            target = self._targets[slot] = flat.Target(snaps.slot_memory(slot))
        return target

    def _drop_file(self) -> None:
        for target in self._targets.values():
            target.close()
        self._targets.clear()
        if self.file is not None:
            self.file.close()
            self.file = None

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        # One thread: snapshots are written in order. Its thread is joined when the
        # interpreter exits, so the last snapshot of a script that returns is whole.
        if self._executor is None:
            threads = torch.get_num_threads()
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="ddpjob-snapshot", initializer=_one_core
            )
            self._executor.submit(int).result()  # the initializer has run
            # torch.set_num_threads also sets the count that threads started later begin
            # with: put that back (this thread's own count never changed).
            torch.set_num_threads(threads)
        return self._executor


def _one_core() -> None:
    """The snapshot thread's torch work (the copy, the page sums) runs on one core. torch's
    OpenMP threads are per calling thread: with its default count the copy starts a second
    team as large as the training's, and on a machine whose cores the training already keeps
    busy the two teams' threads compete and spin (a 100 M-parameter model with AdamW on 2
    cores: a step 1.51x longer than without snapshots in a first, noisy try, 1.12-1.16x with
    the copy on one core, which takes 0.1 s for 1.2 GB)."""
    torch.set_num_threads(1)
    torch.zeros(1 << 16).add_(1)  # a parallel op: this thread's OpenMP count is now 1


def pointers(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """The data pointers of ``model``'s parameters and ``optimizer``'s state tensors: what only
    ``optimizer.step`` changes."""
    found = {param.data_ptr() for param in model.parameters()}
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                found.add(value.data_ptr())
    return found


def _version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter (every in-place change moves it; -1 for a tensor that
    has none, an inference tensor)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return -1
