"""What stands before Kueue's plan (``queue.admit``): Kueue not installed, Workloads the operator
may not read, and the job's priority, which only a new Workload needs; how often a Kueue job's
Workloads are read (``queue.poll_after``); and where the priority comes from. The controller
only reads what these decide on (an ``Observation``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from ddpjob_operator import api
from ddpjob_operator.builders import Placement
from ddpjob_operator.core import queue, workload
from ddpjob_operator.core.queue import Admission, Observation, Plan
from ddpjob_operator.core.workload import Priority, PriorityClass
from ddpjob_operator.parse import parse_job

from .test_queue import FLAVORS, NO_PRIORITY, T0, admitted, make_job, pending, planned

GONE = "WorkloadPriorityClass high (kueue.x-k8s.io/priority-class) does not exist: create it, or "
GONE += "name another; no Workload until then"
HIGH = Priority(1000, {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass", "name": "high"})
NOT_SERVED = (
    "the job names LocalQueue team-a (kueue.x-k8s.io/queue-name), but this cluster serves no "
    "kueue.x-k8s.io/v1beta2 Workloads (is Kueue installed?): it runs without Kueue"
)
FORBIDDEN = (
    "the operator may not read Kueue's Workloads (403 Forbidden: workloads is forbidden): "
    "install the chart with kueue.enabled: true, or remove the label to run the job without "
    "Kueue; no pod is created until then"
)


def without_creation(plan: Plan) -> tuple[workload.WorkloadAction, ...]:
    return tuple(a for a in plan.actions if not isinstance(a, workload.CreateWorkload))


def scaled_up(job: api.DDPJob) -> Plan:
    """An admitted slice of 2 while the job asks for 3: a bigger slice is wanted."""
    return planned(job, admitted(job), desired=3)


# Each case: the observation (of the job), and the plan expected (of the job).
Case = tuple[Callable[[api.DDPJob], Observation], int, Callable[[api.DDPJob], Plan]]
CASES: dict[str, Case] = {
    "kueue-not-served": (
        lambda job: Observation(served=False),
        2,
        lambda job: Plan(
            Admission(queue.UNBOUNDED, Placement(), False, "KueueNotServed", NOT_SERVED), ()
        ),
    ),
    "forbidden": (
        lambda job: Observation(True, forbidden="403 Forbidden: workloads is forbidden"),
        2,
        lambda job: Plan(Admission(0, None, False, "KueueForbidden", FORBIDDEN), ()),
    ),
    "new-workload-priority-not-read": (
        lambda job: Observation(True),
        2,
        lambda job: Plan(planned(job).admission, (), wants_priority=True),
    ),
    "new-workload-with-its-priority": (
        lambda job: Observation(True, priority=HIGH),
        2,
        lambda job: planned(job, priority=HIGH),
    ),
    "new-workload-class-gone": (
        lambda job: Observation(True, priority=GONE),
        2,
        lambda job: Plan(Admission(0, None, False, "PriorityClassNotFound", GONE), ()),
    ),
    "scale-up-class-gone": (
        lambda job: Observation(True, (admitted(job),), flavors=FLAVORS, priority=GONE),
        3,
        lambda job: Plan(
            dataclasses.replace(
                scaled_up(job).admission,
                message=f"{scaled_up(job).admission.message}; cannot ask for more: {GONE}",
            ),
            without_creation(scaled_up(job)),
        ),
    ),
    "no-new-workload-priority-not-needed": (
        lambda job: Observation(True, (pending(job),)),
        2,
        lambda job: planned(job, pending(job), priority=NO_PRIORITY),
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_admit_decides_what_stands_before_the_plan(case: Case) -> None:
    seen, desired, expected = case
    job = make_job(replicas=desired)
    assert queue.admit(job, seen(job), [], desired, T0) == expected(job)


def test_a_job_whose_priority_is_read_gets_its_workload_with_it() -> None:
    """The controller's two steps: no priority read yet, then with the one it read."""
    job, seen = make_job(), Observation(True)
    first = queue.admit(job, seen, [], 2, T0)
    assert first.wants_priority
    again = queue.admit(job, dataclasses.replace(seen, priority=HIGH), [], 2, T0)
    assert again == planned(job, priority=HIGH)
    [create] = again.actions
    assert isinstance(create, workload.CreateWorkload)
    assert create.body["spec"]["priority"] == 1000


def test_only_the_admitted_slices_flavors_are_read() -> None:
    job = make_job()
    slices = [
        admitted(job, flavors={"cpu": "f2", "gpu": "f1"}),
        pending(job, "other"),
    ]
    assert queue.flavors_to_read(slices) == ["f1", "f2"]


WAITS = Admission(0, None, False, "Queued", "")
RUNS = Admission(2, Placement(), True, "Admitted", "")
WRITE = (workload.PatchWorkload("w", {}),)


@pytest.mark.parametrize(
    ("admission", "actions", "finished", "seconds"),
    [
        (WAITS, (), False, queue.POLL_SECONDS),
        (RUNS, (), False, queue.WATCH_SECONDS),
        (RUNS, WRITE, False, queue.POLL_SECONDS),
        (dataclasses.replace(WAITS, reason="KueueForbidden"), (), False, queue.STUCK_SECONDS),
        (dataclasses.replace(WAITS, reason="PriorityClassNotFound"), WRITE, False, 30.0),
        (Admission(queue.UNBOUNDED, Placement(), False, "KueueNotServed", ""), (), False, 30.0),
        (dataclasses.replace(WAITS, reason="Finished"), (), True, None),
        (dataclasses.replace(WAITS, reason="Finished"), WRITE, True, queue.POLL_SECONDS),
    ],
    ids=[
        "waits",
        "admitted",
        "admitted-with-writes",
        "forbidden",
        "class-gone",
        "not-served",
        "finished",
        "finished-with-writes",
    ],
)
def test_a_kueue_jobs_workloads_are_read_as_often_as_it_waits_on_them(
    admission: Admission,
    actions: tuple[workload.WorkloadAction, ...],
    finished: bool,
    seconds: float | None,
) -> None:
    assert queue.poll_after(Plan(admission, actions), finished) == seconds


def with_classes(kueue_class: str = "", pod_class: str = "") -> api.DDPJob:
    job = make_job()
    labels = {**(job.metadata.labels or {})}
    if kueue_class:
        labels[workload.PRIORITY_CLASS_LABEL] = kueue_class
    document: Any = job.model_dump(by_alias=True, mode="json")
    document["metadata"]["labels"] = labels
    if pod_class:
        document["spec"]["template"]["spec"]["priorityClassName"] = pod_class
    return parse_job(document)


@pytest.mark.parametrize(
    ("job", "named"),
    [
        (with_classes(), None),
        (with_classes(pod_class="research"), PriorityClass(False, "research")),
        (with_classes("high", "research"), PriorityClass(True, "high")),
    ],
    ids=["none", "the-pods", "kueues-wins"],
)
def test_the_priority_class_is_kueues_label_else_the_pods(
    job: api.DDPJob, named: PriorityClass | None
) -> None:
    assert workload.priority_class(job) == named


@pytest.mark.parametrize(
    ("named", "value", "found"),
    [
        (None, 0, Priority()),
        (PriorityClass(True, "high"), 1000, HIGH),
        (
            PriorityClass(False, "research"),
            5,
            Priority(
                5, {"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": "research"}
            ),
        ),
        (PriorityClass(True, "high"), None, GONE),
        (
            PriorityClass(False, "research"),
            None,
            "PriorityClass research (spec.template.spec.priorityClassName) does not exist: "
            "create it, or name another; no Workload until then",
        ),
    ],
    ids=["none", "kueue-class", "pod-class", "kueue-class-gone", "pod-class-gone"],
)
def test_the_priority_is_the_classs_value_or_why_there_is_none(
    named: PriorityClass | None, value: int | None, found: Priority | str
) -> None:
    assert workload.priority(named, value) == found
