"""Gang scheduling (``gangScheduling: Native``): the job's PodGroup and its ``GangScheduled``
condition. Pure.

ddpjob makes one ``scheduling.k8s.io/v1beta1`` PodGroup per job (``builders.build_pod_group``:
named like the job, ``minCount`` = ``minReplicas``) before any pod, and every new pod names it,
unless the cluster does not serve PodGroups or pods made without one still run. The controller
posts the group (:func:`to_post`) and the reconciler decides which group new pods join
(:func:`group_for_new_pods`) and what the condition says (:func:`condition`; :func:`paused`
while the job is suspended or held by Kueue, :func:`ended` once it is over).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Any

from ddpjob_operator import api, builders
from ddpjob_operator.api import Condition, ConditionType, set_condition
from ddpjob_operator.observe import ObservedPod

RECHECK_SECONDS = 30.0
"""While pods of a gang wait unbound, the job's PodGroup is posted again this often: a group
someone deleted is made again (pods that name a missing group are never scheduled)."""


@dataclasses.dataclass(frozen=True)
class Posted:
    """The job's PodGroup as this operator last made it or set its ``minCount``."""

    min_count: int
    at: float
    """When (``time.monotonic()``)."""


def to_post(
    job: api.DDPJob,
    served: bool | None,
    posted: Posted | None,
    pods: Iterable[ObservedPod],
    now: float,
) -> dict[str, Any] | None:
    """The job's PodGroup, to create (or to set its minCount): when the job wants a gang
    that this operator has not made yet at this size, or has pods of the gang waiting
    unbound (then at most every :data:`RECHECK_SECONDS`). ``served`` is None for a job that
    wants no gang; ``now`` is on the clock of ``posted.at``."""
    if not served or job.status.phase.is_finished or job.metadata.deletion_timestamp:
        return None
    if posted is not None and posted.min_count == job.spec.effective_min:
        name = builders.pod_group_name(job.name)
        waiting = any(p.pod_group == name and p.node is None and p.live for p in pods)
        if not waiting or now - posted.at < RECHECK_SECONDS:
            return None
    return builders.build_pod_group(job)


def group_for_new_pods(
    job: api.DDPJob, served: bool | None, pods: Sequence[ObservedPod]
) -> str | None:
    """The PodGroup new pods join: the job's own, if it asks for a gang, the cluster serves
    PodGroups, and no live pod of the job was made without one (a pod the gang does not count
    would leave the group's newcomers waiting for a minCount they can never reach alone)."""
    if job.spec.gang_scheduling is not api.GangScheduling.NATIVE or not served:
        return None
    if any(p.pod_group == "" and p.live for p in pods):
        return None
    return builders.pod_group_name(job.name)


def condition(
    conditions: Sequence[Condition],
    job: api.DDPJob,
    served: bool | None,
    group: str | None,
    live: Sequence[ObservedPod],
    completing: bool,
    now: dt.datetime,
) -> list[Condition]:
    """``GangScheduled`` of a running job that asks for a gang (others never get it); ``group``:
    the one its new pods join (:func:`group_for_new_pods`). Once a pod has succeeded
    (``completing``) nothing is placed any more: the condition keeps its last word until the
    job ends (:func:`ended`), instead of counting the last pods still on their way out."""
    gang = job.spec.gang_scheduling is api.GangScheduling.NATIVE
    if not gang or served is None or completing:
        return list(conditions)
    placed, reason, message = _state(job.spec.effective_min, served, group, live)
    return set_condition(conditions, ConditionType.GANG_SCHEDULED, placed, reason, message, now)


def _state(
    gang: int, served: bool, group: str | None, live: Sequence[ObservedPod]
) -> tuple[bool, str, str]:
    """(placed, reason, message) of a gang of ``gang`` pods."""
    if not served:
        return (
            False,
            "PodGroupsNotServed",
            f"this cluster serves no {api.POD_GROUP_API} PodGroups (Kubernetes 1.37+ "
            "with the GenericWorkload feature gate and that API version on): the job runs "
            "without a gang, its pods placed one by one",
        )
    if group is None:
        return (
            False,
            "PodsWithoutGroup",
            "pods made before the cluster served PodGroups still run: new pods join them "
            "without a gang (suspend and resume the job to form one)",
        )
    bound = sum(p.node is not None for p in live)
    if bound >= gang:
        return True, "Placed", f"gang of {gang} placed: {bound} of {len(live)} pods bound"
    refused = next(
        (p for p in live if p.node is None and p.waiting_reason == "Unschedulable"), None
    )
    if refused is not None:
        return False, "Unschedulable", f"gang of {gang} cannot be placed: {refused.waiting_message}"
    return False, "Waiting", f"gang of {gang} waits to be placed: {bound} bound"


def paused(conditions: Sequence[Condition], reason: str, now: dt.datetime) -> list[Condition]:
    """A job that was said to be a gang, suspended or held by Kueue (``reason``): no gang."""
    return _no_gang(conditions, reason, "no gang to place until the job runs again", now)


def ended(
    conditions: Sequence[Condition], phase: api.JobPhase, now: dt.datetime
) -> list[Condition]:
    """A finished job that was said to be a gang: its end, not a placement nobody wants any
    more (whatever its last pods were doing, or a suspend before the end)."""
    return _no_gang(
        conditions, phase.value, f"no gang to place: the job {phase.value.lower()}", now
    )


def _no_gang(
    conditions: Sequence[Condition], reason: str, message: str, now: dt.datetime
) -> list[Condition]:
    if not any(c.type == ConditionType.GANG_SCHEDULED for c in conditions):
        return list(conditions)
    return set_condition(conditions, ConditionType.GANG_SCHEDULED, False, reason, message, now)
