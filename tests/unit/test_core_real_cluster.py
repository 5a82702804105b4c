"""The pure core against what review found real clusters do (issue 14): table-driven.

* point 9: an operator that parses leniently, and a spec problem that is never terminal;
* point 11: pods belong to the job their controller owner reference names, not to its name;
* point 13: a pod whose trainer never started is replaced with backoff, not in a tight loop;
* point 17: status, events and accountedPods stay bounded however large the job.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

import pytest

from ddpjob_operator import api
from ddpjob_operator.core.actions import CreatePod, DeletePod, DeleteWhy, Observed, RemoveFinalizer
from ddpjob_operator.core.events import MAX_EVENT_PODS
from ddpjob_operator.core.facts import MAX_NEW_ACCOUNTED
from ddpjob_operator.core.reconcile import reconcile
from ddpjob_operator.core.running import MAX_WAITING
from ddpjob_operator.errors import SpecError
from ddpjob_operator.observe import ObservedPod, PodPhase, observe_pod
from ddpjob_operator.parse import parse_job, parse_job_lenient

from .jobs import manifest
from .test_reconcile import T0, kinds, make_job, pod, run, running_status

UID = "uid-demo"

# ---- point 9 -------------------------------------------------------------------------------------


def test_the_operator_ignores_fields_a_newer_crd_defaults() -> None:
    document = manifest(futureKnob=3, rendezvous={"port": 29400, "newTimeout": 5})
    with pytest.raises(SpecError, match=r"spec\.futureKnob: unknown field"):
        parse_job(document)  # ddpjob validate stays strict
    job, ignored = parse_job_lenient(document)
    assert sorted(ignored) == ["spec.futureKnob", "spec.rendezvous.newTimeout"]
    assert job.spec.rendezvous.port == 29400
    with pytest.raises(SpecError, match="minReplicas"):  # a real problem still is one
        parse_job_lenient(manifest(futureKnob=3, minReplicas=9))


def _legacy_invalid(**update: Any) -> api.DDPJobStatus:
    """What an older operator wrote for a spec it could not parse: Failed, InvalidSpec."""
    status = running_status()
    failed_condition = api.Condition(
        type="Failed",
        status="True",
        reason="InvalidSpec",
        message="spec.newField: unknown field",
        last_transition_time=T0,
    )
    return status.model_copy(
        update={
            "phase": api.JobPhase.FAILED,
            "conditions": [*status.conditions, failed_condition],
            "completion_time": T0,
            **update,
        }
    )


def test_a_job_failed_only_for_an_unparsable_spec_is_taken_up_again() -> None:
    """An older operator marked running jobs Failed after a CRD upgrade; the next one must not
    clean their pods up as if they had finished."""
    job = make_job(status=_legacy_invalid())
    decision = run(job, pod(0), pod(1))
    assert not [a for a in decision.actions if isinstance(a, DeletePod)]
    assert decision.status.phase is api.JobPhase.RUNNING
    assert decision.status.completion_time is None
    conditions = {c.type: c for c in decision.status.conditions}
    assert conditions["Failed"].status == "False"


def test_a_real_failure_stays_terminal() -> None:
    status = _legacy_invalid()
    conditions = [
        c.model_copy(update={"reason": "BackoffLimitExceeded"}) if c.type == "Failed" else c
        for c in status.conditions
    ]
    decision = run(make_job(status=status.model_copy(update={"conditions": conditions})), pod(0))
    assert decision.status.phase is api.JobPhase.FAILED
    assert [a.why for a in decision.actions if isinstance(a, DeletePod)] == [DeleteWhy.CLEANUP]


def test_an_invalid_spec_condition_clears_once_the_spec_parses() -> None:
    status = running_status()
    invalid = api.Condition(
        type="InvalidSpec", status="True", reason="InvalidSpec", last_transition_time=T0
    )
    job = make_job(status=status.model_copy(update={"conditions": [*status.conditions, invalid]}))
    decision = run(job, pod(0), pod(1), now=T0 + dt.timedelta(seconds=5))
    condition = next(c for c in decision.status.conditions if c.type == "InvalidSpec")
    assert (condition.status, condition.reason) == ("False", "SpecValid")
    assert decision.status.phase is api.JobPhase.RUNNING


# ---- point 11 ------------------------------------------------------------------------------------


def _old(index: int, **kw: Any) -> ObservedPod:
    """A pod of an earlier job of the same name (its controller is another uid)."""
    kw.setdefault("owner_uid", "uid-of-the-job-before")
    return pod(index, **kw)


@pytest.mark.parametrize("owner", ["uid-of-the-job-before", ""])
def test_a_re_created_job_never_adopts_the_pods_of_the_one_before(owner: str) -> None:
    job = make_job()
    decision = run(job, _old(0, owner_uid=owner), pod(1, owner_uid=UID))
    # Not counted, not adopted, its name not reused until it is gone.
    assert kinds(decision) == []
    assert decision.status.replicas == 1
    [waiting] = decision.status.waiting
    assert (waiting.pod, waiting.reason) == ("demo-worker-0", "NameInUse")
    assert ("delete it" in waiting.message) is (owner == "")
    # Once it is gone, this job's pod 0 is created.
    assert kinds(run(job, pod(1, owner_uid=UID))) == [("create", 0, None)]


def test_pods_of_the_job_before_are_not_counted_and_their_finalizer_is_let_go() -> None:
    job = make_job(status=running_status())
    ended = _old(1, phase=PodPhase.FAILED, exit_code=1, deleting=True)
    decision = run(job, pod(0, owner_uid=UID), ended)
    assert (decision.status.restarts, decision.status.backoff_count) == (0, 0)
    assert [(a.name, a.uid) for a in decision.actions if isinstance(a, RemoveFinalizer)] == [
        ("demo-worker-1", ended.uid)
    ]
    assert ended.uid not in decision.status.accounted_pods


def test_observed_owner() -> None:
    from ddpjob_operator import builders  # noqa: PLC0415

    body = builders.build_pod(make_job(), 0)
    body["metadata"]["uid"] = "p"
    observed = observe_pod(body)
    assert observed is not None and observed.owner_uid == UID and observed.owned_by(UID)
    del body["metadata"]["ownerReferences"]
    orphan = observe_pod(body)
    assert orphan is not None and orphan.owner_uid == "" and not orphan.owned_by(UID)
    # The local runner's pods carry no owner references: unknown ownership is ours.
    assert pod(0).owner_uid is None and pod(0).owned_by(UID)


# ---- point 13 ------------------------------------------------------------------------------------


def _rejected(index: int) -> ObservedPod:
    """The kubelet refused the pod at admission: Failed, status.reason OutOfcpu, no containers."""
    return pod(
        index,
        PodPhase.FAILED,
        ready=False,
        disruption="OutOfcpu",
        message="Node didn't have enough resource: cpu",
        started=False,
    )


def test_a_pod_rejected_at_admission_is_replaced_with_backoff() -> None:
    job = make_job(status=running_status())
    t = T0
    delays = []
    for _ in range(4):
        first = run(job, pod(0), _rejected(1), now=t)
        assert [f.reason for f in first.status.failures][-1] == "Evicted"
        assert first.status.failures[-1].charged is False
        assert first.status.failures[-1].started is False
        job = job.model_copy(update={"status": first.status})
        gone = run(job, pod(0), now=t)  # deleted; the replacement waits
        assert not [a for a in gone.actions if isinstance(a, CreatePod)]
        assert gone.requeue_after is not None
        [waiting] = [w for w in gone.status.waiting if w.pod == "demo-worker-1"]
        assert waiting.reason == "BackOff"
        assert "Node didn't have enough resource" in waiting.message
        delays.append(gone.requeue_after)
        t += dt.timedelta(seconds=gone.requeue_after)
        job = job.model_copy(update={"status": gone.status})
        assert kinds(run(job, pod(0), now=t)) == [("create", 1, None)]
    assert delays == [10.0, 20.0, 40.0, 80.0]


def test_a_disruption_of_a_pod_that_ran_is_replaced_at_once() -> None:
    job = make_job(status=running_status())
    evicted = dataclasses.replace(_rejected(1), started=True, disruption="Evicted")
    first = run(job, pod(0), evicted)
    assert first.status.pod_backoff == []
    job = job.model_copy(update={"status": first.status})
    assert kinds(run(job, pod(0))) == [("create", 1, None)]


def test_the_backoff_is_capped() -> None:
    streak = api.IndexBackoff(index=1, failures=12, last_failure_time=T0)
    job = make_job(status=running_status(pod_backoff=[streak]))
    assert run(job, pod(0), now=T0).requeue_after == 360.0
    capped = make_job(
        status=running_status(pod_backoff=[streak]), podBackoff={"maxDelaySeconds": 300}
    )
    assert run(capped, pod(0), now=T0).requeue_after == 300.0


# ---- point 17 ------------------------------------------------------------------------------------

BIG = 1000


def _big_job(status: api.DDPJobStatus | None = None, **spec: Any) -> api.DDPJob:
    return make_job(status, replicas=BIG, minReplicas=1, maxReplicas=BIG, **spec)


def test_status_and_events_stay_bounded_when_every_pod_waits() -> None:
    pending = [
        pod(
            i,
            PodPhase.PENDING,
            waiting_reason="Unschedulable",
            waiting_message="0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        )
        for i in range(BIG)
    ]
    decision = run(_big_job(), *pending)
    assert len(decision.status.waiting) == MAX_WAITING
    assert [w.pod for w in decision.status.waiting][:2] == ["demo-worker-0", "demo-worker-1"]
    running = next(c for c in decision.status.conditions if c.type == "Running")
    assert f"waiting: {BIG} pods: {BIG} pods Unschedulable" in running.message
    assert len(running.message) < 1000
    waiting_events = [e for e in decision.events if e.reason == "PodWaiting"]
    assert len(waiting_events) == MAX_EVENT_PODS + 1
    assert "more pods cannot start (Unschedulable x" in waiting_events[-1].message
    # The next pass emits nothing new for the same pods.
    again = run(_big_job(status=decision.status), *pending)
    assert not [e for e in again.events if e.reason == "PodWaiting"]


def test_events_stay_bounded_when_many_pods_fail_at_once() -> None:
    live = [pod(i) for i in range(BIG)]
    status = run(_big_job(), *live).status
    job = _big_job(status=status)
    preempted = [
        dataclasses.replace(p, disruption="PreemptionByScheduler", deleting=True)
        for p in live[:600]
    ]
    decision = run(job, *preempted, *live[600:])
    failed_events = [e for e in decision.events if e.reason == "PodFailed"]
    assert len(failed_events) == MAX_EVENT_PODS + 1
    assert "more pods failed (Preempted x" in failed_events[-1].message
    created = [e for e in decision.events if e.reason == "CreatedPods"]
    assert all(len(e.message) < 400 for e in created)


def test_accounted_pods_grow_by_at_most_the_bound_per_pass() -> None:
    """As the Job controller bounds uncountedTerminatedPods: the rest in the next passes, every
    pod still counted exactly once, and no failed pod deleted before it is counted."""
    live = [pod(i) for i in range(BIG)]
    job = _big_job(status=run(_big_job(), *live).status, backoffLimit=10 * BIG)
    pods = [dataclasses.replace(p, phase=PodPhase.FAILED, exit_code=1, ready=False) for p in live]
    counted: set[str] = set()
    for _ in range(10):
        decision = run(job, *pods)
        assert len(decision.status.accounted_pods) <= MAX_NEW_ACCOUNTED
        deleted = {a.uid for a in decision.actions if isinstance(a, DeletePod)}
        assert deleted <= set(decision.status.accounted_pods)
        counted |= set(decision.status.accounted_pods)
        released = {a.uid for a in decision.actions if isinstance(a, RemoveFinalizer)}
        # The executor releases them; the pods then leave (their replacements are not modelled).
        pods = [p for p in pods if p.uid not in released]
        job = job.model_copy(update={"status": decision.status})
        if not pods:
            break
        assert decision.requeue_after is not None and decision.requeue_after <= 1.0
    assert not pods
    assert counted == {p.uid for p in live}
    assert job.status.restarts == BIG


def test_suspending_a_huge_job_deletes_within_the_bound() -> None:
    live = [pod(i) for i in range(BIG)]
    job = _big_job(status=run(_big_job(), *live).status)
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
    decision = reconcile(job, Observed(tuple(live), True), T0)
    deletes = [a for a in decision.actions if isinstance(a, DeletePod)]
    assert len(deletes) == MAX_NEW_ACCOUNTED
    assert decision.requeue_after is not None


def test_the_status_of_a_scale_down_by_half_of_1024_pods_stays_under_20_kb() -> None:
    """The largest status bench/scale_job.py saw (24 KB with a bound of 500): a 1,024-pod job
    scaled to 512 after a node of pods was lost, the uids of the pods it deletes (36
    characters, as the API server's) going into accountedPods at the bound, with 20 recent
    failures kept."""
    live = [dataclasses.replace(p, uid=f"{p.index:08d}-0000-4000-8000-000000000000") for p in
            (pod(i) for i in range(1024))]  # fmt: skip
    failed = [
        api.PodFailure(pod=p.name, index=p.index, uid=p.uid, reason="NodeLost", charged=False,
                       message="node hollow-1 is lost", node="hollow-1", time=T0)
        for p in live[: api.MAX_RECENT_FAILURES]
    ]  # fmt: skip
    spec: dict[str, Any] = {"replicas": 1024, "minReplicas": 1, "maxReplicas": 1024}
    status = run(make_job(**spec), *live).status.model_copy(update={"failures": failed})
    decision = run(make_job(status, **{**spec, "replicas": 512}), *live)
    assert len([a for a in decision.actions if isinstance(a, DeletePod)]) == MAX_NEW_ACCOUNTED
    assert len(decision.status.accounted_pods) == MAX_NEW_ACCOUNTED
    assert len(decision.status.failures) == api.MAX_RECENT_FAILURES
    text = json.dumps(decision.status.model_dump(by_alias=True, mode="json"), separators=(",", ":"))
    assert 12_000 < len(text.encode()) < 20_000
