"""Kueue's objects as ddpjob shares them: the labels and annotations of the protocol, a Workload
as read (:class:`Slice`), the writes the core decides (:data:`WorkloadAction`), the job's
priority, and the Workload ddpjob builds for a job. Pure (``docs/design/kueue-workloads.md``
has the protocol; :mod:`~ddpjob_operator.core.queue` decides with these)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ddpjob_operator import api, builders

JSON = dict[str, Any]

API = api.KUEUE_API


QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"


JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


FINALIZER = "kueue.x-k8s.io/resource-in-use"


ELASTIC_ANNOTATION = "kueue.x-k8s.io/elastic-job"


SLICE_NAME_ANNOTATION = "kueue.x-k8s.io/workload-slice-name"


REPLACEMENT_ANNOTATION = "kueue.x-k8s.io/workload-slice-replacement-for"


POD_WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"


PODSET_LABEL = "kueue.x-k8s.io/podset"


LOCAL_QUEUE_LABEL = "kueue.x-k8s.io/local-queue-name"


CLUSTER_QUEUE_LABEL = "kueue.x-k8s.io/cluster-queue-name"


SUSPENDED_ANNOTATION = "ddpjob.io/suspended"
"""The job's ``spec.suspend`` as last copied to the Workload's ``spec.active``."""


TEMPLATE_ANNOTATION = "ddpjob.io/template-hash"
"""A hash of the pod template the Workload's podSet was made from."""


OWNER_GONE = "The workload's owner no longer exists"


LABEL_REMOVED = (
    "QueueLabelRemoved",
    f"The job no longer has the {QUEUE_LABEL} label: it runs without Kueue",
)


PODSET = "main"
REQUEUED_AFTER = frozenset({"Preempted", "NodeFailures"})
"""Eviction reasons after which the Workload goes back to the queue at once (``Requeued``
True); after the others Kueue requeues it itself (reactivation, back-off, a restarted queue)."""


def queue_name(job: api.DDPJob) -> str | None:
    """The LocalQueue the job names, if it is a Kueue workload."""
    return (job.metadata.labels or {}).get(QUEUE_LABEL) or None


def workload_name(job: api.DDPJob, extra: str = "") -> str:
    """As Kueue names a job's Workload (``ddpjob-<job>-<5 hex>``), so a retried create is a 409."""
    parts = [api.KIND, api.GROUP, job.name, job.metadata.uid or ""]
    if extra:
        parts.append(extra)
    digest = hashlib.sha1("\n".join(parts).encode(), usedforsecurity=False).hexdigest()
    return f"{api.KIND.lower()}-{job.name}"[:247] + "-" + digest[:5]


@dataclasses.dataclass(frozen=True)
class Slice:
    """One Workload of the job, as read."""

    name: str
    uid: str
    resource_version: str
    generation: int
    count: int
    active: bool
    annotations: Mapping[str, str]
    finalizers: tuple[str, ...]
    deleting: bool
    conditions: tuple[JSON, ...]
    admission: JSON | None
    queue: str
    pod_sets: tuple[JSON, ...] = ()
    admission_checks: tuple[JSON, ...] = ()

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Slice:
        meta = obj.get("metadata") or {}
        spec = obj.get("spec") or {}
        status = obj.get("status") or {}
        pod_sets = spec.get("podSets") or [{}]
        return cls(
            name=str(meta.get("name", "")),
            uid=str(meta.get("uid", "")),
            resource_version=str(meta.get("resourceVersion", "")),
            generation=int(meta.get("generation") or 0),
            count=int(pod_sets[0].get("count") or 0),
            active=spec.get("active") is not False,
            annotations=dict(meta.get("annotations") or {}),
            finalizers=tuple(meta.get("finalizers") or ()),
            deleting=meta.get("deletionTimestamp") is not None,
            conditions=tuple(c for c in status.get("conditions") or () if isinstance(c, dict)),
            admission=status.get("admission") or None,
            queue=str(spec.get("queueName", "")),
            pod_sets=tuple(p for p in spec.get("podSets") or () if isinstance(p, dict)),
            admission_checks=tuple(
                c for c in status.get("admissionChecks") or () if isinstance(c, dict)
            ),
        )

    def condition(self, type_: str) -> JSON | None:
        """The condition of that type if it is True."""
        return next(
            (c for c in self.conditions if c.get("type") == type_ and c.get("status") == "True"),
            None,
        )

    def said(self, type_: str) -> str:
        """The message of the condition of that type, whatever its status."""
        found = next((c for c in self.conditions if c.get("type") == type_), None)
        return str((found or {}).get("message") or "")

    @property
    def reserved(self) -> bool:
        return self.condition("QuotaReserved") is not None and self.admission is not None

    @property
    def admitted(self) -> bool:
        return self.reserved and self.condition("Admitted") is not None

    @property
    def finished(self) -> bool:
        return self.condition("Finished") is not None

    @property
    def evicted(self) -> JSON | None:
        return self.condition("Evicted")

    @property
    def replaces(self) -> str | None:
        """The name of the slice this one is to replace (a scale up)."""
        value = self.annotations.get(REPLACEMENT_ANNOTATION)
        return value.rpartition("/")[2] if value else None

    @property
    def assignment(self) -> JSON:
        assignments = (self.admission or {}).get("podSetAssignments") or [{}]
        return dict(assignments[0])

    @property
    def admitted_count(self) -> int:
        """Pods this slice lets the job run: its count (lowered by a scale down), at most the
        admitted one."""
        admitted = self.assignment.get("count")
        return self.count if admitted is None else min(self.count, int(admitted))

    @property
    def flavors(self) -> tuple[str, ...]:
        return tuple(sorted(set((self.assignment.get("flavors") or {}).values())))

    @property
    def pod_set_updates(self) -> list[JSON]:
        """The admission checks' updates of the podSet (labels, annotations, nodeSelector,
        tolerations)."""
        return [
            update
            for check in self.admission_checks
            for update in check.get("podSetUpdates") or ()
            if isinstance(update, dict) and update.get("name") == PODSET
        ]

    @property
    def cluster_queue(self) -> str:
        return str((self.admission or {}).get("clusterQueue") or "")


@dataclasses.dataclass(frozen=True)
class CreateWorkload:
    body: JSON


@dataclasses.dataclass(frozen=True)
class PatchWorkload:
    """A JSON merge patch of the Workload (``status`` True: of its status subresource); it
    carries the resourceVersion it was decided on."""

    name: str
    patch: JSON
    status: bool = False


@dataclasses.dataclass(frozen=True)
class ReleaseWorkload:
    """Remove Kueue's ``resource-in-use`` finalizer: the Workload holds no quota any more."""

    name: str
    uid: str
    finalizers: tuple[str, ...]


WorkloadAction = CreateWorkload | PatchWorkload | ReleaseWorkload


@dataclasses.dataclass(frozen=True)
class Priority:
    """The Workload's priority: Kueue reads it, it does not compute it for external kinds."""

    value: int = 0
    ref: JSON | None = None


@dataclasses.dataclass(frozen=True)
class PriorityClass:
    """The class a job's Workload takes its priority from."""

    kueue: bool
    """A ``WorkloadPriorityClass`` (the job's label); else the pod template's ``PriorityClass``."""
    name: str

    @property
    def ref(self) -> JSON:
        if self.kueue:
            return {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": self.name}
        return {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": self.name}

    @property
    def where(self) -> str:
        if self.kueue:
            return f"WorkloadPriorityClass {self.name} ({PRIORITY_CLASS_LABEL})"
        return f"PriorityClass {self.name} (spec.template.spec.priorityClassName)"


def priority_class(job: api.DDPJob) -> PriorityClass | None:
    """As Kueue's job framework picks it: the job's ``kueue.x-k8s.io/priority-class`` (a
    WorkloadPriorityClass), else the template's ``priorityClassName``; else none (priority 0)."""
    kueue_class = (job.metadata.labels or {}).get(PRIORITY_CLASS_LABEL)
    if kueue_class:
        return PriorityClass(True, kueue_class)
    pod_class = (job.spec.template.spec.model_extra or {}).get("priorityClassName")
    return PriorityClass(False, str(pod_class)) if pod_class else None


def priority(named: PriorityClass | None, value: int | None) -> Priority | str:
    """The Workload's priority, from the value read of the class (``None``: the class does not
    exist, and the message that says so)."""
    if named is None:
        return Priority()
    if value is None:
        return f"{named.where} does not exist: create it, or name another; no Workload until then"
    return Priority(value, named.ref)


def pod_set(job: api.DDPJob, count: int) -> JSON:
    """The Workload's one podSet: ``count`` pods whose template is the job's pod as ddpjob makes
    it (its requests are the quota Kueue reserves)."""
    pod = builders.build_pod(job, 0)
    template: JSON = {
        "metadata": {
            "labels": dict(pod["metadata"].get("labels") or {}),
            "annotations": dict(pod["metadata"].get("annotations") or {}),
        },
        "spec": pod["spec"],
    }
    return {"name": PODSET, "count": count, "template": template}


def template_hash(job: api.DDPJob) -> str:
    text = json.dumps(pod_set(job, 0)["template"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_workload(
    job: api.DDPJob,
    name: str,
    count: int,
    priority: Priority,
    replaces: Slice | None = None,
) -> JSON:
    """A Workload for ``count`` pods of the job; a scale up's replaces the admitted slice."""
    origin = name if replaces is None else replaces.annotations.get(SLICE_NAME_ANNOTATION, name)
    annotations = {
        ELASTIC_ANNOTATION: "true",
        SLICE_NAME_ANNOTATION: origin,
        SUSPENDED_ANNOTATION: flag(job.spec.suspend),
        TEMPLATE_ANNOTATION: template_hash(job),
    }
    if replaces is not None:
        annotations[REPLACEMENT_ANNOTATION] = f"{job.namespace}/{replaces.name}"
    spec: JSON = {
        "queueName": queue_name(job),
        "active": not job.spec.suspend,
        "priority": priority.value,
        "podSets": [pod_set(job, count)],
    }
    if priority.ref is not None:
        spec["priorityClassRef"] = priority.ref
    return {
        "apiVersion": API,
        "kind": "Workload",
        "metadata": {
            "name": name,
            "namespace": job.namespace,
            "labels": {JOB_UID_LABEL: job.metadata.uid or ""},
            "annotations": annotations,
            "finalizers": [FINALIZER],
            "ownerReferences": builders.owner_references(job),
        },
        "spec": spec,
    }


def flag(value: bool) -> str:
    return "true" if value else "false"


def condition(
    conditions: Sequence[JSON],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: dt.datetime,
    generation: int,
) -> list[JSON]:
    """``meta.SetStatusCondition``: the transition time moves only when the status flips."""
    wanted = "True" if status else "False"
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = (
        old.get("lastTransitionTime")
        if old is not None and old.get("status") == wanted
        else now.strftime("%Y-%m-%dT%H:%M:%SZ")
    )
    new = {
        "type": type_,
        "status": wanted,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }
    return [c for c in conditions if c.get("type") != type_] + [new]


def status_patch(wl: Slice, status: JSON) -> PatchWorkload:
    return PatchWorkload(
        wl.name, {"metadata": {"resourceVersion": wl.resource_version}, "status": status}, True
    )


def finish(wl: Slice, reason: str, message: str, now: dt.datetime) -> PatchWorkload:
    conditions = condition(wl.conditions, "Finished", True, reason, message, now, wl.generation)
    return status_patch(wl, {"conditions": conditions})


def clear_reservation(wl: Slice, evicted: JSON, now: dt.datetime) -> PatchWorkload:
    """What Kueue's job framework writes once an evicted job's pods are gone: the quota is
    free, and the Workload is back in line (at once after a preemption)."""
    reason = str(evicted.get("reason") or "Evicted")
    message = str(evicted.get("message") or "")
    generation = wl.generation
    # Kueue requeues a reactivated Workload only when the reason is exactly Deactivated (not
    # DeactivatedDueTo...): a job it deactivated itself could then never run again.
    requeued = "Deactivated" if reason.startswith("Deactivated") else reason
    conditions = condition(
        wl.conditions, "Requeued", reason in REQUEUED_AFTER, requeued, message, now, generation
    )
    if any(c.get("type") == "PodsReady" for c in conditions):
        # Its next admission starts over: Kueue's start timeout applies again.
        conditions = condition(
            conditions,
            "PodsReady",
            False,
            "WaitForStart",
            "Not all pods are ready or succeeded",
            now,
            generation,
        )
    conditions = condition(conditions, "QuotaReserved", False, "Pending", message, now, generation)
    conditions = condition(
        conditions,
        "Admitted",
        False,
        "NoReservation",
        "The workload has no reservation",
        now,
        generation,
    )
    return status_patch(wl, {"conditions": conditions, "admission": None})
