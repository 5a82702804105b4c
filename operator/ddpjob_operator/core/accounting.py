"""Counting, exactly once: every ended pod is accounted with a classified reason and charged
unless it was a disruption; ``accountedPods`` and the finalizer removals that go with it; the
per-pass bounds; pods stuck Terminating force-deleted once counted."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence

from ddpjob_operator import api
from ddpjob_operator.api import (
    DDPJobStatus,
    PodFailure,
)
from ddpjob_operator.core import backoff
from ddpjob_operator.core.actions import Action, DeletePod, DeleteWhy, RemoveFinalizer
from ddpjob_operator.core.facts import Buckets
from ddpjob_operator.observe import DISRUPTIONS, ObservedPod, PodPhase, classify

DEFERRED_REQUEUE = 1.0
"""Seconds until the next pass when this one left work for it (the per-pass bounds)."""


def _ended_at(pod: ObservedPod, now: dt.datetime) -> dt.datetime:
    """When a pod ended: its trainer's finish time as the kubelet wrote it, else now (the
    first pass that sees the end). Never later than now: a node whose clock runs ahead must
    not push a back-off further out."""
    if pod.finished_at is None:
        return now
    return min(pod.finished_at, now)


def account(
    job: api.DDPJob, buckets: Buckets, status: DDPJobStatus, now: dt.datetime
) -> tuple[DDPJobStatus, list[PodFailure]]:
    """Count every pod in ``buckets.uncounted`` once: a success, or a classified failure.
    The failures come in the order they happened (then by index), and so do their counts;
    each one moves its index's back-off (:func:`.backoff.advance`), and a live pod that has run
    long enough clears its index's (:func:`.backoff.clear_healthy`)."""
    new: list[tuple[PodFailure, float]] = []
    successes = 0
    for pod in buckets.uncounted:
        if pod.phase is PodPhase.SUCCEEDED:
            successes += 1
            continue
        reason = classify(pod)
        failure = PodFailure(
            pod=pod.name,
            index=pod.index,
            uid=pod.uid,
            reason=reason,
            exit_code=pod.exit_code,
            message=pod.message,
            node=pod.node,
            charged=job.spec.restart_policy.charges(reason in DISRUPTIONS),
            started=pod.started,
            time=_ended_at(pod, now),
        )
        new.append((failure, pod.ran_for(now)))
    new.sort(key=lambda pair: (pair[0].time, pair[0].index))
    failures = [f for f, _ in new]
    policy = job.spec.pod_backoff
    delays = backoff.advance(policy, status.pod_backoff, new)
    delays = backoff.clear_healthy(policy, delays, buckets.live, now)
    if not new and not successes and delays == status.pod_backoff:
        return status, []
    status = status.model_copy(
        update={
            "failures": [*status.failures, *failures][-api.MAX_RECENT_FAILURES :],
            "restarts": status.restarts + len(failures),
            "backoff_count": status.backoff_count + sum(f.charged for f in failures),
            "succeeded": status.succeeded + successes,
            "pod_backoff": delays,
        }
    )
    return status, failures


def bookkeeping(
    pods: Sequence[ObservedPod],
    status: DDPJobStatus,
    counted: Iterable[ObservedPod],
    actions: Sequence[Action],
) -> tuple[list[str], list[Action]]:
    """The next ``accountedPods`` and the finalizer removals that go with it.

    A uid stays while its pod still carries our finalizer; pods we delete in this pass join
    before the delete is carried out (the status is written first), so they never count.
    """
    tracked = {p.uid: p for p in pods if p.tracked}
    deleted_now = {a.uid for a in actions if isinstance(a, DeletePod)}
    accounted = {
        uid
        for uid in status.accounted_pods
        if uid in tracked and (tracked[uid].ended or uid in deleted_now)
    }
    accounted |= {p.uid for p in counted}
    accounted |= deleted_now & set(tracked)
    removals: list[Action] = [
        RemoveFinalizer(p.name, p.uid, p.index)
        for p in sorted(tracked.values(), key=lambda p: p.index)
        if p.uid in accounted
    ]
    return sorted(accounted), removals


def release_all(pods: Sequence[ObservedPod]) -> list[Action]:
    """Finalizer removals for every pod still tracked (the job is over or going away)."""
    return [
        RemoveFinalizer(p.name, p.uid, p.index)
        for p in sorted(pods, key=lambda p: p.index)
        if p.tracked
    ]


def force_stuck(
    job: api.DDPJob,
    pods: Sequence[ObservedPod],
    now: dt.datetime,
    uncounted: Iterable[ObservedPod] = (),
) -> tuple[list[Action], float | None]:
    """Force-delete pods stuck Terminating past their bound; when the next bound is due. A pod
    not counted yet (held, or left for the next pass by the per-pass bound) waits for its
    count: deleted by us, it would join ``accountedPods`` uncounted (the next pass counts it,
    and then forces it)."""
    slack = dt.timedelta(seconds=job.spec.force_delete_after_seconds)
    waits = {p.uid for p in uncounted}
    actions: list[Action] = []
    due: list[float] = []
    for pod in sorted(pods, key=lambda p: p.index):
        if not pod.deleting or pod.deletion_timestamp is None:
            continue
        bound = pod.deletion_timestamp + slack
        if now < bound:
            due.append((bound - now).total_seconds())
        elif pod.uid not in waits:
            actions.append(DeletePod(pod.name, pod.uid, pod.index, DeleteWhy.STUCK, force=True))
    return actions, min(due, default=None)


def limit_deletes(
    actions: Sequence[Action], pods: Sequence[ObservedPod], accounted: set[str], room: int
) -> tuple[list[Action], bool]:
    """Keep at most ``room`` deletions of tracked pods not accounted yet (each adds a uid to
    ``accountedPods``); True when some were left for the next pass."""
    tracked = {p.uid for p in pods if p.tracked}
    kept: list[Action] = []
    deferred = False
    for action in actions:
        if isinstance(action, DeletePod) and action.uid in tracked - accounted:
            if room <= 0:
                deferred = True
                continue
            room -= 1
        kept.append(action)
    return kept, deferred
