"""The whole plan of one pass: what the controller writes, does and tells, decided in one place.

:func:`plan` takes what the controller saw (:class:`Seen`), what the operator remembers of the
job between passes (:class:`Remembered`) and the operator's defaults, and returns a
:class:`PassPlan`: the job's decision (:func:`~ddpjob_operator.core.reconcile.reconcile`) with
the desired count, Kueue's admission and the Workload writes
(:func:`~ddpjob_operator.core.queue.admit`), the NetworkPolicy, store-key Secret and PodGroup
to post before any pod, whether the status is written now or its counts settle first
(:mod:`~ddpjob_operator.core.settle`), and when to look again. The controller only observes,
writes, acts and emits. Pure.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from ddpjob_operator import api, builders
from ddpjob_operator.core import gang, queue, workload
from ddpjob_operator.core.actions import CreatePod, Decision, Observed
from ddpjob_operator.core.facts import desired_replicas
from ddpjob_operator.core.reconcile import INVALID_SPEC, reconcile
from ddpjob_operator.core.settle import ALONE, settle_for, whole
from ddpjob_operator.errors import SpecError
from ddpjob_operator.observe import ObservedPod

JSON = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Remembered:
    """What the operator remembers of a job between its passes. None of it is state that
    matters across a restart: lost, each is found again or made again harmlessly (a PodGroup
    or Secret posted again is a 409, which is success)."""

    pod_group: gang.Posted | None = None
    """The job's PodGroup as this operator last made or resized it."""
    unwritten_since: float | None = None
    """When a large job first had counts that it did not write (:func:`settle.settle_for`)."""
    network_policy_made: bool = False
    store_key_made: bool = False
    queued: bool | None = None
    """Whether the job named a LocalQueue in its last pass (None: not known since a start)."""


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The operator's defaults for jobs (``ddpjob operator``'s flags)."""

    network_policy: bool = False
    security_profile: api.SecurityProfile = api.SecurityProfile.BASELINE


@dataclasses.dataclass(frozen=True)
class Seen:
    """What the controller observed of the job for this pass."""

    pods: tuple[ObservedPod, ...]
    """The pods under the job's names (its own and others'), with the ones it created that the
    watch has not shown yet as Pending."""
    service: bool
    pod_groups: bool | None = None
    """The cluster serves PodGroups (asked only for a job that wants a gang)."""
    kueue: queue.Observation | None = None
    """What was read of Kueue, for a job that names a queue (else None)."""
    ask_every: float | None = None
    """The agents are asked this often while a pod of the job is live (``--ask-agents``)."""


@dataclasses.dataclass(frozen=True)
class PassPlan:
    decision: Decision
    kueue: queue.Plan | None
    """Kueue's admission and the Workload writes (a Kueue job; else None)."""
    write: bool
    """Write ``decision.status`` now (it differs, and its counts need not settle)."""
    remembered: Remembered
    """What to remember of the job after this pass (before its writes and actions succeed:
    the controller marks what they made)."""
    network_policy: JSON | None = None
    secret: JSON | None = None
    pod_group: JSON | None = None
    leave_kueue: bool = False
    """The job no longer names a queue and its Workloads may still be open: finish them."""
    requeue_after: float | None = None
    """The next pass at the latest, without an event."""

    @property
    def desired(self) -> int:
        return self.decision.desired

    @property
    def wants_priority(self) -> bool:
        """Kueue's plan needs the job's priority, which was not read: read it and plan again."""
        return self.kueue is not None and self.kueue.wants_priority


def plan(
    job: api.DDPJob,
    seen: Seen,
    now: dt.datetime,
    clock: float,
    remembered: Remembered,
    defaults: Defaults,
    store_key: str,
) -> PassPlan:
    """Decide the pass. ``now`` is the wall clock (what the API server's times are read
    against), ``clock`` a monotonic one (what the memory is stamped on), ``store_key`` a fresh
    random key for a Secret made now."""
    own = [p for p in seen.pods if p.owned_by(job.metadata.uid)]
    named = workload.queue_name(job) is not None
    kueue = None
    if named and seen.kueue is not None:
        kueue = queue.admit(job, seen.kueue, own, desired_replicas(job.spec), now)
    admission = kueue.admission if kueue is not None else None
    decision = reconcile(
        job,
        Observed(seen.pods, seen.service, seen.pod_groups, admission),
        now,
        default_profile=defaults.security_profile,
    )
    settle, unwritten = _settle(job, decision, len(seen.pods), remembered.unwritten_since, clock)
    queued = remembered.queued
    if queued is None:  # after a restart: only a Kueue job ever gets Admitted
        queued = any(c.type == api.ConditionType.ADMITTED for c in job.status.conditions)
    # The job has no pod (but ones going away) and gets its first ones (it starts, resumes, or
    # is admitted again): its NetworkPolicy and Secret are posted again, so one deleted
    # meanwhile is made anew.
    afresh = all(p.deleting for p in seen.pods) and any(
        isinstance(a, CreatePod) for a in decision.actions
    )
    return PassPlan(
        decision=decision,
        kueue=kueue,
        write=decision.status != job.status and settle is None,
        remembered=dataclasses.replace(remembered, unwritten_since=unwritten, queued=named),
        network_policy=_network_policy(job, defaults, remembered, afresh),
        secret=_store_key_secret(job, remembered, afresh, store_key),
        pod_group=gang.to_post(job, seen.pod_groups, remembered.pod_group, seen.pods, clock),
        leave_kueue=not named and queued,
        requeue_after=_requeue(job, decision, seen, kueue, settle),
    )


def _settle(
    job: api.DDPJob, decision: Decision, pods: int, since: float | None, clock: float
) -> tuple[float | None, float | None]:
    """How long the decided status waits (None: written now, or nothing to write), and when
    its unwritten counts began (None: none wait)."""
    if decision.status == job.status:
        return None, None
    complete = whole(decision.status, decision.desired, builders.nproc_per_node(job.spec))
    settle = settle_for(job.status, decision.status, pods, since, clock, complete)
    if settle is None or settle == ALONE:
        return settle, None  # no counts wait (or they are written now)
    return settle, clock if since is None else since


def _requeue(
    job: api.DDPJob,
    decision: Decision,
    seen: Seen,
    kueue: queue.Plan | None,
    settle: float | None,
) -> float | None:
    due = decision.requeue_after
    if seen.ask_every is not None and any(p.live for p in seen.pods):
        due = min(due or seen.ask_every, seen.ask_every)
    poll = None if kueue is None else queue.poll_after(kueue, job.status.phase.is_finished)
    if poll is not None:
        due = min(due or poll, poll)
    if settle is not None and settle != ALONE:
        due = min(due or settle, settle)
    return due


def _network_policy(
    job: api.DDPJob, defaults: Defaults, remembered: Remembered, afresh: bool
) -> JSON | None:
    """The job's NetworkPolicy, if it wants one that this operator has not made yet (or the
    job gets its first pods ``afresh``)."""
    wanted = job.spec.network_policy
    if wanted is None:
        wanted = defaults.network_policy
    if not wanted or (remembered.network_policy_made and not afresh):
        return None
    if job.status.phase.is_finished:
        return None
    return builders.build_network_policy(job)


def _store_key_secret(
    job: api.DDPJob, remembered: Remembered, afresh: bool, key: str
) -> JSON | None:
    """The job's store-key Secret with a new random key, unless this operator has made (or
    found) it already. After a restart, and whenever the job gets its first pods
    (``afresh``), it is posted again: the 409 for the job's own Secret is success, and the key
    in it stays the one its pods read; a Secret deleted meanwhile is made with a new key, which
    no running pod holds an older one of."""
    if (remembered.store_key_made and not afresh) or job.status.phase.is_finished:
        return None
    if job.metadata.deletion_timestamp is not None:
        return None
    return builders.build_store_key_secret(job, key)


def invalid_status(raw: JSON, error: SpecError, now: dt.datetime) -> JSON | None:
    """A spec that slipped past the CRD schema: the status to write, with an InvalidSpec
    condition naming the fields (None: it says so already).

    Not terminal, and nothing is done to the job's pods: they keep running (and wait, with
    their tracking finalizer, to be counted) until the spec is fixed or the job deleted, as
    while no operator runs. The phase stays what it was.
    """
    stated = f"{invalid_message(error)} (nothing is done to the job's pods until the spec is fixed)"
    status = dict(raw.get("status") or {})
    generation = raw.get("metadata", {}).get("generation")
    conditions = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
    invalid = next((c for c in conditions if c.get("type") == INVALID_SPEC), None)
    if (
        invalid is not None
        and invalid.get("status") == "True"
        and invalid.get("message") == stated
        and status.get("observedGeneration") == generation
    ):
        return None
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    since = (
        invalid.get("lastTransitionTime", stamp)
        if invalid is not None and invalid.get("status") == "True"
        else stamp
    )
    status.update(
        observedGeneration=generation,
        conditions=[
            *(c for c in conditions if c.get("type") != INVALID_SPEC),
            {
                "type": INVALID_SPEC,
                "status": "True",
                "reason": INVALID_SPEC,
                "message": stated,
                "lastTransitionTime": since,
            },
        ],
    )
    status.setdefault("phase", api.JobPhase.PENDING.value)
    return status


def invalid_message(error: SpecError) -> str:
    """The fields an invalid spec gets wrong, in one line (the event and the log say it)."""
    return "; ".join(str(p) for p in error.problems)
