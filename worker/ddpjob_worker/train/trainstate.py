"""The training-state API (issue 36, option (a)): a step's state in memory every few steps and
whenever the worker stops, and a restart that resumes from the survivors' newest step instead
of the last checkpoint.

About three changed lines in a plain DDP script::

    state = TrainState(model=ddp_model, optimizer=opt, scheduler=sched,
                       sampler=ElasticSampler(len(ds), batch_size=32, seed=0))
    for indices in state.batches():     # restores first; then this rank's next sample indices
        with state.step():              # a clean exit commits: step_no += 1
            ...forward/backward/opt.step()...

What a step's state is: the model's and optimizer's (and scheduler's) state dicts, the
sampler's position (epoch and the count of samples the whole job has consumed in it), the
rank's RNG states (torch, ``random``, numpy when it is installed), the user's ``extra`` dict
and the committed step number. Its tensors are copied once straight into this local rank's
:class:`~ddpjob_worker.train.snapshot.SnapshotFile` (two slots: a worker killed mid-write keeps the
snapshot before it), ``<DDPJOB_SNAPSHOT_DIR>/rank<local rank>.snap`` in the directory the agent
owns (:mod:`ddpjob_worker.snapdir`), so it outlives the worker. For a large state the
parameters and the optimizer's state are copied on a background thread while the next step's
forward and backward run, and the next ``optimizer.step`` waits for that copy
(:mod:`ddpjob_worker.train.snapwriter`, which says what that asks of a script);
``TrainState(background=False)`` writes every snapshot whole at the commit.

When: a commit writes a snapshot every ``snapshot_every`` steps, by default as often as keeps
them at about 0.5 % of the step time (:mod:`ddpjob_worker.train.cadence`), and the steps in between
are not lost for it, because a worker writes the step it has committed when

* **it is stopped** (SIGTERM, from ddpjob-agent or torchrun: its group broke, a peer hangs, the
  job changes size): a thread woken by the signal writes it even while the main thread is
  blocked in the all-reduce (:mod:`ddpjob_worker.train.onstop`), and the agent waits for that write
  (up to its grace period) before it kills the worker;
* **its step fails** (a peer died under the all-reduce): the step block writes it before the
  error goes on.

Between a commit and the next ``optimizer.step`` the parameters and the optimizer's state are
still the commit's; the rest of the state that the next forward may change (the torch RNG
state, the model's buffers, ``extra``'s entries) is kept at each commit, for about 1.4 µs. A
stop that comes after ``optimizer.step`` waits (up to three step times) for the commit; one
that never comes (the step blocks or fails after ``optimizer.step``: a collective after it, in
the block) writes nothing, and the periodic snapshot is what that worker holds. Put a
collective of your own (a loss all-reduce for logging) after the step block. Python's and
numpy's RNG states in a stop's snapshot are the stop's, not the commit's (keeping them at each
commit would cost more than the rest together); torch's are the commit's.

A script's own SIGTERM handler still runs; while a step is between its ``optimizer.step`` and
its commit it is held until the commit, so a handler that exits does not throw that step away.

The restore (:meth:`TrainState.restore`, run by :meth:`TrainState.batches` before its first
batch) over the default process group: every rank tells the others its newest good snapshot
(step, generation, CRC); the source is the rank with the highest step (ties: the lowest rank).
In DDP every rank holds the same model after a step, so the highest step anywhere is a valid
state for all, and any older one would lose steps. Ranks holding exactly the source's step
and CRC load their own copy; the others (a replacement process, a rank whose file is gone or
one step behind) receive the source's bytes by broadcast. Then all ranks compare a checksum of
their model state and fail loudly if they differ.

Checkpoints on disk stay, less often, as the fallback when no rank holds a snapshot (most
pods lost at once, a job started again): ``TrainState(checkpoint=path)``, and
:meth:`TrainState.save_checkpoint` every K steps (rank 0 writes, atomically). The restore
reads it only when no rank holds a snapshot; rank 0 reads the file and sends it to the others
(on a cluster the others may not see the same volume).

The generation written with a snapshot is ``TORCHELASTIC_RESTART_COUNT``, what both torchrun
and ddpjob-agent give every worker (it grows with each restart after a failure). The restore
picks by step, not generation: the counter is per node, and a scale-up restart does not
change it.

Only the worker side imports this module (it imports torch); the agent never does.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib
import io
import logging
import os
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddpjob_worker import progress, snapdir
from ddpjob_worker.contract import DDPJOB_SNAPSHOT_DIR
from ddpjob_worker.hang import StepTimes
from ddpjob_worker.progress import Phase
from ddpjob_worker.saving import marked, saving
from ddpjob_worker.train import cadence, flat, onstop, snapwriter
from ddpjob_worker.train.sampler import Batch, ElasticSampler
from ddpjob_worker.train.snapshot import SLOTS, Snapshot, SnapshotError, SnapshotFile
from ddpjob_worker.train.snapwriter import SnapshotWriter

__all__ = [
    "Batch",
    "ElasticSampler",
    "Restored",
    "TrainState",
    "model_checksum",
    "newest",
    "snapshot_path",
]

logger = logging.getLogger("ddpjob_worker.train")

PAYLOAD_VERSION = 1

STOP_WAIT_FLOOR_SECONDS = 0.5
STOP_WAIT_MAX_SECONDS = 10.0
"""A worker stopped between ``optimizer.step`` and the commit waits this long at most (three
step times, at least the floor) for the commit before it writes the committed step (the one
before is all it could write: the parameters are half-way to the next)."""


class Stateful(Protocol):
    """What a scheduler (or anything else restored) must have."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


# -- RNG and checksums ------------------------------------------------------------------------


@functools.cache
def _numpy() -> Any:
    """numpy's module if it is installed (its RNG is then part of the state), else None. Looked
    up once: every step's snapshot asks, and a failed import searches the whole path again."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def rng_state() -> dict[str, Any]:
    """This process's RNG states."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np = _numpy()
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])


def derived_seed(seed: int, rank: int, step: int) -> int:
    """A seed for a rank that has no RNG state of its own at ``step``: a function of
    (seed, rank, step) only, so the same in any rerun."""
    return zlib.crc32(f"{seed}/{rank}/{step}".encode()) | (seed & 0xFFFF) << 32


def seed_rng(value: int) -> None:
    torch.manual_seed(value)
    random.seed(value)
    np = _numpy()
    if np is not None:
        np.random.seed(value % 2**32)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A CPU copy of ``tensor``'s bytes (no numpy needed)."""
    flat = tensor.detach().cpu().contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


def model_checksum(model: torch.nn.Module) -> int:
    """CRC-32 over the model's state (parameters and buffers, in order): equal on every rank
    after a good restore."""
    crc = 0
    for name, value in model.state_dict().items():
        crc = zlib.crc32(name.encode(), crc)
        if isinstance(value, torch.Tensor):
            crc = zlib.crc32(tensor_bytes(value), crc)
    return crc


# -- where the snapshots live -----------------------------------------------------------------


def snapshot_path(env: dict[str, str] | os._Environ[str], base: Path = snapdir.SHM) -> Path:
    """This local rank's snapshot file: in the agent's directory (``DDPJOB_SNAPSHOT_DIR``), or
    under plain torchrun in ``/dev/shm/ddpjob-torchrun_<run id>`` (nobody removes that one)."""
    name = f"rank{int(env.get('LOCAL_RANK', '0'))}.snap"
    directory = env.get(DDPJOB_SNAPSHOT_DIR)
    if directory:
        return Path(directory) / name
    run = snapdir.safe_run_id(env.get("TORCHELASTIC_RUN_ID", ""))
    return base / f"{snapdir.PREFIX}torchrun_{run}" / name


def newest(snaps: SnapshotFile) -> Snapshot | None:
    """The snapshot with the highest step (then generation): see the module doc for why not
    :meth:`SnapshotFile.latest`'s generation first."""
    found = [s for s in (snaps.read(slot) for slot in range(SLOTS)) if s is not None]
    return max(found, key=lambda s: (s.step, s.generation), default=None)


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


@dataclasses.dataclass
class _Held:
    """What a commit that wrote no snapshot keeps for a snapshot written later at a stop:
    what the next step changes before its ``optimizer.step`` (the parameters and the
    optimizer's state are still the commit's until then)."""

    step: int
    torch_rng: torch.Tensor
    extra: dict[str, Any]
    buffers: list[torch.Tensor]


class _Step:
    """:meth:`TrainState.step`'s block: a class, not a generator, as it runs once a step (a
    ``contextlib.contextmanager`` costs a generator and two more calls each time)."""

    __slots__ = ("_state",)

    def __init__(self, state: TrainState) -> None:
        self._state = state

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self._state._commit()
        else:
            self._state._failed()


class TrainState:
    """A DDP script's state, snapshotted after committed steps and at a stop (see the module
    doc)."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler,
        scheduler: Stateful | None = None,
        extra: dict[str, Any] | None = None,
        seed: int | None = None,
        path: Path | None = None,
        snapshots: bool = True,
        checkpoint: Path | str | None = None,
        background: bool | None = None,
        snapshot_every: int | None = None,
    ) -> None:
        """``path``: the snapshot file (default: :func:`snapshot_path`); ``snapshots=False``
        keeps nothing (the loop and the sampler still work). ``checkpoint``: the file on disk
        that :meth:`save_checkpoint` writes and the restore falls back to when no rank holds
        a snapshot (the same path on every rank; rank 0's copy is the one read).
        ``background``: copy the parameters and the optimizer's state on a background thread
        that overlaps the next step (True), never (False: every snapshot whole at the commit),
        or from :data:`ddpjob_worker.train.snapwriter.BACKGROUND_FROM` bytes of state (None).
        ``snapshot_every``: a snapshot every this many committed steps; None (the default)
        learns the interval that keeps them at about 0.5 % of the step time
        (:mod:`ddpjob_worker.train.cadence`). Either way a worker that is stopped, or whose step
        fails, writes the step it has committed first (see the module doc)."""
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.scheduler = scheduler
        self.extra: dict[str, Any] = {} if extra is None else extra
        self.seed = sampler.seed if seed is None else seed
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.step_no = 0
        """The committed step."""
        self.restored: Restored | None = None
        self.snapshots_written = 0
        """Snapshots this process has written (periodic and at stops)."""
        self.generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self._path = None if not snapshots else path or snapshot_path(os.environ)
        self._writer: SnapshotWriter | None = None
        if self._path is not None:
            self._writer = SnapshotWriter(self._path, background=background)
            # The parameters and the optimizer's state may still be being copied for the
            # last commit's snapshot: its next step must not change them before that ends.
            optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._pending: int | None = None
        self._cadence = cadence.Cadence(snapshot_every)
        self._lock = threading.Lock()
        """Guards what a stop's snapshot and the training thread share: the four below,
        ``step_no`` and the sampler's position. The training thread takes it bare (a C call)
        and notifies ``_cond`` only when a stop's thread waits (``_stopping``): a step's
        bookkeeping is most of what this API costs a small model."""
        self._cond = threading.Condition(self._lock)
        self._dirty = True
        """The parameters or the optimizer's state may differ from the committed step's:
        ``optimizer.step`` has begun since the last commit, or the restore has not run."""
        self._writing = False
        """The training thread is writing a commit's snapshot."""
        self._stopping = False
        """A stop's snapshot is being written."""
        self._broken = False
        """The step failed after ``optimizer.step``: no commit is coming."""
        self._snapped = -1
        """The step of the newest snapshot this rank's file holds (-1: none known)."""
        self._held: _Held | None = None
        self._writer_lock = threading.Lock()
        """The writer is not thread-safe: a stop's snapshot and the training thread's flushes
        and snapshots take turns."""
        self._buffers: list[torch.Tensor] | None = None
        self._committed_at: float | None = None
        self._step_block = _Step(self)
        self._progress = _progress_writer(os.environ)
        self._step_times = StepTimes()
        self._collective = False
        """This step's gradients went to the all-reduce (the hook marked it)."""
        if self._progress is not None:
            _watch_collective(model, self._entered_collective)
        self._onstop: onstop.OnStop | None = None
        if self._writer is not None and _under_launcher(os.environ):
            self._onstop = onstop.install(self._at_stop, self._past_optimizer_step)

    # -- the loop ---------------------------------------------------------------------------

    def batches(self) -> Iterator[list[int]]:
        """Restore (once), then yield this rank's indices for each next step until the
        sampler's epochs are done. A batch whose step was not committed is yielded again."""
        if self.restored is None:
            self._mark(Phase.IDLE)
            self.restore()
        rank, world = _rank_world()  # a process's world does not change: a restart is a new one
        while True:
            batch = self.sampler.next_batch(rank, world)
            if batch is None:
                self._mark(Phase.IDLE)
                self.flush()
                return
            self._pending = batch.consumed
            if self._progress is not None:
                self._mark(Phase.COMPUTE)
            if self._writer is not None:
                self._writer.waited = 0.0
            yield batch.indices

    def step(self) -> _Step:
        """A context manager that commits the step on a clean exit of the block: advance the
        sampler by the batch :meth:`batches` yielded, count the step, write the snapshot when
        one is due. An exception commits nothing, and writes the committed step's snapshot if
        the newest is older (a peer died under the all-reduce, most likely: the restart needs
        this rank's committed step)."""
        return self._step_block

    def _failed(self) -> None:
        with marked():  # the agent, stopping this worker meanwhile, lets the write end
            self._save_at_stop(0.0, "its step failed", training=True)

    def _commit(self) -> None:
        # Once a step: a commit that writes no snapshot stays a few attribute writes (the
        # cold caches after a step make every call here cost several times its warm price).
        now = time.perf_counter()
        writer = self._writer
        cadence = self._cadence
        with self._lock:
            if self._pending is not None:
                self.sampler.advance(self._pending)
                self._pending = None
            self.step_no += 1
            self._dirty = False
            stopped = self._stopping
            if stopped:  # a stop's snapshot waits for this commit, then writes it
                self._cond.notify_all()
                while self._stopping:
                    self._cond.wait()
            else:
                due = writer is not None and cadence.due(self.step_no)
                self._writing = due
        if not stopped:
            if self._committed_at is not None:
                cadence.stepped(now - self._committed_at)
            if writer is not None and cadence.waiting and not writer.busy:
                # A slot's first fill faults its pages in: not what the next ones cost.
                cadence.copied(
                    writer.background_cpu_seconds if writer.deferred else 0.0,
                    count=not writer.first_fill,
                )
            if due:
                self._snapshot_at_commit()
            else:
                if self._progress is not None:
                    self._mark(Phase.COMMIT)
                if writer is not None:
                    self._hold()
            self._committed_at = time.perf_counter()
        if self._onstop is not None and self._onstop.pending is not None:
            self._onstop.release()  # the script's SIGTERM handler, held while the step ran

    def _snapshot_at_commit(self) -> None:
        self._mark(Phase.SNAPSHOT)
        try:
            self.snapshot()
        finally:
            with self._lock:
                self._writing = False
                if self._stopping:
                    self._cond.notify_all()
        self._cadence.wrote(self.step_no, self.snapshot_seconds)

    # -- the snapshot's timings and waits ----------------------------------------------------

    @property
    def snapshot_interval(self) -> int:
        """Committed steps from one periodic snapshot to the next, as of now
        (``snapshot_every``, or what :mod:`ddpjob_worker.train.cadence` learned)."""
        return self._cadence.interval

    @property
    def snapshot_seconds(self) -> float:
        """How long the last snapshot took on the training thread (at the commit)."""
        return 0.0 if self._writer is None else self._writer.seconds

    @property
    def background_seconds(self) -> float:
        """How long the last finished background copy took (copy, checksum, publish)."""
        return 0.0 if self._writer is None else self._writer.background_seconds

    @property
    def wait_seconds(self) -> float:
        """How long this step waited for the last snapshot's background copy."""
        return 0.0 if self._writer is None else self._writer.waited

    def flush(self) -> None:
        """Wait until the last snapshot is whole in its file (its background copy, if any,
        done); raise its failure if it failed. Call it before changing the parameters or the
        optimizer's state outside ``optimizer.step`` and the step block (the copy may still
        be reading them; see :mod:`ddpjob_worker.train.snapwriter`). The restore, a checkpoint, the
        next snapshot and the end of :meth:`batches` call it."""
        if self._writer is not None:
            with self._writer_lock:
                self._writer.flush()

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self._lock:
            while self._stopping:  # a stop's snapshot reads the parameters now
                self._cond.wait()
            self._dirty = True
        if self._writer is not None:
            self._writer.wait_copied()

    # -- a stop's snapshot ----------------------------------------------------------------------

    def _hold(self) -> None:
        """Keep what the next step changes before its ``optimizer.step`` (:class:`_Held`): the
        torch RNG state, ``extra``'s entries, the model's buffers (copied into tensors kept
        for it: one ``_foreach_copy_``)."""
        if self._buffers is None:
            self._buffers = [b for b in self.model.buffers() if not b.is_meta]
        held = self._held
        if held is None or len(held.buffers) != len(self._buffers):
            copies = [b.detach().clone() for b in self._buffers]
        else:
            copies = held.buffers
            if copies:
                torch._foreach_copy_(copies, self._buffers)
        self._held = _Held(self.step_no, torch.get_rng_state(), dict(self.extra), copies)

    def _past_optimizer_step(self) -> bool:
        """A step is between its ``optimizer.step`` and its commit."""
        return self._dirty and self.restored is not None

    def _at_stop(self) -> None:
        """SIGTERM (:mod:`ddpjob_worker.train.onstop`'s thread): write the committed step."""
        typical = self._cadence.typical() or 0.0
        wait = min(STOP_WAIT_MAX_SECONDS, max(STOP_WAIT_FLOOR_SECONDS, 3 * typical))
        self._save_at_stop(wait, "stopped (SIGTERM)")

    def _save_at_stop(self, wait: float, why: str, *, training: bool = False) -> bool:
        """Write the committed step's snapshot if this rank's newest is older (see the module
        doc). Waits up to ``wait`` seconds for a step that is past its ``optimizer.step`` to
        commit (the stop's thread); the training thread (``training``), whose step failed,
        cannot wait for itself. Whether it wrote one."""
        if self._writer is None:
            return False
        with self._cond:
            if training and self._dirty:
                self._broken = True  # the step failed after optimizer.step: no commit comes
                self._cond.notify_all()
            while self._stopping:  # the other thread writes it
                self._cond.wait()
            self._stopping = True
            deadline = time.monotonic() + wait
            while (self._dirty or self._writing) and not self._broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            clean = not self._dirty and not self._writing
            step = self.step_no
        try:
            if not clean:
                logger.warning(
                    "%s at step %d past its optimizer.step: its snapshot holds step %d, the "
                    "newest written",
                    why,
                    step,
                    self._snapped,
                )
                return False
            return self._write_held(step, why)
        finally:
            with self._cond:
                self._stopping = False
                self._broken = False
                self._cond.notify_all()

    def _write_held(self, step: int, why: str) -> bool:
        """Write the committed ``step`` now, whole: the parameters and the optimizer's state as
        they are (unchanged since the commit), the rest as the commit held it."""
        with self._writer_lock:
            return self._write_held_locked(step, why)

    def _write_held_locked(self, step: int, why: str) -> bool:
        assert self._writer is not None
        try:
            self._writer.flush()  # the periodic snapshot's background copy first
        except SnapshotError as exc:
            logger.warning("%s", exc)
            self._snapped = -1
        if step <= self._snapped:
            return False
        started = time.perf_counter()
        state = self.state_dict()
        held = self._held
        if held is not None and held.step == step:
            state["rng"]["torch"] = held.torch_rng
            state["extra"] = held.extra
            if held.buffers:
                kept = {
                    live.data_ptr(): copy
                    for live, copy in zip(self._buffers or [], held.buffers, strict=True)
                }
                model = state["model"]
                for key, value in model.items():
                    if isinstance(value, torch.Tensor) and value.data_ptr() in kept:
                        model[key] = kept[value.data_ptr()]
        if not self._writer.write(step, self.generation, state, set):
            return False
        self._writer.flush()
        self._snapped = step
        self.snapshots_written += 1
        logger.info(
            "rank %d: %s: wrote the snapshot of step %d (%.0f ms)",
            _rank_world()[0],
            why,
            step,
            (time.perf_counter() - started) * 1000,
        )
        return True

    def _deferrable(self) -> set[int]:
        return snapwriter.pointers(self.model, self.optimizer)

    # -- progress (hang detection) --------------------------------------------------------------

    def _mark(self, phase: Phase) -> None:
        """Tell the agent where this worker is (:mod:`ddpjob_worker.progress`)."""
        if self._progress is None:
            return
        now = time.monotonic()
        if phase is Phase.COMPUTE:
            self._collective = False
            self._step_times.observe(progress.Progress(self.step_no, phase, now))
        self._progress.mark(self.step_no, phase, now, self._step_times.threshold())

    def _entered_collective(self) -> None:
        if not self._collective:
            self._collective = True
            self._mark(Phase.COLLECTIVE)

    # -- the state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": PAYLOAD_VERSION,
            "step": self.step_no,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "extra": self.extra,
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any], *, rng: bool = True) -> None:
        """Load a :meth:`state_dict`; ``rng=False`` leaves the RNG states alone."""
        self.flush()  # a background copy may still read the tensors this overwrites
        if state.get("version") != PAYLOAD_VERSION:
            raise SnapshotError(
                f"snapshot payload version {state.get('version')!r}, this code reads "
                f"{PAYLOAD_VERSION}: restore with the same ddpjob_worker version"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        self.extra.clear()
        self.extra.update(state["extra"])
        self.step_no = int(state["step"])
        if rng:
            set_rng_state(state["rng"])

    def payload(self) -> memoryview:
        buffer = io.BytesIO()
        torch.save(self.state_dict(), buffer)
        return buffer.getbuffer()

    def load_payload(self, payload: bytes | memoryview, *, rng: bool = True) -> None:
        """Load a snapshot's bytes (:mod:`ddpjob_worker.train.flat`) or a checkpoint's
        (``torch.save``)."""
        if flat.is_flat(payload):
            state = flat.load(payload)
        else:
            # Our own bytes, CRC-checked: the RNG states and extra need the full unpickler.
            state = torch.load(io.BytesIO(payload), weights_only=False)
        self.load_state_dict(state, rng=rng)

    # -- checkpoints on disk ------------------------------------------------------------------

    def save_checkpoint(self) -> bool:
        """Write the committed state to ``checkpoint`` on rank 0 (the others do nothing):
        a temporary file, flushed, then renamed over the old one, so a reader sees the old
        checkpoint or the new one, never a torn file; under :func:`ddpjob_worker.saving`, so
        ddpjob-agent lets the write finish before it stops this worker. Whether it wrote."""
        if self.checkpoint is None:
            raise ValueError("save_checkpoint needs TrainState(checkpoint=<path>)")
        self.flush()  # the snapshot of this step first (and its failure, if it failed)
        if self._writer is not None and self._snapped < self.step_no:
            # Every rank holds the checkpoint's step in memory too: the restore prefers a
            # snapshot to the file, and one older than the file would lose steps.
            self._write_held(self.step_no, "a checkpoint")
        if _rank_world()[0] != 0:
            return False
        path = self.checkpoint
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        # Marked SAVING: the others wait for this rank in the next step's all-reduce meanwhile,
        # and a write slower than the hang threshold must not be taken for a hang.
        self._mark(Phase.SAVING)
        try:
            with saving():
                payload = self.payload()
                with tmp.open("wb") as out:
                    out.write(payload)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
                directory = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(directory)  # the rename itself
                finally:
                    os.close(directory)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            self._mark(Phase.COMMIT)
        return True

    def _from_checkpoint(self, rank: int, world: int) -> Restored:
        """No rank holds a snapshot: rank 0's checkpoint, sent to the others, or a fresh
        start. Collective when there is a checkpoint path."""
        fresh = Restored(step=0, source=None, local=False, nbytes=0)
        mine = b""
        failed = ""
        if rank == 0 and self.checkpoint is not None:
            try:
                mine = self.checkpoint.read_bytes()
            except FileNotFoundError:
                pass
            except OSError as exc:
                failed = f"{self.checkpoint}: {exc}"
                logger.error("rank 0 cannot read the checkpoint %s", failed)
        # Every rank agrees before the broadcast (a rank alone in a collective waits forever):
        # each says whether it was given a checkpoint path, rank 0 whether it could read it.
        flags = _all_gather([int(self.checkpoint is not None), int(bool(failed))], world)
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
        if self.checkpoint is None:
            return fresh
        payload = mine if world == 1 else _broadcast_bytes(mine if rank == 0 else None, 0)
        if not payload:
            return fresh
        self.load_payload(payload, rng=rank == 0)
        if rank != 0:
            seed_rng(derived_seed(self.seed, rank, self.step_no))
        logger.info(
            "rank %d: no rank holds a snapshot; resumed at step %d from the checkpoint %s",
            rank,
            self.step_no,
            self.checkpoint,
        )
        return Restored(
            step=self.step_no, source=None, local=rank == 0, nbytes=len(payload), checkpoint=True
        )

    # -- snapshots ----------------------------------------------------------------------------

    def snapshot(self) -> None:
        """Write the committed state into this rank's snapshot file (the tensors copied once,
        straight into the file: :mod:`ddpjob_worker.train.flat`; the parameters and the optimizer's
        state possibly in the background: :mod:`ddpjob_worker.train.snapwriter`)."""
        if self._writer is None:
            return
        with self._writer_lock:
            written = self._writer.write(
                self.step_no, self.generation, self.state_dict(), self._deferrable
            )
        if not written:
            self._writer = None  # no file could be made: no snapshots (a warning said why)
            self._path = None
            return
        self._snapped = self.step_no
        self.snapshots_written += 1

    def _local(self) -> Snapshot | None:
        """This rank's own newest snapshot, if it has one."""
        if self._writer is None:
            return None
        snaps = self._writer.open_existing()
        return None if snaps is None else newest(snaps)

    # -- restore ------------------------------------------------------------------------------

    def restore(self) -> Restored:
        """Resume from the newest step any rank holds (see the module doc), or start fresh;
        then check that every rank holds the same model. Collective: every rank calls it."""
        rank, world = _rank_world()
        local = self._local()
        mine = [0, 0, 0, 0] if local is None else [1, local.step, local.generation, local.checksum]
        # (step, generation, crc) of each rank's newest snapshot, None where it has none
        infos = [info[1:] if info[0] else None for info in _all_gather(mine, world)]
        held = [(info[0], -r) for r, info in enumerate(infos) if info is not None]
        if not held:
            self.restored = self._from_checkpoint(rank, world)
        else:
            step, neg = max(held)
            source = -neg
            target = infos[source]
            if target is None:
                raise RuntimeError(f"rank {source} was chosen as the source and has no snapshot")
            # Same step and same bytes as the source's: (step, crc), not the generation.
            have = [
                info is not None and (info[0], info[2]) == (target[0], target[2]) for info in infos
            ]
            payload = local.payload if have[rank] and local is not None else b""
            if not all(have):
                received = _broadcast_bytes(payload if rank == source else None, source)
                payload = payload or received
            self.load_payload(payload, rng=have[rank])
            if not have[rank]:
                seed_rng(derived_seed(self.seed, rank, step))
            self.restored = Restored(
                step=step, source=source, local=have[rank], nbytes=len(payload)
            )
            logger.info(
                "rank %d: resumed at step %d from rank %d's snapshot (%s, %d bytes)",
                rank,
                step,
                source,
                "own copy" if have[rank] else "received",
                len(payload),
            )
        self._check_same_model(rank, world)
        with self._cond:
            self._dirty = False
            # A rank that received the step holds no snapshot of it: a stop writes it.
            self._snapped = (
                self.restored.step if self.restored.local and not (self.restored.checkpoint) else -1
            )
        self._committed_at = None
        return self.restored

    def _check_same_model(self, rank: int, world: int) -> None:
        sums = [values[0] for values in _all_gather([model_checksum(self.model)], world)]
        if len(set(sums)) > 1:
            raise RuntimeError(
                f"rank {rank}: the ranks' models differ after the restore (checksums by rank: "
                f"{sums}); the snapshots are inconsistent: remove the job's snapshot directory "
                f"({self._path.parent if self._path else 'none'}) to resume from a checkpoint"
            )


def _progress_writer(env: dict[str, str] | os._Environ[str]) -> progress.ProgressWriter | None:
    """This local rank's progress record, in the agent's directory; None outside a
    ddpjob-agent (nobody would read it) or where it cannot be made."""
    directory = env.get(DDPJOB_SNAPSHOT_DIR)
    if not directory:
        return None
    path = progress.path_for(Path(directory), int(env.get("LOCAL_RANK", "0")))
    try:
        return progress.ProgressWriter(path)
    except OSError as exc:
        logger.warning("no progress record for hang detection (%s): %s", path, exc)
        return None


def _watch_collective(model: torch.nn.Module, entered: Callable[[], None]) -> None:
    """Call ``entered()`` when a step's gradients go to DDP's all-reduce: a communication hook
    that marks it, then all-reduces as DDP's default does. A model that is not DDP, or that
    has a hook of its own already, is not watched (hang detection then sees no rank waiting
    in the collective, and pins nothing)."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    if not isinstance(model, DistributedDataParallel):
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415

    def hook(state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        entered()
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    # DDP checks a hook's annotations as objects, and this module's are strings.
    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,  # type: ignore[attr-defined]
        "return": torch.futures.Future[torch.Tensor],
    }
    try:
        model.register_comm_hook(None, hook)
    except RuntimeError as exc:
        logger.warning("hang detection does not see this model's all-reduce: %s", exc)


def _under_launcher(env: dict[str, str] | os._Environ[str]) -> bool:
    """This worker was started by ddpjob-agent or torchrun, which stop it with SIGTERM: it
    writes its committed step then (:mod:`ddpjob_worker.train.onstop`). A script run by hand (or a
    test in its runner's process) keeps its signals as they are."""
    return bool(env.get(DDPJOB_SNAPSHOT_DIR) or env.get("TORCHELASTIC_RUN_ID"))


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(values: list[int], world: int) -> list[list[int]]:
    """Every rank's ``values`` (the same number on each), as int64 tensors: not
    ``all_gather_object``, which needs numpy to unpickle."""
    if world == 1:
        return [values]
    mine = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [[int(v) for v in tensor.tolist()] for tensor in out]


def _broadcast_bytes(payload: bytes | None, source: int) -> bytes:
    """``source``'s bytes on every rank: their length, then a flat uint8 tensor."""
    length = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64)
    dist.broadcast(length, source)
    if payload:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    else:
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(buffer, source)
    return payload if payload is not None else tensor_bytes(buffer)
