"""How often a training state is snapshotted: its cost held to a small share of the step time.
No torch.

A snapshot after every step costs what it costs: on this 2-core machine 0.3 ms of Python on a
0.57 ms toy step, and about 0.1 s of a 0.8 s step for 100 M parameters with AdamW, whose copy
takes one core from a training that uses both. Issue 36 asks for at most 5 % of the step. The
steps between two snapshots are not lost for that: a worker that is stopped (SIGTERM: its
group broke, or the job changes size) writes the step it has committed before it exits, and
one whose step fails (a peer died under the all-reduce) does so before it raises
(:mod:`ddpjob_worker.train.onstop`, :meth:`ddpjob_worker.train.TrainState.step`). The periodic
snapshot is what is left when a worker cannot: all of a job's workers killed at once, or a
worker stopped after ``optimizer.step`` in a step that never commits.

:class:`Cadence` learns both sides from the run itself: a step's time (commit to commit, the
median of the last :data:`WINDOW` steps) and a snapshot's cost (the median of what the last
ones took on the training thread at the commit plus the CPU time of their background copy, as
if the copy took that time from the training: on a machine with a core to spare it takes less;
its wall time, longer when it shares the cores with the training, would count the sharing
twice). A snapshot into a new file's slot is not a sample: it faults the slot's pages in.
Both are measured directly, never as a difference of step times: a gap between two steps (an
evaluation, a checkpoint, the benchmark's other modes) is one outlier among the step times,
and none among the costs. The interval is the fewest steps that keep the cost under
:data:`BUDGET` of the time they take; it is worked out again before each snapshot, so it
follows a run whose steps speed up after the first ones.
"""

from __future__ import annotations

import collections
import math
import statistics

BUDGET = 0.005
"""The share of the step time the periodic snapshots may take, as measured: 0.5 %. What is
measured misses what a snapshot leaves behind: the toy model's step that writes one is 0.54 ms
slower than the others where its commit measures 0.40 ms (the next step runs on caches the
copy cooled), so half a percent measured is most of one percent paid. They are the fallback of
a fallback (a stop writes the committed step), and the training loop's own bookkeeping needs
room under issue 36's 5 %."""
WINDOW = 16
"""Step times (and snapshot costs) kept for the medians."""
FIRST_INTERVAL = 8
"""Steps between the first snapshot and the second, before anything is measured."""
MAX_INTERVAL = 10_000
GROWTH = 2
"""The interval grows at most this many times over from one snapshot to the next."""


class Cadence:
    """When to snapshot: every ``every`` steps, or (``every=None``) as often as :data:`BUDGET`
    allows (see the module doc)."""

    def __init__(self, every: int | None = None, budget: float = BUDGET) -> None:
        if every is not None and every < 1:
            raise ValueError(
                f"snapshot_every={every}: give a count of steps >= 1 (1: after every step), "
                "or None to let the snapshots take about 0.5 % of the step time"
            )
        self.every = every
        self.budget = budget
        self.interval = every if every is not None else FIRST_INTERVAL
        """Steps from one snapshot to the next."""
        self.last: int | None = None
        """The step of the last snapshot."""
        self._steps: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._costs: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._base = self.interval
        """The interval the last snapshot was written at (what the next may grow from)."""
        self._written: float | None = None
        """The last snapshot's time at its commit, until its background copy's is known."""

    def due(self, step: int) -> bool:
        """Whether the commit of ``step`` writes a snapshot."""
        if self.last is None:
            return True
        if step - self.last < self.interval:
            return False
        if self.every is None:
            self.interval = self._learned()
        return step - self.last >= self.interval

    def wrote(self, step: int, seconds: float) -> None:
        """The commit of ``step`` wrote a snapshot, taking ``seconds`` on the training thread;
        :meth:`copied` follows once its background copy is done."""
        self.last = step
        self._written = seconds
        self._base = self.interval

    @property
    def waiting(self) -> bool:
        """The last snapshot's background time is still to come (:meth:`copied`)."""
        return self._written is not None

    def copied(self, seconds: float, *, count: bool = True) -> None:
        """The last snapshot's background copy took ``seconds`` (0: it had none);
        ``count=False``: its cost is not what the next ones will cost (leave it out)."""
        if self._written is not None:
            if count:
                self._costs.append(self._written + seconds)
            self._written = None
            if self.every is None:
                self.interval = self._learned()

    def stepped(self, seconds: float) -> None:
        """A step took ``seconds``, commit to commit (the snapshot written at the commit that
        began it not counted: :meth:`wrote` has it)."""
        self._steps.append(seconds)

    def typical(self) -> float | None:
        """The median step time, once three steps are known."""
        return statistics.median(self._steps) if len(self._steps) >= 3 else None

    def cost(self) -> float | None:
        """The median snapshot cost, once one is known."""
        return statistics.median(self._costs) if self._costs else None

    def _learned(self) -> int:
        typical, cost = self.typical(), self.cost()
        if typical is None or cost is None:
            return self.interval
        wanted = MAX_INTERVAL if typical <= 0 else math.ceil(cost / (self.budget * typical))
        # At most twice as far each time: one costly snapshot (the first, which page-faults a
        # new file in: 3.9 s for 2.3 GB here) would otherwise set an interval so long that no
        # second one comes to correct it.
        return max(1, min(MAX_INTERVAL, wanted, GROWTH * self._base))
