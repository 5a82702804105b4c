"""The pure reconciler: ``(job, observed, now) -> Decision(actions, status, events)``.

It decides; it does nothing. An executor (the kopf operator's ``kube`` module, or the local
runner) carries the decision out in this order:

1. write ``decision.status`` (one write per pass),
2. apply ``decision.actions`` in order,
3. emit ``decision.events``,
4. reconcile again after ``decision.requeue_after`` seconds at the latest.

Writing the status first means a failure is counted before its pod is deleted, so a crash
between the two can only re-delete a pod, never lose a failure: failures are keyed by pod uid.

Rules, in the order they apply:

* A finished job (Succeeded/Failed) only cleans up per ``cleanPodPolicy`` and honours
  ``ttlSecondsAfterFinished``.
* ``suspend`` deletes every pod and resets the deadline clock; resuming starts over at Pending.
* Every failed pod is accounted exactly once (by uid) with a classified reason, and charged to
  ``backoffLimit`` unless it was a disruption. A pod deleted by someone else while it was part
  of the job counts as ``Deleted``. Pods we delete (scale-down, suspend) never count.
* The job fails when the budget is spent, on a permanent exit code (``ExitCode`` policy), on
  any failure (``Never`` policy), when ``activeDeadlineSeconds`` passes, or when running pods
  stay below ``minReplicas`` for longer than ``rendezvous.joinTimeoutSeconds``.
* Once any pod has succeeded the job is completing: nothing is created or replaced, and the job
  succeeds when no pod is left pending or running (Kubeflow trainer#1982 marks it Succeeded as
  soon as one worker does, while others still hold GPUs).
* Otherwise: create the Service and every missing pod ``0..replicas-1``, delete failed pods so
  they can be recreated under the same name, and scale down by deleting the highest indices
  first (pod 0, the rendezvous host, is never removed while the job runs).
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
    RestartPolicy,
)
from ddpjob_operator.observe import DISRUPTIONS, ObservedPod, PodPhase, classify

JSON = dict[str, Any]


class DeleteWhy(enum.StrEnum):
    REPLACE = "Replace"
    SCALE_DOWN = "ScaleDown"
    SUSPEND = "Suspend"
    CLEANUP = "Cleanup"


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
    name: str
    uid: str
    index: int
    why: DeleteWhy


@dataclasses.dataclass(frozen=True)
class DeleteJob:
    """``ttlSecondsAfterFinished`` has passed: delete the DDPJob itself."""


Action = CreateService | CreatePod | DeletePod | DeleteJob


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
    """Seconds until a time-based rule (deadline, below-min, TTL) is due, if any."""


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


# ---- failure accounting ----------------------------------------------------------------------


def _needs_accounting(pod: ObservedPod, desired: int) -> bool:
    if pod.phase is PodPhase.FAILED:
        # A pod we are removing by scale-down ends Failed (SIGTERM); that is not a failure.
        return not (pod.deleting and pod.index >= desired)
    # Deleted by someone else (kubectl delete, node controller) while part of the job.
    return pod.deleting and pod.phase is not PodPhase.SUCCEEDED and pod.index < desired


def _charged(reason: str, policy: RestartPolicy) -> bool:
    return policy is RestartPolicy.NEVER or reason not in DISRUPTIONS


def _permanent(failure: PodFailure, policy: RestartPolicy) -> bool:
    if policy is RestartPolicy.NEVER:
        return True
    if policy is RestartPolicy.EXIT_CODE and failure.exit_code is not None:
        return failure.reason.startswith("ExitCode") and 1 <= failure.exit_code <= 127
    return False


def _account(
    job: api.DDPJob, pods: Sequence[ObservedPod], status: DDPJobStatus, now: dt.datetime
) -> tuple[DDPJobStatus, list[PodFailure]]:
    seen = {f.uid for f in status.failures if f.uid}
    desired = desired_replicas(job.spec)
    new: list[PodFailure] = []
    for pod in sorted(pods, key=lambda p: p.index):
        if pod.uid in seen or not _needs_accounting(pod, desired):
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
    if not new:
        return status, []
    failures = [*status.failures, *new][-api.MAX_RECENT_FAILURES :]
    status = status.model_copy(
        update={
            "failures": failures,
            "restarts": status.restarts + len(new),
            "backoff_count": status.backoff_count + sum(f.charged for f in new),
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
    completing: bool,
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
        return _Verdict(JobPhase.FAILED, "DeadlineExceeded", f"the job ran longer than {deadline}s")
    timeout = spec.rendezvous.join_timeout_seconds
    since = status.below_min_since
    below = not completing and since is not None and running < spec.effective_min
    if below and since is not None and now >= since + dt.timedelta(seconds=timeout):
        return _Verdict(
            JobPhase.FAILED,
            "BelowMinReplicas",
            f"only {running} of minReplicas {spec.effective_min} pods ran for longer than "
            f"rendezvous.joinTimeoutSeconds ({timeout}s)",
        )
    return None


def _cleanup(pods: Sequence[ObservedPod], policy: CleanPodPolicy) -> list[Action]:
    if policy is CleanPodPolicy.NONE:
        return []
    doomed = [
        p
        for p in pods
        if not p.deleting and (policy is CleanPodPolicy.ALL or not p.phase.terminated)
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
    actions = _cleanup(pods, job.spec.clean_pod_policy)
    status = status.model_copy(update={"replicas": sum(p.live for p in pods)})
    ttl = job.spec.ttl_seconds_after_finished
    requeue = None
    if ttl is not None and status.completion_time is not None:
        expires = status.completion_time + dt.timedelta(seconds=ttl)
        if now >= expires:
            actions.append(DeleteJob())
        else:
            requeue = (expires - now).total_seconds()
    return Decision(tuple(actions), status, tuple(events), requeue)


# ---- the pass ------------------------------------------------------------------------------------


def _suspend(
    job: api.DDPJob, pods: Sequence[ObservedPod], status: DDPJobStatus, now: dt.datetime
) -> Decision:
    actions: list[Action] = [
        DeletePod(p.name, p.uid, p.index, DeleteWhy.SUSPEND)
        for p in sorted(pods, key=lambda p: -p.index)
        if not p.deleting
    ]
    conditions = set_condition(
        status.conditions, ConditionType.SUSPENDED, True, "Suspended", "spec.suspend is true", now
    )
    conditions = set_condition(conditions, ConditionType.RUNNING, False, "Suspended", "", now)
    events = (
        []
        if status.phase is JobPhase.SUSPENDED
        else [Event("Normal", "Suspended", "job suspended; deleting its pods")]
    )
    status = status.model_copy(
        update={
            "phase": JobPhase.SUSPENDED,
            "conditions": conditions,
            "start_time": None,
            "below_min_since": None,
            "replicas": sum(p.live for p in pods),
            "ready_replicas": 0,
            "world_size": 0,
        }
    )
    return Decision(tuple(actions), status, tuple(events))


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


def reconcile(
    job: api.DDPJob,
    observed: Observed,
    now: dt.datetime,
    network: builders.Network = builders.CLUSTER,
) -> Decision:
    """Decide what the job needs now. Pure and deterministic."""
    pods = observed.pods
    status = job.status.model_copy(
        update={
            "observed_generation": job.metadata.generation,
            "selector": api.job_selector(job.name),
        }
    )
    events: list[Event] = []
    if status.phase.is_finished:
        return _finished(job, pods, status, now, events)
    if job.spec.suspend:
        return _suspend(job, pods, status, now)
    if status.phase is JobPhase.SUSPENDED:
        events.append(Event("Normal", "Resumed", "job resumed"))
        status = status.model_copy(
            update={
                "phase": JobPhase.PENDING,
                "conditions": set_condition(
                    status.conditions, ConditionType.SUSPENDED, False, "Resumed", "", now
                ),
            }
        )
    if status.start_time is None:
        status = status.model_copy(update={"start_time": now})

    status, new_failures = _account(job, pods, status, now)
    events += [_failure_event(job, f, status) for f in new_failures]

    spec = job.spec
    desired = desired_replicas(spec)
    live = [p for p in pods if p.live]
    running = sum(p.phase is PodPhase.RUNNING for p in live)
    completing = any(p.phase is PodPhase.SUCCEEDED for p in pods)
    below_since = None
    if not completing and running < spec.effective_min:
        below_since = status.below_min_since or now
    status = status.model_copy(update={"below_min_since": below_since})

    verdict = _failure_verdict(job, new_failures, status, now, running, completing)
    if verdict is None and completing and not live:
        verdict = _Verdict(
            JobPhase.SUCCEEDED, "Succeeded", "every pod of the job terminated successfully"
        )
    if verdict is not None:
        return _finish(job, pods, status, verdict, now, events)

    actions: list[Action] = []
    if not observed.service:
        actions.append(CreateService(builders.build_service(job)))
    if not completing:
        by_index = {p.index: p for p in pods}
        for pod in sorted(pods, key=lambda p: p.index):
            if pod.phase is PodPhase.FAILED and not pod.deleting and pod.index < desired:
                actions.append(DeletePod(pod.name, pod.uid, pod.index, DeleteWhy.REPLACE))
        actions += [
            CreatePod(i, builders.build_pod(job, i, network))
            for i in range(desired)
            if i not in by_index
        ]
        actions += [
            DeletePod(p.name, p.uid, p.index, DeleteWhy.SCALE_DOWN)
            for p in sorted(pods, key=lambda p: -p.index)
            if p.index >= desired and not p.deleting
        ]

    phase = _phase(completing, running, spec.effective_min, status.conditions)
    conditions = status.conditions
    if not _condition_true(conditions, ConditionType.CREATED):
        conditions = set_condition(
            conditions, ConditionType.CREATED, True, "Created", "pods and service created", now
        )
    conditions = set_condition(
        conditions,
        ConditionType.RUNNING,
        phase is JobPhase.RUNNING,
        "Completing"
        if completing
        else ("MinReplicasRunning" if phase is JobPhase.RUNNING else "WaitingForPods"),
        f"{running} of {desired} pods running (minReplicas {spec.effective_min})",
        now,
    )
    conditions = set_condition(
        conditions,
        ConditionType.RESTARTING,
        phase is JobPhase.RESTARTING,
        "ReplacingPods" if phase is JobPhase.RESTARTING else "NotRestarting",
        "",
        now,
    )
    status = status.model_copy(
        update={
            "phase": phase,
            "conditions": conditions,
            "replicas": len(live),
            "ready_replicas": sum(p.ready for p in live),
            "world_size": _world_size(job, live),
        }
    )
    return Decision(tuple(actions), status, tuple(events), _requeue(job, status, now))


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
