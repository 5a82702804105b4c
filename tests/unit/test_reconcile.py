"""The pure reconciler: table-driven scenarios, then properties with hypothesis."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from ddpjob_operator import api, builders
from ddpjob_operator.api import STORE_KEY_ENV
from ddpjob_operator.core.actions import (
    CreatePod,
    CreateService,
    Decision,
    DeleteJob,
    DeletePod,
    Observed,
    RemoveFinalizer,
)
from ddpjob_operator.core.facts import (
    DELETION_BATCH_SECONDS,
    DELETION_QUIET_SECONDS,
    LARGE_JOB_PODS,
    MAX_NEW_ACCOUNTED,
    held_deletions,
)
from ddpjob_operator.core.reconcile import reconcile
from ddpjob_operator.core.running import store_keyed
from ddpjob_operator.core.verdict import STRANDED_AFTER_SECONDS
from ddpjob_operator.observe import ObservedPod, PodPhase, observe_pod
from ddpjob_operator.parse import parse_job

from .jobs import manifest

T0 = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.UTC)
_uids = itertools.count()


def make_job(status: api.DDPJobStatus | None = None, **spec: Any) -> api.DDPJob:
    job = parse_job(manifest(**spec))
    return job.model_copy(update={"status": status}) if status is not None else job


def pod(index: int, phase: PodPhase = PodPhase.RUNNING, **kw: Any) -> ObservedPod:
    kw.setdefault("uid", f"uid-{index}-{next(_uids)}")
    kw.setdefault("ready", phase is PodPhase.RUNNING)
    return ObservedPod(name=f"demo-worker-{index}", index=index, phase=phase, **kw)


def failed(index: int, exit_code: int = 1, **kw: Any) -> ObservedPod:
    return pod(index, PodPhase.FAILED, exit_code=exit_code, **kw)


def run(
    job: api.DDPJob, *pods: ObservedPod, now: dt.datetime = T0, service: bool = True
) -> Decision:
    return reconcile(job, Observed(tuple(pods), service), now)


def kinds(decision: Decision) -> list[tuple[str, int | None, str | None]]:
    out: list[tuple[str, int | None, str | None]] = []
    for action in decision.actions:
        if isinstance(action, CreatePod):
            out.append(("create", action.index, None))
        elif isinstance(action, DeletePod):
            out.append(("delete", action.index, action.why.value))
        elif isinstance(action, CreateService):
            out.append(("service", None, None))
        elif isinstance(action, RemoveFinalizer):
            continue  # bookkeeping: see released()
        else:
            out.append(("delete-job", None, None))
    return out


def released(decision: Decision) -> list[int]:
    """The indices whose tracking finalizer the decision removes."""
    return [a.index for a in decision.actions if isinstance(a, RemoveFinalizer)]


def running_status(**kw: Any) -> api.DDPJobStatus:
    first = run(make_job(), pod(0), pod(1)).status
    return first.model_copy(update=kw)


# ---- table-driven scenarios --------------------------------------------------------------------


def test_new_job_creates_service_and_every_pod() -> None:
    decision = run(make_job(), service=False)
    assert kinds(decision) == [("service", None, None), ("create", 0, None), ("create", 1, None)]
    assert decision.status.phase is api.JobPhase.PENDING
    assert decision.status.selector == "ddpjob.io/job-name=demo"
    assert decision.status.observed_generation == 3
    assert decision.status.start_time == T0


def test_running_job_needs_nothing_and_reports_status() -> None:
    decision = run(make_job(), pod(0), pod(1, ready=False))
    assert decision.actions == ()
    status = decision.status
    assert (status.phase, status.replicas, status.ready_replicas, status.world_size) == (
        api.JobPhase.RUNNING,
        2,
        1,
        1,
    )


def test_agent_reported_world_size_wins() -> None:
    decision = run(make_job(), pod(0, world_size=8), pod(1, world_size=8))
    assert decision.status.world_size == 8


def test_failed_pod_is_counted_deleted_then_recreated() -> None:
    # No back-off here (tests/unit/test_pod_backoff.py has it): this is about the counting.
    job = make_job(status=running_status(), podBackoff={"initialDelaySeconds": 0})
    broken = failed(1, exit_code=137)
    first = run(job, pod(0), broken)
    assert kinds(first) == [("delete", 1, "Replace")]
    assert (first.status.restarts, first.status.backoff_count) == (1, 1)
    [failure] = first.status.failures
    assert (failure.pod, failure.reason, failure.charged, failure.uid) == (
        "demo-worker-1",
        "ExitCode(137)",
        True,
        broken.uid,
    )
    assert first.events[0].reason == "PodFailed"
    assert released(first) == [1]  # counted: its tracking finalizer goes
    assert first.status.accounted_pods == [broken.uid]
    # The delete is in flight: the same pod, now deleting, is not counted again, even if the
    # finalizer removal did not land yet.
    job = job.model_copy(update={"status": first.status})
    gone = run(job, pod(0), failed(1, exit_code=137, uid=broken.uid, deleting=True))
    assert kinds(gone) == [] and released(gone) == [1] and gone.status.restarts == 1
    untracked = run(
        job, pod(0), failed(1, exit_code=137, uid=broken.uid, deleting=True, tracked=False)
    )
    assert untracked.actions == () and untracked.status.restarts == 1
    assert untracked.status.accounted_pods == []
    # Once it is gone, it is recreated under the same name.
    again = run(job.model_copy(update={"status": gone.status}), pod(0))
    assert kinds(again) == [("create", 1, None)]
    assert isinstance(again.actions[0], CreatePod) and again.actions[0].name == "demo-worker-1"


@pytest.mark.parametrize(
    ("observed", "reason", "charged"),
    [
        ({"exit_code": 1}, "ExitCode(1)", True),
        ({"exit_code": 137, "container_reason": "OOMKilled"}, "OOMKilled", True),
        ({"exit_code": 143}, "Preempted", False),
        ({"exit_code": 137, "disruption": "PreemptionByScheduler"}, "Preempted", False),
        ({"exit_code": 137, "disruption": "EvictionByEvictionAPI"}, "Evicted", False),
        ({"exit_code": 137, "disruption": "DeletionByTaintManager"}, "NodeLost", False),
    ],
)
def test_failures_are_classified_and_disruptions_are_free(
    observed: dict[str, Any], reason: str, charged: bool
) -> None:
    decision = run(make_job(status=running_status()), pod(0), failed(1, **observed))
    [failure] = decision.status.failures
    assert (failure.reason, failure.charged) == (reason, charged)
    assert decision.status.backoff_count == int(charged)
    assert decision.status.restarts == 1


def test_pod_deleted_by_someone_else_counts_as_deleted() -> None:
    decision = run(make_job(status=running_status()), pod(0), pod(1, deleting=True))
    [failure] = decision.status.failures
    assert (failure.reason, failure.charged) == ("Deleted", False)
    assert kinds(decision) == [] and released(decision) == [1]


def test_backoff_limit_fails_the_job_and_cleans_up_running_pods() -> None:
    job = make_job(status=running_status(backoff_count=2, restarts=2), backoffLimit=2)
    survivor = pod(0)
    decision = run(job, survivor, failed(1))
    assert decision.status.phase is api.JobPhase.FAILED
    assert decision.status.backoff_count == 3
    assert decision.status.completion_time == T0
    failed_condition = next(c for c in decision.status.conditions if c.type == "Failed")
    assert failed_condition.reason == "BackoffLimitExceeded"
    assert "demo-worker-1 ExitCode(1)" in failed_condition.message
    assert kinds(decision) == [("delete", 0, "Cleanup")]


def test_exit_code_policy_permanent_and_retryable() -> None:
    permanent = run(
        make_job(status=running_status(), restartPolicy="ExitCode"), pod(0), failed(1, exit_code=2)
    )
    assert permanent.status.phase is api.JobPhase.FAILED
    assert permanent.status.conditions[-3].reason == "PermanentExitCode"
    retryable = run(
        make_job(status=running_status(), restartPolicy="ExitCode"),
        pod(0),
        failed(1, exit_code=137),
    )
    assert retryable.status.phase is api.JobPhase.RUNNING
    assert kinds(retryable) == [("delete", 1, "Replace")]


def test_exit_code_policy_honours_backoff_limit() -> None:
    job = make_job(status=running_status(backoff_count=1), restartPolicy="ExitCode", backoffLimit=1)
    assert run(job, pod(0), failed(1, exit_code=137)).status.phase is api.JobPhase.FAILED


def test_never_policy_fails_on_any_failure() -> None:
    decision = run(
        make_job(status=running_status(), restartPolicy="Never"), pod(0), failed(1, exit_code=143)
    )
    assert decision.status.phase is api.JobPhase.FAILED


def test_success_needs_every_live_pod_to_finish() -> None:
    job = make_job(status=running_status())
    one_done = run(job, pod(0, PodPhase.SUCCEEDED, exit_code=0), pod(1))
    assert one_done.status.phase is api.JobPhase.RUNNING
    assert kinds(one_done) == []  # nothing is created or replaced while completing
    assert one_done.status.succeeded == 1
    all_done = run(
        job, pod(0, PodPhase.SUCCEEDED, exit_code=0), pod(1, PodPhase.SUCCEEDED, exit_code=0)
    )
    assert all_done.status.phase is api.JobPhase.SUCCEEDED
    assert kinds(all_done) == []  # cleanPodPolicy Running keeps finished pods for their logs
    assert released(all_done) == [0, 1]
    assert all_done.status.succeeded == 2


@pytest.mark.parametrize("host", [0, 1], ids=["pod 0 hosted the store", "pod 1 hosted it"])
def test_a_pod_that_never_joined_the_last_round_is_not_waited_for_once_it_is_done(
    host: int,
) -> None:
    """A scale-up (or a replacement) that lands as the last round finishes: its pod's agent
    waits for a store host that will never come back. It holds its node only
    STRANDED_AFTER_SECONDS past the first pod's end, not the agent's join timeout; whichever
    pod hosted the last round's store (after a failover any pod may: here pod 0 is the
    stranded replacement)."""
    job = make_job(status=running_status(), replicas=3, maxReplicas=3)
    done = {"exit_code": 0, "finished_at": T0}
    members = [i for i in range(3) if i != (2 if host == 0 else 0)]
    pods = tuple(pod(i, PodPhase.SUCCEEDED, **done) for i in members)
    stranded = 2 if host == 0 else 0
    late = pod(stranded, ready=False)
    soon = run(job, *pods, late, now=T0 + dt.timedelta(seconds=10))
    assert soon.status.phase is api.JobPhase.RUNNING
    assert kinds(soon) == []
    assert soon.requeue_after == pytest.approx(STRANDED_AFTER_SECONDS - 10)
    due = run(job, *pods, late, now=T0 + dt.timedelta(seconds=STRANDED_AFTER_SECONDS))
    assert due.status.phase is api.JobPhase.SUCCEEDED
    (succeeded,) = [c for c in due.status.conditions if c.type == "Succeeded"]
    assert f"demo-worker-{stranded} never joined it" in succeeded.message
    assert kinds(due) == [("delete", stranded, "Cleanup")]  # cleanPodPolicy Running
    assert due.status.succeeded == 2 and due.status.restarts == 0
    assert due.status.backoff_count == 0


@pytest.mark.parametrize(
    "pods",
    [
        # A member of the last round still on its way out: ready.
        (pod(0, PodPhase.SUCCEEDED, exit_code=0, finished_at=T0), pod(1)),
        # When the succeeded pod finished is unknown: no clock to start.
        (pod(0, PodPhase.SUCCEEDED, exit_code=0), pod(1, ready=False)),
    ],
    ids=["a ready pod", "the end unknown"],
)
def test_a_completing_job_still_waits_for(pods: tuple[ObservedPod, ...]) -> None:
    job = make_job(status=running_status())
    later = run(job, *pods, now=T0 + dt.timedelta(hours=1))
    assert later.status.phase is api.JobPhase.RUNNING
    assert kinds(later) == []


@pytest.mark.parametrize(("policy", "deleted"), [("Running", [1]), ("All", [1, 0]), ("None", [])])
def test_clean_pod_policy(policy: str, deleted: list[int]) -> None:
    job = make_job(
        status=running_status(phase=api.JobPhase.FAILED, completion_time=T0), cleanPodPolicy=policy
    )
    decision = run(job, pod(0, PodPhase.FAILED, exit_code=1), pod(1))
    assert kinds(decision) == [("delete", i, "Cleanup") for i in deleted]


def test_ttl_after_finished() -> None:
    status = running_status(phase=api.JobPhase.SUCCEEDED, completion_time=T0)
    job = make_job(status=status, ttlSecondsAfterFinished=60)
    early = run(job, now=T0 + dt.timedelta(seconds=10))
    assert early.actions == () and early.requeue_after == 50
    late = run(job, now=T0 + dt.timedelta(seconds=60))
    assert late.actions == (DeleteJob(),)


def test_scale_up_and_down_highest_index_first() -> None:
    up = run(make_job(status=running_status(), replicas=4), pod(0), pod(1))
    assert kinds(up) == [("create", 2, None), ("create", 3, None)]
    down = run(make_job(status=running_status(), replicas=1), pod(0), pod(1), pod(2), pod(3))
    assert kinds(down) == [
        ("delete", 3, "ScaleDown"),
        ("delete", 2, "ScaleDown"),
        ("delete", 1, "ScaleDown"),
    ]
    assert down.status.restarts == 0


def test_scaled_down_pod_ending_on_sigterm_is_not_a_failure() -> None:
    victim = pod(1)
    job = make_job(status=running_status(), replicas=1)
    down = run(job, pod(0), victim)
    assert kinds(down) == [("delete", 1, "ScaleDown")]
    assert down.status.accounted_pods == [victim.uid]  # marked before the delete runs
    later = run(
        job.model_copy(update={"status": down.status}),
        pod(0),
        failed(1, exit_code=143, deleting=True, uid=victim.uid),
    )
    assert later.status.restarts == 0 and later.status.failures == []


def test_suspend_deletes_everything_and_resume_recreates() -> None:
    suspended = run(make_job(status=running_status(), suspend=True), pod(0), pod(1))
    assert kinds(suspended) == [("delete", 1, "Suspend"), ("delete", 0, "Suspend")]
    assert suspended.status.phase is api.JobPhase.SUSPENDED
    assert suspended.status.start_time is None
    resumed = run(make_job(status=suspended.status), now=T0 + dt.timedelta(hours=1))
    assert kinds(resumed) == [("create", 0, None), ("create", 1, None)]
    assert resumed.status.phase is api.JobPhase.PENDING
    assert resumed.status.start_time == T0 + dt.timedelta(hours=1)


def test_active_deadline() -> None:
    job = make_job(status=running_status(start_time=T0), activeDeadlineSeconds=100)
    before = run(job, pod(0), pod(1), now=T0 + dt.timedelta(seconds=40))
    assert before.status.phase is api.JobPhase.RUNNING and before.requeue_after == 60
    after = run(job, pod(0), pod(1), now=T0 + dt.timedelta(seconds=100))
    assert after.status.phase is api.JobPhase.FAILED
    assert kinds(after) == [("delete", 1, "Cleanup"), ("delete", 0, "Cleanup")]


def test_below_min_replicas_past_the_rendezvous_timeout_fails() -> None:
    job = make_job(status=running_status(), minReplicas=2, rendezvous={"joinTimeoutSeconds": 30})
    first = run(job, pod(0), pod(1, PodPhase.PENDING))
    assert first.status.below_min_since == T0 and first.status.phase is api.JobPhase.RESTARTING
    job = job.model_copy(update={"status": first.status})
    still = run(job, pod(0), pod(1, PodPhase.PENDING), now=T0 + dt.timedelta(seconds=29))
    assert still.status.phase is api.JobPhase.RESTARTING and still.requeue_after == 1
    late = run(job, pod(0), pod(1, PodPhase.PENDING), now=T0 + dt.timedelta(seconds=30))
    assert late.status.phase is api.JobPhase.FAILED
    recovered = run(job, pod(0), pod(1), now=T0 + dt.timedelta(seconds=20))
    assert recovered.status.below_min_since is None


def test_condition_transition_time_moves_only_on_change() -> None:
    first = run(make_job(), pod(0), pod(1))
    later = run(make_job(status=first.status), pod(0), pod(1), now=T0 + dt.timedelta(minutes=5))
    running = next(c for c in later.status.conditions if c.type == "Running")
    assert running.status == "True" and running.last_transition_time == T0


# ---- pod 0, the first store's host, left waiting by the scheduler -------------------------------

NO_ROOM = "0/4 nodes are available: 4 Insufficient cpu."


def unplaced(index: int, **kw: Any) -> ObservedPod:
    return pod(
        index, PodPhase.PENDING, waiting_reason="Unschedulable", waiting_message=NO_ROOM, **kw
    )


def placed(index: int, **kw: Any) -> ObservedPod:
    return pod(index, PodPhase.RUNNING, node=f"node-{index}", **kw)


def waiting(decision: Decision) -> list[tuple[str, str]]:
    return [(w.pod, w.reason) for w in decision.status.waiting]


def test_pod_0_left_waiting_gets_the_room_of_the_highest_pod_beyond_min_replicas() -> None:
    """CI's suite saw it: 5 replicas, minReplicas 2, 4 slots; the scheduler bound 3, 1, 4, 2
    and left pod 0, whose agent hosts the store the others wait for: nothing trained."""
    job = make_job(replicas=5, minReplicas=2, maxReplicas=5)
    first = run(job, unplaced(0), placed(1), placed(2), placed(3), placed(4))
    assert kinds(first) == [("delete", 4, "StoreHost")]
    [event] = [e for e in first.events if e.reason == "StoreHostUnplaced"]
    assert "deleting demo-worker-4" in event.message and event.type == "Warning"
    assert waiting(first) == [("demo-worker-0", "Unschedulable")]
    assert first.status.restarts == 0 and first.status.failures == []

    # Pod 4 goes: no other pod is deleted for pod 0, and pod 4 is not created again yet.
    job = make_job(status=first.status, replicas=5, minReplicas=2, maxReplicas=5)
    going = run(job, unplaced(0), placed(1), placed(2), placed(3), placed(4, deleting=True))
    assert kinds(going) == []
    gone = run(job, unplaced(0), placed(1), placed(2), placed(3))
    assert kinds(gone) == []
    assert waiting(gone) == [
        ("demo-worker-0", "Unschedulable"),
        ("demo-worker-4", "StoreHostUnplaced"),
    ]
    assert gone.status.restarts == 0 and gone.status.failures == []

    # Pod 0 is placed: pod 4 is created again (and waits for room, as any fifth pod would).
    again = run(job, placed(0), placed(1), placed(2), placed(3))
    assert kinds(again) == [("create", 4, None)]


def test_the_waiting_pods_beyond_min_replicas_go_too() -> None:
    """They would compete with pod 0 for the room made; they are created once it is placed."""
    job = make_job(replicas=6, minReplicas=2, maxReplicas=6)
    decision = run(job, unplaced(0), placed(1), placed(2), placed(3), placed(4), unplaced(5))
    assert kinds(decision) == [("delete", 5, "StoreHost"), ("delete", 4, "StoreHost")]


@pytest.mark.parametrize(
    "pods",
    [
        # A round formed: the survivors carry the store on, pod 0 is not needed.
        (unplaced(0), placed(1, world_size=3), placed(2, world_size=3), placed(3, world_size=3)),
        (unplaced(0), placed(1, store_host=True), placed(2), placed(3)),
        # Only pods within minReplicas hold nodes: no room to make.
        (unplaced(0), placed(1), unplaced(2), unplaced(3)),
        # Pod 0 waits for something other than room (an image pull), or is placed.
        (pod(0, PodPhase.PENDING, waiting_reason="ErrImagePull"), placed(1), placed(2), placed(3)),
        (pod(0, PodPhase.PENDING, node="node-0"), placed(1), placed(2), placed(3)),
    ],
)
def test_no_room_is_made_where_pod_0_is_not_what_the_job_waits_for(
    pods: tuple[ObservedPod, ...],
) -> None:
    job = make_job(replicas=4, minReplicas=2, maxReplicas=4)
    assert [k for k in kinds(run(job, *pods)) if k[2] == "StoreHost"] == []


def test_no_room_is_made_for_a_replacement_pod_0_once_a_pod_has_failed() -> None:
    """Pod 0 lost while the job trained (its agents not asked: no world reported): the
    survivors carried the store on, and its replacement waits for room as any pod would."""
    job = make_job(status=running_status(restarts=1), replicas=4, minReplicas=2, maxReplicas=4)
    assert kinds(run(job, unplaced(0), placed(1), placed(2), placed(3))) == []


# ---- the store key across an operator upgrade ----------------------------------------------------

STORE_KEY_FROM_SECRET = {
    "name": "DDPJOB_STORE_KEY",
    "valueFrom": {"secretKeyRef": {"name": "demo-store-key", "key": "key"}},
}


def created_env(decision: Decision) -> dict[int, list[dict[str, Any]]]:
    """The store-key entries of each created pod's trainer env, by index."""
    return {
        a.index: [e for e in a.pod["spec"]["containers"][0]["env"] if e["name"] == STORE_KEY_ENV]
        for a in decision.actions
        if isinstance(a, CreatePod)
    }


def test_a_new_job_gets_pods_that_read_the_store_key() -> None:
    job = make_job()
    decision = run(job, service=False)
    assert decision.actions == (
        CreateService(builders.build_service(job)),
        CreatePod(0, builders.build_pod(job, 0, store_key=True)),
        CreatePod(1, builders.build_pod(job, 1, store_key=True)),
    )
    assert created_env(decision) == {0: [STORE_KEY_FROM_SECRET], 1: [STORE_KEY_FROM_SECRET]}


def test_a_job_whose_running_pods_lack_the_key_keeps_building_pods_without_it() -> None:
    """Pods an older operator made (no DDPJOB_STORE_KEY): their agents write unsigned, and a
    keyed newcomer could not join them, so the replacement is built unkeyed too."""
    job = make_job(status=running_status(), replicas=3)
    decision = run(job, pod(0, store_keyed=False), pod(1, store_keyed=False))
    assert decision.actions == (CreatePod(2, builders.build_pod(job, 2, store_key=False)),)
    assert created_env(decision) == {2: []}
    # One unkeyed pod still running is enough (a mix never comes from this rule, but if one
    # existed, the pods that trained before the upgrade win).
    mixed = run(job, pod(0, store_keyed=False), pod(1, store_keyed=True))
    assert created_env(mixed) == {2: []}
    # So is one being deleted that may still train.
    leaving = run(job, pod(0, store_keyed=True), pod(1, store_keyed=False, deleting=True))
    assert created_env(leaving) == {2: []}


def test_a_job_whose_pods_have_the_key_or_ended_builds_keyed_pods() -> None:
    job = make_job(status=running_status(), replicas=3)
    keyed = run(job, pod(0, store_keyed=True), pod(1, store_keyed=True))
    assert keyed.actions == (CreatePod(2, builders.build_pod(job, 2)),)
    assert created_env(keyed) == {2: [STORE_KEY_FROM_SECRET]}
    # Pods not seen yet (the operator's own expectations) and an unkeyed pod that has ended
    # (Succeeded or Failed) do not hold the job back.
    ended = run(
        job,
        pod(0, PodPhase.PENDING, store_keyed=None),
        pod(1, store_keyed=True),
        failed(3, store_keyed=False),  # scaled away before it failed
    )
    assert created_env(ended) == {2: [STORE_KEY_FROM_SECRET]}
    assert store_keyed([]) is True


def test_observe_reads_whether_a_pod_was_built_with_the_key() -> None:
    job = make_job()
    for built, expected in (
        (builders.build_pod(job, 0), True),
        (builders.build_pod(job, 0, store_key=False), False),
    ):
        built["metadata"]["uid"] = "u0"
        observed = observe_pod(built)
        assert observed is not None and observed.store_keyed is expected
    # The user's own DDPJOB_STORE_KEY counts: the agent reads it either way.
    mine = {"name": "trainer", "image": "x", "env": [{"name": STORE_KEY_ENV, "value": "s"}]}
    theirs = make_job(template={"spec": {"containers": [mine]}})
    observed = observe_pod(builders.build_pod(theirs, 0, store_key=False))
    assert observed is not None and observed.store_keyed is True


# ---- properties --------------------------------------------------------------------------------

phases = st.sampled_from(list(PodPhase))


@st.composite
def worlds(draw: st.DrawFn) -> tuple[api.DDPJob, tuple[ObservedPod, ...]]:
    low = draw(st.integers(1, 3))
    replicas = draw(st.integers(low, low + 3))
    high = draw(st.integers(replicas, replicas + 3))
    job = make_job(
        replicas=replicas,
        minReplicas=low,
        maxReplicas=high,
        restartPolicy=draw(st.sampled_from(["OnFailure", "ExitCode", "Never"])),
        backoffLimit=draw(st.integers(0, 4)),
        suspend=draw(st.booleans()),
        cleanPodPolicy=draw(st.sampled_from(["Running", "All", "None"])),
    )
    indices = draw(st.sets(st.integers(0, high + 2), max_size=high + 3))
    pods = tuple(
        pod(
            i,
            draw(phases),
            deleting=draw(st.booleans()),
            exit_code=draw(st.sampled_from([None, 0, 1, 2, 137, 143])),
            disruption=draw(
                st.sampled_from([None, None, "PreemptionByScheduler", "EvictionByEvictionAPI"])
            ),
        )
        for i in sorted(indices)
    )
    return job, pods


def apply(decision: Decision, observed: Observed) -> Observed:
    pods = {p.name: p for p in observed.pods}
    service = observed.service
    for action in decision.actions:
        if isinstance(action, CreateService):
            service = True
        elif isinstance(action, CreatePod):
            assert action.name not in pods, f"{action.name} created twice"
            pods[action.name] = pod(action.index, PodPhase.PENDING)
        elif isinstance(action, DeletePod):
            old = pods[action.name]
            assert not old.deleting or action.force, f"{action.name} deleted twice"
            pods[action.name] = dataclasses.replace(old, deleting=True)
        elif isinstance(action, RemoveFinalizer):
            pods[action.name] = dataclasses.replace(pods[action.name], tracked=False)
    return Observed(tuple(pods.values()), service)


PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PROPERTY_SETTINGS
@given(worlds())
def test_never_more_than_max_replicas_pods(
    world: tuple[api.DDPJob, tuple[ObservedPod, ...]],
) -> None:
    job, pods = world
    decision = run(job, *pods)
    after = apply(decision, Observed(pods, True))
    live_before = sum(p.live for p in pods)
    assert sum(p.live for p in after.pods) <= max(job.spec.effective_max, live_before)
    assert all(
        a.index < job.spec.effective_max for a in decision.actions if isinstance(a, CreatePod)
    )
    if live_before <= job.spec.effective_max:
        assert len({p.index for p in after.pods if p.live}) == sum(p.live for p in after.pods)


@PROPERTY_SETTINGS
@given(worlds(), st.booleans())
def test_applying_the_actions_then_reconciling_again_is_a_no_op(
    world: tuple[api.DDPJob, tuple[ObservedPod, ...]], service: bool
) -> None:
    job, pods = world
    first = run(job, *pods, service=service)
    if any(isinstance(a, DeleteJob) for a in first.actions):
        return
    observed = apply(first, Observed(pods, service))
    second = reconcile(job.model_copy(update={"status": first.status}), observed, T0)
    assert second.actions == ()
    assert second.status.restarts == first.status.restarts
    assert second.status.backoff_count == first.status.backoff_count


@PROPERTY_SETTINGS
@given(worlds())
def test_decisions_are_deterministic_and_names_stable(
    world: tuple[api.DDPJob, tuple[ObservedPod, ...]],
) -> None:
    job, pods = world
    first, second = run(job, *pods), run(job, *pods)
    assert first == second
    for action in first.actions:
        if isinstance(action, CreatePod):
            assert action.name == f"demo-worker-{action.index}"
            assert action.pod["spec"]["hostname"] == action.name


@PROPERTY_SETTINGS
@given(worlds())
def test_a_failed_pod_is_never_dropped_from_the_restart_count(
    world: tuple[api.DDPJob, tuple[ObservedPod, ...]],
) -> None:
    job, pods = world
    decision = run(job, *pods)
    must_count = [p for p in pods if p.phase is PodPhase.FAILED]
    assert decision.status.restarts >= len(must_count)
    counted = {f.uid for f in decision.status.failures}
    assert all(p.uid in counted for p in must_count)
    assert decision.status.backoff_count == sum(f.charged for f in decision.status.failures)


# ---- a burst of deletions in a large job is counted once it is over ------------------------------


def deleted(index: int, asked: float, grace: float = 30.0, **kw: Any) -> ObservedPod:
    """Pod ``index``, deleted by someone else ``asked`` seconds before T0 (with ``grace``),
    still running: no kubelet has confirmed its end (a lost node's pod)."""
    requested = T0 - dt.timedelta(seconds=asked)
    kw.setdefault("disruption", "DeletionByTaintManager")
    kw.setdefault("ready", False)
    return pod(
        index,
        deleting=True,
        deletion_timestamp=requested + dt.timedelta(seconds=grace),
        deletion_grace_seconds=grace,
        **kw,
    )


def large(size: int, gone: dict[int, ObservedPod]) -> tuple[ObservedPod, ...]:
    return tuple(gone.get(i) or pod(i, uid=f"uid-{i}") for i in range(size))


@pytest.mark.parametrize(
    ("size", "asked", "held", "due"),
    [
        (LARGE_JOB_PODS, [0.5], [], None),  # a small job counts each deletion at once
        (LARGE_JOB_PODS + 1, [0.5], [0], DELETION_QUIET_SECONDS - 0.5),
        (LARGE_JOB_PODS + 1, [1.5, 0.5], [0, 1], DELETION_QUIET_SECONDS - 0.5),
        (LARGE_JOB_PODS + 1, [DELETION_QUIET_SECONDS, 2.5], [], None),  # the burst is over
        # Deletions keep coming: counted DELETION_BATCH_SECONDS after the first all the same.
        (LARGE_JOB_PODS + 1, [DELETION_BATCH_SECONDS, 0.5], [], None),
        (LARGE_JOB_PODS + 1, [DELETION_BATCH_SECONDS - 1, 0.5], [0, 1], 1.0),
    ],
)
def test_held_deletions(size: int, asked: list[float], held: list[int], due: float | None) -> None:
    pods = large(size, {i: deleted(i, at, uid=f"uid-{i}") for i, at in enumerate(asked)})
    hold, left = held_deletions(pods, [], T0)
    assert sorted(hold) == [f"uid-{i}" for i in held]
    assert left == pytest.approx(due) if due is not None else left is None


def test_held_deletions_leave_out_what_is_confirmed_counted_or_untracked() -> None:
    gone = {
        0: deleted(0, 0.5, uid="uid-0"),
        1: deleted(1, 0.5, uid="uid-1", phase=PodPhase.FAILED, exit_code=143),  # confirmed
        2: deleted(2, 0.5, uid="uid-2"),  # counted already
        3: deleted(3, 0.5, uid="uid-3", tracked=False),  # released already
    }
    hold, _ = held_deletions(large(100, gone), ["uid-2"], T0)
    assert hold == {"uid-0"}


def test_a_large_jobs_burst_of_deletions_is_counted_together_once_it_is_over() -> None:
    """A lost node's pods, deleted by the taint manager over a few seconds and never confirmed:
    a pass during the burst counts none and does nothing to them (it asks to come back when the
    burst is over); the pass after counts them all, uncharged, and releases them; the force
    delete comes after the count."""
    size = 1024
    status = running_status(replicas=size, ready_replicas=size)
    job = make_job(status, replicas=size, maxReplicas=size)
    lost = range(size - 64, size)
    burst = large(size, {i: deleted(i, 1.5 if i < size - 34 else 0.0) for i in lost})
    during = run(job, *burst)
    assert during.status.restarts == 0
    assert during.status.accounted_pods == []
    assert kinds(during) == [] and released(during) == []
    assert during.requeue_after == pytest.approx(DELETION_QUIET_SECONDS)
    after = run(job, *burst, now=T0 + dt.timedelta(seconds=DELETION_QUIET_SECONDS))
    assert (after.status.restarts, after.status.backoff_count) == (64, 0)
    assert {f.reason for f in after.status.failures} == {"NodeLost"}
    assert sorted(after.status.accounted_pods) == sorted(p.uid for p in burst if p.deleting)
    assert released(after) == list(lost)
    assert kinds(after) == []  # not replaced before they are gone, not forced yet


def test_a_stuck_pod_is_force_deleted_only_once_it_is_counted() -> None:
    """300 pods stuck Terminating, none counted yet: a pass counts MAX_NEW_ACCOUNTED of them
    and force-deletes those; the other 50 wait for the next pass (before, they were
    force-deleted with the rest and joined accountedPods uncounted: 250 restarts, not 300)."""
    size = 300
    job = make_job(running_status(), replicas=size, maxReplicas=size)
    stuck = large(size, {i: deleted(i, 120.0, uid=f"uid-{i}") for i in range(size)})
    first = run(job, *stuck)
    forced = [a.index for a in first.actions if isinstance(a, DeletePod) and a.force]
    assert first.status.restarts == len(forced) == MAX_NEW_ACCOUNTED
    assert sorted(first.status.accounted_pods) == sorted(f"uid-{i}" for i in forced)
    left = tuple(p for p in stuck if p.index not in forced)
    second = run(job.model_copy(update={"status": first.status}), *left)
    assert second.status.restarts == size
    assert sorted(a.index for a in second.actions if isinstance(a, DeletePod)) == sorted(
        p.index for p in left
    )
