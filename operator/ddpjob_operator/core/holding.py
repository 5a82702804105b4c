"""A job held back: suspended (``spec.suspend``), or queued by Kueue (not admitted, or
evicted): its pods deleted uncharged, none made; and its way out (resumed, admitted)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from ddpjob_operator.api import (
    Condition,
    ConditionType,
    DDPJobStatus,
    JobPhase,
    set_condition,
)
from ddpjob_operator.core import gang, queue
from ddpjob_operator.core.accounting import (
    DEFERRED_REQUEUE,
    bookkeeping,
    force_stuck,
    limit_deletes,
)
from ddpjob_operator.core.actions import Action, Decision, DeletePod, DeleteWhy, sooner
from ddpjob_operator.core.events import Event
from ddpjob_operator.core.facts import Facts
from ddpjob_operator.observe import PodPhase


def suspend(facts: Facts, status: DDPJobStatus, queued: queue.Admission | None = None) -> Decision:
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
    actions, held_back = limit_deletes(wanted, pods, set(status.accounted_pods), facts.room)
    stuck, requeue = force_stuck(facts.job, pods, now, facts.buckets.waiting_count)
    if held_back or deferred:
        requeue = sooner(requeue, DEFERRED_REQUEUE)
    requeue = sooner(requeue, facts.hold_due)
    actions += stuck
    accounted, removals = bookkeeping(pods, status, facts.buckets.uncounted, actions)
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
        conditions = admitted_condition(status.conditions, queued, now)
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


def resumed(
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


def without_admitted(status: DDPJobStatus) -> DDPJobStatus:
    kept = [c for c in status.conditions if c.type != ConditionType.ADMITTED]
    return status.model_copy(update={"conditions": kept})


def admitted_condition(
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
