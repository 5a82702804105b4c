"""The elastic sampler of the training-state API (:mod:`ddpjob_worker.train`): which samples
each rank takes at each step, for any world size, resumable at any step. No torch: its
position is two integers that the snapshot carries.

It is also a batch sampler for torch's ``DataLoader``
(``DataLoader(dataset, batch_sampler=sampler, num_workers=..., pin_memory=...)``): iterating it
yields this rank's index lists for the rest of the current epoch, so the loader's worker
processes fetch and collate them, prefetching ahead. What they fetched ahead is not what the
job consumed: the position a snapshot carries moves only at a commit, by the batches whose step
blocks ended since the last one (one batch a block; the blocks of a step's micro-batches and
the block of its ``optimizer.step``). A new iteration (the next epoch, a loader started again)
begins after the last batch a step block took, dropping what was fetched beyond it.
"""

from __future__ import annotations

import array
import collections
import os
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

__all__ = ["Batch", "ElasticSampler"]


class Batch(NamedTuple):
    """This rank's indices for one step, and how many samples the whole job consumes in it
    (a named tuple: made once a step, and a frozen dataclass's ``__init__`` costs several
    times a tuple's)."""

    indices: list[int]
    consumed: int


def max_world(env: Mapping[str, str]) -> int | None:
    """The largest world the job may reach: the launcher's ``PET_NNODES`` (``min:max``, as
    ddpjob-agent's pods and torchrun's environment give it) times ``PET_NPROC_PER_NODE``; None
    where they are not set or not numbers."""
    nodes = env.get("PET_NNODES", "").rpartition(":")[2]
    nproc = env.get("PET_NPROC_PER_NODE", "1")
    if not nodes.isdigit() or not nproc.isdigit():
        return None
    return int(nodes) * int(nproc)


class ElasticSampler:
    """Sample indices of one dataset for any world size, resumable at any step.

    The position is the epoch and the number of samples of the epoch's order that the whole
    job has consumed (``processed``), not a per-rank iterator: after a change of world size the
    epoch's remaining indices are split across the new ranks, so none is skipped or repeated
    (the idea of Horovod's ElasticSampler). Each step takes the next ``world * batch_size``
    indices of the epoch's order; rank ``r`` gets the ``r``-th share.

    No rank gets an empty batch, so a loss that is a ``.mean()`` over the batch is right: a
    step that would leave fewer samples in the epoch than the largest world can share (one
    each) takes them too (its shares are at most that many larger), and the epoch's last step
    shares what is left as evenly as possible. The largest world is ``max_world``, by default
    what the launcher's environment says (:func:`max_world`), else the world of the step. Only
    a world larger than that can find fewer samples left than ranks: its step then takes the
    first samples of the next epoch's order to make one each (they count as consumed in that
    epoch), and in the last epoch the ranks beyond the samples get empty lists.
    """

    def __init__(
        self,
        size: int,
        *,
        batch_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        epochs: int = 1,
        max_world: int | None = None,
    ) -> None:
        if size <= 0:
            raise ValueError(f"ElasticSampler size must be positive (the dataset's length): {size}")
        if batch_size <= 0:
            raise ValueError(f"ElasticSampler batch_size must be positive: {batch_size}")
        if epochs <= 0:
            raise ValueError(f"ElasticSampler epochs must be positive: {epochs}")
        if max_world is not None and max_world <= 0:
            raise ValueError(f"ElasticSampler max_world must be positive: {max_world}")
        self.size = size
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epochs = epochs
        self.max_world = max_world if max_world is not None else _env_max_world()
        self.epoch = 0
        """The committed position's epoch."""
        self.processed = 0
        """The samples of the epoch's order that the committed steps consumed."""
        self._order: tuple[int, array.array[int]] | None = None
        self._taken: collections.deque[int] = collections.deque()
        """What each batch handed out beyond the committed position consumed, in order."""
        self._done = 0
        """Of those, the batches whose step blocks ended (a step's micro-batches so far)."""
        self._cursor = (0, 0)
        """Where the next batch handed out begins (epoch, processed)."""
        self._where: Callable[[], tuple[int, int]] | None = None
        self._first: Callable[[], None] | None = None
        self.kept: collections.deque[tuple[int, list[int]]] | None = None
        """With an audit (:mod:`ddpjob_worker.train.audit`): the epoch and this rank's indices
        of each batch handed out beyond the committed position."""

    # -- the epoch's order and the step's shares ---------------------------------------------

    def order(self, epoch: int) -> list[int]:
        """The epoch's order of indices: the same in every process (a seeded shuffle)."""
        return self._indices(epoch).tolist()

    def _indices(self, epoch: int) -> array.array[int]:
        """The epoch's order as a compact array: 8 bytes an index instead of a list's 36, and a
        step's slice reads contiguous memory (a shuffled list's ints lie all over the heap)."""
        if self._order is None or self._order[0] != epoch:
            indices = list(range(self.size))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(indices)  # noqa: S311
            self._order = (epoch, array.array("q", indices))
        return self._order[1]

    def _count(self, start: int, world: int) -> int:
        """How many samples the step from ``start`` takes at ``world`` (the class doc)."""
        left = self.size - start
        step = world * self.batch_size
        if left - step < max(world, self.max_world or 0):
            return left  # the tail, or a step that would leave fewer than the ranks can share
        return step

    def _batch_at(self, epoch: int, start: int, rank: int, world: int) -> Batch | None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        if epoch >= self.epochs:
            return None
        n = self._count(start, world)
        if n < world and epoch + 1 < self.epochs:
            # A world larger than max_world at the epoch's end: one sample each, the missing
            # ones the first of the next epoch's order.
            merged = [*self._indices(epoch)[start:], *self._indices(epoch + 1)[: world - n]]
            return Batch([merged[rank]], world)
        # One slice, of this rank's share: slicing what is left of the epoch first copied it
        # whole, a cost that grew with the dataset (0.5 ms a step at 192,000 samples).
        order = self._indices(epoch)
        return Batch(order[start + rank * n // world : start + (rank + 1) * n // world].tolist(), n)

    def _moved(self, epoch: int, processed: int, consumed: int) -> tuple[int, int]:
        processed += consumed
        while processed >= self.size:
            processed -= self.size
            epoch += 1
        return epoch, processed

    def next_batch(self, rank: int, world: int) -> Batch | None:
        """The step's indices for ``rank`` of ``world`` at the committed position; None when
        every epoch is done."""
        return self._batch_at(self.epoch, self.processed, rank, world)

    def advance(self, consumed: int) -> None:
        """A step that consumed ``consumed`` samples (all ranks together) was committed."""
        self.epoch, self.processed = self._moved(self.epoch, self.processed, consumed)
        self._taken.clear()
        if self.kept is not None:
            self.kept.clear()
        self._done = 0
        self._cursor = (self.epoch, self.processed)

    def steps_left(self, world: int) -> int:
        """The steps from the committed position to the end of its epoch at ``world``."""
        return self._steps_from(self.epoch, self.processed, world)

    def _steps_from(self, epoch: int, start: int, world: int) -> int:
        if epoch >= self.epochs:
            return 0
        steps = 0
        while start < self.size:
            start += max(world, self._count(start, world))
            steps += 1
        return steps

    # -- the batches handed out, and the commits ---------------------------------------------

    def take(self, rank: int, world: int) -> Batch | None:
        """The next batch for ``rank`` of ``world`` after those handed out since the last
        commit (a step's next micro-batch, a loader's prefetch); None when every epoch is
        done."""
        epoch, start = self._cursor
        batch = self._batch_at(epoch, start, rank, world)
        if batch is not None:
            self._taken.append(batch.consumed)
            if self.kept is not None:
                self.kept.append((epoch, batch.indices))
            self._cursor = self._moved(epoch, start, batch.consumed)
        return batch

    @property
    def outstanding(self) -> bool:
        """A batch was handed out whose step block has not ended."""
        return len(self._taken) > self._done

    def ended(self) -> None:
        """A step block ended without a commit: its batch is one of the step's micro-batches."""
        if self._done < len(self._taken):
            self._done += 1

    def commit(self) -> list[tuple[int, list[int]]] | None:
        """A step block ended with a commit: the step consumed its batch and the micro-batches
        before it. With an audit, their epochs and this rank's indices."""
        self.ended()
        consumed = 0
        taken = self._taken
        kept = self.kept
        batches = None if kept is None else [kept.popleft() for _ in range(self._done)]
        for _ in range(self._done):
            consumed += taken.popleft()
        self._done = 0
        self.epoch, self.processed = self._moved(self.epoch, self.processed, consumed)
        return batches

    def rewind(self) -> None:
        """Forget the batches handed out that no step block took (a loader's prefetch, a
        failed step's batch): the next batch begins after the last one taken."""
        taken = self._taken
        while len(taken) > self._done:
            taken.pop()
            if self.kept:
                self.kept.pop()
        epoch, processed = self.epoch, self.processed
        for consumed in taken:
            epoch, processed = self._moved(epoch, processed, consumed)
        self._cursor = (epoch, processed)

    # -- a batch sampler for torch's DataLoader -------------------------------------------------

    def attach(self, where: Callable[[], tuple[int, int]], first: Callable[[], None]) -> None:
        """The training state this sampler serves: ``where()`` gives this process's rank and
        world, ``first()`` restores the state before the first batch is handed out."""
        self._where = where
        self._first = first

    def _bound(self) -> tuple[int, int]:
        if self._where is None or self._first is None:
            # No TrainState: nothing commits, so each iteration is the epoch from the start
            # (an evaluation loader), this rank's share by the launcher's RANK and WORLD_SIZE.
            return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self._first()
        return self._where()

    def __iter__(self) -> Iterator[list[int]]:
        """This rank's batches for the rest of the current epoch, from after the last batch a
        step block took (a DataLoader's ``batch_sampler``)."""
        rank, world = self._bound()
        self.rewind()
        epoch = self._cursor[0]
        while self._cursor[0] == epoch:
            batch = self.take(rank, world)
            if batch is None:
                return
            yield batch.indices

    def __len__(self) -> int:
        """The batches a new iteration yields (the rest of the current epoch)."""
        _, world = self._bound()
        self.rewind()
        epoch, start = self._cursor
        return self._steps_from(epoch, start, world)

    @property
    def resumed_epoch(self) -> int:
        """The epoch the next batch belongs to (after the restore: the restored one)."""
        self.rewind()
        return self._cursor[0]

    # -- the position a snapshot carries -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed": self.processed, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size:
            raise ValueError(
                f"the snapshot's sampler covers {state['size']} samples and this one "
                f"{self.size}: the dataset's length changed since the snapshot; give "
                "ElasticSampler the same dataset length as before (or start the job afresh)"
            )
        self.advance(0)
        self.epoch = int(state["epoch"])
        self.processed = int(state["processed"])
        self._cursor = (self.epoch, self.processed)


def _env_max_world() -> int | None:
    return max_world(os.environ)
