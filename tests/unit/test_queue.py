"""Kueue in the pure parts: the Workloads :mod:`ddpjob_operator.core.queue` builds and what
:func:`~ddpjob_operator.core.queue.plan` writes to them, the :class:`~ddpjob_operator.core.queue.Admission`
the reconciler obeys, and the placement the builders put on an admitted job's pods.

The protocol (Kueue v0.19.2) is in docs/design/kueue-workloads.md. Workloads are built here as
the API server stores them: what :func:`~ddpjob_operator.core.workload.build_workload` made, plus a uid,
a resourceVersion, a generation and the status Kueue writes."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from ddpjob_operator import api, builders
from ddpjob_operator.builders import Placement
from ddpjob_operator.core import queue, workload
from ddpjob_operator.core.actions import (
    CreatePod,
    Decision,
    DeletePod,
    DeleteWhy,
    Observed,
    RemoveFinalizer,
)
from ddpjob_operator.core.events import Event
from ddpjob_operator.core.queue import Admission, Plan
from ddpjob_operator.core.reconcile import reconcile
from ddpjob_operator.core.workload import (
    CreateWorkload,
    PatchWorkload,
    Priority,
    ReleaseWorkload,
    Slice,
)
from ddpjob_operator.observe import ObservedPod, PodPhase
from ddpjob_operator.parse import parse_job

from .jobs import manifest

JSON = dict[str, Any]

T0 = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.UTC)
STAMP = "2026-11-27T12:00:00Z"
"""``T0`` as a condition's lastTransitionTime."""
EARLIER = "2026-11-27T11:00:00Z"
GENERATION = 5
"""Every stored Workload's metadata.generation (the job's is 3: they must not be confused)."""
LOCAL_QUEUE = "team-a"
RESOURCES: JSON = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"nvidia.com/gpu": "1"}}
GPU_TOLERATION: JSON = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SPOT_TOLERATION: JSON = {"key": "spot", "operator": "Equal", "value": "yes", "effect": "NoSchedule"}
FLAVORS: dict[str, JSON] = {
    "f1": {
        "metadata": {"name": "f1"},
        "spec": {"nodeLabels": {"pool": "a100"}, "tolerations": [GPU_TOLERATION]},
    },
    "f2": {
        "metadata": {"name": "f2"},
        "spec": {
            "nodeLabels": {"zone": "z1"},
            "tolerations": [GPU_TOLERATION, SPOT_TOLERATION],
        },
    },
}
PENDING_MESSAGE = (
    "couldn't assign flavors to pod set main: insufficient unused quota for nvidia.com/gpu "
    "in flavor f1, 1 more needed"
)
PREEMPTED_MESSAGE = "Preempted to accommodate a workload (UID: u-9) due to prioritization"
NOT_READY = "node.kubernetes.io/not-ready"
NO_PRIORITY = Priority()
UNREACHABLE = "node.kubernetes.io/unreachable"


# ---- helpers -------------------------------------------------------------------------------------


def kueue_manifest(**spec: Any) -> JSON:
    """The unit tests' job, in LocalQueue ``team-a``, its trainer asking for a GPU."""
    document = manifest(**spec)
    document["metadata"]["labels"] = {workload.QUEUE_LABEL: LOCAL_QUEUE}
    trainer = document["spec"]["template"]["spec"]["containers"][0]
    trainer["resources"] = copy.deepcopy(RESOURCES)
    return document


def make_job(status: api.DDPJobStatus | None = None, **spec: Any) -> api.DDPJob:
    job = parse_job(kueue_manifest(**spec))
    return job.model_copy(update={"status": status}) if status is not None else job


def pod(index: int, phase: PodPhase = PodPhase.RUNNING, **kw: Any) -> ObservedPod:
    kw.setdefault("uid", f"uid-{index}")
    kw.setdefault("ready", phase is PodPhase.RUNNING)
    return ObservedPod(name=f"demo-worker-{index}", index=index, phase=phase, **kw)


def cond(
    type_: str, status: bool = True, reason: str = "", message: str = "", since: str = EARLIER
) -> JSON:
    """A Workload condition as Kueue writes it."""
    return {
        "type": type_,
        "status": "True" if status else "False",
        "reason": reason or type_,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": GENERATION,
    }


RESERVED = cond("QuotaReserved", True, "QuotaReserved", "Quota reserved in ClusterQueue cq")
ADMITTED = cond("Admitted", True, "Admitted", "The workload is admitted")
WAITING = cond("QuotaReserved", False, "Pending", PENDING_MESSAGE)
PREEMPTED = cond("Evicted", True, "Preempted", PREEMPTED_MESSAGE)


def assigned(count: int = 2, flavors: Mapping[str, str] | None = None, cq: str = "cq") -> JSON:
    """``status.admission``: one podSetAssignment for ``main``."""
    return {
        "clusterQueue": cq,
        "podSetAssignments": [
            {
                "name": "main",
                "flavors": dict(flavors if flavors is not None else {"cpu": "f1"}),
                "count": count,
                "resourceUsage": {"cpu": str(2 * count)},
            }
        ],
    }


def stored(
    job: api.DDPJob,
    name: str,
    count: int = 2,
    *,
    conditions: Sequence[JSON] = (),
    admission: JSON | None = None,
    rv: str = "100",
    active: bool | None = None,
    annotations: Mapping[str, str] | None = None,
    finalizers: Sequence[str] = (workload.FINALIZER,),
    deleting: bool = False,
    replaces: Slice | None = None,
) -> Slice:
    """A Workload as the API server holds it once ddpjob made it and Kueue wrote its status."""
    body = workload.build_workload(job, name, count, Priority(), replaces)
    meta = body["metadata"]
    meta.update(
        uid=f"uid-{name}", resourceVersion=rv, generation=GENERATION, finalizers=list(finalizers)
    )
    meta["annotations"].update(annotations or {})
    if deleting:
        meta["deletionTimestamp"] = "2026-11-27T11:59:00Z"
    if active is not None:
        body["spec"]["active"] = active
    status: JSON = {"conditions": [dict(c) for c in conditions]}
    if admission is not None:
        status["admission"] = admission
    body["status"] = status
    return Slice.of(body)


def admitted(
    job: api.DDPJob,
    name: str | None = None,
    count: int = 2,
    admitted_count: int | None = None,
    flavors: Mapping[str, str] | None = None,
    extra: Sequence[JSON] = (),
    **kw: Any,
) -> Slice:
    """A slice Kueue admitted (QuotaReserved and Admitted True, ``status.admission`` set)."""
    return stored(
        job,
        name or workload.workload_name(job),
        count,
        conditions=[RESERVED, ADMITTED, *extra],
        admission=assigned(count if admitted_count is None else admitted_count, flavors),
        **kw,
    )


def pending(job: api.DDPJob, name: str | None = None, count: int = 2, **kw: Any) -> Slice:
    """A slice that waits in line: QuotaReserved False (Pending), no admission."""
    return stored(job, name or workload.workload_name(job), count, conditions=[WAITING], **kw)


def planned(
    job: api.DDPJob,
    *slices: Slice,
    pods: Sequence[ObservedPod] = (),
    flavors: Mapping[str, JSON] = FLAVORS,
    desired: int = 2,
    priority: Priority = NO_PRIORITY,
) -> Plan:
    return queue.plan(job, slices, pods, flavors, desired, priority, T0)


def finished(wl: Slice, reason: str, message: str) -> PatchWorkload:
    """The status patch that marks ``wl`` Finished (it had no Finished condition)."""
    new = {
        "type": "Finished",
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": STAMP,
        "observedGeneration": GENERATION,
    }
    patch = {
        "metadata": {"resourceVersion": wl.resource_version},
        "status": {"conditions": [*wl.conditions, new]},
    }
    return PatchWorkload(wl.name, patch, True)


def count_patch(wl: Slice, count: int) -> PatchWorkload:
    """A merge patch of the count: the whole podSets list as read (template kept), new count."""
    assert len(wl.pod_sets) == 1 and wl.pod_sets[0]["name"] == "main"
    pod_set = {"name": "main", "count": count, "template": wl.pod_sets[0]["template"]}
    patch = {"metadata": {"resourceVersion": wl.resource_version}, "spec": {"podSets": [pod_set]}}
    return PatchWorkload(wl.name, patch)


READY = cond("PodsReady", True, "Started", "All pods reached readiness and the workload is running")


def canonical(action: workload.WorkloadAction) -> object:
    """A status patch with its conditions keyed by type (each type once): their order in the
    list means nothing to the API server."""
    if not isinstance(action, PatchWorkload) or "conditions" not in action.patch.get("status", {}):
        return action
    status = dict(action.patch["status"])
    conditions = status.pop("conditions")
    types = [c["type"] for c in conditions]
    assert len(types) == len(set(types)), types
    status["conditions"] = {c["type"]: c for c in conditions}
    return dataclasses.replace(action, patch={**action.patch, "status": status})


def kueue_placement(wl: Slice, node_selector: Mapping[str, str], *tolerations: JSON) -> Placement:
    return Placement(
        dict(node_selector),
        tuple(tolerations),
        {
            "kueue.x-k8s.io/podset": "main",
            "kueue.x-k8s.io/local-queue-name": LOCAL_QUEUE,
            "kueue.x-k8s.io/cluster-queue-name": "cq",
        },
        {"kueue.x-k8s.io/workload": wl.name},
    )


def lost_node(key: str, seconds: int = 30) -> JSON:
    return {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}


# ---- the Workload's name -------------------------------------------------------------------------


def test_the_workload_name_is_kueues_hash_of_kind_group_name_and_uid() -> None:
    job = make_job()
    digest = hashlib.sha1(b"DDPJob\nddpjob.io\ndemo\nuid-demo", usedforsecurity=False)
    assert workload.workload_name(job) == "ddpjob-demo-" + digest.hexdigest()[:5]
    assert workload.workload_name(job) == "ddpjob-demo-b0732"
    with_extra = hashlib.sha1(b"DDPJob\nddpjob.io\ndemo\nuid-demo\n3-1", usedforsecurity=False)
    assert workload.workload_name(job, "3-1") == "ddpjob-demo-" + with_extra.hexdigest()[:5]
    assert workload.workload_name(job, "3-1") != workload.workload_name(job)
    # Another job of the same name (a new uid) gets another Workload.
    other = job.model_copy(
        update={"metadata": job.metadata.model_copy(update={"uid": "uid-other"})}
    )
    again = hashlib.sha1(b"DDPJob\nddpjob.io\ndemo\nuid-other", usedforsecurity=False)
    assert workload.workload_name(other) == "ddpjob-demo-" + again.hexdigest()[:5]


def test_queue_name_is_the_jobs_label() -> None:
    assert workload.queue_name(make_job()) == LOCAL_QUEUE
    assert workload.queue_name(parse_job(manifest())) is None


# ---- build_workload ------------------------------------------------------------------------------


def test_the_first_slice_is_the_jobs_pods_in_its_queue_owned_and_held_by_kueues_finalizer() -> None:
    job = make_job()
    body = workload.build_workload(job, "ddpjob-demo-b0732", 2, Priority())
    template = body["spec"]["podSets"][0]["template"]
    assert body == {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "name": "ddpjob-demo-b0732",
            "namespace": "ml",
            "labels": {"kueue.x-k8s.io/job-uid": "uid-demo"},
            "annotations": {
                "kueue.x-k8s.io/elastic-job": "true",
                "kueue.x-k8s.io/workload-slice-name": "ddpjob-demo-b0732",
                "ddpjob.io/suspended": "false",
                "ddpjob.io/template-hash": workload.template_hash(job),
            },
            "finalizers": ["kueue.x-k8s.io/resource-in-use"],
            "ownerReferences": [
                {
                    "apiVersion": "ddpjob.io/v1alpha1",
                    "kind": "DDPJob",
                    "name": "demo",
                    "uid": "uid-demo",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "queueName": LOCAL_QUEUE,
            "active": True,
            "priority": 0,
            "podSets": [{"name": "main", "count": 2, "template": template}],
        },
    }
    # The template is the pod ddpjob will create: the quota is its requests times the count.
    assert template == {
        "metadata": {"labels": builders.labels(job, 0), "annotations": {}},
        "spec": builders.build_pod(job, 0)["spec"],
    }
    assert template["spec"]["containers"][0]["resources"] == RESOURCES
    assert "nodeSelector" not in template["spec"]
    # No minCount: Kueue's webhook refuses it next to the elastic annotation.
    assert "minCount" not in body["spec"]["podSets"][0]
    assert "priorityClassRef" not in body["spec"]


def test_a_workload_carries_the_priority_and_its_class_only_when_there_is_one() -> None:
    job = make_job()
    ref = {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"}
    spec = workload.build_workload(job, "w", 3, Priority(1000, ref))["spec"]
    assert (spec["priority"], spec["priorityClassRef"]) == (1000, ref)
    assert spec["podSets"][0]["count"] == 3
    plain = workload.build_workload(job, "w", 3, Priority(7))["spec"]
    assert plain["priority"] == 7
    assert "priorityClassRef" not in plain


def test_a_suspended_job_gets_an_inactive_workload() -> None:
    body = workload.build_workload(make_job(suspend=True), "w", 2, Priority())
    assert body["spec"]["active"] is False
    assert body["metadata"]["annotations"]["ddpjob.io/suspended"] == "true"


def test_a_replacement_slice_names_the_slice_it_replaces_and_keeps_the_origin_name() -> None:
    job = make_job(replicas=3)
    # The admitted slice is itself a replacement of the first one: the origin is carried on.
    old = admitted(
        job,
        "ddpjob-demo-2nd00",
        annotations={workload.SLICE_NAME_ANNOTATION: "ddpjob-demo-first"},
    )
    body = workload.build_workload(job, "ddpjob-demo-3rd00", 3, Priority(), replaces=old)
    assert body["metadata"]["name"] == "ddpjob-demo-3rd00"
    assert body["metadata"]["annotations"] == {
        "kueue.x-k8s.io/elastic-job": "true",
        "kueue.x-k8s.io/workload-slice-name": "ddpjob-demo-first",
        "ddpjob.io/suspended": "false",
        "ddpjob.io/template-hash": workload.template_hash(job),
        "kueue.x-k8s.io/workload-slice-replacement-for": "ml/ddpjob-demo-2nd00",
    }
    assert body["spec"]["podSets"][0]["count"] == 3
    assert Slice.of(body).replaces == "ddpjob-demo-2nd00"
    # The same queue: Kueue reuses the old slice's usage only within its ClusterQueue.
    assert body["spec"]["queueName"] == LOCAL_QUEUE


def test_a_slice_reads_what_kueue_wrote() -> None:
    job = make_job()
    wl = admitted(job, "w", count=3, admitted_count=3, flavors={"cpu": "f2", "gpu": "f1"})
    assert (wl.name, wl.uid, wl.resource_version, wl.generation) == ("w", "uid-w", "100", 5)
    assert (wl.count, wl.admitted_count, wl.flavors, wl.cluster_queue) == (3, 3, ("f1", "f2"), "cq")
    assert (wl.reserved, wl.admitted, wl.finished, wl.evicted, wl.active) == (
        True,
        True,
        False,
        None,
        True,
    )
    assert (wl.queue, wl.finalizers, wl.deleting, wl.replaces) == (
        LOCAL_QUEUE,
        (workload.FINALIZER,),
        False,
        None,
    )
    # A scale down lowered the spec count below the admitted one: the lower one counts.
    assert admitted(job, "w", count=1, admitted_count=3).admitted_count == 1
    # Reserved without Admitted (admission checks pending) is not admitted.
    checks = stored(job, "w", conditions=[RESERVED], admission=assigned())
    assert (checks.reserved, checks.admitted) == (True, False)
    # QuotaReserved True without status.admission is not a reservation.
    assert stored(job, "w", conditions=[RESERVED, ADMITTED]).reserved is False


# ---- plan: waiting in line -----------------------------------------------------------------------


def test_a_job_without_a_workload_creates_one_for_its_desired_pods_and_waits() -> None:
    job = make_job(replicas=3)
    name = workload.workload_name(job)
    result = planned(job, desired=3)
    assert result == Plan(
        Admission(0, None, False, "Queued", f"Workload {name} created in LocalQueue team-a"),
        (CreateWorkload(workload.build_workload(job, name, 3, Priority())),),
    )
    action = result.actions[0]
    assert isinstance(action, CreateWorkload)
    assert action.body["metadata"]["name"] == "ddpjob-demo-b0732"
    assert action.body["spec"]["podSets"][0]["count"] == 3


def test_the_workload_is_created_with_the_priority_it_is_given() -> None:
    job = make_job()
    ref = {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "research"}
    (action,) = planned(job, priority=Priority(50, ref)).actions
    assert isinstance(action, CreateWorkload)
    assert (action.body["spec"]["priority"], action.body["spec"]["priorityClassRef"]) == (50, ref)


def test_a_pending_workload_makes_the_job_wait_with_kueues_reason() -> None:
    job = make_job()
    wl = pending(job)
    assert planned(job, wl, pods=[pod(0)]) == Plan(
        Admission(
            0,
            None,
            False,
            "Queued",
            f"Workload ddpjob-demo-b0732 waits in LocalQueue team-a: {PENDING_MESSAGE}",
        ),
        (),
    )


def test_a_pending_workload_gets_the_new_count_with_its_pod_sets_as_read() -> None:
    job = make_job(replicas=3)
    wl = pending(job, count=2, rv="417")
    before = copy.deepcopy(wl.pod_sets)
    result = planned(job, wl, desired=3)
    assert result.actions == (count_patch(wl, 3),)
    (action,) = result.actions
    assert isinstance(action, PatchWorkload)
    assert action.status is False
    assert action.patch["metadata"] == {"resourceVersion": "417"}
    (pod_set,) = action.patch["spec"]["podSets"]
    assert pod_set["count"] == 3
    assert pod_set["template"]["spec"]["containers"][0]["resources"] == RESOURCES
    assert result.admission.count == 0
    assert result.admission.reason == "Queued"
    # The slice as read is left alone.
    assert wl.pod_sets == before
    assert wl.count == 2


def test_an_inactive_workload_says_so_and_is_not_reactivated() -> None:
    """Kueue deactivated it (its requeuing limit, say) while the job is not suspended: the
    job waits, and ddpjob does not turn it on again (spec.active follows edges of suspend)."""
    job = make_job()
    wl = pending(job, active=False)
    assert planned(job, wl) == Plan(
        Admission(
            0,
            None,
            False,
            "Inactive",
            "Workload ddpjob-demo-b0732 is inactive (spec.active is false)",
        ),
        (),
    )


def test_of_two_pending_workloads_one_waits_and_the_other_is_finished() -> None:
    job = make_job()
    first = pending(job, "ddpjob-demo-aaaaa")
    second = pending(job, "ddpjob-demo-bbbbb", rv="7")
    result = planned(job, first, second)
    assert [canonical(a) for a in result.actions] == [
        canonical(finished(second, "OutOfSync", "one slice waits in line at a time"))
    ]
    assert result.admission.reason == "Queued"
    assert result.admission.message.startswith("Workload ddpjob-demo-aaaaa waits")


def test_a_workload_being_deleted_is_released_and_replaced_once_it_is_gone() -> None:
    job = make_job()
    wl = admitted(job, deleting=True)
    message = "Workload ddpjob-demo-b0732 is being deleted; a new one is made once it is gone"
    # Its pods still run: they go first (count 0), the finalizer stays.
    assert planned(job, wl, pods=[pod(0), pod(1)]) == Plan(
        Admission(0, None, False, "WorkloadDeleted", message), ()
    )
    # None holds resources: the finalizer goes; nothing new until the Workload is gone.
    assert planned(job, wl, pods=[pod(0, PodPhase.FAILED)]) == Plan(
        Admission(0, None, False, "WorkloadDeleted", message),
        (ReleaseWorkload("ddpjob-demo-b0732", "uid-ddpjob-demo-b0732", (workload.FINALIZER,)),),
    )


def test_a_template_changed_while_suspended_reaches_the_pending_workload() -> None:
    old = make_job(suspend=True)
    wl = pending(old, active=False, annotations={workload.SUSPENDED_ANNOTATION: "true"})
    document = kueue_manifest()
    bigger = {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"nvidia.com/gpu": "2"}}
    document["spec"]["template"]["spec"]["containers"][0]["resources"] = bigger
    resumed = parse_job(document)
    templates = [
        a.patch["spec"]["podSets"][0]["template"]
        for a in planned(resumed, wl).actions
        if isinstance(a, PatchWorkload) and "podSets" in a.patch.get("spec", {})
    ]
    assert [t["spec"]["containers"][0]["resources"] for t in templates] == [bigger]


def test_a_new_queue_name_reaches_the_workload_that_waits() -> None:
    wl = pending(make_job(), rv="12")
    document = kueue_manifest()
    document["metadata"]["labels"] = {workload.QUEUE_LABEL: "team-b"}
    moved = parse_job(document)
    result = planned(moved, wl)
    queues = [
        a.patch["spec"]["queueName"]
        for a in result.actions
        if isinstance(a, PatchWorkload) and "queueName" in a.patch.get("spec", {})
    ]
    assert queues == ["team-b"]


# ---- plan: admitted ------------------------------------------------------------------------------


def test_an_admitted_workload_lets_the_job_run_on_its_flavor() -> None:
    job = make_job()
    wl = admitted(job)
    assert planned(job, wl) == Plan(
        Admission(
            2,
            kueue_placement(wl, {"pool": "a100"}, GPU_TOLERATION),
            True,
            "Admitted",
            "admitted by ClusterQueue cq (flavors: f1) for 2 pods",
        ),
        (),
    )


def test_the_job_runs_at_most_its_desired_size_and_at_most_the_admitted_one() -> None:
    job = make_job()
    wl = admitted(job, count=2)
    # A scale down to 1 whose surplus pod 1 still runs: the job runs 1, no patch yet.
    assert planned(job, wl, pods=[pod(0), pod(1)], desired=1).admission.count == 1
    # A scale up beyond the admitted size: the job keeps its admitted 2.
    assert planned(job, wl, desired=4).admission.count == 2


def test_the_flavors_node_labels_and_tolerations_merge_without_duplicates() -> None:
    job = make_job()
    wl = admitted(job, flavors={"cpu": "f1", "nvidia.com/gpu": "f2"})
    result = planned(job, wl)
    assert result.admission.placement == kueue_placement(
        wl, {"pool": "a100", "zone": "z1"}, GPU_TOLERATION, SPOT_TOLERATION
    )
    assert result.admission.message == "admitted by ClusterQueue cq (flavors: f1, f2) for 2 pods"


def test_a_cluster_queue_name_that_is_no_label_value_is_left_out() -> None:
    job = make_job()
    wl = stored(
        job,
        "w",
        conditions=[RESERVED, ADMITTED],
        admission=assigned(2, {"cpu": "f1"}, cq="c" * 64),
    )
    placed = planned(job, wl).admission.placement
    assert placed is not None
    assert placed.labels == {
        "kueue.x-k8s.io/podset": "main",
        "kueue.x-k8s.io/local-queue-name": LOCAL_QUEUE,
    }


def test_a_flavor_that_cannot_be_read_holds_back_new_pods() -> None:
    job = make_job()
    wl = admitted(job)
    result = planned(job, wl, flavors={})
    assert result == Plan(
        Admission(
            2,
            None,
            True,
            "Admitted",
            "admitted by ClusterQueue cq (flavors: f1) for 2 pods; waiting to read its "
            "ResourceFlavors",
        ),
        (),
    )
    # The reconciler keeps the pods it has and creates none.
    decision = reconcile(job, Observed((pod(0),), True, queue=result.admission), T0)
    assert [a for a in decision.actions if isinstance(a, CreatePod)] == []
    assert [a for a in decision.actions if isinstance(a, DeletePod)] == []
    (condition,) = [c for c in decision.status.conditions if c.type == "Admitted"]
    assert (condition.status, condition.reason) == ("True", "Admitted")


def test_quota_reserved_without_admitted_waits_for_the_admission_checks() -> None:
    job = make_job()
    checks = cond("Admitted", False, "UnsatisfiedChecks", "The workload has not all checks ready")
    wl = stored(job, "w", conditions=[RESERVED, checks], admission=assigned())
    assert planned(job, wl) == Plan(
        Admission(0, None, False, "AdmissionChecks", "The workload has not all checks ready"), ()
    )


# ---- plan: scale up and down ---------------------------------------------------------------------


def test_a_scale_up_asks_for_a_replacement_slice_of_the_full_size_and_keeps_running() -> None:
    job = make_job(replicas=3)
    head = admitted(job, extra=[READY])
    result = planned(job, head, pods=[pod(0), pod(1)], desired=3)
    name = workload.workload_name(job, "3-1")  # the job's generation, the slices it has
    assert result.actions == (
        CreateWorkload(workload.build_workload(job, name, 3, Priority(), head)),
    )
    (action,) = result.actions
    assert isinstance(action, CreateWorkload)
    assert action.body["metadata"]["name"] == name
    assert action.body["spec"]["podSets"][0]["count"] == 3
    assert action.body["metadata"]["annotations"][workload.REPLACEMENT_ANNOTATION] == (
        "ml/ddpjob-demo-b0732"
    )
    assert action.body["metadata"]["annotations"][workload.SLICE_NAME_ANNOTATION] == (
        "ddpjob-demo-b0732"
    )
    assert result.admission == Admission(
        2,
        kueue_placement(head, {"pool": "a100"}, GPU_TOLERATION),
        True,
        "Admitted",
        "admitted by ClusterQueue cq (flavors: f1) for 2 pods; asking Kueue for 3",
    )


def test_a_scale_up_resizes_the_replacement_that_waits_instead_of_making_another() -> None:
    job = make_job(replicas=3)
    head = admitted(job)
    asked = pending(job, "ddpjob-demo-r3p1c", count=4, rv="55", replaces=head)
    result = planned(job, head, asked, desired=3)
    assert result.actions == (count_patch(asked, 3),)
    assert result.admission.count == 2
    assert result.admission.message == (
        f"admitted by ClusterQueue cq (flavors: f1) for 2 pods; asking Kueue for 3: "
        f"{PENDING_MESSAGE}"
    )
    # At the right size already: nothing to write.
    same = pending(job, "ddpjob-demo-r3p1c", count=3, replaces=head)
    assert planned(job, head, same, desired=3).actions == ()


def test_a_scale_back_to_the_admitted_size_resizes_the_replacement_that_waits() -> None:
    """Never finished: Kueue's scheduler admits without a resourceVersion and may be admitting it
    right now (a Finished and admitted replacement would leave the job no slice at all)."""
    job = make_job()
    head = admitted(job)
    asked = pending(job, "ddpjob-demo-r3p1c", count=3, replaces=head)
    result = planned(job, head, asked, desired=2)
    assert result.actions == (count_patch(asked, 2),)
    assert result.admission.count == 2
    assert result.admission.message == "admitted by ClusterQueue cq (flavors: f1) for 2 pods"


def test_an_admitted_replacement_is_the_head_and_its_predecessor_is_finished() -> None:
    job = make_job(replicas=3)
    old = admitted(job)
    new = admitted(job, "ddpjob-demo-r3p1c", count=3, flavors={"cpu": "f2"}, replaces=old, rv="300")
    result = planned(job, old, new, desired=3)
    assert [canonical(a) for a in result.actions] == [
        canonical(finished(old, "OutOfSync", "a newer slice replaced it"))
    ]
    assert result.admission == Admission(
        3,
        kueue_placement(new, {"zone": "z1"}, GPU_TOLERATION, SPOT_TOLERATION),
        True,
        "Admitted",
        "admitted by ClusterQueue cq (flavors: f2) for 3 pods",
    )


def test_a_scale_down_lowers_the_count_only_once_the_surplus_pods_hold_nothing() -> None:
    job = make_job(replicas=2)
    head = admitted(job, count=3, rv="900", extra=[READY])
    # Pod 2 still runs, then is being deleted but still running: the quota stays.
    for surplus in (pod(2), pod(2, deleting=True), pod(2, PodPhase.FAILED, sidecars_running=True)):
        result = planned(job, head, pods=[pod(0), pod(1), surplus], desired=2)
        assert result.actions == (), surplus
        assert result.admission.count == 2
    # Gone, or ended: the count goes down to 2 (pods 0 and 1 keep running).
    for left in ([pod(0), pod(1)], [pod(0), pod(1), pod(2, PodPhase.FAILED, deleting=True)]):
        result = planned(job, head, pods=left, desired=2)
        assert result.actions == (count_patch(head, 2),)
        assert result.admission.count == 2
    # Once lowered (the admission keeps its 3), nothing more is written.
    lowered = admitted(job, count=2, admitted_count=3, rv="901", extra=[READY])
    result = planned(job, lowered, pods=[pod(0), pod(1)], desired=2)
    assert result.actions == ()
    assert result.admission.count == 2
    assert result.admission.message == "admitted by ClusterQueue cq (flavors: f1) for 2 pods"


def test_a_scale_down_resizes_a_replacement_that_waits() -> None:
    job = make_job(replicas=1)
    head = admitted(job)
    asked = pending(job, "ddpjob-demo-r3p1c", count=3, replaces=head)
    result = planned(job, head, asked, pods=[pod(0)], desired=1)
    assert result.actions == (count_patch(head, 1), count_patch(asked, 1))


# ---- plan: eviction ------------------------------------------------------------------------------


def test_an_evicted_job_runs_nothing_and_keeps_the_reservation_while_pods_hold_resources() -> None:
    job = make_job()
    wl = admitted(job, extra=[PREEMPTED])
    for pods in (
        [pod(0), pod(1)],
        [pod(0, deleting=True)],
        [pod(1, PodPhase.FAILED, sidecars_running=True)],
    ):
        assert planned(job, wl, pods=pods) == Plan(
            Admission(
                0, None, False, "Preempted", f"evicted by Kueue (Preempted): {PREEMPTED_MESSAGE}"
            ),
            (),
        ), pods


def test_once_no_pod_holds_resources_the_reservation_is_cleared_and_the_job_requeued() -> None:
    job = make_job()
    wl = admitted(job, extra=[PREEMPTED], rv="4242")
    result = planned(job, wl, pods=[pod(0, PodPhase.FAILED), pod(1, PodPhase.SUCCEEDED)])
    assert result.admission == Admission(
        0, None, False, "Preempted", f"evicted by Kueue (Preempted): {PREEMPTED_MESSAGE}"
    )
    expected = PatchWorkload(
        "ddpjob-demo-b0732",
        {
            "metadata": {"resourceVersion": "4242"},
            "status": {
                "admission": None,
                "conditions": [
                    PREEMPTED,  # left as it is: the scheduler flips it on the next reservation
                    cond("Requeued", True, "Preempted", PREEMPTED_MESSAGE, since=STAMP),
                    cond("QuotaReserved", False, "Pending", PREEMPTED_MESSAGE, since=STAMP),
                    cond(
                        "Admitted",
                        False,
                        "NoReservation",
                        "The workload has no reservation",
                        since=STAMP,
                    ),
                ],
            },
        },
        True,
    )
    assert [canonical(a) for a in result.actions] == [canonical(expected)]
    (action,) = result.actions
    assert isinstance(action, PatchWorkload)
    assert "admission" in action.patch["status"]
    assert action.patch["status"]["admission"] is None
    # The same with no pod at all.
    assert planned(job, wl).actions == result.actions


def test_a_deactivated_workload_is_not_requeued_by_ddpjob() -> None:
    """Requeued False: Kueue flips it itself when the Workload is active again."""
    job = make_job()
    deactivated = cond("Evicted", True, "Deactivated", "The workload is deactivated")
    wl = admitted(job, extra=[deactivated], active=False)
    result = planned(job, wl)
    assert result.admission == Admission(
        0, None, False, "Deactivated", "evicted by Kueue (Deactivated): The workload is deactivated"
    )
    (action,) = result.actions
    assert isinstance(action, PatchWorkload) and action.status
    conditions = {c["type"]: c for c in action.patch["status"]["conditions"]}
    assert conditions["Requeued"] == cond(
        "Requeued", False, "Deactivated", "The workload is deactivated", since=STAMP
    )
    assert conditions["QuotaReserved"]["status"] == "False"
    assert conditions["Admitted"]["status"] == "False"
    assert action.patch["status"]["admission"] is None


def test_a_node_failure_requeues_and_a_known_requeued_condition_keeps_its_time() -> None:
    job = make_job()
    evicted = cond("Evicted", True, "NodeFailures", "node n1 failed")
    before = cond("Requeued", True, "Preempted", "earlier")
    wl = admitted(job, extra=[before, evicted])
    (action,) = planned(job, wl).actions
    assert isinstance(action, PatchWorkload)
    conditions = {c["type"]: c for c in action.patch["status"]["conditions"]}
    assert conditions["Requeued"] == cond("Requeued", True, "NodeFailures", "node n1 failed")


def test_an_eviction_finishes_the_replacement_that_waits() -> None:
    job = make_job(replicas=3)
    head = admitted(job, extra=[PREEMPTED])
    asked = pending(job, "ddpjob-demo-r3p1c", count=3, replaces=head)
    result = planned(job, head, asked, pods=[pod(0)], desired=3)
    assert [canonical(a) for a in result.actions] == [
        canonical(finished(asked, "OutOfSync", "its slice was evicted"))
    ]
    assert result.admission.count == 0


def test_a_cleared_reservation_waits_in_line_again() -> None:
    job = make_job()
    cleared = stored(
        job,
        workload.workload_name(job),
        conditions=[
            PREEMPTED,
            cond("Requeued", True, "Preempted", PREEMPTED_MESSAGE),
            cond("QuotaReserved", False, "Pending", PREEMPTED_MESSAGE),
            cond("Admitted", False, "NoReservation", "The workload has no reservation"),
        ],
    )
    assert planned(job, cleared) == Plan(
        Admission(
            0,
            None,
            False,
            "Queued",
            f"Workload ddpjob-demo-b0732 waits in LocalQueue team-a: {PREEMPTED_MESSAGE}",
        ),
        (),
    )


# ---- plan: the end -------------------------------------------------------------------------------


def succeeded_job() -> api.DDPJob:
    status = api.DDPJobStatus(
        phase=api.JobPhase.SUCCEEDED,
        conditions=[
            api.Condition(
                type="Succeeded",
                status="True",
                reason="Succeeded",
                message="every pod of the job terminated successfully",
                last_transition_time=T0,
            )
        ],
    )
    return make_job(status)


def test_a_finished_job_finishes_its_workload_once_no_pod_holds_resources() -> None:
    job = succeeded_job()
    wl = admitted(job, rv="77")
    done = Admission(0, None, False, "Finished", "")
    assert planned(job, wl, pods=[pod(0, PodPhase.SUCCEEDED, sidecars_running=True)]) == Plan(
        done, ()
    )
    assert planned(job, wl, pods=[pod(1)]) == Plan(done, ())
    result = planned(job, wl, pods=[pod(0, PodPhase.SUCCEEDED), pod(1, PodPhase.SUCCEEDED)])
    assert result.admission == done
    assert [canonical(a) for a in result.actions] == [
        canonical(finished(wl, "Succeeded", "every pod of the job terminated successfully"))
    ]


def test_a_finished_workload_loses_kueues_finalizer() -> None:
    job = succeeded_job()
    done = cond("Finished", True, "Succeeded", "every pod of the job terminated successfully")
    wl = admitted(job, extra=[done])
    assert planned(job, wl) == Plan(
        Admission(0, None, False, "Finished", ""),
        (ReleaseWorkload("ddpjob-demo-b0732", "uid-ddpjob-demo-b0732", (workload.FINALIZER,)),),
    )
    # Released already: nothing left to do.
    assert planned(job, admitted(job, extra=[done], finalizers=())).actions == ()


def test_a_failed_job_without_a_message_says_it_failed() -> None:
    job = make_job(api.DDPJobStatus(phase=api.JobPhase.FAILED))
    wl = admitted(job)
    assert [canonical(a) for a in planned(job, wl).actions] == [
        canonical(finished(wl, "Failed", "the DDPJob failed"))
    ]


def deleted_job(phase: api.JobPhase = api.JobPhase.RUNNING) -> api.DDPJob:
    job = make_job(api.DDPJobStatus(phase=phase))
    return job.model_copy(
        update={"metadata": job.metadata.model_copy(update={"deletion_timestamp": T0})}
    )


def test_a_deleted_job_finishes_its_workload_as_owner_not_found_once_its_pods_are_gone() -> None:
    job = deleted_job()
    wl = admitted(job)
    gone = Admission(0, None, False, "Finished", "")
    assert planned(job, wl, pods=[pod(0)]) == Plan(gone, ())
    result = planned(job, wl)
    assert result.admission == gone
    (action,) = result.actions
    assert isinstance(action, PatchWorkload) and action.status
    (new,) = [c for c in action.patch["status"]["conditions"] if c["type"] == "Finished"]
    assert (new["status"], new["reason"]) == ("True", "OwnerNotFound")


def test_a_deleted_jobs_workload_says_its_owner_no_longer_exists() -> None:
    job = deleted_job()
    wl = admitted(job)
    assert [canonical(a) for a in planned(job, wl).actions] == [
        canonical(finished(wl, "OwnerNotFound", "The workload's owner no longer exists"))
    ]


def test_a_replaced_slice_loses_its_finalizer_while_the_job_runs() -> None:
    job = make_job(replicas=3)
    replaced = cond("Finished", True, "WorkloadSliceReplaced", "Replaced to accommodate ...")
    old = admitted(job, extra=[replaced])
    new = admitted(job, "ddpjob-demo-r3p1c", count=3, replaces=old)
    result = planned(job, old, new, desired=3)
    assert result.actions == (
        ReleaseWorkload("ddpjob-demo-b0732", "uid-ddpjob-demo-b0732", (workload.FINALIZER,)),
    )
    assert result.admission.count == 3


# ---- plan: suspend -------------------------------------------------------------------------------


def suspend_patch(wl: Slice, suspend: bool) -> PatchWorkload:
    flag = "true" if suspend else "false"
    return PatchWorkload(
        wl.name,
        {
            "metadata": {
                "resourceVersion": wl.resource_version,
                "annotations": {"ddpjob.io/suspended": flag},
            },
            "spec": {"active": not suspend},
        },
    )


def test_suspending_a_job_deactivates_its_admitted_workload() -> None:
    job = make_job(suspend=True)
    wl = admitted(job, annotations={workload.SUSPENDED_ANNOTATION: "false"}, rv="31")
    result = planned(job, wl)
    assert result.actions == (suspend_patch(wl, True),)
    assert result.actions[0] == PatchWorkload(
        "ddpjob-demo-b0732",
        {
            "metadata": {"resourceVersion": "31", "annotations": {"ddpjob.io/suspended": "true"}},
            "spec": {"active": False},
        },
    )


def test_suspend_is_copied_once_per_change() -> None:
    # Suspended and inactive already: nothing to write, however often it is planned.
    job = make_job(suspend=True)
    wl = admitted(job, active=False, annotations={workload.SUSPENDED_ANNOTATION: "true"})
    assert planned(job, wl).actions == ()
    # A pending one too.
    assert planned(job, pending(job, active=False)).actions == ()


def test_resuming_a_job_reactivates_its_pending_workload() -> None:
    job = make_job()
    wl = pending(job, active=False, annotations={workload.SUSPENDED_ANNOTATION: "true"}, rv="8")
    result = planned(job, wl)
    assert result.actions == (suspend_patch(wl, False),)
    # As read it is still inactive: the job waits for the patch to land.
    assert result.admission.reason == "Inactive"


def test_suspending_a_job_whose_workload_waits_deactivates_it() -> None:
    job = make_job(suspend=True)
    wl = pending(job, annotations={workload.SUSPENDED_ANNOTATION: "false"})
    assert planned(job, wl).actions == (suspend_patch(wl, True),)


# ---- the reconciler obeys the admission ----------------------------------------------------------


def queued_admission() -> Admission:
    return Admission(
        0, None, False, "Preempted", f"evicted by Kueue (Preempted): {PREEMPTED_MESSAGE}"
    )


def run(job: api.DDPJob, admission: Admission | None, *pods: ObservedPod) -> Decision:
    return reconcile(job, Observed(tuple(pods), True, queue=admission), T0)


def test_a_job_kueue_does_not_admit_deletes_its_pods_uncharged_and_is_queued() -> None:
    status = api.DDPJobStatus(phase=api.JobPhase.RUNNING, backoff_count=1, restarts=2)
    job = make_job(status)
    admission = queued_admission()
    decision = run(job, admission, pod(0), pod(1))
    assert decision.actions == (
        DeletePod("demo-worker-1", "uid-1", 1, DeleteWhy.QUEUE),
        DeletePod("demo-worker-0", "uid-0", 0, DeleteWhy.QUEUE),
        RemoveFinalizer("demo-worker-0", "uid-0", 0),
        RemoveFinalizer("demo-worker-1", "uid-1", 1),
    )
    assert decision.status.phase is api.JobPhase.QUEUED
    assert (decision.status.backoff_count, decision.status.restarts) == (1, 2)
    assert decision.status.failures == []
    assert decision.status.accounted_pods == ["uid-0", "uid-1"]
    conditions = {c.type: c for c in decision.status.conditions}
    admitted_condition = conditions["Admitted"]
    assert (admitted_condition.status, admitted_condition.reason, admitted_condition.message) == (
        "False",
        "Preempted",
        admission.message,
    )
    assert (conditions["Running"].status, conditions["Running"].reason) == ("False", "Preempted")
    assert decision.events == (
        Event("Normal", "Preempted", f"{admission.message}; deleting its pods until admitted"),
    )
    # The next pass sees them go (killed, being deleted): still nothing charged.
    later = job.model_copy(update={"status": decision.status})
    going = [
        pod(i, PodPhase.FAILED, deleting=True, exit_code=143, deletion_timestamp=T0) for i in (0, 1)
    ]
    again = run(later, admission, *going)
    assert (again.status.backoff_count, again.status.restarts) == (1, 2)
    assert again.status.failures == []
    assert [a for a in again.actions if isinstance(a, (DeletePod, CreatePod))] == []
    assert again.events == ()


def test_a_job_that_waits_in_line_makes_no_pod() -> None:
    job = make_job()
    admission = Admission(0, None, False, "Queued", "Workload w waits in LocalQueue team-a")
    decision = run(job, admission)
    assert decision.actions == ()
    assert decision.status.phase is api.JobPhase.QUEUED
    assert decision.events == (
        Event(
            "Normal",
            "Queued",
            "Workload w waits in LocalQueue team-a; no pod is made until admitted",
        ),
    )


def placed_job() -> api.DDPJob:
    document = kueue_manifest()
    template = document["spec"]["template"]
    template["metadata"] = {"annotations": {"team": "vision"}}
    template["spec"]["nodeSelector"] = {"disk": "ssd"}
    template["spec"]["tolerations"] = [GPU_TOLERATION]
    queued = api.DDPJobStatus(phase=api.JobPhase.QUEUED)
    return parse_job(document).model_copy(update={"status": queued})


def test_an_admitted_job_creates_its_pods_where_kueue_put_its_quota() -> None:
    job = placed_job()
    placement = Placement(
        {"a": "b"},
        (GPU_TOLERATION, SPOT_TOLERATION),
        {"kueue.x-k8s.io/podset": "main", "kueue.x-k8s.io/local-queue-name": LOCAL_QUEUE},
        {"kueue.x-k8s.io/workload": "ddpjob-demo-b0732"},
    )
    message = "admitted by ClusterQueue cq (flavors: f1) for 2 pods"
    decision = run(job, Admission(2, placement, True, "Admitted", message))
    creates = [a for a in decision.actions if isinstance(a, CreatePod)]
    assert [a.index for a in creates] == [0, 1]
    for action in creates:
        assert action.pod == builders.build_pod(job, action.index, placement=placement)
        spec, meta = action.pod["spec"], action.pod["metadata"]
        assert spec["nodeSelector"] == {"disk": "ssd", "a": "b"}
        assert spec["tolerations"] == [
            GPU_TOLERATION,
            lost_node(NOT_READY),
            lost_node(UNREACHABLE),
            SPOT_TOLERATION,
        ]
        assert meta["labels"] == {
            "kueue.x-k8s.io/podset": "main",
            "kueue.x-k8s.io/local-queue-name": LOCAL_QUEUE,
            **builders.labels(job, action.index),
        }
        assert meta["annotations"] == {
            "team": "vision",
            "kueue.x-k8s.io/workload": "ddpjob-demo-b0732",
        }
        # Never the queue-name label: Kueue's pod webhook would take the pod for its own.
        assert workload.QUEUE_LABEL not in meta["labels"]
    assert decision.status.phase is api.JobPhase.PENDING
    assert decision.events == (
        Event("Normal", "Admitted", message),
        Event("Normal", "CreatedPods", "created demo-worker-0, demo-worker-1"),
    )
    (condition,) = [c for c in decision.status.conditions if c.type == "Admitted"]
    assert (condition.status, condition.reason, condition.message) == ("True", "Admitted", message)


def test_an_admitted_job_creates_no_more_pods_than_kueue_admitted() -> None:
    job = make_job(replicas=3)
    decision = run(job, Admission(2, Placement(), True, "Admitted", "m"))
    assert [a.index for a in decision.actions if isinstance(a, CreatePod)] == [0, 1]
    # Admitted at 1 (a scale down was patched): the surplus pod goes as a scale down.
    decision = run(make_job(), Admission(1, Placement(), True, "Admitted", "m"), pod(0), pod(1))
    assert [a for a in decision.actions if isinstance(a, DeletePod)] == [
        DeletePod("demo-worker-1", "uid-1", 1, DeleteWhy.SCALE_DOWN)
    ]


def test_a_job_without_a_queue_gets_no_admitted_condition() -> None:
    decision = reconcile(parse_job(manifest()), Observed((), True), T0)
    assert [c for c in decision.status.conditions if c.type == "Admitted"] == []
    assert len([a for a in decision.actions if isinstance(a, CreatePod)]) == 2


def test_a_job_whose_queue_label_was_removed_loses_its_admitted_condition() -> None:
    job = make_job()
    admitted_run = run(job, Admission(2, Placement(), True, "Admitted", "m"), pod(0), pod(1))
    assert "Admitted" in {c.type for c in admitted_run.status.conditions}
    left = job.model_copy(update={"status": admitted_run.status})
    decision = run(left, None, pod(0), pod(1))
    assert "Admitted" not in {c.type for c in decision.status.conditions}
    assert decision.status.phase is api.JobPhase.RUNNING
    assert not [a for a in decision.actions if isinstance(a, DeletePod)]
    # Suspended after it left Kueue: no Admitted condition either.
    suspended = make_job(admitted_run.status, suspend=True)
    decision = run(suspended, None, pod(0), pod(1))
    assert decision.status.phase is api.JobPhase.SUSPENDED
    assert "Admitted" not in {c.type for c in decision.status.conditions}
    # A suspended Kueue job keeps it.
    kept = run(suspended, queued_admission(), pod(0), pod(1))
    assert "Admitted" in {c.type for c in kept.status.conditions}


def test_plan_and_reconcile_from_creation_to_running() -> None:
    """The Workload is created, waits, is admitted: only then are pods made, on its flavor."""
    job = make_job()
    first = planned(job)
    (create,) = first.actions
    assert isinstance(create, CreateWorkload)
    waiting = run(job, first.admission)
    assert waiting.actions == ()
    assert waiting.status.phase is api.JobPhase.QUEUED
    # Kueue admits what ddpjob created.
    body = copy.deepcopy(create.body)
    body["metadata"].update(uid="uid-wl", resourceVersion="1", generation=GENERATION)
    body["status"] = {"conditions": [RESERVED, ADMITTED], "admission": assigned()}
    then = planned(job, Slice.of(body))
    assert then.actions == ()
    job = job.model_copy(update={"status": waiting.status})
    running = run(job, then.admission)
    pods = [a.pod for a in running.actions if isinstance(a, CreatePod)]
    assert [p["spec"]["nodeSelector"] for p in pods] == [{"pool": "a100"}] * 2
    assert [p["metadata"]["annotations"] for p in pods] == [
        {"kueue.x-k8s.io/workload": "ddpjob-demo-b0732"}
    ] * 2
    assert running.status.phase is api.JobPhase.PENDING


# ---- build_pod with a placement ------------------------------------------------------------------


def test_a_flavors_node_label_wins_over_the_templates_entry_of_the_same_key() -> None:
    document = kueue_manifest()
    document["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "cpu", "disk": "ssd"}
    job = parse_job(document)
    placement = Placement({"pool": "a100"}, (), {}, {})
    pod_spec = builders.build_pod(job, 1, placement=placement)["spec"]
    assert pod_spec["nodeSelector"] == {"pool": "a100", "disk": "ssd"}
    # Without a placement the template's selector is the pod's, and no Kueue key appears.
    plain = builders.build_pod(job, 1)
    assert plain["spec"]["nodeSelector"] == {"pool": "cpu", "disk": "ssd"}
    assert "annotations" not in plain["metadata"]
    assert plain["metadata"]["labels"] == builders.labels(job, 1)


def test_an_empty_placement_changes_nothing_but_an_absent_selector_stays_absent() -> None:
    job = make_job()
    assert builders.build_pod(job, 0, placement=Placement()) == builders.build_pod(job, 0)
    placed = builders.build_pod(job, 0, placement=Placement({"pool": "a100"}))
    assert placed["spec"]["nodeSelector"] == {"pool": "a100"}


@pytest.mark.parametrize("index", [0, 3])
def test_kueues_labels_never_replace_the_jobs_own(index: int) -> None:
    job = make_job()
    placement = Placement(labels={api.LABEL_JOB: "other", "kueue.x-k8s.io/podset": "main"})
    labels = builders.build_pod(job, index, placement=placement)["metadata"]["labels"]
    assert labels == {"kueue.x-k8s.io/podset": "main", **builders.labels(job, index)}
    assert labels[api.LABEL_JOB] == "demo"


# ---- one spec patch per Workload and pass -------------------------------------------------------


def test_the_template_hash_follows_the_pod_template_and_nothing_else() -> None:
    job = make_job()
    assert workload.template_hash(job) == workload.template_hash(make_job())
    assert workload.template_hash(job) == workload.template_hash(make_job(replicas=3))
    document = kueue_manifest()
    document["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "8"}}
    assert workload.template_hash(parse_job(document)) != workload.template_hash(job)


def test_a_resumed_and_rescaled_job_sends_its_waiting_workload_one_patch() -> None:
    """Suspend flag, count and queue go in one patch: two on one resourceVersion would 409."""
    wl = pending(make_job(), rv="40", annotations={workload.SUSPENDED_ANNOTATION: "true"})
    document = kueue_manifest(replicas=3)
    document["metadata"]["labels"] = {workload.QUEUE_LABEL: "team-b"}
    job = parse_job(document)
    (action,) = planned(job, wl, desired=3).actions
    assert isinstance(action, PatchWorkload) and not action.status
    pod_sets = [dict(p) for p in wl.pod_sets]
    pod_sets[0]["count"] = 3
    assert action.patch == {
        "metadata": {
            "resourceVersion": "40",
            "annotations": {workload.SUSPENDED_ANNOTATION: "false"},
        },
        "spec": {"active": True, "queueName": "team-b", "podSets": pod_sets},
    }


def test_an_admitted_workload_is_never_sent_a_queue_or_template() -> None:
    """Both are immutable while the quota is reserved (CEL and Kueue's webhook)."""
    job = make_job()
    wl = admitted(job, annotations={workload.TEMPLATE_ANNOTATION: "stale"})
    document = kueue_manifest()
    document["metadata"]["labels"] = {workload.QUEUE_LABEL: "team-b"}
    assert planned(parse_job(document), wl).actions == ()


# ---- PodsReady (Kueue's waitForPodsReady) -------------------------------------------------------


def pods_ready(wl: Slice, status: bool, reason: str, message: str, since: str) -> PatchWorkload:
    new = {
        "type": "PodsReady",
        "status": "True" if status else "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": GENERATION,
    }
    conditions = [c for c in wl.conditions if c["type"] != "PodsReady"] + [new]
    patch = {
        "metadata": {"resourceVersion": wl.resource_version},
        "status": {"conditions": conditions},
    }
    return PatchWorkload(wl.name, patch, True)


ALL_READY = "All pods reached readiness and the workload is running"


def test_pods_ready_is_reported_once_every_admitted_pod_is_ready() -> None:
    job = make_job()
    wl = admitted(job, rv="70")
    # Still starting: nothing written (Kueue times the start from the admission).
    assert planned(job, wl, pods=[pod(0), pod(1, ready=False)]).actions == ()
    assert planned(job, wl, pods=[pod(0), pod(1)]).actions == (
        pods_ready(wl, True, "Started", ALL_READY, STAMP),
    )
    # A succeeded pod counts as ready; a pod being deleted does not.
    assert planned(job, wl, pods=[pod(0), pod(1, PodPhase.SUCCEEDED, ready=False)]).actions == (
        pods_ready(wl, True, "Started", ALL_READY, STAMP),
    )
    assert planned(job, wl, pods=[pod(0), pod(1, deleting=True)]).actions == ()


def test_pods_ready_goes_false_while_a_lost_pod_is_replaced_then_recovers() -> None:
    job = make_job()
    ready = admitted(job, rv="71", extra=[READY])
    assert planned(job, ready, pods=[pod(0), pod(1)]).actions == ()
    lost = planned(job, ready, pods=[pod(0)]).actions
    assert lost == (
        pods_ready(
            ready, False, "WaitForRecovery", "At least one pod has failed, waiting for recovery",
            STAMP,
        ),
    )  # fmt: skip
    waiting = admitted(
        job, rv="72", extra=[cond("PodsReady", False, "WaitForRecovery", "At least one ...")]
    )
    assert planned(job, waiting, pods=[pod(0), pod(1, ready=False)]).actions == ()
    assert planned(job, waiting, pods=[pod(0), pod(1)]).actions == (
        pods_ready(waiting, True, "Recovered", ALL_READY, STAMP),
    )


# ---- what the review of the integration found ---------------------------------------------------


def test_a_bigger_slice_that_waits_for_admission_checks_keeps_the_job_at_its_old_size() -> None:
    """Kueue finishes the old slice as soon as it reserves quota for the replacement, before
    the replacement's admission checks are ready: the job must not lose its pods meanwhile."""
    job = make_job(replicas=3)
    replaced = cond("Finished", True, "WorkloadSliceReplaced", "Replaced to accommodate ...")
    old = admitted(job, extra=[replaced])
    checks = cond("Admitted", False, "UnsatisfiedChecks", "The workload has not all checks ready")
    new = stored(
        job, "ddpjob-demo-r3p1c", 3, conditions=[RESERVED, checks], admission=assigned(3),
        replaces=old,
    )  # fmt: skip
    result = planned(job, old, new, pods=[pod(0), pod(1)], desired=3)
    assert result.admission == Admission(
        2,
        kueue_placement(old, {"pool": "a100"}, GPU_TOLERATION),
        True,
        "Admitted",
        "admitted for 2 pods; asking Kueue for 3: The workload has not all checks ready",
    )
    assert result.actions == (ReleaseWorkload(old.name, old.uid, (workload.FINALIZER,)),)


def test_admission_checks_pod_set_updates_reach_the_pods() -> None:
    job = make_job()
    wl = admitted(job)
    update = {
        "name": "main",
        "labels": {"autoscaling.x-k8s.io/provisioning": "yes"},
        "annotations": {"autoscaling.x-k8s.io/consume-provisioning-request": "pr-1"},
        "nodeSelector": {"zone": "a"},
        "tolerations": [{"key": "booked", "operator": "Exists"}],
    }
    body = {"metadata": {"name": wl.name}, "spec": {"podSets": list(wl.pod_sets)},
            "status": {"admission": wl.admission, "conditions": list(wl.conditions),
                       "admissionChecks": [{"name": "prov", "state": "Ready",
                                            "podSetUpdates": [update, {"name": "other"}]}]}}  # fmt: skip
    where = queue.placement(Slice.of(body), FLAVORS)
    assert where is not None
    assert where.node_selector == {"pool": "a100", "zone": "a"}
    assert where.tolerations == (GPU_TOLERATION, {"key": "booked", "operator": "Exists"})
    assert where.labels["autoscaling.x-k8s.io/provisioning"] == "yes"
    assert where.annotations == {
        workload.POD_WORKLOAD_ANNOTATION: wl.name,
        "autoscaling.x-k8s.io/consume-provisioning-request": "pr-1",
    }


def test_clearing_a_reservation_starts_pods_ready_over_and_requeues_a_kueue_deactivation() -> None:
    job = make_job()
    deactivated = cond(
        "Evicted", True, "DeactivatedDueToRequeuingLimitExceeded", "exceeded the requeuing limit"
    )
    wl = admitted(job, extra=[deactivated, READY], rv="77")
    (action,) = planned(job, wl).actions
    assert isinstance(action, PatchWorkload) and action.status
    conditions = {c["type"]: c for c in action.patch["status"]["conditions"]}
    # Reactivation (active true again) requeues only the exact reason Deactivated.
    assert (conditions["Requeued"]["status"], conditions["Requeued"]["reason"]) == (
        "False",
        "Deactivated",
    )
    ready = conditions["PodsReady"]
    assert (ready["status"], ready["reason"], ready["lastTransitionTime"]) == (
        "False",
        "WaitForStart",
        STAMP,
    )


def test_a_deleted_slice_that_holds_no_quota_is_released_while_the_job_runs() -> None:
    job = make_job()
    head = admitted(job, extra=[READY])
    gone = pending(job, "ddpjob-demo-r3p1c", count=3, deleting=True, replaces=head)
    result = planned(job, head, gone, pods=[pod(0), pod(1)])
    assert result.actions == (ReleaseWorkload(gone.name, gone.uid, (workload.FINALIZER,)),)
    assert result.admission.count == 2


def test_a_job_that_runs_when_it_is_queued_is_queued_once_its_pods_are_gone() -> None:
    """The label added to a running job (or Kueue installed later): Kueue must not admit it
    while its old pods still hold resources."""
    job = make_job()
    result = planned(job, pods=[pod(0)])
    assert result == Plan(
        Admission(0, None, False, "Queued", "the job's pods stop before it is queued"), ()
    )
    (action,) = planned(job, pods=[pod(0, PodPhase.SUCCEEDED)]).actions
    assert isinstance(action, CreateWorkload)
