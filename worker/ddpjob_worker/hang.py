"""Which rank holds the others up: issue 36's hang detection, as pure functions of the ranks'
progress records (:mod:`ddpjob_worker.progress`). No torch, no clock of its own.

A worker stuck while its agent and every peer live (a hung driver, a deadlock in user code,
one rank that never reaches the all-reduce) looks, from the records, like this: most ranks
have waited in the step's collective for longer than the threshold, and one has not reached
it (it is still computing that step, or writing the step before's snapshot). That one is
stuck; the others are only waiting for it. Without a majority waiting nothing is pinned on
anyone: a job whose every rank computes for a long time (an evaluation, a slow step) is slow,
not hung.

The threshold is learned from the job's own steps (:class:`StepTimes`): ``FACTOR`` times the
p99 of the recent step times, never under ``FLOOR_SECONDS`` (as NVIDIA's resiliency extension
learns its timeouts from observed intervals). The backends' own timeouts must stay above it,
so that the agent, not a watchdog's abort, decides.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from typing import TypeVar

from ddpjob_worker.progress import Phase, Progress

K = TypeVar("K")

FLOOR_SECONDS = 5.0
"""The shortest threshold, whatever the steps take."""
FACTOR = 5.0
"""The threshold's margin over the p99 step time."""
WARMUP_STEPS = 3
"""Steps not counted (the first ones build buckets, warm caches, compile)."""
WINDOW = 200
"""How many recent step times the threshold is learned from."""


class StepTimes:
    """One rank's recent step times, learned by its worker from its own steps' starts."""

    def __init__(self) -> None:
        self._times: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._last: tuple[int, float] | None = None
        self._seen = 0
        self._threshold = FLOOR_SECONDS

    def observe(self, progress: Progress) -> None:
        """A record read: a step that moved on gives the time since the step before moved."""
        last = self._last
        if last is not None and progress.step == last[0]:
            return
        if last is not None and progress.step == last[0] + 1:
            self._seen += 1
            if self._seen > WARMUP_STEPS:
                self._times.append(max(0.0, progress.since - last[1]))
                ordered = sorted(self._times)
                p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
                self._threshold = max(FLOOR_SECONDS, FACTOR * p99)
        self._last = (progress.step, progress.since)

    def threshold(self) -> float:
        """The threshold as of the last step time (worked out once per step, not per read:
        the worker asks at every mark)."""
        return self._threshold


def stuck(records: Mapping[K, Progress], now: float, threshold: float) -> set[K]:
    """The ranks (any key: a rank, a node) that hold the others up, from every rank's record:
    a strict majority has waited in a collective for longer than ``threshold``, and these have
    been outside it for as long, at the step the waiting ranks wait in or an earlier one.
    Empty when no majority waits (see the module doc)."""
    waiting = {
        key
        for key, record in records.items()
        if record.phase is Phase.COLLECTIVE and now - record.since > threshold
    }
    if 2 * len(waiting) <= len(records):
        return set()
    step = min(records[key].step for key in waiting)
    return {
        key
        for key, record in records.items()
        if key not in waiting
        and record.phase not in (Phase.COLLECTIVE, Phase.SAVING)
        and record.step <= step
        and now - record.since > threshold
    }


def heard(raw: object, now: float) -> tuple[int, list[Progress]] | None:
    """A heartbeat's ``p`` (see :meth:`ddpjob_worker.membership.member.Member._heartbeat`): the
    member's round and its local ranks' records, their times on our clock (``now`` less each age).
    None when there is none, or it is malformed."""
    if not isinstance(raw, list) or len(raw) != 2 or not isinstance(raw[0], int):
        return None
    records = []
    for item in raw[1] if isinstance(raw[1], list) else []:
        try:
            step, phase, age, threshold = item
            records.append(Progress(int(step), Phase(phase), now - float(age), float(threshold)))
        except (TypeError, ValueError):
            return None
    return raw[0], records


def stuck_members(reports: Mapping[K, Sequence[Progress]], now: float) -> tuple[set[K], float]:
    """The members (each with its local ranks' records) that hold the round up, and the
    threshold used: the largest any worker learned, at least :data:`FLOOR_SECONDS`."""
    records = {(key, k): r for key, found in reports.items() for k, r in enumerate(found)}
    threshold = max([FLOOR_SECONDS, *(r.threshold for r in records.values())])
    return {key for key, _ in stuck(records, now, threshold)}, threshold
