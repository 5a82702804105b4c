"""The commit and the stop: this rank's snapshots, and the synchronisation between the
training thread's commits and a stop's snapshot (:class:`Committer`).

A commit writes a snapshot every few steps (:mod:`ddpjob_worker.train.cadence`); the steps in
between are written by the worker when it is stopped (SIGTERM: a thread woken by the signal,
:mod:`ddpjob_worker.train.onstop`, writes the committed step even while the main thread is
blocked in the all-reduce) or when its step fails. Between a commit and the next
``optimizer.step`` the parameters and the optimizer's state are still the commit's; the rest of
the state that the next forward may change (the torch RNG state, the model's buffers,
``extra``'s entries) is kept at each commit (:class:`Held`). A stop that comes after
``optimizer.step`` waits (up to three step times) for the commit; one that never comes writes
nothing, and the periodic snapshot is what that worker holds.

One lock guards what the two threads share: the flags below, the state's committed step and
its sampler's position. The training thread takes it bare (a C call) and notifies the condition
only when a stop's thread waits: a step's bookkeeping is most of what this API costs a small
model.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from ddpjob_worker.contract import DDPJOB_SNAPSHOT_DIR
from ddpjob_worker.progress import Phase
from ddpjob_worker.saving import marked
from ddpjob_worker.train import cadence, onstop, snapwriter
from ddpjob_worker.train.audit import Audit
from ddpjob_worker.train.payload import Stateful
from ddpjob_worker.train.phases import Marks
from ddpjob_worker.train.restore import Restored, rank_world
from ddpjob_worker.train.sampler import ElasticSampler
from ddpjob_worker.train.snapshot import Snapshot, SnapshotError, newest
from ddpjob_worker.train.snapwriter import SnapshotWriter

logger = logging.getLogger("ddpjob_worker.train")

STOP_WAIT_FLOOR_SECONDS = 0.5
STOP_WAIT_MAX_SECONDS = 10.0
"""A worker stopped between ``optimizer.step`` and the commit waits this long at most (three
step times, at least the floor) for the commit before it writes the committed step (the one
before is all it could write: the parameters are half-way to the next)."""


class Committed(Protocol):
    """What the committer reads and moves of the training state
    (:class:`~ddpjob_worker.train.trainstate.TrainState`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: ElasticSampler
    scheduler: Stateful | None
    extra: dict[str, Any]
    generation: int
    step_no: int
    restored: Restored | None

    def state_dict(self) -> dict[str, Any]: ...


@dataclasses.dataclass
class Held:
    """What a commit that wrote no snapshot keeps for a snapshot written later at a stop:
    what the next step changes before its ``optimizer.step`` (the parameters and the
    optimizer's state are still the commit's until then)."""

    step: int
    torch_rng: torch.Tensor
    extra: dict[str, Any]
    buffers: list[torch.Tensor]
    scheduler: dict[str, Any] | None = None
    """The scheduler's state, and each param group's hyperparameters (what a scheduler sets):
    a scheduler stepped per micro-batch moves them before the next ``optimizer.step``."""
    groups: list[dict[str, Any]] | None = None


class Committer:
    """A training state's commits and snapshots: its
    snapshot file and writer, the cadence of its periodic snapshots, and the writes at a stop
    or a failed step (the module doc)."""

    def __init__(
        self,
        state: Committed,
        marks: Marks,
        path: Path | None,
        *,
        background: bool | None,
        snapshot_every: int | None,
    ) -> None:
        self._state = state
        self._marks = marks
        self.path = path
        self.stepped = False
        """An optimizer step (or a step the scaler skipped) ran in the step block under way:
        its end commits. A block without one is a micro-batch of the next step."""
        self.in_block = False
        self._warned_outside = False
        self.audit = Audit.from_env(os.environ, _rank())
        if self.audit is not None:
            state.sampler.kept = collections.deque()
        self.writer: SnapshotWriter | None = None
        if path is not None:
            self.writer = SnapshotWriter(path, background=background)
            # The parameters and the optimizer's state may still be being copied for the
            # last commit's snapshot: its next step must not change them before that ends.
            state.optimizer.register_step_pre_hook(self._before_optimizer_step)
        state.optimizer.register_step_post_hook(self._after_optimizer_step)
        self.cadence = cadence.Cadence(snapshot_every)
        self.written = 0
        """Snapshots this process has written (periodic and at stops)."""
        self._lock = threading.Lock()
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
        self._held: Held | None = None
        self._writer_lock = threading.Lock()
        """The writer is not thread-safe: a stop's snapshot and the training thread's flushes
        and snapshots take turns."""
        self._buffers: list[torch.Tensor] | None = None
        self._committed_at: float | None = None
        self._onstop: onstop.OnStop | None = None
        if self.writer is not None and _under_launcher(os.environ):
            self._onstop = onstop.install(self._at_stop, self._past_optimizer_step)

    # -- the commit ---------------------------------------------------------------------------

    def commit(self) -> None:
        """The step block ended cleanly: advance the sampler by the batch, count the step,
        write the snapshot when one is due (or let a waiting stop write it)."""
        # Once a step: a commit that writes no snapshot stays a few attribute writes (the
        # cold caches after a step make every call here cost several times its warm price).
        now = time.perf_counter()
        state = self._state
        writer = self.writer
        cadence = self.cadence
        self.stepped = False
        sampler = state.sampler
        audit = self.audit
        before = None if audit is None else (sampler.epoch, sampler.processed)
        with self._lock:
            batches = sampler.commit()
            state.step_no += 1
            self._dirty = False
            stopped = self._stopping
            if stopped:  # a stop's snapshot waits for this commit, then writes it
                self._cond.notify_all()
                while self._stopping:
                    self._cond.wait()
            else:
                due = writer is not None and cadence.due(state.step_no)
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
                if self._marks.on:
                    self._marks.mark(state.step_no, Phase.COMMIT)
                if writer is not None:
                    self._hold()
            self._committed_at = time.perf_counter()
        if audit is not None and before is not None:
            after = (sampler.epoch, sampler.processed)
            audit.committed(state.step_no, rank_world()[1], before, after, batches)
        if self._onstop is not None and self._onstop.pending is not None:
            self._onstop.release()  # the script's SIGTERM handler, held while the step ran

    def failed(self) -> None:
        """The step block raised: write the committed step if this rank's newest is older."""
        with marked():  # the agent, stopping this worker meanwhile, lets the write end
            self._save_at_stop(0.0, "its step failed", training=True)

    def _snapshot_at_commit(self) -> None:
        state = self._state
        self._marks.mark(state.step_no, Phase.SNAPSHOT)
        try:
            self.snapshot()
        finally:
            with self._lock:
                self._writing = False
                if self._stopping:
                    self._cond.notify_all()
        self.cadence.wrote(state.step_no, self.seconds)

    def restored(self, step: int | None) -> None:
        """The restore loaded ``step`` from this rank's own snapshot (None: received, from a
        checkpoint, or a fresh start: this rank's file does not hold it, and a stop writes it)."""
        with self._cond:
            self._dirty = False
            self._snapped = -1 if step is None else step
        self._committed_at = None

    # -- snapshots ----------------------------------------------------------------------------

    def snapshot(self) -> None:
        """Write the committed state into this rank's snapshot file (the tensors copied once,
        straight into the file: :mod:`ddpjob_worker.train.flat`; the parameters and the
        optimizer's state possibly in the background: :mod:`ddpjob_worker.train.snapwriter`)."""
        if self.writer is None:
            return
        state = self._state
        with self._writer_lock:
            written = self.writer.write(
                state.step_no, state.generation, state.state_dict(), self._deferrable
            )
        if not written:
            self.writer = None  # no file could be made: no snapshots (a warning said why)
            self.path = None
            return
        self._snapped = state.step_no
        self.written += 1

    def local(self) -> Snapshot | None:
        """This rank's own newest snapshot, if it has one."""
        if self.writer is None:
            return None
        snaps = self.writer.open_existing()
        return None if snaps is None else newest(snaps)

    def flush(self) -> None:
        """Wait until the last snapshot is whole in its file; raise its failure if it failed."""
        if self.writer is not None:
            with self._writer_lock:
                self.writer.flush()

    @property
    def seconds(self) -> float:
        """How long the last snapshot took on the training thread (at the commit)."""
        return 0.0 if self.writer is None else self.writer.seconds

    def _deferrable(self) -> set[int]:
        return snapwriter.pointers(self._state.model, self._state.optimizer)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.in_block:
            self.stepped = True
        elif not self._warned_outside:
            self._warned_outside = True
            logger.warning(
                "optimizer.step() ran outside `with state.step():`: call it inside the step "
                "block (the block in which it runs commits the step; the blocks before it, "
                "without one, are the step's micro-batches); this step is not counted"
            )

    def scaler_step(self, step: Any) -> Any:
        """``GradScaler.step``, wrapped: a step the scaler skips (inf or NaN gradients: no
        ``optimizer.step``) is a step all the same, and commits."""

        def wrapped(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            self._before_optimizer_step(optimizer, args, kwargs)
            result = step(optimizer, *args, **kwargs)
            if self.in_block:
                self.stepped = True
            return result

        return wrapped

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.writer is None:
            return
        with self._lock:
            while self._stopping:  # a stop's snapshot reads the parameters now
                self._cond.wait()
            self._dirty = True
        self.writer.wait_copied()

    # -- a stop's snapshot ----------------------------------------------------------------------

    def _hold(self) -> None:
        """Keep what the next step changes before its ``optimizer.step`` (:class:`Held`): the
        torch RNG state, ``extra``'s entries, the model's buffers (copied into tensors kept
        for it: one ``_foreach_copy_``)."""
        state = self._state
        if self._buffers is None:
            self._buffers = [b for b in state.model.buffers() if not b.is_meta]
        held = self._held
        if held is None or len(held.buffers) != len(self._buffers):
            copies = [b.detach().clone() for b in self._buffers]
        else:
            copies = held.buffers
            if copies:
                torch._foreach_copy_(copies, self._buffers)
        held = Held(state.step_no, torch.get_rng_state(), dict(state.extra), copies)
        if state.scheduler is not None:
            held.scheduler = state.scheduler.state_dict()
            held.groups = [
                {key: value for key, value in group.items() if key != "params"}
                for group in state.optimizer.param_groups
            ]
        self._held = held

    def _past_optimizer_step(self) -> bool:
        """A step is between its ``optimizer.step`` and its commit."""
        return self._dirty and self._state.restored is not None

    def _at_stop(self) -> None:
        """SIGTERM (:mod:`ddpjob_worker.train.onstop`'s thread): write the committed step."""
        typical = self.cadence.typical() or 0.0
        wait = min(STOP_WAIT_MAX_SECONDS, max(STOP_WAIT_FLOOR_SECONDS, 3 * typical))
        self._save_at_stop(wait, "stopped (SIGTERM)")

    def _save_at_stop(self, wait: float, why: str, *, training: bool = False) -> bool:
        """Write the committed step's snapshot if this rank's newest is older (see the module
        doc). Waits up to ``wait`` seconds for a step that is past its ``optimizer.step`` to
        commit (the stop's thread); the training thread (``training``), whose step failed,
        cannot wait for itself. Whether it wrote one."""
        if self.writer is None:
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
            step = self._state.step_no
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
            return self.write_held(step, why)
        finally:
            with self._cond:
                self._stopping = False
                self._broken = False
                self._cond.notify_all()

    def write_held(self, step: int, why: str) -> bool:
        """Write the committed ``step`` now, whole: the parameters and the optimizer's state as
        they are (unchanged since the commit), the rest as the commit held it. Whether it wrote
        one (not when this rank's file holds ``step`` already)."""
        with self._writer_lock:
            return self._write_held_locked(step, why)

    def _write_held_locked(self, step: int, why: str) -> bool:
        writer = self.writer
        if writer is None:
            return False
        try:
            writer.flush()  # the periodic snapshot's background copy first
        except SnapshotError as exc:
            logger.warning("%s", exc)
            self._snapped = -1
        if step <= self._snapped:
            return False
        started = time.perf_counter()
        state = self._state.state_dict()
        held = self._held
        if held is not None and held.step == step:
            state["rng"]["torch"] = held.torch_rng
            state["extra"] = held.extra
            if held.scheduler is not None and held.groups is not None:
                state["scheduler"] = held.scheduler
                groups = state["optimizer"]["param_groups"]
                for group, hyper in zip(groups, held.groups, strict=True):
                    group.update(hyper)
            if held.buffers:
                kept = {
                    live.data_ptr(): copy
                    for live, copy in zip(self._buffers or [], held.buffers, strict=True)
                }
                model = state["model"]
                for key, value in model.items():
                    if isinstance(value, torch.Tensor) and value.data_ptr() in kept:
                        model[key] = kept[value.data_ptr()]
        if not writer.write(step, self._state.generation, state, set):
            return False
        writer.flush()
        self._snapped = step
        self.written += 1
        logger.info(
            "rank %d: %s: wrote the snapshot of step %d (%.0f ms)",
            rank_world()[0],
            why,
            step,
            (time.perf_counter() - started) * 1000,
        )
        return True

    @property
    def snapped(self) -> int:
        """The step of the newest snapshot this rank's file holds (-1: none known)."""
        return self._snapped


def _rank() -> int:
    """This process's rank: the group's, else the launcher's ``RANK`` (a state made before the
    process group)."""
    rank, world = rank_world()
    return rank if world > 1 else int(os.environ.get("RANK", "0") or 0)


def _under_launcher(env: dict[str, str] | os._Environ[str]) -> bool:
    """This worker was started by ddpjob-agent or torchrun, which stop it with SIGTERM: it
    writes its committed step then (:mod:`ddpjob_worker.train.onstop`). A script run by hand (or a
    test in its runner's process) keeps its signals as they are."""
    return bool(env.get(DDPJOB_SNAPSHOT_DIR) or env.get("TORCHELASTIC_RUN_ID"))
