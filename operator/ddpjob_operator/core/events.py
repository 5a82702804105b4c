"""What a pass tells people: its Events, and the summaries its conditions and verdicts carry.

Pure text from values (no actions, no I/O), bounded in size however large the job: at most
:data:`MAX_EVENT_PODS` events of a kind per pass, then one that sums up the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Literal

from ddpjob_operator import api
from ddpjob_operator.api import DDPJobStatus, JobPhase, PodFailure, PodWaiting

MAX_EVENT_PODS = 10
"""Events of one kind a pass emits pod by pod; one more sums up the rest."""


@dataclasses.dataclass(frozen=True)
class Event:
    """A Kubernetes Event about the job, emitted once the pass's status is written."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def counted(items: Iterable[str]) -> str:
    """``"Preempted x3, Evicted x1"``: the most frequent first."""
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{item} x{n}" for item, n in ordered)


def some(names: Sequence[str], limit: int = MAX_EVENT_PODS) -> str:
    """At most ``limit`` names, then how many more."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def failure_events(
    job: api.DDPJob, failures: Sequence[PodFailure], status: DDPJobStatus
) -> list[Event]:
    """One event per failure, at most :data:`MAX_EVENT_PODS`, then one for the rest. Each
    charged one names the count it brought the budget to (1/N, then 2/N, in the order they
    happened), not the count after the whole pass."""
    used = status.backoff_count - sum(f.charged for f in failures)
    events = []
    for failure in failures[:MAX_EVENT_PODS]:
        used += failure.charged
        events.append(_failure_event(job, failure, used))
    rest = failures[MAX_EVENT_PODS:]
    if rest:
        reasons = counted(f.reason for f in rest)
        charged = sum(f.charged for f in rest)
        events.append(
            Event(
                "Warning",
                "PodFailed",
                f"{len(rest)} more pods failed ({reasons}; {charged} charged, "
                f"{status.backoff_count}/{job.spec.backoff_limit} of backoffLimit)",
            )
        )
    return events


def _failure_event(job: api.DDPJob, failure: PodFailure, used: int) -> Event:
    budget = (
        f"charged, {used}/{job.spec.backoff_limit} of backoffLimit"
        if failure.charged
        else "not charged: disruption"
    )
    detail = f": {failure.message}" if failure.message else ""
    return Event(
        "Warning", "PodFailed", f"pod {failure.pod} failed ({failure.reason}, {budget}){detail}"
    )


def waiting_summary(waiting: Sequence[PodWaiting]) -> str:
    """Every waiting pod, by reason, with the first one's message: bounded in size."""
    if not waiting:
        return ""
    if len(waiting) <= 3:
        parts = [f"{w.pod} {w.reason}" + (f" ({w.message})" if w.message else "") for w in waiting]
        return "; waiting: " + "; ".join(parts)
    groups: dict[str, list[PodWaiting]] = {}
    for entry in waiting:
        groups.setdefault(entry.reason, []).append(entry)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    parts = []
    for reason, entries in ordered[:3]:
        first = entries[0]
        example = f"{first.pod}: {first.message}" if first.message else first.pod
        parts.append(f"{len(entries)} pods {reason} (e.g. {example})")
    if len(ordered) > 3:
        parts.append(f"{sum(len(e) for _, e in ordered[3:])} pods for other reasons")
    return f"; waiting: {len(waiting)} pods: " + "; ".join(parts)


def waiting_events(old: Sequence[PodWaiting], new: Sequence[PodWaiting]) -> list[Event]:
    before = {(w.pod, w.reason) for w in old}
    # A back-off has its own event, once, when the failure that starts it is counted.
    fresh = [w for w in new if (w.pod, w.reason) not in before and w.reason != "BackOff"]
    events = [
        Event("Warning", "PodWaiting", f"pod {w.pod} cannot start: {w.reason}: {w.message}")
        for w in fresh[:MAX_EVENT_PODS]
    ]
    rest = fresh[MAX_EVENT_PODS:]
    if rest:
        events.append(
            Event(
                "Warning",
                "PodWaiting",
                f"{len(rest)} more pods cannot start ({counted(w.reason for w in rest)})",
            )
        )
    return events


def phase_events(old: JobPhase, new: JobPhase, running: int, desired: int) -> list[Event]:
    if new is old or new not in (JobPhase.RUNNING, JobPhase.RESTARTING):
        return []
    kind: Literal["Normal", "Warning"] = "Normal" if new is JobPhase.RUNNING else "Warning"
    return [Event(kind, new.value, f"{running} of {desired} pods running (was {old})")]


def room_for_store_host(deleted: Sequence[str]) -> list[Event]:
    """Pods deleted so that pod 0, the first store's host, gets the room they took."""
    if not deleted:
        return []
    return [
        Event(
            "Warning",
            "StoreHostUnplaced",
            f"pod 0 hosts the rendezvous store and waits for room, which pods beyond "
            f"minReplicas took: deleting {some(deleted)} (created again once pod 0 is placed)",
        )
    ]


def pods_changed(replicas: int, created: Sequence[str], scaled_down: Sequence[str]) -> list[Event]:
    """The pods a pass creates, and those a scale-down to ``replicas`` deletes."""
    events = []
    if created:
        events.append(Event("Normal", "CreatedPods", f"created {some(created)}"))
    if scaled_down:
        events.append(
            Event(
                "Normal",
                "ScalingDown",
                f"spec.replicas is {replicas}: deleting {some(scaled_down)}",
            )
        )
    return events
