"""Kueue: the Workloads of a DDPJob that names a queue, and what they allow. Pure.

A DDPJob with the label ``kueue.x-k8s.io/queue-name`` is a Kueue workload (Kueue runs with
``integrations.externalFrameworks: ["DDPJob.v1alpha1.ddpjob.io"]``). Kueue runs no reconciler
for an external kind: ddpjob does what Kueue's job framework does for a batch Job. The protocol,
checked against Kueue v0.19.2's source, is in ``docs/design/kueue-workloads.md``; in short:

* One Workload per job, controlled by it (``kueue.x-k8s.io/job-uid`` label, Kueue's
  ``resource-in-use`` finalizer), one podSet ``main`` of ``spec.replicas`` pods whose template
  is the job's pod. No pod is created until the Workload is ``Admitted``; the pods then get the
  admitted flavors' node labels and tolerations.
* Elastic through workload slices: a scale up asks for a new slice of the full new size that
  replaces the admitted one (Kueue admits it when the difference fits, then finishes the old
  slice); the job keeps training at its admitted size meanwhile. A scale down deletes the
  surplus pods, then lowers the admitted slice's count, which gives the quota back at once.
* Eviction (preemption, a deactivation, a stopped queue): every pod is deleted, uncharged;
  once none holds resources the reservation is cleared, and the job waits to be admitted again.
* Suspend: ``spec.suspend`` is copied to the Workload's ``spec.active`` when the user changes
  it (never re-asserted: Kueue deactivates Workloads itself).
* The end: ``Finished`` once no pod holds resources, then the finalizer goes.

The controller reads the job's Workloads, the flavors they were admitted to and the job's priority
into an :class:`Observation`, and only does that I/O: :func:`admit` says what the job may run
(:class:`Admission`, which :func:`~ddpjob_operator.core.reconcile.reconcile` obeys) and what to
write to the Workloads, and :func:`poll_after` when to read them again.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ddpjob_operator import api
from ddpjob_operator.builders import Placement
from ddpjob_operator.core.workload import (
    API,
    CLUSTER_QUEUE_LABEL,
    FINALIZER,
    LOCAL_QUEUE_LABEL,
    OWNER_GONE,
    POD_WORKLOAD_ANNOTATION,
    PODSET,
    PODSET_LABEL,
    QUEUE_LABEL,
    SUSPENDED_ANNOTATION,
    TEMPLATE_ANNOTATION,
    CreateWorkload,
    PatchWorkload,
    Priority,
    ReleaseWorkload,
    Slice,
    WorkloadAction,
    build_workload,
    clear_reservation,
    condition,
    finish,
    flag,
    pod_set,
    queue_name,
    status_patch,
    template_hash,
    workload_name,
)
from ddpjob_operator.observe import ObservedPod, PodPhase

JSON = dict[str, Any]


UNBOUNDED = 1 << 30
"""More pods than any job asks for: what a job may run where Kueue is not installed."""


POLL_SECONDS = 2.0
"""How often a Kueue job's Workloads are read while it waits on Kueue (to be admitted, for a
bigger slice, or to give back an evicted one's quota)."""


WATCH_SECONDS = 5.0
"""How often an admitted Kueue job's Workload is read (a preemption is seen that late at most;
the preemptor waits until the evicted job's pods are gone)."""


STUCK_SECONDS = 30.0
"""How often a Kueue job that cannot be queued at all is looked at again."""


STUCK_REASONS = frozenset({"KueueNotServed", "KueueForbidden", "PriorityClassNotFound"})
"""Admission reasons that only people can fix (install Kueue, grant the operator, a class)."""


@dataclasses.dataclass(frozen=True)
class Admission:
    """What Kueue lets the job run now."""

    count: int
    """Pods the job may have; 0 while it is queued or evicted."""
    placement: Placement | None
    """For new pods; None: create none (an admitted flavor could not be read)."""
    admitted: bool
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Plan:
    admission: Admission
    actions: tuple[WorkloadAction, ...]
    wants_priority: bool = False
    """A new Workload waits for the job's priority, not read yet (:attr:`Observation.priority`):
    read it and :func:`admit` again (the actions hold no Workload creation meanwhile)."""


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the controller read of Kueue for a job that names a queue."""

    served: bool
    """The cluster serves Kueue's Workloads."""
    slices: tuple[Slice, ...] = ()
    """The job's own Workloads."""
    forbidden: str | None = None
    """Why the operator may not read Workloads (it was refused), if it may not."""
    flavors: Mapping[str, JSON] = dataclasses.field(default_factory=dict)
    """The ResourceFlavors the admitted slices name (:func:`flavors_to_read`), as read."""
    priority: Priority | str | None = None
    """The job's priority; why it has none (its class does not exist); ``None``: not read."""


def flavors_to_read(slices: Iterable[Slice]) -> list[str]:
    """The ResourceFlavors the job's admitted slices name (new pods need their node labels)."""
    return sorted({f for s in slices if s.admission for f in s.flavors})


def admit(
    job: api.DDPJob,
    seen: Observation,
    pods: Sequence[ObservedPod],
    desired: int,
    now: dt.datetime,
) -> Plan:
    """:func:`plan`, and what stands before it: Kueue not installed (the job runs without it),
    Workloads the operator may not read (no pod until it may), and the job's priority, which
    only a new Workload needs (a class that does not exist, or is not read yet, must never hold
    back what the job's other Workloads need: a finish, a release)."""
    if not seen.served:
        message = (
            f"the job names LocalQueue {queue_name(job)} ({QUEUE_LABEL}), but this cluster "
            f"serves no {API} Workloads (is Kueue installed?): it runs without Kueue"
        )
        return Plan(Admission(UNBOUNDED, Placement(), False, "KueueNotServed", message), ())
    if seen.forbidden is not None:
        message = (
            f"the operator may not read Kueue's Workloads ({seen.forbidden}): install the chart "
            "with kueue.enabled: true, or remove the label to run the job without Kueue; no pod "
            "is created until then"
        )
        return Plan(Admission(0, None, False, "KueueForbidden", message), ())
    known = seen.priority if isinstance(seen.priority, Priority) else Priority()
    planned = plan(job, seen.slices, pods, seen.flavors, desired, known, now)
    creates = any(isinstance(a, CreateWorkload) for a in planned.actions)
    if isinstance(seen.priority, Priority) or not creates:
        return planned
    others = tuple(a for a in planned.actions if not isinstance(a, CreateWorkload))
    if seen.priority is None:
        return Plan(planned.admission, others, wants_priority=True)
    admission = planned.admission
    if admission.admitted:
        message = f"{admission.message}; cannot ask for more: {seen.priority}"
        return Plan(dataclasses.replace(admission, message=message), others)
    return Plan(Admission(0, None, False, "PriorityClassNotFound", seen.priority), others)


def poll_after(planned: Plan, finished: bool) -> float | None:
    """How soon the job's Workloads are read again without any event (Kueue's writes to them
    wake no pass): often while the job waits on Kueue or has Workload writes to make, less
    often while it is admitted, seldom when only people can help; never once a finished job's
    Workloads need nothing more."""
    if finished and not planned.actions:
        return None
    if planned.admission.reason in STUCK_REASONS:
        return STUCK_SECONDS
    if planned.actions or not planned.admission.admitted:
        return POLL_SECONDS
    return WATCH_SECONDS


def placement(head: Slice, flavors: Mapping[str, JSON]) -> Placement | None:
    """Node labels and tolerations of the admitted flavors, and Kueue's pod labels."""
    selector: dict[str, str] = {}
    tolerations: list[JSON] = []
    for name in head.flavors:
        flavor = flavors.get(name)
        if flavor is None:
            return None
        spec = flavor.get("spec") or {}
        selector.update(spec.get("nodeLabels") or {})
        tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
    labels = {PODSET_LABEL: PODSET, LOCAL_QUEUE_LABEL: head.queue}
    if head.cluster_queue and len(head.cluster_queue) <= 63:
        labels[CLUSTER_QUEUE_LABEL] = head.cluster_queue
    annotations = {POD_WORKLOAD_ANNOTATION: head.name}
    for update in head.pod_set_updates:
        # What an admission check (a ProvisioningRequest, say) asks of the pods.
        selector.update(update.get("nodeSelector") or {})
        tolerations += [t for t in update.get("tolerations") or [] if t not in tolerations]
        labels.update(update.get("labels") or {})
        annotations.update(update.get("annotations") or {})
    return Placement(selector, tuple(tolerations), labels, annotations)


def plan(
    job: api.DDPJob,
    slices: Sequence[Slice],
    pods: Sequence[ObservedPod],
    flavors: Mapping[str, JSON],
    desired: int,
    priority: Priority,
    now: dt.datetime,
) -> Plan:
    """What the job may run, and what to write to its Workloads.

    ``pods``: the job's own pods; ``desired``: the pods the spec asks for; ``flavors``: the
    ResourceFlavors the admitted slice names (one missing: no new pod until it can be read).
    """
    actions: list[WorkloadAction] = [
        ReleaseWorkload(s.name, s.uid, s.finalizers)
        for s in slices
        if FINALIZER in s.finalizers
        and (s.finished or (s.deleting and not (s.reserved and _holding(pods))))
    ]
    live = [s for s in slices if not s.finished and not s.deleting]
    if job.status.phase.is_finished or job.metadata.deletion_timestamp is not None:
        if not _holding(pods):
            if job.status.phase.is_finished:
                reason, message = job.status.phase.value, _ended(job)
            else:
                reason, message = "OwnerNotFound", OWNER_GONE
            actions += [finish(s, reason, message, now) for s in live]
        return Plan(Admission(0, None, False, "Finished", ""), tuple(actions))

    reserved = [s for s in live if s.reserved]
    head = _head(reserved)
    pending = [s for s in live if s is not head and not s.reserved]
    actions += [
        finish(s, "OutOfSync", "a newer slice replaced it", now) for s in reserved if s is not head
    ]
    gone = next((s for s in slices if s.deleting and not s.finished), None)
    if head is None:
        return _queued(job, slices, pending, gone, pods, desired, priority, now, actions)
    if head.evicted is None and not head.admitted:
        before = next((s for s in slices if s.name == head.replaces and s.admission), None)
        if before is not None:
            # A scale up whose bigger slice has its quota but waits for admission checks (Kueue
            # finished the old slice already): the job trains on at the old slice's size.
            checks = head.said("Admitted") or "admission checks are not ready"
            count = min(desired, before.admitted_count)
            message = f"admitted for {count} pods; asking Kueue for {head.count}: {checks}"
            where = placement(before, flavors)
            return Plan(Admission(count, where, True, "Admitted", message), tuple(actions))
    if head.evicted is not None or not head.admitted:
        actions += [finish(s, "OutOfSync", "its slice was evicted", now) for s in pending]
        return _not_running(job, head, pods, now, actions)

    count = min(desired, head.admitted_count)
    flavor_names = ", ".join(head.flavors) or "none"
    message = (
        f"admitted by ClusterQueue {head.cluster_queue} (flavors: {flavor_names}) "
        f"for {head.admitted_count} pods"
    )
    lower = None
    if desired < head.count and not any(p.index >= desired and p.holds_resources for p in pods):
        lower = desired  # a scale down: the quota goes back once the surplus pods are gone
    synced = _sync(job, head, lower)
    actions += synced or _pods_ready(head, pods, count, now)
    asked = next(iter(pending), None)
    # A replacement that waits is resized, never finished: Kueue's scheduler admits without a
    # resourceVersion, and may be admitting it right now. Of the same size or smaller, it is
    # admitted at once, and replaces the running slice.
    actions += [finish(s, "OutOfSync", "a newer slice replaced it", now) for s in pending[1:]]
    if desired > head.count:
        if asked is None:
            name = workload_name(job, f"{job.metadata.generation or 0}-{len(slices)}")
            actions.append(CreateWorkload(build_workload(job, name, desired, priority, head)))
        else:
            actions += _sync(job, asked, desired)
        waiting = asked.said("QuotaReserved") if asked is not None else ""
        message += f"; asking Kueue for {desired}" + (f": {waiting}" if waiting else "")
    elif asked is not None:
        actions += _sync(job, asked, desired)
    where = placement(head, flavors)
    if where is None:
        message += "; waiting to read its ResourceFlavors"
    return Plan(Admission(count, where, True, "Admitted", message), tuple(actions))


def _not_running(
    job: api.DDPJob,
    head: Slice,
    pods: Sequence[ObservedPod],
    now: dt.datetime,
    actions: list[WorkloadAction],
) -> Plan:
    """The slice holds quota but the job may not run: evicted (its pods go, then the
    reservation is given back), or its admission checks are not ready."""
    evicted = head.evicted
    if evicted is None:
        actions += _sync(job, head, None)
        waiting = head.said("Admitted") or "admission checks are not ready"
        return Plan(Admission(0, None, False, "AdmissionChecks", waiting), tuple(actions))
    if _holding(pods):
        actions += _sync(job, head, None)
    else:  # alone: a spec patch decided on the same resourceVersion would get a 409
        actions.append(clear_reservation(head, evicted, now))
    reason = str(evicted.get("reason") or "Evicted")
    message = f"evicted by Kueue ({reason}): {evicted.get('message', '')}"
    return Plan(Admission(0, None, False, reason, message), tuple(actions))


def _pods_ready(
    wl: Slice, pods: Sequence[ObservedPod], count: int, now: dt.datetime
) -> list[WorkloadAction]:
    """``PodsReady``, as Kueue's job framework reports it (Kueue reads it only with
    ``waitForPodsReady``, and then evicts a job that never reports it): True once the admitted
    pods are all ready (or succeeded); False (``WaitForRecovery``) when one is lost after that.
    Never written before it is first True: Kueue times the start from the admission either way."""
    ready = sum(p.ready or p.phase is PodPhase.SUCCEEDED for p in pods if not p.deleting)
    old = next((c for c in wl.conditions if c.get("type") == "PodsReady"), None)
    was = (old or {}).get("reason")
    if count > 0 and ready >= count:
        status = True
        reason = "Recovered" if was in ("WaitForRecovery", "Recovered") else "Started"
        message = "All pods reached readiness and the workload is running"
    elif (old or {}).get("status") == "True" or was == "WaitForRecovery":
        status, reason = False, "WaitForRecovery"
        message = "At least one pod has failed, waiting for recovery"
    else:
        return []
    if old is not None and old.get("status") == flag(status).title() and was == reason:
        return []
    conditions = condition(wl.conditions, "PodsReady", status, reason, message, now, wl.generation)
    return [status_patch(wl, {"conditions": conditions})]


def _queued(
    job: api.DDPJob,
    slices: Sequence[Slice],
    pending: Sequence[Slice],
    gone: Slice | None,
    pods: Sequence[ObservedPod],
    desired: int,
    priority: Priority,
    now: dt.datetime,
    actions: list[WorkloadAction],
) -> Plan:
    """No slice holds quota: make one, or keep the one that waits in line at the right size."""
    if not pending:
        if gone is not None:
            message = f"Workload {gone.name} is being deleted; a new one is made once it is gone"
            return Plan(Admission(0, None, False, "WorkloadDeleted", message), tuple(actions))
        if _holding(pods):
            # Pods made before the job was queued (the label added later, Kueue installed
            # later): they go first, or Kueue could admit the job while they still run.
            message = "the job's pods stop before it is queued"
            return Plan(Admission(0, None, False, "Queued", message), tuple(actions))
        name = workload_name(job, f"{job.metadata.generation or 0}-{len(slices)}" if slices else "")
        actions.append(CreateWorkload(build_workload(job, name, desired, priority)))
        message = f"Workload {name} created in LocalQueue {queue_name(job)}"
        return Plan(Admission(0, None, False, "Queued", message), tuple(actions))
    first, *rest = pending
    actions += [finish(s, "OutOfSync", "one slice waits in line at a time", now) for s in rest]
    actions += _sync(job, first, desired)
    if not first.active:
        why = "Inactive"
        message = f"Workload {first.name} is inactive (spec.active is false)"
    else:
        why = "Queued"
        said = first.said("QuotaReserved")
        message = f"Workload {first.name} waits in LocalQueue {first.queue or queue_name(job)}"
        message += f": {said}" if said else ""
    return Plan(Admission(0, None, False, why, message), tuple(actions))


def _head(reserved: Sequence[Slice]) -> Slice | None:
    """The slice the job runs on: of two that hold quota (a replacement admitted, its
    predecessor not yet finished), the replacement."""
    replaced = {s.replaces for s in reserved}
    heads = [s for s in reserved if s.name not in replaced]
    return heads[0] if heads else (reserved[0] if reserved else None)


def _holding(pods: Iterable[ObservedPod]) -> bool:
    return any(p.holds_resources for p in pods)


def _ended(job: api.DDPJob) -> str:
    phase = job.status.phase.value
    said = next((c.message for c in job.status.conditions if str(c.type) == phase), "")
    return said or f"the DDPJob {phase.lower()}"


def _sync(job: api.DDPJob, wl: Slice, count: int | None) -> list[WorkloadAction]:
    """At most one spec patch that brings a Workload in line with the job.

    * ``spec.active`` follows the user's ``spec.suspend`` when it changes (edge-triggered: a
      Workload Kueue deactivated itself stays so).
    * While it holds no quota: the queue the job names now, the pod template (changed while
      the job was suspended), and ``count``.
    * While it holds quota: only a lower ``count`` (a scale down; the webhook refuses the rest).
    """
    annotations: dict[str, str] = {}
    spec: JSON = {}
    if wl.annotations.get(SUSPENDED_ANNOTATION) != flag(job.spec.suspend):
        annotations[SUSPENDED_ANNOTATION] = flag(job.spec.suspend)
        spec["active"] = not job.spec.suspend
    wanted = wl.count if count is None else count
    if not wl.reserved:
        name = queue_name(job)
        if name and wl.queue != name:
            spec["queueName"] = name
        digest = template_hash(job)
        if wl.annotations.get(TEMPLATE_ANNOTATION) != digest:
            annotations[TEMPLATE_ANNOTATION] = digest
            spec["podSets"] = [pod_set(job, wanted)]
    if "podSets" not in spec and wanted != wl.count and (not wl.reserved or wanted < wl.count):
        # A merge patch replaces a list whole, so the podSets go as read, with the new count.
        pod_sets = [dict(p) for p in wl.pod_sets] or [{"name": PODSET}]
        pod_sets[0]["count"] = wanted
        spec["podSets"] = pod_sets
    if not annotations and not spec:
        return []
    meta: JSON = {"resourceVersion": wl.resource_version}
    if annotations:
        meta["annotations"] = annotations
    patch: JSON = {"metadata": meta}
    if spec:
        patch["spec"] = spec
    return [PatchWorkload(wl.name, patch)]
