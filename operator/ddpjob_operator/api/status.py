"""The job's status: its phase, conditions, counts and the pods it waits for or lost."""

from __future__ import annotations

import datetime as dt
import enum
from collections.abc import Iterable, Sequence
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from ddpjob_operator.api.base import MAX_RECENT_FAILURES, POD_FINALIZER, Model


class JobPhase(enum.StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    QUEUED = "Queued"
    """A Kueue job (``kueue.x-k8s.io/queue-name``) that Kueue has not admitted, or evicted: it
    has no pods, and waits in its queue."""
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    @property
    def is_finished(self) -> bool:
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED)


class ConditionType(enum.StrEnum):
    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    GANG_SCHEDULED = "GangScheduled"
    """Only with ``gangScheduling: Native``: True once the job's first ``minReplicas`` pods
    are bound together; False while they wait for room (reason ``Unschedulable``, with the
    scheduler's message), or when the cluster serves no PodGroups (``PodGroupsNotServed``: the
    job runs without a gang)."""
    ADMITTED = "Admitted"
    """Only for a Kueue job (label ``kueue.x-k8s.io/queue-name``): True while Kueue admits its
    Workload (the message names the ClusterQueue, the flavors and the admitted size); False
    while it waits in line (``Queued``, ``Inactive``) or after an eviction (``Preempted``, and
    Kueue's other eviction reasons)."""
    INVALID_SPEC = "InvalidSpec"
    """True while the operator cannot parse the spec (it then acts on nothing). Not terminal:
    fixing the spec clears it and the job goes on."""


class Condition(Model):
    """A Kubernetes-style condition. ``lastTransitionTime`` changes only when ``status`` does.

    ``type`` is any string: a condition another controller (or a newer ddpjob) wrote must not
    make the job unparseable. :class:`ConditionType` lists the ones ddpjob writes.
    """

    model_config = ConfigDict(extra="ignore")

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: dt.datetime


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


def condition_true(conditions: Iterable[Condition], type_: ConditionType) -> bool:
    return any(c.type == type_ and c.status == "True" for c in conditions)


class PodFailure(Model):
    """One pod that ended badly, with a classified reason.

    ``reason`` is one of ``Preempted``, ``Evicted``, ``OOMKilled``, ``NodeLost``, ``Deleted`` or
    ``ExitCode(n)`` (read leniently: another version may write others). ``charged`` says
    whether it counted against ``backoffLimit``; ``started`` whether the trainer had started
    (a pod the kubelet rejected at admission never did: its replacement waits, see
    ``reconcile``).
    """

    model_config = ConfigDict(extra="ignore")

    pod: str
    index: int
    uid: str | None = None
    reason: str
    exit_code: int | None = None
    message: str = ""
    node: str | None = None
    charged: bool
    started: bool = True
    time: dt.datetime

    @property
    def delays_next_pod(self) -> bool:
        """The next pod of the index waits (:class:`PodBackoff`): the failure was charged, or
        the trainer never started (a node that rejects the pod at admission would reject the
        next one in a tight loop). A disruption of a pod that ran is replaced at once."""
        return self.charged or not self.started


class PodWaiting(Model):
    """A pod of the job that cannot start yet, and why (image pull, scheduling, config; or
    ``BackOff``: it is not created before ``retryTime``)."""

    model_config = ConfigDict(extra="ignore")

    pod: str
    reason: str
    message: str = ""
    index: int | None = None
    retry_time: Annotated[
        dt.datetime | None,
        Field(description="When the pod is created (reason BackOff)."),
    ] = None


class IndexBackoff(Model):
    """The back-off state of one pod index (see :class:`PodBackoff`): it lives in the status,
    so that it survives an operator restart."""

    model_config = ConfigDict(extra="ignore")

    index: int
    failures: Annotated[int, Field(ge=0, description="Delayed failures of this index in a row.")]
    last_failure_time: Annotated[
        dt.datetime,
        Field(description="When the last of them ended (the pod's finish time, when known)."),
    ]


class DDPJobStatus(Model):
    """What the operator observed and decided. Written once per reconcile pass."""

    model_config = ConfigDict(extra="ignore")

    phase: JobPhase = JobPhase.PENDING
    conditions: list[Condition] = []
    observed_generation: int | None = None
    replicas: Annotated[int, Field(ge=0, description="Pods that are pending or running.")] = 0
    ready_replicas: Annotated[
        int, Field(ge=0, description="Pods whose agent runs its workers.")
    ] = 0
    world_size: Annotated[
        int,
        Field(ge=0, description="Worker processes in the world that trains now (0: none does)."),
    ] = 0
    store_host: Annotated[
        str | None,
        Field(
            description=(
                "The pod that hosts the rendezvous store now, as its agent says (pod 0 at "
                "first, a survivor after a failover); unset while unknown."
            )
        ),
    ] = None
    restarts: Annotated[
        int, Field(ge=0, description="Pods replaced after a failure, all reasons.")
    ] = 0
    backoff_count: Annotated[
        int, Field(ge=0, description="Replacements charged to backoffLimit.")
    ] = 0
    selector: str | None = None
    start_time: dt.datetime | None = None
    completion_time: dt.datetime | None = None
    below_min_since: dt.datetime | None = None
    succeeded: Annotated[
        int, Field(ge=0, description="Pods whose trainer finished successfully.")
    ] = 0
    failures: Annotated[
        list[PodFailure],
        Field(
            description=(
                f"The {MAX_RECENT_FAILURES} most recent pod failures (for people: the counts "
                "above are exact, this list is not the ledger)."
            )
        ),
    ] = []
    waiting: Annotated[
        list[PodWaiting],
        Field(description="Pods that cannot start yet, with the reason (until the job has run)."),
    ] = []
    pod_backoff: Annotated[
        list[IndexBackoff],
        Field(
            description=(
                "Pod indices whose recent failures delay their next pod (spec.podBackoff), "
                "lowest index first."
            )
        ),
    ] = []
    accounted_pods: Annotated[
        list[str],
        Field(
            description=(
                "UIDs of pods whose outcome is already in this status (counted, or deleted by "
                f"the operator) and whose {POD_FINALIZER} finalizer is still to be removed."
            )
        ),
    ] = []
