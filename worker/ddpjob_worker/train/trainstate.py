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

The restore (run by :meth:`TrainState.batches`, :meth:`TrainState.epochs` or the first
iteration of the sampler, before its first
batch, over the default process group: :mod:`ddpjob_worker.train.restore`) resumes every rank
from the highest step any rank holds, each rank from its own copy where it has the same bytes,
the others by broadcast; then all ranks compare a checksum of their model state and fail loudly
if they differ. The commits, and the writes at a stop or a failed step, are
:mod:`ddpjob_worker.train.commit`'s.

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

import dataclasses
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ddpjob_worker.progress import Phase
from ddpjob_worker.saving import saving
from ddpjob_worker.train import checkpoint as checkpoint_file
from ddpjob_worker.train import flat, restore
from ddpjob_worker.train.commit import Committer
from ddpjob_worker.train.payload import (
    PAYLOAD_VERSION,
    Stateful,
    model_checksum,
    rng_state,
    set_rng_state,
)
from ddpjob_worker.train.phases import Marks
from ddpjob_worker.train.restore import Restored, rank_world
from ddpjob_worker.train.sampler import Batch, ElasticSampler
from ddpjob_worker.train.snapshot import SnapshotError, newest, snapshot_path

__all__ = [
    "Batch",
    "ElasticSampler",
    "Restored",
    "Stats",
    "TrainState",
    "model_checksum",
    "newest",
    "snapshot_path",
]


@dataclasses.dataclass(frozen=True, slots=True)
class Stats:
    """:attr:`TrainState.stats`: what the snapshots have cost."""

    snapshots_written: int
    """Snapshots this process has written (periodic and at stops)."""
    snapshot_interval: int
    """Committed steps from one periodic snapshot to the next, as of now (``snapshot_every``,
    or what :mod:`ddpjob_worker.train.cadence` learned)."""
    snapshot_seconds: float
    """How long the last snapshot took on the training thread (at the commit)."""
    background_seconds: float
    """How long the last finished background copy took (copy, checksum, publish)."""
    wait_seconds: float
    """How long this step waited for the last snapshot's background copy."""


class _Step:
    """:meth:`TrainState.step`'s block: a class, not a generator, as it runs once a step (a
    ``contextlib.contextmanager`` costs a generator and two more calls each time)."""

    __slots__ = ("_commits", "_marks", "_state")

    def __init__(self, state: TrainState, commits: Committer, marks: Marks) -> None:
        self._state = state
        self._commits = commits
        self._marks = marks

    def __enter__(self) -> None:
        commits = self._commits
        commits.in_block = True
        if commits.writer is not None:
            commits.writer.waited = 0.0
        if self._marks.on:
            self._marks.mark(self._state.step_no, Phase.COMPUTE)

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        commits = self._commits
        commits.in_block = False
        if kind is not None:
            commits.stepped = False
            commits.failed()
        elif commits.stepped:
            commits.commit()
        else:  # no optimizer step: a micro-batch of the next step
            self._state.sampler.ended()


class TrainState:
    """A DDP script's state, snapshotted after committed steps and at a stop (see the module
    doc)."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler | None = None,
        loader: Any = None,
        scheduler: Stateful | None = None,
        scaler: Any = None,
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
        self.sampler = _the_sampler(sampler, loader)
        self.scheduler = scheduler
        self.scaler = scaler
        self.extra: dict[str, Any] = {} if extra is None else extra
        self.seed = self.sampler.seed if seed is None else seed
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.step_no = 0
        """The committed step."""
        self.restored: Restored | None = None
        self.generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self._marks = Marks(model, os.environ)
        self._commits = Committer(
            self,
            self._marks,
            None if not snapshots else path or snapshot_path(os.environ),
            background=background,
            snapshot_every=snapshot_every,
        )
        self._step_block = _Step(self, self._commits, self._marks)
        self.sampler.attach(rank_world, self._restore_once)
        if scaler is not None:
            # A step the scaler skips calls no optimizer.step: it commits all the same.
            scaler.step = self._commits.scaler_step(scaler.step)

    # -- the loop ---------------------------------------------------------------------------

    def batches(self) -> Iterator[list[int]]:
        """Restore (once), then yield this rank's indices for each next step until the
        sampler's epochs are done. A batch whose step was not committed is yielded again."""
        self._restore_once()
        rank, world = rank_world()  # a process's world does not change: a restart is a new one
        sampler = self.sampler
        while True:
            if sampler.outstanding:  # the last batch's block failed: it comes again
                sampler.rewind()
            batch = sampler.take(rank, world)
            if batch is None:
                self._marks.mark(self.step_no, Phase.IDLE)
                self.flush()
                return
            yield batch.indices

    def epochs(self, epochs: int | None = None) -> Iterator[int]:
        """Restore (once), then yield the number of each epoch left, from the restored one
        (``epochs``, when given, is the sampler's count of epochs): the loop over a DataLoader
        whose ``batch_sampler`` is the sampler, each epoch's iteration the rest of that epoch::

            for epoch in state.epochs(max_epochs):
                for x, y in loader:
                    with state.step():
                        ...
        """
        if epochs is not None:
            if epochs <= 0:
                raise ValueError(f"TrainState.epochs: epochs must be positive: {epochs}")
            self.sampler.epochs = epochs
        self._restore_once()
        sampler = self.sampler
        while sampler.resumed_epoch < sampler.epochs:
            epoch = sampler.resumed_epoch
            yield epoch
            if sampler.resumed_epoch == epoch:  # the loop left the epoch early
                return
        self._marks.mark(self.step_no, Phase.IDLE)
        self.flush()

    def _restore_once(self) -> None:
        if self.restored is None:
            self._marks.mark(self.step_no, Phase.IDLE)
            self._restore()

    def step(self) -> _Step:
        """A context manager around one batch (from :meth:`batches` or the DataLoader). A clean
        exit of a block in which ``optimizer.step`` (or the scaler's step) ran commits: advance
        the sampler by this batch and the micro-batches before it, count the step, write the
        snapshot when one is due; a clean exit without one leaves the batch a micro-batch of the
        next step. An exception commits nothing, and writes the committed step's snapshot if
        the newest is older (a peer died under the all-reduce, most likely: the restart needs
        this rank's committed step)."""
        return self._step_block

    # -- the snapshot's timings and waits ----------------------------------------------------

    @property
    def stats(self) -> Stats:
        """What the snapshots have cost so far (:class:`Stats`), as of now."""
        commits = self._commits
        writer = commits.writer
        return Stats(
            snapshots_written=commits.written,
            snapshot_interval=commits.cadence.interval,
            snapshot_seconds=commits.seconds,
            background_seconds=0.0 if writer is None else writer.background_seconds,
            wait_seconds=0.0 if writer is None else writer.waited,
        )

    def flush(self) -> None:
        """Wait until the last snapshot is whole in its file (its background copy, if any,
        done); raise its failure if it failed. Call it before changing the parameters or the
        optimizer's state outside ``optimizer.step`` and the step block (the copy may still
        be reading them; see :mod:`ddpjob_worker.train.snapwriter`). The restore, a checkpoint,
        the next snapshot and the end of :meth:`batches` call it."""
        self._commits.flush()

    # -- the state ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": PAYLOAD_VERSION,
            "step": self.step_no,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
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
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.sampler.load_state_dict(state["sampler"])
        self.extra.clear()
        self.extra.update(state["extra"])
        self.step_no = int(state["step"])
        if rng:
            set_rng_state(state["rng"])

    def _payload(self) -> memoryview:
        buffer = io.BytesIO()
        torch.save(self.state_dict(), buffer)
        return buffer.getbuffer()

    def _load_payload(self, payload: bytes | memoryview, *, rng: bool = True) -> None:
        """Load a snapshot's bytes (:mod:`ddpjob_worker.train.flat`) or a checkpoint's
        (``torch.save``)."""
        if flat.is_flat(payload):
            state = flat.load(payload)
        else:
            # Our own bytes, CRC-checked: the RNG states and extra need the full unpickler.
            state = torch.load(io.BytesIO(payload), weights_only=False)
        self.load_state_dict(state, rng=rng)

    def _load(self, payload: bytes | memoryview, *, rng: bool) -> int:
        self._load_payload(payload, rng=rng)
        return self.step_no

    # -- checkpoints on disk, and the restore -------------------------------------------------

    def save_checkpoint(self) -> bool:
        """Write the committed state to ``checkpoint`` on rank 0 (the others do nothing):
        a temporary file, flushed, then renamed over the old one, so a reader sees the old
        checkpoint or the new one, never a torn file; under :func:`ddpjob_worker.saving`, so
        ddpjob-agent lets the write finish before it stops this worker. Whether it wrote."""
        if self.checkpoint is None:
            raise ValueError("save_checkpoint needs TrainState(checkpoint=<path>)")
        self.flush()  # the snapshot of this step first (and its failure, if it failed)
        commits = self._commits
        if commits.writer is not None and commits.snapped < self.step_no:
            # Every rank holds the checkpoint's step in memory too: the restore prefers a
            # snapshot to the file, and one older than the file would lose steps.
            commits.write_held(self.step_no, "a checkpoint")
        if rank_world()[0] != 0:
            return False
        # Marked SAVING: the others wait for this rank in the next step's all-reduce meanwhile,
        # and a write slower than the hang threshold must not be taken for a hang.
        self._marks.mark(self.step_no, Phase.SAVING)
        try:
            with saving():
                checkpoint_file.write(self.checkpoint, self._payload())
        finally:
            self._marks.mark(self.step_no, Phase.COMMIT)
        return True

    def _restore(self) -> Restored:
        """Resume from the newest step any rank holds (:mod:`ddpjob_worker.train.restore`), or
        from the checkpoint, or start fresh; then check that every rank holds the same model.
        Collective: every rank calls it."""
        commits = self._commits
        restored = restore.from_peers(commits.local(), self._load, self.seed)
        if restored is None:
            restored = restore.from_checkpoint(self.checkpoint, self._load, self.seed)
        self.restored = restored
        restore.check_same_model(self.model, commits.path.parent if commits.path else None)
        # A rank that received the step holds no snapshot of it: a stop writes it.
        commits.restored(restored.step if restored.local and not restored.checkpoint else None)
        if commits.audit is not None:
            commits.audit.restored(self.step_no, rank_world()[1], model_checksum(self.model))
        return restored


def _the_sampler(sampler: ElasticSampler | None, loader: Any) -> ElasticSampler:
    """The sampler given, or the one the DataLoader given takes its batches from."""
    if sampler is not None:
        if loader is not None and getattr(loader, "batch_sampler", None) is not sampler:
            raise ValueError(
                "TrainState(sampler=..., loader=...): the loader's batch_sampler is not this "
                "sampler; give one of them (DataLoader(dataset, batch_sampler=sampler))"
            )
        if not isinstance(sampler, ElasticSampler):
            raise TypeError(
                f"TrainState(sampler=...) takes an ElasticSampler, not a "
                f"{type(sampler).__name__}: replace it with "
                "ElasticSampler(len(dataset), batch_size=...), and give the DataLoader "
                "batch_sampler=that sampler (no sampler, batch_size, shuffle or drop_last)"
            )
        return sampler
    if loader is None:
        raise TypeError("TrainState needs sampler=ElasticSampler(...) or loader=<a DataLoader>")
    if isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
        raise TypeError(
            f"TrainState(loader=...): this DataLoader reads an iterable dataset "
            f"({type(loader.dataset).__name__}), whose position is its own, not a sampler's, "
            "so no restore at another world size can be exact: give it a map-style Dataset "
            "(__len__ and __getitem__) and batch_sampler=ElasticSampler(len(dataset), "
            "batch_size=B); or keep it, leave loader= out, and save its state_dict() in your "
            "own checkpoint (exact only at the world size it was saved at)"
        )
    if getattr(loader, "in_order", True) is False and getattr(loader, "num_workers", 0) > 0:
        raise ValueError(
            "TrainState(loader=...): DataLoader(in_order=False) hands out batches as its "
            "workers finish them, not in the sampler's order, so the committed position would "
            "not be what the committed steps consumed: drop in_order=False"
        )
    found = getattr(loader, "batch_sampler", None)
    if isinstance(found, ElasticSampler):
        return found
    inner = getattr(found, "sampler", None) or getattr(loader, "sampler", None)
    named = type(inner if inner is not None else found).__name__
    raise TypeError(
        f"TrainState(loader=...): this DataLoader takes its batches from a {named}, whose "
        "position the snapshot cannot carry across a change of world size: make it "
        "DataLoader(dataset, batch_sampler=ElasticSampler(len(dataset), batch_size=B), ...) "
        "with no sampler, batch_size, shuffle or drop_last (the ElasticSampler shuffles by "
        "epoch and splits each step over the ranks)"
    )
