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
:func:`ddpjob_operator.observe.classify`. Rules, in the order they apply:

* A DDPJob being deleted creates nothing; it only releases its pods' finalizers.
* A finished job (Succeeded/Failed) only cleans up per ``cleanPodPolicy`` and honours
  ``ttlSecondsAfterFinished``.
* Every ended pod is accounted exactly once with a classified reason, and charged to
  ``backoffLimit`` unless it was a disruption (see :class:`~ddpjob_operator.api.RestartPolicy`).
* ``suspend`` deletes every pod that holds resources and keeps Succeeded ones; resuming starts
  over at Pending (no condition claims Restarting).
* The job fails when the budget is spent, on a permanent exit code (``ExitCode`` policy), on
  any failure (``Never`` policy), when ``activeDeadlineSeconds`` passes, or when, after it has
  run, running pods stay below ``minReplicas`` for longer than ``rendezvous.joinTimeoutSeconds``.
  Pods that never started do not start that clock: their waiting reasons (image pulls,
  scheduling, config errors) are in ``status.waiting``, the Running condition and Events.
* Once any pod has succeeded the job is completing: nothing is created or replaced, and the job
  succeeds when no pod is left pending or running (Kubeflow trainer#1982 marks it Succeeded as
  soon as one worker does, while others still hold GPUs).
* Otherwise: create the Service and every missing pod ``0..replicas-1``, delete failed pods so
  they can be recreated under the same name, and scale down by deleting the highest indices
  first (pod 0, the rendezvous host, is never removed while the job runs).
* A pod still Terminating ``forceDeleteAfterSeconds`` after its grace period ended (its node is
  lost; no kubelet will confirm) is force-deleted, and the pass asks to be requeued when that is
  due, so the job never wedges (kubeflow trainer#2072).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from ddpjob_operator import api, builders
from ddpjob_operator.api import (
    CleanPodPolicy,
    Condition,
    ConditionType,
    DDPJobStatus,
    JobPhase,
    PodFailure,
    PodWaiting,
    RestartPolicy,
)
from ddpjob_operator.observe import DISRUPTIONS, ObservedPod, PodPhase, classify

JSON = dict[str, Any]


class DeleteWhy(enum.StrEnum):
    REPLACE = "Replace"
    SCALE_DOWN = "ScaleDown"
    SUSPEND = "Suspend"
    CLEANUP = "Cleanup"
    STUCK = "Stuck"
    """Force-delete a pod stuck Terminating past its bound (``force`` is set)."""


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
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Observed:
    """Everything of the job's world the reconciler looks at."""

    pods: tuple[ObservedPod, ...] = ()
    service: bool = False


@dataclasses.dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    status: DDPJobStatus
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None
    """Seconds until a time-based rule (deadline, below-min, stuck pod, TTL) is due, if any."""


def set_condition(
    conditions: Sequence[Condition],
    type_: ConditionType,
    status: bool,
    reason: str,
    message: str,
    now: dt.datetime,
) -> list[Condition]:
    """Replace one condition; ``lastTransitionTime`` moves only when its status flips."""
    wanted = "True" if status else "False"
    old = next((c for c in conditions if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == wanted else now
    new = Condition(
        type=type_, status=wanted, reason=reason, message=message, last_transition_time=since
    )
    return [c for c in conditions if c.type != type_] + [new]


def _condition_true(conditions: Iterable[Condition], type_: ConditionType) -> bool:
    return any(c.type == type_ and c.status == "True" for c in conditions)


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

    @property
    def live(self) -> tuple[ObservedPod, ...]:
        return self.active + self.surplus


def sort_pods(pods: Sequence[ObservedPod], accounted: Iterable[str], desired: int) -> Buckets:
    done = set(accounted)
    ordered = sorted(pods, key=lambda p: (p.index, p.name))
    uncounted = tuple(p for p in ordered if p.tracked and p.ended and p.uid not in done)
    fresh = {p.uid for p in uncounted}
    return Buckets(
        active=tuple(p for p in ordered if p.live and p.index < desired),
        surplus=tuple(p for p in ordered if p.live and p.index >= desired),
        succeeded=tuple(p for p in ordered if p.phase is PodPhase.SUCCEEDED),
        failed=tuple(p for p in ordered if p.phase is PodPhase.FAILED and not p.deleting),
        uncounted=uncounted,
        terminating_by_us=tuple(p for p in ordered if p.deleting and p.uid not in fresh),
        terminating_by_others=tuple(p for p in ordered if p.deleting and p.uid in fresh),
    )


# ---- failure accounting ----------------------------------------------------------------------


def _charged(reason: str, policy: RestartPolicy) -> bool:
    return policy is RestartPolicy.NEVER or reason not in DISRUPTIONS


def _permanent(failure: PodFailure, policy: RestartPolicy) -> bool:
    if policy is RestartPolicy.NEVER:
        return True
    if policy is RestartPolicy.EXIT_CODE and failure.exit_code is not None:
        return failure.reason.startswith("ExitCode") and 1 <= failure.exit_code <= 127
    return False


def _account(
    job: api.DDPJob, buckets: Buckets, status: DDPJobStatus, now: dt.datetime
) -> tuple[DDPJobStatus, list[PodFailure]]:
    """Count every pod in ``buckets.uncounted`` once: a success, or a classified failure."""
    new: list[PodFailure] = []
    successes = 0
    for pod in buckets.uncounted:
        if pod.phase is PodPhase.SUCCEEDED:
            successes += 1
            continue
        reason = classify(pod)
        new.append(
            PodFailure(
                pod=pod.name,
                index=pod.index,
                uid=pod.uid,
                reason=reason,
                exit_code=pod.exit_code,
                message=pod.message,
                node=pod.node,
                charged=_charged(reason, job.spec.restart_policy),
                time=now,
            )
        )
    if not new and not successes:
        return status, []
    status = status.model_copy(
        update={
            "failures": [*status.failures, *new][-api.MAX_RECENT_FAILURES :],
            "restarts": status.restarts + len(new),
            "backoff_count": status.backoff_count + sum(f.charged for f in new),
            "succeeded": status.succeeded + successes,
        }
    )
    return status, new


def _failure_event(job: api.DDPJob, failure: PodFailure, status: DDPJobStatus) -> Event:
    budget = (
        f"charged, {status.backoff_count}/{job.spec.backoff_limit} of backoffLimit"
        if failure.charged
        else "not charged: disruption"
    )
    detail = f": {failure.message}" if failure.message else ""
    return Event(
        "Warning", "PodFailed", f"pod {failure.pod} failed ({failure.reason}, {budget}){detail}"
    )


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
    job: api.DDPJob, pods: Sequence[ObservedPod], now: dt.datetime
) -> tuple[list[Action], float | None]:
    """Force-delete pods stuck Terminating past their bound; when the next bound is due."""
    slack = dt.timedelta(seconds=job.spec.force_delete_after_seconds)
    actions: list[Action] = []
    due: list[float] = []
    for pod in sorted(pods, key=lambda p: p.index):
        if not pod.deleting or pod.deletion_timestamp is None:
            continue
        bound = pod.deletion_timestamp + slack
        if now >= bound:
            actions.append(DeletePod(pod.name, pod.uid, pod.index, DeleteWhy.STUCK, force=True))
        else:
            due.append((bound - now).total_seconds())
    return actions, min(due, default=None)


# ---- verdicts ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Verdict:
    phase: JobPhase
    reason: str
    message: str


def _waiting_summary(waiting: Sequence[PodWaiting]) -> str:
    parts = [f"{w.pod} {w.reason}" + (f" ({w.message})" if w.message else "") for w in waiting]
    return "; waiting: " + "; ".join(parts) if parts else ""


def _failure_verdict(
    job: api.DDPJob,
    new: Sequence[PodFailure],
    status: DDPJobStatus,
    now: dt.datetime,
    running: int,
) -> _Verdict | None:
    spec = job.spec
    for failure in new:
        if _permanent(failure, spec.restart_policy):
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
            f"the job ran longer than {deadline}s{_waiting_summary(status.waiting)}",
        )
    timeout = spec.rendezvous.join_timeout_seconds
    since = status.below_min_since
    if since is not None and now >= since + dt.timedelta(seconds=timeout):
        return _Verdict(
            JobPhase.FAILED,
            "BelowMinReplicas",
            f"only {running} of minReplicas {spec.effective_min} pods ran for longer than "
            f"rendezvous.joinTimeoutSeconds ({timeout}s){_waiting_summary(status.waiting)}",
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


def _finish(
    job: api.DDPJob,
    pods: Sequence[ObservedPod],
    status: DDPJobStatus,
    verdict: _Verdict,
    now: dt.datetime,
    events: list[Event],
) -> Decision:
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
        }
    )
    kind: Literal["Normal", "Warning"] = (
        "Normal" if verdict.phase is JobPhase.SUCCEEDED else "Warning"
    )
    events.append(Event(kind, verdict.reason, verdict.message))
    return _finished(job, pods, status, now, events)


def _finished(
    job: api.DDPJob,
    pods: Sequence[ObservedPod],
    status: DDPJobStatus,
    now: dt.datetime,
    events: list[Event],
) -> Decision:
    """After the verdict: clean up, release every finalizer, honour the TTL."""
    actions = _cleanup(pods, job.spec.clean_pod_policy)
    stuck, requeue = _force_stuck(job, pods, now)
    actions += stuck + _release_all(pods)
    status = status.model_copy(
        update={"replicas": sum(p.live for p in pods), "accounted_pods": [], "waiting": []}
    )
    ttl = job.spec.ttl_seconds_after_finished
    if ttl is not None and status.completion_time is not None:
        expires = status.completion_time + dt.timedelta(seconds=ttl)
        if now >= expires:
            actions.append(DeleteJob())
        else:
            requeue = _sooner(requeue, (expires - now).total_seconds())
    return Decision(tuple(actions), status, tuple(events), requeue)


def _sooner(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


# ---- the pass ------------------------------------------------------------------------------------


def _being_deleted(job: api.DDPJob, pods: Sequence[ObservedPod], status: DDPJobStatus) -> Decision:
    """The DDPJob has a deletionTimestamp: create nothing, let go of the pods."""
    return Decision(tuple(_release_all(pods)), status.model_copy(update={"accounted_pods": []}))


def _suspend(
    job: api.DDPJob,
    pods: Sequence[ObservedPod],
    buckets: Buckets,
    status: DDPJobStatus,
    now: dt.datetime,
    events: list[Event],
) -> Decision:
    """Delete every pod that holds resources (or failed); keep Succeeded ones: a completing job
    stays completing."""
    doomed = [
        p for p in pods if not p.deleting and (p.holds_resources or p.phase is PodPhase.FAILED)
    ]
    actions: list[Action] = [
        DeletePod(p.name, p.uid, p.index, DeleteWhy.SUSPEND)
        for p in sorted(doomed, key=lambda p: -p.index)
    ]
    stuck, requeue = _force_stuck(job, pods, now)
    actions += stuck
    accounted, removals = _bookkeeping(pods, status, buckets.uncounted, actions)
    conditions = set_condition(
        status.conditions, ConditionType.SUSPENDED, True, "Suspended", "spec.suspend is true", now
    )
    conditions = set_condition(conditions, ConditionType.RUNNING, False, "Suspended", "", now)
    conditions = set_condition(conditions, ConditionType.RESTARTING, False, "Suspended", "", now)
    if status.phase is not JobPhase.SUSPENDED:
        events.append(Event("Normal", "Suspended", "job suspended; deleting its pods"))
    status = status.model_copy(
        update={
            "phase": JobPhase.SUSPENDED,
            "conditions": conditions,
            "start_time": None,
            "below_min_since": None,
            "replicas": sum(p.live for p in pods),
            "ready_replicas": 0,
            "world_size": 0,
            "waiting": [],
            "accounted_pods": accounted,
        }
    )
    return Decision(tuple(actions + removals), status, tuple(events), requeue)


def _world_size(job: api.DDPJob, live: Sequence[ObservedPod]) -> int:
    reported = [p.world_size for p in live if p.world_size is not None]
    if reported:
        return max(reported)
    return sum(p.ready for p in live) * builders.nproc_per_node(job.spec)


def _phase(
    completing: bool, running: int, minimum: int, conditions: Sequence[Condition]
) -> JobPhase:
    if completing or running >= minimum:
        return JobPhase.RUNNING
    if _condition_true(conditions, ConditionType.RUNNING) or _condition_true(
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


def _waiting_events(old: Sequence[PodWaiting], new: Sequence[PodWaiting]) -> list[Event]:
    before = {(w.pod, w.reason) for w in old}
    return [
        Event("Warning", "PodWaiting", f"pod {w.pod} cannot start: {w.reason}: {w.message}")
        for w in new
        if (w.pod, w.reason) not in before
    ]


def _names(actions: Iterable[Action], kind: type[CreatePod] | type[DeletePod]) -> str:
    return ", ".join(a.name for a in actions if isinstance(a, kind))


def _run_actions(
    job: api.DDPJob,
    pods: Sequence[ObservedPod],
    buckets: Buckets,
    service: bool,
    completing: bool,
    network: builders.Network,
    default_profile: api.SecurityProfile,
) -> list[Action]:
    """Service, replacements, scale-down (highest index first), then missing pods."""
    actions: list[Action] = []
    if not service:
        actions.append(CreateService(builders.build_service(job)))
    if completing:
        return actions  # nothing is created or replaced once a pod has succeeded
    present = {p.index for p in pods}
    actions += [DeletePod(p.name, p.uid, p.index, DeleteWhy.REPLACE) for p in buckets.failed]
    actions += [
        DeletePod(p.name, p.uid, p.index, DeleteWhy.SCALE_DOWN)
        for p in sorted(buckets.surplus, key=lambda p: -p.index)
    ]
    actions += [
        CreatePod(i, builders.build_pod(job, i, network, default_profile))
        for i in range(desired_replicas(job.spec))
        if i not in present
    ]
    return actions


def _action_events(job: api.DDPJob, actions: Sequence[Action]) -> list[Event]:
    events = []
    if any(isinstance(a, CreatePod) for a in actions):
        events.append(Event("Normal", "CreatedPods", f"created {_names(actions, CreatePod)}"))
    scaled_down = [a for a in actions if isinstance(a, DeletePod) and a.why is DeleteWhy.SCALE_DOWN]
    if scaled_down:
        events.append(
            Event(
                "Normal",
                "ScalingDown",
                f"spec.replicas is {job.spec.replicas}: deleting {_names(scaled_down, DeletePod)}",
            )
        )
    return events


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
    if not _condition_true(out, ConditionType.CREATED):
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
        f"{running} of {desired} pods running (minReplicas {minimum})" + _waiting_summary(waiting),
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


def reconcile(
    job: api.DDPJob,
    observed: Observed,
    now: dt.datetime,
    network: builders.Network = builders.CLUSTER,
    default_profile: api.SecurityProfile = api.SecurityProfile.BASELINE,
) -> Decision:
    """Decide what the job needs now. Pure and deterministic."""
    pods = observed.pods
    spec = job.spec
    status = job.status.model_copy(
        update={
            "observed_generation": job.metadata.generation,
            "selector": api.job_selector(job.name),
        }
    )
    events: list[Event] = []
    if job.metadata.deletion_timestamp is not None:
        return _being_deleted(job, pods, status)
    if status.phase.is_finished:
        return _finished(job, pods, status, now, events)

    desired = desired_replicas(spec)
    buckets = sort_pods(pods, status.accounted_pods, desired)
    status, new_failures = _account(job, buckets, status, now)
    events += [_failure_event(job, f, status) for f in new_failures]

    if spec.suspend:
        return _suspend(job, pods, buckets, status, now, events)
    if status.phase is JobPhase.SUSPENDED:
        events.append(Event("Normal", "Resumed", "job resumed"))
        conditions = set_condition(
            status.conditions, ConditionType.SUSPENDED, False, "Resumed", "", now
        )
        status = status.model_copy(update={"phase": JobPhase.PENDING, "conditions": conditions})
    if status.start_time is None:
        status = status.model_copy(update={"start_time": now})

    live = buckets.live
    running = sum(p.phase is PodPhase.RUNNING for p in live)
    completing = status.succeeded > 0 or bool(buckets.succeeded)
    phase = _phase(completing, running, spec.effective_min, status.conditions)
    waiting = _waiting(live)
    events += _waiting_events(status.waiting, waiting)
    # The below-minReplicas clock runs only once the job has run (Restarting): pods that never
    # started (slow image pulls, nodes still being provisioned) are reported, not timed out.
    below_since = (status.below_min_since or now) if phase is JobPhase.RESTARTING else None
    status = status.model_copy(update={"below_min_since": below_since, "waiting": waiting})

    verdict = _failure_verdict(job, new_failures, status, now, running)
    if verdict is None and completing and not live:
        verdict = _Verdict(
            JobPhase.SUCCEEDED, "Succeeded", "every pod of the job terminated successfully"
        )
    if verdict is not None:
        return _finish(job, pods, status, verdict, now, events)

    actions = _run_actions(
        job, pods, buckets, observed.service, completing, network, default_profile
    )
    stuck, stuck_due = _force_stuck(job, pods, now)
    actions += stuck
    accounted, removals = _bookkeeping(pods, status, buckets.uncounted, actions)
    actions += removals
    events += _action_events(job, actions)
    conditions = _running_conditions(
        status.conditions, phase, completing, running, desired, spec.effective_min, waiting, now
    )
    if phase is not status.phase and phase in (JobPhase.RUNNING, JobPhase.RESTARTING):
        kind: Literal["Normal", "Warning"] = "Normal" if phase is JobPhase.RUNNING else "Warning"
        events.append(
            Event(kind, phase.value, f"{running} of {desired} pods running (was {status.phase})")
        )
    status = status.model_copy(
        update={
            "phase": phase,
            "conditions": conditions,
            "replicas": len(live),
            "ready_replicas": sum(p.ready for p in live),
            "world_size": _world_size(job, live),
            "accounted_pods": accounted,
        }
    )
    requeue = _sooner(_requeue(job, status, now), stuck_due)
    return Decision(tuple(actions), status, tuple(events), requeue)


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
