"""Back-off per pod index (``spec.podBackoff``, :class:`~ddpjob_operator.api.PodBackoff`).

After a failure that delays its index (:attr:`~ddpjob_operator.api.PodFailure.delays_next_pod`:
charged, or the trainer never started), the next pod of that index waits 10 s after the failed
trainer ended, doubling with each such failure of the index in a row up to 360 s, as the Job
controller does; a pod of the index that ran ``resetAfterSeconds`` starts the count over. The
state is ``status.podBackoff``, moved only when a failure is counted (exactly once), so a pass
that runs again never moves it twice, and an operator that restarts reads it back. Pure.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from ddpjob_operator import api, builders
from ddpjob_operator.api import DDPJobStatus, PodFailure, PodWaiting
from ddpjob_operator.core.events import MAX_EVENT_PODS, Event, some
from ddpjob_operator.observe import ObservedPod, PodPhase


def advance(
    policy: api.PodBackoff,
    entries: Sequence[api.IndexBackoff],
    counted: Sequence[tuple[PodFailure, float]],
) -> list[api.IndexBackoff]:
    """Each index's failures in a row after this pass's failures (in the order they happened,
    with how long each pod ran): a pod that ran ``resetAfterSeconds`` starts its index's count
    over, a delayed failure adds one. Counting is exact (each pod is counted once), so the
    back-off moves once per failure however often a pass runs."""
    state = {e.index: e for e in entries}
    for failure, ran in counted:
        if ran >= policy.reset_after_seconds:
            state.pop(failure.index, None)
        if not failure.delays_next_pod:
            continue
        old = state.get(failure.index)
        state[failure.index] = api.IndexBackoff(
            index=failure.index,
            failures=(old.failures if old is not None else 0) + 1,
            last_failure_time=failure.time,
        )
    return sorted(state.values(), key=lambda e: e.index)


def clear_healthy(
    policy: api.PodBackoff,
    entries: Sequence[api.IndexBackoff],
    live: Sequence[ObservedPod],
    now: dt.datetime,
) -> list[api.IndexBackoff]:
    """Drop the back-off of an index whose pod has now run ``resetAfterSeconds``."""
    well = {
        p.index
        for p in live
        if p.phase is PodPhase.RUNNING
        and p.started_at is not None
        and p.ran_for(now) >= policy.reset_after_seconds
    }
    return [e for e in entries if e.index not in well]


def retry_time(policy: api.PodBackoff, entry: api.IndexBackoff) -> dt.datetime:
    """When the next pod of the entry's index may be created."""
    return entry.last_failure_time + dt.timedelta(seconds=policy.delay(entry.failures))


def waiting_for(
    job: api.DDPJob, status: DDPJobStatus, index: int, now: dt.datetime
) -> PodWaiting | None:
    """Pod ``index`` waits for its back-off (``spec.podBackoff``): why, and until when."""
    entry = next((e for e in status.pod_backoff if e.index == index), None)
    if entry is None:
        return None
    retry = retry_time(job.spec.pod_backoff, entry)
    left = (retry - now).total_seconds()
    if left <= 0:
        return None
    last = next((f for f in reversed(status.failures) if f.index == index), None)
    what = "pods never started" if last is not None and not last.started else "pods failed"
    why = f"{last.reason}" + (f": {last.message}" if last.message else "") if last else "?"
    return PodWaiting(
        pod=builders.pod_name(job.name, index),
        reason="BackOff",
        message=(
            f"its last {entry.failures} {what} in a row (last: {why}); the next one is created "
            f"in {left:.0f}s"
        )[:500],
        index=index,
        retry_time=retry,
    )


def events(
    job: api.DDPJob,
    failures: Sequence[PodFailure],
    status: DDPJobStatus,
    now: dt.datetime,
    completing: bool,
) -> list[Event]:
    """One event per back-off that this pass's failures started (at most
    :data:`MAX_EVENT_PODS`, then one for the rest): the failures are counted once, so each
    back-off is told once, however many passes it lasts. None once the job is completing
    (nothing is re-created)."""
    if completing:
        return []
    policy = job.spec.pod_backoff
    entries = {e.index: e for e in status.pod_backoff}
    started: list[tuple[api.IndexBackoff, dt.datetime]] = []
    for index in sorted({f.index for f in failures if f.delays_next_pod}):
        entry = entries.get(index)
        if entry is not None and retry_time(policy, entry) > now:
            started.append((entry, retry_time(policy, entry)))
    told = []
    for entry, retry in started[:MAX_EVENT_PODS]:
        delay = policy.delay(entry.failures)
        told.append(
            Event(
                "Warning",
                "BackOff",
                f"pod {builders.pod_name(job.name, entry.index)} is re-created in "
                f"{(retry - now).total_seconds():.0f}s, at {retry:%Y-%m-%dT%H:%M:%SZ}: back-off "
                f"{delay:g}s after {entry.failures} failures of its index in a row "
                f"(spec.podBackoff)",
            )
        )
    rest = started[MAX_EVENT_PODS:]
    if rest:
        told.append(
            Event(
                "Warning",
                "BackOff",
                f"{len(rest)} more pods back off (indices {some([str(e.index) for e, _ in rest])})",
            )
        )
    return told
