"""The pure reconciler: ``(job, observed, now) -> Decision(actions, status, events)``.

It decides; it does nothing. An executor (the kopf operator's ``kube`` module, or the local
runner) carries the decision out in this order:

1. write ``decision.status`` (one write per pass, with a resourceVersion precondition),
2. apply ``decision.actions`` in order,
3. emit ``decision.events``,
4. reconcile again after ``decision.requeue_after`` seconds at the latest.

Counting is exact, the way the Job controller tracks pods with finalizers: every pod carries
:data:`~ddpjob_operator.api.POD_FINALIZER`, so it cannot vanish before it is seen. A pod whose
outcome is known (its trainer terminated, or it is being deleted) is counted once, its uid goes
into ``status.accountedPods`` in the same status write, and only then is its finalizer removed.
A pod with the finalizer whose uid is already accounted is never counted again; a pod without it
was counted already. The operator's own deletions (scale-down, suspend, cleanup) put the pod's
uid into ``accountedPods`` *before* the delete, so they are never failures.

Each pass sorts the pods into buckets once (:func:`sort_pods`), as JobSet and the Job controller
do, and the rules read the buckets. Every classification rule lives in
:func:`ddpjob_operator.observe.classify`; the back-off in :mod:`~ddpjob_operator.backoff`, the
gang in :mod:`~ddpjob_operator.gang`, Kueue's side in :mod:`~ddpjob_operator.queue`, the words in
:mod:`~ddpjob_operator.events`. Rules, in the order they apply:

* A DDPJob being deleted creates nothing; it only releases its pods' finalizers.
* A job that an older operator marked ``Failed`` only because its spec did not parse
  (``InvalidSpec``: it was never terminal) is taken up again once the spec parses.
* A finished job (Succeeded/Failed) only cleans up per ``cleanPodPolicy`` and honours
  ``ttlSecondsAfterFinished``; its ``GangScheduled`` condition, if any, says it ended.
* Only the job's own pods count: a pod whose controller is another object (an earlier job of
  the same name, still being deleted) or none is never counted or adopted; its name is not
  reused until it is gone, and our finalizer, if it has one, is removed (its job is gone).
* Every ended pod is accounted exactly once with a classified reason, and charged to
  ``backoffLimit`` unless it was a disruption (see :class:`~ddpjob_operator.api.RestartPolicy`).
* ``suspend`` deletes every pod that holds resources and keeps Succeeded ones; resuming starts
  over at Pending (no condition claims Restarting).
* A Kueue job (one that names a LocalQueue) runs only as Kueue admits it (``observed.queue``):
  not admitted, or evicted, it is ``Queued`` as if suspended (its pods deleted uncharged, none
  made), and its ``Admitted`` condition says why; once admitted it runs at most the admitted
  count of pods (it caps ``desired``), new pods placed on the admitted flavors (none while a
  flavor cannot be read). Other jobs never get ``Admitted``.
* The job fails when the budget is spent, on a permanent exit code (``ExitCode`` policy), on
  any failure (``Never`` policy), when ``activeDeadlineSeconds`` passes, or when, after it has
  run, running pods stay below ``minReplicas`` for longer than ``rendezvous.joinTimeoutSeconds``.
  Pods that never started do not start that clock: their waiting reasons (image pulls,
  scheduling, config errors) are in ``status.waiting``, the Running condition and Events.
* Once any pod has succeeded the job is completing: nothing is created or replaced, and the job
  succeeds when no pod is left pending or running (Kubeflow trainer#1982 marks it Succeeded as
  soon as one worker does, while others still hold GPUs). A pod that is not ready once a pod
  has succeeded can never join a round (the last round is over, whichever pod hosted its store,
  and nothing is re-created): a pod created by a late scale-up or replacement, still waiting to
  join. It is no longer waited for ``STRANDED_AFTER_SECONDS`` after the first pod finished
  successfully, and the job's cleanup (``cleanPodPolicy``) removes it, instead of it holding its
  node until its agent's join timeout.
* Otherwise: create the Service and every missing pod ``0..desired-1``, delete failed pods so
  they can be recreated under the same name, and scale down by deleting the highest indices
  first (pod 0, which bootstraps the job's first store, is never removed while the job runs;
  any pod may host the store later: docs/agent.md, store failover). New pods carry the job's
  store key unless a pod made without it may still run (:func:`store_keyed`), and name the
  job's PodGroup if it asks for a gang, the cluster serves PodGroups and no live pod was made
  without the group; ``GangScheduled`` says where the gang is.
* A pod still Terminating ``forceDeleteAfterSeconds`` after its grace period ended (its node is
  lost; no kubelet will confirm) is force-deleted once it is counted, and the pass asks to be
  requeued when that is due, so the job never wedges (kubeflow trainer#2072).
* A job of more than :data:`LARGE_JOB_PODS` pods counts the pods that others delete while their
  containers still run (no kubelet has confirmed the end) once such deletions stop coming
  (:func:`held_deletions`): the taint manager deletes a lost node's 64 pods over seconds, and
  each pass that saw a few more wrote a status to count them. They are counted together, at
  most :data:`DELETION_BATCH_SECONDS` after the first; a pod whose kubelet confirms its end is
  counted at once (its replacement waits for it), and nothing is done to a held pod meanwhile.
* Back-off per pod index (``spec.podBackoff``): after a charged failure, or one whose trainer
  never started (the kubelet rejected it at admission: ``OutOfcpu``,
  ``UnexpectedAdmissionError``...; the same node would reject the next one in a tight loop),
  the next pod of that index waits, 10 s doubling up to 360 s, as the Job controller does. The
  state is in ``status.podBackoff``, moved only when a pod is counted (exactly once).
  Disruptions are replaced at once. The deadline and ``suspend`` win over a pending back-off.
* Sizes stay bounded however large the job: ``status.waiting`` lists at most
  :data:`MAX_WAITING` pods (the Running condition counts all of them, by reason), a pass emits
  at most :data:`~ddpjob_operator.events.MAX_EVENT_PODS` events of a kind (then one that sums up
  the rest), and it adds at most :data:`MAX_NEW_ACCOUNTED` uids to ``accountedPods`` (as the Job
  controller bounds ``uncountedTerminatedPods``): the rest is counted or deleted in the next
  passes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from ddpjob_operator import api, backoff, builders, gang, queue
from ddpjob_operator.api import (
    CleanPodPolicy,
    Condition,
    ConditionType,
    DDPJobStatus,
    JobPhase,
    PodFailure,
    PodWaiting,
    RestartPolicy,
    condition_true,
    set_condition,
)
from ddpjob_operator.events import (
    Event,
    failure_events,
    phase_events,
    pods_changed,
    room_for_store_host,
    waiting_events,
    waiting_summary,
)
from ddpjob_operator.observe import DISRUPTIONS, ObservedPod, PodPhase, classify

JSON = dict[str, Any]

MAX_WAITING = 20
"""Pods listed in ``status.waiting`` (lowest indices first); the Running condition counts all."""
MAX_NEW_ACCOUNTED = 250
"""Uids a pass may add to ``status.accountedPods`` (counted pods and our own deletions). 500,
the Job controller's bound for ``uncountedTerminatedPods``, made a 24 KB status (39 B a uid)
when a 1,024-pod job was scaled to 512; 250 keep it under 20 KB, for one more pass and status
write per 250 pods deleted or ended at once."""
INVALID_SPEC = "InvalidSpec"
"""The condition (and reason) of a spec the operator cannot parse; never terminal."""
DEFERRED_REQUEUE = 1.0
"""Seconds until the next pass when this one left work for it (the per-pass bounds)."""
LARGE_JOB_PODS = 64
"""A job of more pods than this counts a burst of deletions together (:func:`held_deletions`);
the controller settles its counts too (``controller.SETTLE_PODS``)."""
DELETION_QUIET_SECONDS = 2.0
"""A burst of deletions is over when none was asked for this long (the taint manager deletes a
lost node's pods at kube-controller-manager's 20 requests a second: one every 0.1 s)."""
DELETION_BATCH_SECONDS = 10.0
"""A held deletion is counted this long after the first of its burst at the latest."""
STRANDED_AFTER_SECONDS = 30.0
"""How long a completing job still waits for its pods that are not ready after its first pod
succeeded: a member of the last round may still be on its way out (a pod succeeds after the
round's exit barrier, so every member had finished training by then)."""


class DeleteWhy(enum.StrEnum):
    REPLACE = "Replace"
    SCALE_DOWN = "ScaleDown"
    SUSPEND = "Suspend"
    QUEUE = "Queue"
    """Kueue evicted the job (a preemption, say): its pods go, uncharged."""
    CLEANUP = "Cleanup"
    STUCK = "Stuck"
    """Force-delete a pod stuck Terminating past its bound (``force`` is set)."""
    STORE_HOST = "StoreHost"
    """Make room for pod 0, the first store's host, which the scheduler left waiting: the pod
    is created again once pod 0 is placed (:func:`_store_host_unplaced`)."""


@dataclasses.dataclass(frozen=True)
class CreateService:
    service: JSON


@dataclasses.dataclass(frozen=True)
class CreatePod:
    index: int
    pod: JSON

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])


@dataclasses.dataclass(frozen=True)
class DeletePod:
    """Delete one pod, with a uid precondition. ``force``: ``gracePeriodSeconds: 0``."""

    name: str
    uid: str
    index: int
    why: DeleteWhy
    force: bool = False


@dataclasses.dataclass(frozen=True)
class RemoveFinalizer:
    """Remove :data:`~ddpjob_operator.api.POD_FINALIZER` from a pod whose outcome is counted."""

    name: str
    uid: str
    index: int


@dataclasses.dataclass(frozen=True)
class DeleteJob:
    """``ttlSecondsAfterFinished`` has passed: delete the DDPJob itself."""


Action = CreateService | CreatePod | DeletePod | RemoveFinalizer | DeleteJob


@dataclasses.dataclass(frozen=True)
class Observed:
    """Everything of the job's world the reconciler looks at."""

    pods: tuple[ObservedPod, ...] = ()
    service: bool = False
    pod_groups: bool | None = None
    """The cluster serves the native PodGroup API (asked only for a job with
    ``gangScheduling: Native``; ``None``: not asked, as by the local runner)."""
    queue: queue.Admission | None = None
    """What Kueue admits, for a job that names a Kueue queue (``None``: not a Kueue job)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    status: DDPJobStatus
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None
    """Seconds until a time-based rule (deadline, below-min, stuck pod, TTL) is due, if any."""


def desired_replicas(spec: api.DDPJobSpec) -> int:
    return min(max(spec.replicas, spec.effective_min), spec.effective_max)


# ---- buckets ----------------------------------------------------------------------------------


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


# ---- failure accounting ----------------------------------------------------------------------


def _ended_at(pod: ObservedPod, now: dt.datetime) -> dt.datetime:
    """When a pod ended: its trainer's finish time as the kubelet wrote it, else now (the
    first pass that sees the end). Never later than now: a node whose clock runs ahead must
    not push a back-off further out."""
    if pod.finished_at is None:
        return now
    return min(pod.finished_at, now)


def _account(
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


def _bookkeeping(
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


def _release_all(pods: Sequence[ObservedPod]) -> list[Action]:
    """Finalizer removals for every pod still tracked (the job is over or going away)."""
    return [
        RemoveFinalizer(p.name, p.uid, p.index)
        for p in sorted(pods, key=lambda p: p.index)
        if p.tracked
    ]


def _force_stuck(
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


# ---- verdicts ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Verdict:
    phase: JobPhase
    reason: str
    message: str


def _failure_verdict(
    job: api.DDPJob,
    new: Sequence[PodFailure],
    status: DDPJobStatus,
    now: dt.datetime,
    running: int,
    waiting: Sequence[PodWaiting],
) -> _Verdict | None:
    spec = job.spec
    for failure in new:
        if spec.restart_policy.fails_job(failure):
            return _Verdict(
                JobPhase.FAILED,
                "PodFailed" if spec.restart_policy is RestartPolicy.NEVER else "PermanentExitCode",
                f"pod {failure.pod} failed with {failure.reason} under restartPolicy "
                f"{spec.restart_policy.value}",
            )
    if status.backoff_count > spec.backoff_limit:
        last = next((f for f in reversed(status.failures) if f.charged), None)
        why = f"; last: pod {last.pod} {last.reason}" if last else ""
        return _Verdict(
            JobPhase.FAILED,
            "BackoffLimitExceeded",
            f"{status.backoff_count} charged pod failures exceed backoffLimit "
            f"{spec.backoff_limit}{why}",
        )
    deadline = spec.active_deadline_seconds
    start = status.start_time
    if deadline is not None and start is not None and now >= start + dt.timedelta(seconds=deadline):
        return _Verdict(
            JobPhase.FAILED,
            "DeadlineExceeded",
            f"the job ran longer than {deadline}s{waiting_summary(waiting)}",
        )
    timeout = spec.rendezvous.join_timeout_seconds
    since = status.below_min_since
    if since is not None and now >= since + dt.timedelta(seconds=timeout):
        return _Verdict(
            JobPhase.FAILED,
            "BelowMinReplicas",
            f"only {running} of minReplicas {spec.effective_min} pods ran for longer than "
            f"rendezvous.joinTimeoutSeconds ({timeout}s){waiting_summary(waiting)}",
        )
    return None


def _cleanup(pods: Sequence[ObservedPod], policy: CleanPodPolicy) -> list[Action]:
    if policy is CleanPodPolicy.NONE:
        return []
    doomed = [
        p for p in pods if not p.deleting and (policy is CleanPodPolicy.ALL or p.holds_resources)
    ]
    return [
        DeletePod(p.name, p.uid, p.index, DeleteWhy.CLEANUP)
        for p in sorted(doomed, key=lambda p: -p.index)
    ]


def _success(
    succeeded: Sequence[ObservedPod], live: Sequence[ObservedPod], now: dt.datetime
) -> tuple[_Verdict | None, float | None]:
    """A completing job's success: once no pod is live, or once the only live pods are not
    ready ``STRANDED_AFTER_SECONDS`` after the first pod succeeded (they can never join a
    round: the last round is over, whichever pod hosted its store). Else no verdict, and the
    seconds until that check is due (``None`` when it never will be: no succeeded pod's end is
    known, or a live pod is ready)."""
    if not live:
        return _Verdict(
            JobPhase.SUCCEEDED, "Succeeded", "every pod of the job terminated successfully"
        ), None
    ends = [p.finished_at for p in succeeded if p.finished_at is not None]
    if not ends or any(p.ready for p in live):
        return None, None
    left = STRANDED_AFTER_SECONDS - (now - min(ends)).total_seconds()
    if left > 0:
        return None, left
    names = ", ".join(p.name for p in live)
    message = (
        f"the last round succeeded; {names} never joined it and no longer can (its store is "
        f"gone with it): left to cleanPodPolicy"
    )
    return _Verdict(JobPhase.SUCCEEDED, "Succeeded", message), None


def _finish(
    job: api.DDPJob,
    pods: Sequence[ObservedPod],
    status: DDPJobStatus,
    verdict: _Verdict,
    now: dt.datetime,
) -> Decision:
    """The verdict: the job's phase and conditions say it, and so does an event."""
    conditions = set_condition(
        status.conditions,
        ConditionType(verdict.phase.value),
        True,
        verdict.reason,
        verdict.message,
        now,
    )
    conditions = set_condition(conditions, ConditionType.RUNNING, False, verdict.reason, "", now)
    conditions = set_condition(conditions, ConditionType.RESTARTING, False, verdict.reason, "", now)
    status = status.model_copy(
        update={
            "phase": verdict.phase,
            "conditions": conditions,
            "completion_time": now,
            "below_min_since": None,
            "ready_replicas": 0,
            "world_size": 0,
            "store_host": None,
        }
    )
    kind: Literal["Normal", "Warning"] = (
        "Normal" if verdict.phase is JobPhase.SUCCEEDED else "Warning"
    )
    return _told_first(
        [Event(kind, verdict.reason, verdict.message)], _finished(job, pods, status, now)
    )


def _finished(
    job: api.DDPJob,
    pods: Sequence[ObservedPod],
    status: DDPJobStatus,
    now: dt.datetime,
) -> Decision:
    """After the verdict: clean up, release every finalizer, honour the TTL."""
    actions = _cleanup(pods, job.spec.clean_pod_policy)
    stuck, requeue = _force_stuck(job, pods, now)
    actions += stuck + _release_all(pods)
    status = status.model_copy(
        update={
            "conditions": gang.ended(status.conditions, status.phase, now),
            "replicas": sum(p.live for p in pods),
            "accounted_pods": [],
            "waiting": [],
            "pod_backoff": [],
        }
    )
    ttl = job.spec.ttl_seconds_after_finished
    if ttl is not None and status.completion_time is not None:
        expires = status.completion_time + dt.timedelta(seconds=ttl)
        if now >= expires:
            actions.append(DeleteJob())
        else:
            requeue = _sooner(requeue, (expires - now).total_seconds())
    return Decision(tuple(actions), status, (), requeue)


# ---- the pass ------------------------------------------------------------------------------------


def reconcile(
    job: api.DDPJob,
    observed: Observed,
    now: dt.datetime,
    network: builders.Network = builders.CLUSTER,
    default_profile: api.SecurityProfile = api.SecurityProfile.BASELINE,
) -> Decision:
    """Decide what the job needs now. Pure and deterministic."""
    status = job.status.model_copy(
        update={
            "observed_generation": job.metadata.generation,
            "selector": api.job_selector(job.name),
        }
    )
    if job.metadata.deletion_timestamp is not None:
        return _being_deleted(observed.pods, status)
    status = _spec_parses(status, now)
    facts = _Facts.start(job, observed, status, now, network, default_profile)
    if status.phase.is_finished:
        decision = _finished(job, facts.pods, status, now)
    else:
        decision = _unfinished(facts, status)
    # Our finalizer on a pod that is not this job's: its own job is gone, nobody counts it.
    return _also(
        decision, [RemoveFinalizer(p.name, p.uid, p.index) for p in facts.foreign if p.tracked]
    )


@dataclasses.dataclass(frozen=True)
class _Facts:
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
    ) -> _Facts:
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


def _unfinished(facts: _Facts, status: DDPJobStatus) -> Decision:
    """Count every pod that ended, then hold the job (suspended, or queued by Kueue) or run it."""
    status, failures = _account(facts.job, facts.buckets, status, facts.now)
    told = failure_events(facts.job, failures, status)
    admission = facts.observed.queue
    if facts.job.spec.suspend:
        # A job that is not (or no longer) a Kueue job has no Admitted condition.
        unqueued = status if admission is not None else _without_admitted(status)
        return _told_first(told, _suspend(facts, unqueued))
    status, resumed = _resumed(status, admission, facts.now)
    if admission is not None and admission.count == 0:
        return _told_first(told + resumed, _suspend(facts, status, admission))
    return _told_first(told + resumed, _run(facts, status, failures))


def _being_deleted(pods: Sequence[ObservedPod], status: DDPJobStatus) -> Decision:
    """The DDPJob has a deletionTimestamp: create nothing, let go of the pods."""
    return Decision(tuple(_release_all(pods)), status.model_copy(update={"accounted_pods": []}))


def _told_first(events: Sequence[Event], decision: Decision) -> Decision:
    """The decision, with ``events`` (of the pass's earlier rules) before its own."""
    return dataclasses.replace(decision, events=(*events, *decision.events))


def _also(decision: Decision, actions: Sequence[Action]) -> Decision:
    return dataclasses.replace(decision, actions=decision.actions + tuple(actions))


def _sooner(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


def _spec_parses(status: DDPJobStatus, now: dt.datetime) -> DDPJobStatus:
    """The spec parses (reconcile runs): clear an InvalidSpec condition, and take up a job an
    older operator marked Failed only for an invalid spec (that was never terminal)."""
    conditions = list(status.conditions)
    if condition_true(conditions, ConditionType.INVALID_SPEC):
        conditions = set_condition(
            conditions, ConditionType.INVALID_SPEC, False, "SpecValid", "", now
        )
    failed = next((c for c in conditions if c.type == ConditionType.FAILED), None)
    update: dict[str, Any] = {"conditions": conditions}
    if (
        status.phase is JobPhase.FAILED
        and failed is not None
        and failed.status == "True"
        and failed.reason == INVALID_SPEC
    ):
        update["conditions"] = set_condition(
            conditions, ConditionType.FAILED, False, "SpecValid", "", now
        )
        update["phase"] = JobPhase.PENDING
        update["completion_time"] = None
    if update["conditions"] == list(status.conditions) and len(update) == 1:
        return status
    return status.model_copy(update=update)


# ---- suspended, or held by Kueue -----------------------------------------------------------------


def _suspend(
    facts: _Facts, status: DDPJobStatus, queued: queue.Admission | None = None
) -> Decision:
    """Delete every pod that holds resources (or failed); keep Succeeded ones: a completing job
    stays completing. A failed pod is deleted only once it is counted.

    ``queued``: not suspended, but held by Kueue (not admitted, or evicted): the same, in phase
    ``Queued``, and the pods' deletions are never charged either."""
    pods, now = facts.pods, facts.now
    deferred = {p.uid for p in facts.buckets.deferred}
    doomed = [
        p
        for p in pods
        if not p.deleting
        and p.uid not in deferred
        and (p.holds_resources or p.phase is PodPhase.FAILED)
    ]
    why = DeleteWhy.SUSPEND if queued is None else DeleteWhy.QUEUE
    wanted: list[Action] = [
        DeletePod(p.name, p.uid, p.index, why) for p in sorted(doomed, key=lambda p: -p.index)
    ]
    actions, held_back = _limit_deletes(wanted, pods, set(status.accounted_pods), facts.room)
    stuck, requeue = _force_stuck(facts.job, pods, now, facts.buckets.waiting_count)
    if held_back or deferred:
        requeue = _sooner(requeue, DEFERRED_REQUEUE)
    requeue = _sooner(requeue, facts.hold_due)
    actions += stuck
    accounted, removals = _bookkeeping(pods, status, facts.buckets.uncounted, actions)
    told: list[Event] = []
    if queued is None:
        phase, reason = JobPhase.SUSPENDED, "Suspended"
        conditions = set_condition(
            status.conditions, ConditionType.SUSPENDED, True, reason, "spec.suspend is true", now
        )
        if status.phase is not phase:
            told.append(Event("Normal", reason, "job suspended; deleting its pods"))
    else:
        phase, reason = JobPhase.QUEUED, queued.reason
        conditions = _admitted_condition(status.conditions, queued, now)
        if status.phase is not phase:
            verb = "deleting its pods" if any(p.live for p in pods) else "no pod is made"
            told.append(Event("Normal", reason, f"{queued.message}; {verb} until admitted"))
    conditions = set_condition(conditions, ConditionType.RUNNING, False, reason, "", now)
    conditions = set_condition(conditions, ConditionType.RESTARTING, False, reason, "", now)
    conditions = gang.paused(conditions, reason, now)
    status = status.model_copy(
        update={
            "phase": phase,
            "conditions": conditions,
            "start_time": None,
            "below_min_since": None,
            "replicas": sum(p.live for p in pods),
            "ready_replicas": 0,
            "world_size": 0,
            "store_host": None,
            "waiting": [],
            "accounted_pods": accounted,
        }
    )
    return Decision(tuple(actions + removals), status, tuple(told), requeue)


def _resumed(
    status: DDPJobStatus, admission: queue.Admission | None, now: dt.datetime
) -> tuple[DDPJobStatus, list[Event]]:
    """Out of ``Suspended`` (spec.suspend is false again), or of ``Queued`` (Kueue admits)."""
    told: list[Event] = []
    if status.phase is JobPhase.SUSPENDED:
        told.append(Event("Normal", "Resumed", "job resumed"))
        conditions = set_condition(
            status.conditions, ConditionType.SUSPENDED, False, "Resumed", "", now
        )
        status = status.model_copy(update={"phase": JobPhase.PENDING, "conditions": conditions})
    if status.phase is JobPhase.QUEUED and admission is not None and admission.count > 0:
        told.append(Event("Normal", "Admitted", admission.message))
        status = status.model_copy(update={"phase": JobPhase.PENDING})
    return status, told


def _without_admitted(status: DDPJobStatus) -> DDPJobStatus:
    kept = [c for c in status.conditions if c.type != ConditionType.ADMITTED]
    return status.model_copy(update={"conditions": kept})


def _admitted_condition(
    conditions: Sequence[Condition], admission: queue.Admission | None, now: dt.datetime
) -> list[Condition]:
    """``Admitted``, for a Kueue job (others never get it: a job whose queue label was
    removed loses it)."""
    if admission is None:
        return [c for c in conditions if c.type != ConditionType.ADMITTED]
    return set_condition(
        conditions,
        ConditionType.ADMITTED,
        admission.admitted,
        admission.reason,
        admission.message,
        now,
    )


# ---- a running job -------------------------------------------------------------------------------


def _run(facts: _Facts, status: DDPJobStatus, failures: Sequence[PodFailure]) -> Decision:
    """The job runs: its Service and pods as the spec and its failures ask, or its verdict."""
    job, now, buckets = facts.job, facts.now, facts.buckets
    live = buckets.live
    status = status.model_copy(update={"start_time": status.start_time or now})
    running = sum(p.phase is PodPhase.RUNNING for p in live)
    completing = status.succeeded > 0 or bool(buckets.succeeded)
    phase = _phase(completing, running, job.spec.effective_min, status.conditions)
    plan = _run_actions(facts, status, completing)
    waiting = sorted(_waiting(live) + plan.waiting, key=lambda w: _index_in(job, w.pod))
    shown = waiting[:MAX_WAITING]
    told = waiting_events(status.waiting, shown)
    # The below-minReplicas clock runs only once the job has run (Restarting): pods that never
    # started (slow image pulls, nodes still being provisioned) are reported, not timed out.
    below_since = (status.below_min_since or now) if phase is JobPhase.RESTARTING else None
    status = status.model_copy(update={"below_min_since": below_since, "waiting": shown})

    verdict = _failure_verdict(job, failures, status, now, running, waiting)
    success, stranded_due = _success(buckets.succeeded, live, now) if completing else (None, None)
    verdict = verdict or success
    if verdict is not None:
        return _told_first(told, _finish(job, facts.pods, status, verdict, now))

    actions, deferred = _limit_deletes(
        plan.actions, facts.pods, set(status.accounted_pods), facts.room
    )
    stuck, stuck_due = _force_stuck(job, facts.pods, now, buckets.waiting_count)
    actions += stuck
    accounted, removals = _bookkeeping(facts.pods, status, buckets.uncounted, actions)
    actions += removals
    told += [
        *backoff.events(job, failures, status, now, completing),
        *pods_changed(
            job.spec.replicas,
            [a.name for a in actions if isinstance(a, CreatePod)],
            [a.name for a in actions if isinstance(a, DeletePod) and a.why is DeleteWhy.SCALE_DOWN],
        ),
        *room_for_store_host(
            [a.name for a in actions if isinstance(a, DeletePod) and a.why is DeleteWhy.STORE_HOST]
        ),
        *phase_events(status.phase, phase, running, facts.desired),
    ]
    conditions = _running_conditions(
        status.conditions,
        phase,
        completing,
        running,
        facts.desired,
        job.spec.effective_min,
        waiting,
        now,
    )
    conditions = gang.condition(
        conditions, job, facts.observed.pod_groups, plan.pod_group, live, completing, now
    )
    conditions = _admitted_condition(conditions, facts.observed.queue, now)
    status = status.model_copy(
        update={
            "phase": phase,
            "conditions": conditions,
            "replicas": len(live),
            "ready_replicas": sum(p.ready for p in live),
            "world_size": _world_size(job, live),
            "store_host": _store_host(live),
            "accounted_pods": accounted,
        }
    )
    requeue = _sooner(_sooner(_requeue(job, status, now), stuck_due), plan.due)
    requeue = _sooner(requeue, stranded_due)
    if deferred or buckets.deferred:
        requeue = _sooner(requeue, DEFERRED_REQUEUE)
    requeue = _sooner(requeue, facts.hold_due)
    return Decision(tuple(actions), status, tuple(told), requeue)


@dataclasses.dataclass
class _Plan:
    """What the running job needs, and what holds some of it back."""

    actions: list[Action]
    waiting: list[PodWaiting]
    pod_group: str | None = None
    due: float | None = None


def _run_actions(facts: _Facts, status: DDPJobStatus, completing: bool) -> _Plan:
    """Service, replacements, scale-down (highest index first), then missing pods: not under a
    name another object's pod still holds, nor before its index's back-off is over."""
    job, pods, now = facts.job, facts.pods, facts.now
    group = gang.group_for_new_pods(job, facts.observed.pod_groups, pods)
    plan = _Plan(actions=[], waiting=[], pod_group=group)
    if not facts.observed.service:
        plan.actions.append(CreateService(builders.build_service(job)))
    if completing:
        return plan  # nothing is created or replaced once a pod has succeeded
    present = {p.index for p in pods}
    plan.actions += [
        DeletePod(p.name, p.uid, p.index, DeleteWhy.REPLACE) for p in facts.buckets.failed
    ]
    plan.actions += [
        DeletePod(p.name, p.uid, p.index, DeleteWhy.SCALE_DOWN)
        for p in sorted(facts.buckets.surplus, key=lambda p: -p.index)
    ]
    minimum = job.spec.effective_min
    unplaced = status.restarts == 0 and _store_host_unplaced(facts.buckets.active, minimum)
    if unplaced:
        plan.actions += _room_for_store_host(pods, facts.desired, minimum)
    held = {p.index: p for p in facts.foreign}
    keyed = store_keyed(pods)
    admission = facts.observed.queue
    placement = admission.placement if admission is not None else None
    if admission is not None and placement is None:
        return plan  # admitted to flavors that could not be read: no pod until they are
    for i in range(facts.desired):
        if i in present:
            continue
        if i in held:
            plan.waiting.append(_held(held[i]))
            continue
        if unplaced and i >= minimum:
            plan.waiting.append(_after_store_host(job, i))
            continue
        backing_off = backoff.waiting_for(job, status, i, now)
        if backing_off is not None and backing_off.retry_time is not None:
            plan.due = _sooner(plan.due, (backing_off.retry_time - now).total_seconds())
            plan.waiting.append(backing_off)
            continue
        pod = builders.build_pod(
            job,
            i,
            facts.network,
            facts.default_profile,
            store_key=keyed,
            pod_group=plan.pod_group,
            placement=placement,
        )
        plan.actions.append(CreatePod(i, pod))
    return plan


def _store_host_unplaced(active: Sequence[ObservedPod], minimum: int) -> bool:
    """Pod 0 hosts the job's first rendezvous store, and the scheduler left it waiting for room
    while pods beyond ``minReplicas`` took nodes, before any round formed: those pods wait for
    its store and nothing trains. Once a round has formed (an agent reports a world size or
    hosts the store; the caller also asks that no pod has failed yet, for agents that are not
    asked) a lost pod 0 is not needed: the survivors carry the store on."""
    first = next((p for p in active if p.index == 0), None)
    if first is None or first.node is not None or first.waiting_reason != "Unschedulable":
        return False
    if any(p.store_host or p.world_size for p in active):
        return False
    return any(p.index >= minimum and p.node is not None for p in active)


def _room_for_store_host(
    pods: Sequence[ObservedPod], desired: int, minimum: int
) -> list[DeletePod]:
    """While pod 0 waits for room: the waiting pods beyond ``minReplicas`` go (they would take
    the room first as well as pod 0), and the bound one of highest index, unless an earlier
    pass made room already (a pod beyond ``minReplicas`` is missing or being deleted)."""
    beyond = [p for p in pods if minimum <= p.index < desired]
    waiting = [p for p in beyond if p.live and p.node is None]
    deletes = [DeletePod(p.name, p.uid, p.index, DeleteWhy.STORE_HOST) for p in waiting]
    made = any(p.deleting for p in beyond) or len({p.index for p in beyond}) < desired - minimum
    bound = sorted((p for p in beyond if p.live and p.node is not None), key=lambda p: -p.index)
    if bound and not made:
        victim = bound[0]
        deletes.append(DeletePod(victim.name, victim.uid, victim.index, DeleteWhy.STORE_HOST))
    return deletes


def _after_store_host(job: api.DDPJob, index: int) -> PodWaiting:
    return PodWaiting(
        pod=builders.pod_name(job.name, index),
        reason="StoreHostUnplaced",
        message=(
            "pod 0 hosts the job's first rendezvous store and waits for room: pods beyond "
            "minReplicas are created once it is placed"
        ),
    )


def store_keyed(pods: Iterable[ObservedPod]) -> bool:
    """New pods get the job's store key (``DDPJOB_STORE_KEY``) unless a pod of the job built
    without it may still run (not terminated; one being deleted may still train).

    Agents that sign what they write to the rendezvous store and agents that do not cannot form
    one group, so a job whose pods an operator made before the key keeps getting pods without
    it until none of those is left (the job is suspended, or all its pods end at once); a job with
    no pods, or only keyed ones, gets keyed pods. If both kinds run (which this rule never
    makes), the unkeyed ones win: they are the ones that trained before the upgrade.
    """
    return not any(p.store_keyed is False and not p.phase.terminated for p in pods)


def _held(pod: ObservedPod) -> PodWaiting:
    """The name is taken by a pod that is not this job's."""
    if pod.owner_uid:
        why = (
            f"pod {pod.name} of another owner (uid {pod.owner_uid}, most likely an earlier job "
            "of this name) still holds the name; this job's pod is created once it is gone"
        )
    else:
        why = (
            f"pod {pod.name} has no owner (orphaned?) and holds the name; delete it to let this "
            "job create its pod"
        )
    return PodWaiting(pod=pod.name, reason="NameInUse", message=why)


def _limit_deletes(
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


def _phase(
    completing: bool, running: int, minimum: int, conditions: Sequence[Condition]
) -> JobPhase:
    if completing or running >= minimum:
        return JobPhase.RUNNING
    if condition_true(conditions, ConditionType.RUNNING) or condition_true(
        conditions, ConditionType.RESTARTING
    ):
        return JobPhase.RESTARTING
    return JobPhase.PENDING


def _waiting(live: Sequence[ObservedPod]) -> list[PodWaiting]:
    return [
        PodWaiting(pod=p.name, reason=p.waiting_reason, message=p.waiting_message)
        for p in live
        if p.waiting_reason is not None
    ]


def _index_in(job: api.DDPJob, pod_name: str) -> int:
    suffix = pod_name.removeprefix(builders.pod_name(job.name, 0)[:-1])
    return int(suffix) if suffix.isdigit() else 0


def _running_conditions(
    conditions: Sequence[Condition],
    phase: JobPhase,
    completing: bool,
    running: int,
    desired: int,
    minimum: int,
    waiting: Sequence[PodWaiting],
    now: dt.datetime,
) -> list[Condition]:
    out = list(conditions)
    if not condition_true(out, ConditionType.CREATED):
        out = set_condition(
            out, ConditionType.CREATED, True, "Created", "pods and service created", now
        )
    out = set_condition(
        out,
        ConditionType.RUNNING,
        phase is JobPhase.RUNNING,
        "Completing"
        if completing
        else ("MinReplicasRunning" if phase is JobPhase.RUNNING else "WaitingForPods"),
        f"{running} of {desired} pods running (minReplicas {minimum})" + waiting_summary(waiting),
        now,
    )
    return set_condition(
        out,
        ConditionType.RESTARTING,
        phase is JobPhase.RESTARTING,
        "ReplacingPods" if phase is JobPhase.RESTARTING else "NotRestarting",
        "",
        now,
    )


def _world_size(job: api.DDPJob, live: Sequence[ObservedPod]) -> int:
    reported = [p.world_size for p in live if p.world_size is not None]
    if reported:
        return max(reported)
    return sum(p.ready for p in live) * builders.nproc_per_node(job.spec)


def _store_host(live: Sequence[ObservedPod]) -> str | None:
    """The live pod whose agent says it hosts the store; of two (an old host that has not yet
    heard that it was superseded), the one of the newer generation."""
    hosts = [p for p in live if p.store_host]
    if not hosts:
        return None
    return max(hosts, key=lambda p: (p.store_gen, -p.index)).name


def _requeue(job: api.DDPJob, status: DDPJobStatus, now: dt.datetime) -> float | None:
    due: list[dt.datetime] = []
    if job.spec.active_deadline_seconds is not None and status.start_time is not None:
        due.append(status.start_time + dt.timedelta(seconds=job.spec.active_deadline_seconds))
    if status.below_min_since is not None:
        due.append(
            status.below_min_since + dt.timedelta(seconds=job.spec.rendezvous.join_timeout_seconds)
        )
    if not due:
        return None
    return max(0.0, (min(due) - now).total_seconds())
