"""A running job: its Service and pods as the spec and its failures ask (replacements,
scale-down highest index first, missing pods after their back-off), its phase, conditions and
the counts its status shows, or its verdict."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Sequence

from ddpjob_operator import api, builders
from ddpjob_operator.api import (
    Condition,
    ConditionType,
    DDPJobStatus,
    JobPhase,
    PodFailure,
    PodWaiting,
    condition_true,
    set_condition,
)
from ddpjob_operator.core import backoff, gang
from ddpjob_operator.core.accounting import (
    DEFERRED_REQUEUE,
    bookkeeping,
    force_stuck,
    limit_deletes,
)
from ddpjob_operator.core.actions import (
    Action,
    CreatePod,
    CreateService,
    Decision,
    DeletePod,
    DeleteWhy,
    sooner,
    told_first,
)
from ddpjob_operator.core.events import (
    phase_events,
    pods_changed,
    room_for_store_host,
    waiting_events,
    waiting_summary,
)
from ddpjob_operator.core.facts import Facts
from ddpjob_operator.core.holding import admitted_condition
from ddpjob_operator.core.storehost import after_store_host, make_room, store_host_unplaced
from ddpjob_operator.core.verdict import failure_verdict, finish, success
from ddpjob_operator.observe import ObservedPod, PodPhase

MAX_WAITING = 20
"""Pods listed in ``status.waiting`` (lowest indices first); the Running condition counts all."""


def run(facts: Facts, status: DDPJobStatus, failures: Sequence[PodFailure]) -> Decision:
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

    verdict = failure_verdict(job, failures, status, now, running, waiting)
    succeeded, stranded_due = success(buckets.succeeded, live, now) if completing else (None, None)
    verdict = verdict or succeeded
    if verdict is not None:
        return told_first(told, finish(job, facts.pods, status, verdict, now))

    actions, deferred = limit_deletes(
        plan.actions, facts.pods, set(status.accounted_pods), facts.room
    )
    stuck, stuck_due = force_stuck(job, facts.pods, now, buckets.waiting_count)
    actions += stuck
    accounted, removals = bookkeeping(facts.pods, status, buckets.uncounted, actions)
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
    conditions = admitted_condition(conditions, facts.observed.queue, now)
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
    requeue = sooner(sooner(_requeue(job, status, now), stuck_due), plan.due)
    requeue = sooner(requeue, stranded_due)
    if deferred or buckets.deferred:
        requeue = sooner(requeue, DEFERRED_REQUEUE)
    requeue = sooner(requeue, facts.hold_due)
    return Decision(tuple(actions), status, tuple(told), requeue)


@dataclasses.dataclass
class _Plan:
    """What the running job needs, and what holds some of it back."""

    actions: list[Action]
    waiting: list[PodWaiting]
    pod_group: str | None = None
    due: float | None = None


def _run_actions(facts: Facts, status: DDPJobStatus, completing: bool) -> _Plan:
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
    unplaced = status.restarts == 0 and store_host_unplaced(facts.buckets.active, minimum)
    if unplaced:
        plan.actions += make_room(pods, facts.desired, minimum)
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
            plan.waiting.append(after_store_host(job, i))
            continue
        backing_off = backoff.waiting_for(job, status, i, now)
        if backing_off is not None and backing_off.retry_time is not None:
            plan.due = sooner(plan.due, (backing_off.retry_time - now).total_seconds())
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
