"""What one pass sees of a job: its pods sorted into buckets once (as JobSet and the Job
controller do), the deletions whose count waits for the end of their burst, the desired count,
and the room the pass has to count in (:class:`Facts`, which every rule reads and none
changes)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Sequence

from ddpjob_operator import api, builders
from ddpjob_operator.api import DDPJobStatus
from ddpjob_operator.core import queue
from ddpjob_operator.core.actions import Observed
from ddpjob_operator.observe import ObservedPod, PodPhase

MAX_NEW_ACCOUNTED = 250
"""Uids a pass may add to ``status.accountedPods`` (counted pods and our own deletions). 500,
the Job controller's bound for ``uncountedTerminatedPods``, made a 24 KB status (39 B a uid)
when a 1,024-pod job was scaled to 512; 250 keep it under 20 KB, for one more pass and status
write per 250 pods deleted or ended at once."""


LARGE_JOB_PODS = 64
"""A job of more pods than this counts a burst of deletions together (:func:`held_deletions`);
the controller settles its counts too (``controller.SETTLE_PODS``)."""


DELETION_QUIET_SECONDS = 2.0
"""A burst of deletions is over when none was asked for this long (the taint manager deletes a
lost node's pods at kube-controller-manager's 20 requests a second: one every 0.1 s)."""


DELETION_BATCH_SECONDS = 10.0
"""A held deletion is counted this long after the first of its burst at the latest."""


def desired_replicas(spec: api.DDPJobSpec) -> int:
    return min(max(spec.replicas, spec.effective_min), spec.effective_max)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The job's pods, sorted once per pass. A pod may sit in more than one bucket
    (``uncounted`` overlaps the others)."""

    active: tuple[ObservedPod, ...]
    """Pending or running, not being deleted, index < desired."""
    surplus: tuple[ObservedPod, ...]
    """Pending or running, not being deleted, index >= desired: scale-down deletes them."""
    succeeded: tuple[ObservedPod, ...]
    """The trainer finished successfully (a sidecar may still run)."""
    failed: tuple[ObservedPod, ...]
    """The trainer failed and nobody is deleting the pod yet: replacing it deletes it first."""
    uncounted: tuple[ObservedPod, ...]
    """Tracked, ended, and not yet in the status: counted in this pass."""
    terminating_by_us: tuple[ObservedPod, ...]
    """Being deleted, and already accounted (ours, or counted on an earlier pass)."""
    terminating_by_others: tuple[ObservedPod, ...]
    """Being deleted by someone else, first seen now: a failure (Deleted or a disruption)."""
    deferred: tuple[ObservedPod, ...] = ()
    """Tracked and ended, not yet in the status, and left for the next pass (the per-pass
    bound): never deleted before they are counted."""
    held: tuple[ObservedPod, ...] = ()
    """Being deleted by others while they still run, not yet in the status, and counted once
    the burst of deletions is over (:func:`held_deletions`): nothing is done to them."""

    @property
    def live(self) -> tuple[ObservedPod, ...]:
        return self.active + self.surplus

    @property
    def waiting_count(self) -> tuple[ObservedPod, ...]:
        """Ended, and left uncounted by this pass (deferred or held)."""
        return self.deferred + self.held


def sort_pods(
    pods: Sequence[ObservedPod],
    accounted: Iterable[str],
    desired: int,
    limit: int | None = None,
    hold: Iterable[str] = (),
) -> Buckets:
    """The buckets; at most ``limit`` pods are counted in this pass (the others wait for the
    next one, and a failed one among them is not deleted before it is counted), and none of
    ``hold`` (uids: see :func:`held_deletions`)."""
    done = set(accounted)
    waits = set(hold)
    ordered = sorted(pods, key=lambda p: (p.index, p.name))
    held = tuple(p for p in ordered if p.tracked and p.ended and p.uid in waits - done)
    candidates = tuple(
        p for p in ordered if p.tracked and p.ended and p.uid not in done and p.uid not in waits
    )
    uncounted = candidates if limit is None else candidates[: max(0, limit)]
    fresh = {p.uid for p in uncounted}
    deferred = {p.uid for p in candidates} - fresh
    return Buckets(
        active=tuple(p for p in ordered if p.live and p.index < desired),
        surplus=tuple(p for p in ordered if p.live and p.index >= desired),
        succeeded=tuple(p for p in ordered if p.phase is PodPhase.SUCCEEDED),
        failed=tuple(
            p
            for p in ordered
            if p.phase is PodPhase.FAILED and not p.deleting and p.uid not in deferred
        ),
        uncounted=uncounted,
        terminating_by_us=tuple(
            p for p in ordered if p.deleting and p.uid not in fresh | deferred | waits
        ),
        terminating_by_others=tuple(p for p in ordered if p.deleting and p.uid in fresh),
        deferred=tuple(p for p in candidates if p.uid in deferred),
        held=held,
    )


def held_deletions(
    pods: Sequence[ObservedPod], accounted: Iterable[str], now: dt.datetime
) -> tuple[frozenset[str], float | None]:
    """The pods whose count waits for the end of a burst of deletions, and in how many seconds
    it ends: every pod of a job of more than :data:`LARGE_JOB_PODS` that someone else is
    deleting while it still runs (tracked, not counted, its phase not terminal: no kubelet has
    confirmed its end), as long as the newest such deletion is younger than
    :data:`DELETION_QUIET_SECONDS` and the oldest younger than :data:`DELETION_BATCH_SECONDS`.

    Why waiting is safe: our finalizer holds the pod, so it cannot vanish uncounted, and it is
    not replaced before it is gone; a kubelet that confirms the end (a terminal phase) ends the
    wait for that pod, which is then counted at once. The deletion's time is the API server's
    (``deletionTimestamp`` less the grace period), read against this clock as the force delete
    is. Deterministic: an operator that restarts, or a pass after a dropped watch, holds the
    same pods."""
    if len(pods) <= LARGE_JOB_PODS:
        return frozenset(), None
    done = set(accounted)
    asked = [
        (p.uid, p.deletion_requested_at)
        for p in pods
        if p.tracked and p.deleting and not p.phase.terminated and p.uid not in done
    ]
    times = [at for _, at in asked if at is not None]
    if not times or len(times) < len(asked):
        return frozenset(), None
    quiet = max(times) + dt.timedelta(seconds=DELETION_QUIET_SECONDS)
    latest = min(times) + dt.timedelta(seconds=DELETION_BATCH_SECONDS)
    due = min(quiet, latest)
    if now >= due:
        return frozenset(), None
    return frozenset(uid for uid, _ in asked), (due - now).total_seconds()


@dataclasses.dataclass(frozen=True)
class Facts:
    """The facts of one pass, which every rule reads and none changes: the job, what was seen
    of it (its pods sorted once), the clock, and how its pods are built. (The status is not one:
    the rules pass it along, each returning it changed.)"""

    job: api.DDPJob
    observed: Observed
    now: dt.datetime
    network: builders.Network
    default_profile: api.SecurityProfile
    pods: tuple[ObservedPod, ...]
    """The job's own pods."""
    foreign: tuple[ObservedPod, ...]
    """Pods under the job's pod names whose controller is another object, or none."""
    desired: int
    """The pods the spec asks for, at most as many as Kueue admits."""
    buckets: Buckets
    room: int
    """Uids the pass may still add to ``accountedPods`` once it has counted (the bound)."""
    hold_due: float | None = None
    """Seconds until the held deletions are counted (:func:`held_deletions`), if any."""

    @classmethod
    def start(
        cls,
        job: api.DDPJob,
        observed: Observed,
        status: DDPJobStatus,
        now: dt.datetime,
        network: builders.Network,
        default_profile: api.SecurityProfile,
    ) -> Facts:
        pods = tuple(p for p in observed.pods if p.owned_by(job.metadata.uid))
        foreign = tuple(p for p in observed.pods if not p.owned_by(job.metadata.uid))
        admitted = observed.queue.count if observed.queue else queue.UNBOUNDED
        desired = min(desired_replicas(job.spec), admitted)
        # Uids of pods that no longer carry our finalizer leave accountedPods with the next
        # status write; they take no room meanwhile (a large job writes no status for them
        # alone: controller.settle_for).
        tracked = {p.uid for p in pods if p.tracked}
        room = max(0, MAX_NEW_ACCOUNTED - len(tracked.intersection(status.accounted_pods)))
        hold, hold_due = held_deletions(pods, status.accounted_pods, now)
        buckets = sort_pods(pods, status.accounted_pods, desired, limit=room, hold=hold)
        room -= len(buckets.uncounted)
        return cls(
            job,
            observed,
            now,
            network,
            default_profile,
            pods,
            foreign,
            desired,
            buckets,
            room,
            hold_due,
        )
