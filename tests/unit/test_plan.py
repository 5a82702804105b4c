"""The whole plan of a pass (:func:`ddpjob_operator.core.plan.plan`): the desired count with
Kueue's admission in it, the Workload writes, the objects to post before any pod, when the
status is written, and when to look again. Pure: the controller only carries it out."""

from __future__ import annotations

import dataclasses
import datetime as dt

from ddpjob_operator import api, builders
from ddpjob_operator.core import gang, queue, workload
from ddpjob_operator.core.actions import CreatePod
from ddpjob_operator.core.plan import Defaults, Remembered, Seen, invalid_status, plan
from ddpjob_operator.core.settle import SETTLE_PODS, SETTLE_SECONDS
from ddpjob_operator.errors import FieldProblem, SpecError
from ddpjob_operator.observe import ObservedPod, PodPhase

from .jobs import job as plain_job
from .test_queue import FLAVORS, admitted, make_job

NOW = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.UTC)
CLOCK = 5000.0
KEY = "k" * 43


def running(index: int, **kw: object) -> ObservedPod:
    return ObservedPod(
        name=f"demo-worker-{index}",
        index=index,
        uid=f"uid-{index}",
        phase=PodPhase.RUNNING,
        ready=True,
        tracked=True,
        owner_uid="uid-demo",
        **kw,  # type: ignore[arg-type]
    )


def test_a_plain_job_gets_its_pods_its_secret_and_no_kueue() -> None:
    job = plain_job(replicas=3)
    planned = plan(job, Seen((), service=False), NOW, CLOCK, Remembered(), Defaults(), KEY)
    created = [a.index for a in planned.decision.actions if isinstance(a, CreatePod)]
    assert created == [0, 1, 2]
    assert planned.desired == 3
    assert planned.kueue is None
    assert planned.write
    assert planned.secret == builders.build_store_key_secret(job, KEY)
    assert planned.network_policy is None  # neither the job nor the operator asks for one
    assert planned.pod_group is None
    assert not planned.leave_kueue
    assert planned.remembered == Remembered(queued=False)


def test_what_was_made_is_not_posted_again_until_the_job_starts_afresh() -> None:
    job = plain_job(replicas=2, networkPolicy=True)
    made = Remembered(network_policy_made=True, store_key_made=True)
    live = (running(0), running(1))
    planned = plan(job, Seen(live, service=True), NOW, CLOCK, made, Defaults(), KEY)
    assert planned.network_policy is None
    assert planned.secret is None
    # no pod (a resume, a re-admission), and the pass creates pods: both are posted again
    planned = plan(job, Seen((), service=True), NOW, CLOCK, made, Defaults(), KEY)
    assert any(isinstance(a, CreatePod) for a in planned.decision.actions)
    assert planned.network_policy == builders.build_network_policy(job)
    assert planned.secret == builders.build_store_key_secret(job, KEY)


def test_kueue_admission_caps_the_desired_count() -> None:
    job = make_job(replicas=4, maxReplicas=4)
    seen = Seen(
        (), service=True, kueue=queue.Observation(True, (admitted(job, count=2),), None, FLAVORS)
    )
    planned = plan(job, seen, NOW, CLOCK, Remembered(), Defaults(), KEY)
    assert planned.kueue is not None
    assert planned.kueue.admission.count == 2
    assert planned.desired == 2
    created = [a.index for a in planned.decision.actions if isinstance(a, CreatePod)]
    assert created == [0, 1]
    assert planned.remembered.queued is True
    assert planned.requeue_after is not None


def test_a_new_workload_asks_for_the_priority_first() -> None:
    job = make_job()
    seen = Seen((), service=True, kueue=queue.Observation(True))
    planned = plan(job, seen, NOW, CLOCK, Remembered(), Defaults(), KEY)
    assert planned.wants_priority
    assert not any(isinstance(a, CreatePod) for a in planned.decision.actions)
    read = dataclasses.replace(seen, kueue=queue.Observation(True, priority=workload.Priority()))
    again = plan(job, read, NOW, CLOCK, Remembered(), Defaults(), KEY)
    assert not again.wants_priority
    assert again.kueue is not None
    assert any(isinstance(a, workload.CreateWorkload) for a in again.kueue.actions)


def test_a_job_that_left_its_queue_finishes_its_workloads_once() -> None:
    job = plain_job()  # no queue label
    status = job.status.model_copy(
        update={
            "conditions": api.set_condition(
                [], api.ConditionType.ADMITTED, True, "Admitted", "", NOW
            )
        }
    )
    was_queued = job.model_copy(update={"status": status})
    seen = Seen((), service=True)
    # after a restart the operator knows only the Admitted condition
    assert plan(was_queued, seen, NOW, CLOCK, Remembered(), Defaults(), KEY).leave_kueue
    assert plan(job, seen, NOW, CLOCK, Remembered(queued=True), Defaults(), KEY).leave_kueue
    left = plan(job, seen, NOW, CLOCK, Remembered(queued=False), Defaults(), KEY)
    assert not left.leave_kueue
    assert left.remembered.queued is False


def test_a_large_jobs_counts_settle_before_they_are_written() -> None:
    size = SETTLE_PODS + 8
    job = plain_job(replicas=size, minReplicas=1, maxReplicas=size)
    pods = tuple(running(i) for i in range(size))
    first = plan(job, Seen(pods, service=True), NOW, CLOCK, Remembered(), Defaults(), KEY)
    assert first.write  # the phase, the conditions, the accounted pods: written at once
    written = job.model_copy(update={"status": first.decision.status})
    fewer = tuple(dataclasses.replace(p, ready=p.index != 5) for p in pods)
    later = plan(written, Seen(fewer, service=True), NOW, CLOCK, first.remembered, Defaults(), KEY)
    assert not later.write
    assert later.remembered.unwritten_since == CLOCK
    assert later.requeue_after == SETTLE_SECONDS
    due = plan(
        written, Seen(fewer, service=True), NOW, CLOCK + SETTLE_SECONDS, later.remembered,
        Defaults(), KEY,
    )  # fmt: skip
    assert due.write
    assert due.remembered.unwritten_since is None


def test_the_gang_group_is_posted_before_its_pods_and_then_remembered() -> None:
    job = plain_job(gangScheduling="Native")
    seen = Seen((), service=True, pod_groups=True)
    planned = plan(job, seen, NOW, CLOCK, Remembered(), Defaults(), KEY)
    assert planned.pod_group == builders.build_pod_group(job)
    posted = Remembered(pod_group=gang.Posted(job.spec.effective_min, CLOCK))
    assert plan(job, seen, NOW, CLOCK, posted, Defaults(), KEY).pod_group is None


def test_asked_agents_bring_the_next_pass_closer_while_a_pod_lives() -> None:
    job = plain_job(replicas=1)
    seen = Seen((running(0),), service=True, ask_every=2.0)
    assert plan(job, seen, NOW, CLOCK, Remembered(), Defaults(), KEY).requeue_after == 2.0
    idle = Seen((), service=True, ask_every=2.0)
    assert plan(job, idle, NOW, CLOCK, Remembered(), Defaults(), KEY).requeue_after != 2.0


def test_an_invalid_spec_is_said_once() -> None:
    error = SpecError("DDPJob ml/demo", [FieldProblem("spec.replicas", "must be >= 0")])
    raw = {"metadata": {"generation": 2}, "status": {"phase": "Running"}}
    status = invalid_status(raw, error, NOW)
    assert status is not None
    assert status["phase"] == "Running"
    assert status["observedGeneration"] == 2
    (condition,) = status["conditions"]
    assert condition["type"] == "InvalidSpec"
    assert condition["message"].startswith("spec.replicas: must be >= 0")
    assert invalid_status({**raw, "status": status}, error, NOW) is None
