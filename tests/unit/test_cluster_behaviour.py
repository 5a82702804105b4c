"""The core against what real clusters do (issue: harden the core), over several passes.

Pod objects are written the way the kubelet, the scheduler, the node lifecycle controller,
PodGC and ``kubectl delete`` write them (see :mod:`tests.unit.cluster`), and go through
``observe_pod`` and ``reconcile``. Each test names the point of the issue it covers.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from ddpjob_operator import api, builders
from ddpjob_operator.core.actions import CreatePod, DeletePod, DeleteWhy, Observed, RemoveFinalizer
from ddpjob_operator.core.reconcile import reconcile
from ddpjob_operator.observe import ObservedPod, PodPhase, classify, observe_pod
from ddpjob_operator.parse import parse_job

from .cluster import GRACE, T0, Cluster, stamp
from .jobs import job as make_job


def cluster(**spec: Any) -> Cluster:
    spec.setdefault("backoffLimit", 100)
    world = Cluster(make_job(**spec))
    world.operator_pass()
    world.start_all()
    world.operator_pass()
    assert world.job.status.phase is api.JobPhase.RUNNING
    return world


def settle(world: Cluster, passes: int = 6, step: float = 1.0) -> None:
    """Operator passes with the kubelet confirming deletions, then new pods starting."""
    for _ in range(passes):
        world.operator_pass()
        world.kubelet_tick()
        world.start_all()
        world.advance(step)


def name(i: int) -> str:
    return builders.pod_name("demo", i)


# ---- 1. a pod stuck Terminating never wedges the job --------------------------------------------


def test_pod0_on_a_lost_node_is_force_deleted_at_the_bound_and_replaced() -> None:
    world = cluster()
    world.lose_node(name(0))
    first = world.operator_pass()
    [failure] = first.status.failures
    assert (failure.reason, failure.charged) == ("NodeLost", False)
    assert first.requeue_after == GRACE + 30  # due: grace period + forceDeleteAfterSeconds
    old_uid = world.pods[name(0)]["metadata"]["uid"]
    # Until the bound nothing can be done: the name is taken by the stuck pod.
    world.advance(GRACE + 29)
    waiting = world.operator_pass()
    assert not [a for a in waiting.actions if isinstance(a, (CreatePod, DeletePod))]
    assert waiting.requeue_after == 1
    world.advance(1)
    due = world.operator_pass()
    assert [a for a in due.actions if isinstance(a, DeletePod)] == [
        DeletePod(name(0), old_uid, 0, DeleteWhy.STUCK, force=True)
    ]
    assert name(0) not in world.pods  # finalizer gone, grace 0: the object is removed
    again = world.operator_pass()
    [create] = [a for a in again.actions if isinstance(a, CreatePod)]
    # The replacement answers under the same stable DNS name.
    assert create.pod["spec"]["hostname"] == name(0)
    assert create.pod["spec"]["subdomain"] == "demo"
    assert world.job.status.restarts == 1 and world.job.status.backoff_count == 0


def test_stuck_pod_bound_follows_the_grace_period_and_the_setting() -> None:
    world = cluster(forceDeleteAfterSeconds=5)
    world.lose_node(name(1))
    assert world.operator_pass().requeue_after == GRACE + 5


# ---- 2. counts are exact over any number of passes ----------------------------------------------


def test_25_pods_preempted_at_once_count_25_over_many_passes() -> None:
    world = cluster(replicas=25, minReplicas=1, maxReplicas=25)
    for i in range(25):
        world.preempt(name(i))
    for _ in range(5):
        world.operator_pass()  # the pods are still terminating: nothing confirms yet
        assert (world.job.status.restarts, world.job.status.backoff_count) == (25, 0)
    settle(world, passes=8)
    assert (world.job.status.restarts, world.job.status.backoff_count) == (25, 0)
    assert len(world.job.status.failures) == api.MAX_RECENT_FAILURES
    assert len(world.live_pods()) == 25


def test_a_force_deleted_pod_cannot_vanish_uncounted() -> None:
    world = cluster()
    world.user_delete(name(1), force=True)
    assert name(1) in world.pods  # our finalizer holds it until its outcome is counted
    decision = world.operator_pass()
    assert decision.status.restarts == 1
    assert [f.reason for f in decision.status.failures] == ["Deleted"]
    assert name(1) not in world.pods  # released, gone
    settle(world)
    assert world.job.status.restarts == 1


def test_pod_gc_on_a_deleted_node_is_node_lost_and_counted_once() -> None:
    world = cluster()
    world.pod_gc(name(1))
    settle(world)
    assert world.job.status.restarts == 1 and world.job.status.backoff_count == 0
    assert [f.reason for f in world.job.status.failures] == ["NodeLost"]


def test_built_pods_carry_the_tracking_finalizer() -> None:
    pod = builders.build_pod(make_job(), 0)
    assert pod["metadata"]["finalizers"] == [api.POD_FINALIZER]


# ---- 3. the operator's own deletions are never failures -------------------------------------


def test_scaling_3_2_3_within_the_grace_period_counts_nothing() -> None:
    world = cluster(replicas=3, minReplicas=1, maxReplicas=3)
    world.set_spec(replicas=2)
    world.operator_pass()
    world.set_spec(replicas=3)
    for _ in range(3):
        world.operator_pass()  # pod 2 still terminating: no duplicate, no count
    world.kubelet_tick()
    settle(world)
    assert world.job.status.restarts == 0 and world.job.status.failures == []
    assert world.live_pods() == [name(0), name(1), name(2)]


def test_suspend_then_resume_while_pods_still_terminate_counts_nothing() -> None:
    world = cluster()
    world.set_spec(suspend=True)
    world.operator_pass()
    world.set_spec(suspend=False)
    world.operator_pass()
    world.kubelet_tick()  # the suspended pods end Failed (SIGTERM), then go
    settle(world)
    status = world.job.status
    assert status.restarts == 0 and status.failures == []
    assert status.phase is api.JobPhase.RUNNING
    restarting = next(c for c in status.conditions if c.type == "Restarting")
    assert restarting.status == "False"


def test_cleanup_after_failure_counts_nothing_more() -> None:
    world = cluster(backoffLimit=0, cleanPodPolicy="All")
    world.fail(name(1))
    settle(world)
    assert world.job.status.phase is api.JobPhase.FAILED
    assert world.job.status.restarts == 1
    assert world.pods == {}  # cleaned up, finalizers released


# ---- 4. classification is exact -------------------------------------------------------------


def test_oom_killed_trainer_next_to_a_sidecar_that_exited_0() -> None:
    world = cluster()
    world.start(name(1), sidecar=True)
    pod = world.pods[name(1)]
    pod["status"]["phase"] = "Failed"
    pod["status"]["containerStatuses"] = [  # sorted by name, as the kubelet writes them
        {"name": "istio-proxy", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}},
        {"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}},
    ]
    decision = world.operator_pass()
    assert [(f.reason, f.exit_code, f.charged) for f in decision.status.failures] == [
        ("OOMKilled", 137, True)
    ]


@pytest.mark.parametrize(("code", "reason"), [(255, "Unknown"), (137, "ContainerStatusUnknown")])
def test_a_trainer_its_node_lost_in_a_restart_is_not_charged(code: int, reason: str) -> None:
    """After the node restarts, containerd reports the containers whose tasks it lost as exited
    255 ``Unknown`` (kind: a node killed and started again), and the kubelet one it cannot find
    as 137 ``ContainerStatusUnknown``: a lost node, not the trainer's failure."""
    world = cluster()
    world.start(name(1))
    pod = world.pods[name(1)]
    pod["status"]["phase"] = "Failed"
    pod["status"]["containerStatuses"] = [
        {"name": "trainer", "state": {"terminated": {"exitCode": code, "reason": reason}}},
    ]
    decision = world.operator_pass()
    assert [(f.reason, f.exit_code, f.charged) for f in decision.status.failures] == [
        ("NodeLost", code, False)
    ]
    assert decision.status.backoff_count == 0


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("PreemptionByScheduler", "Preempted"),
        ("PreemptionByKubeScheduler", "Preempted"),
        ("EvictionByEvictionAPI", "Evicted"),
        ("TerminationByKubelet", "Evicted"),
        ("DeletionByTaintManager", "NodeLost"),
        ("DeletionByPodGC", "NodeLost"),
        ("SomethingNewer", "Evicted"),
    ],
)
def test_disruption_target_table(reason: str, expected: str) -> None:
    pod = _pod_object(
        phase="Failed",
        conditions=[{"type": "DisruptionTarget", "status": "True", "reason": reason}],
        trainer={"terminated": {"exitCode": 1, "reason": "Error"}},
    )
    observed = observe_pod(pod)
    assert observed is not None and classify(observed) == expected


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("Evicted", "Evicted"),
        ("NodeLost", "NodeLost"),
        ("Shutdown", "Evicted"),
        ("Terminated", "Evicted"),
        ("OutOfcpu", "Evicted"),
        ("UnexpectedAdmissionError", "Evicted"),
    ],
)
def test_status_reason_table(reason: str, expected: str) -> None:
    pod = _pod_object(phase="Failed", reason=reason)
    observed = observe_pod(pod)
    assert observed is not None and classify(observed) == expected


def test_user_deleted_pod_first_seen_failed_is_deleted_not_137() -> None:
    world = cluster()
    world.user_delete(name(1))
    world.kubelet_tick()  # killed on deletion: Failed, exit 137/143, before we look
    world.pods[name(1)]["metadata"]["finalizers"] = [api.POD_FINALIZER]
    decision = world.operator_pass()
    assert [(f.reason, f.charged) for f in decision.status.failures] == [("Deleted", False)]


def test_a_pod_that_failed_before_someone_deleted_it_keeps_its_exit_code() -> None:
    world = cluster()
    world.fail(name(1), code=3)
    world.advance(60)  # well before: a kubelet's confirmation cannot be that late
    world.delete(name(1))
    decision = world.operator_pass()
    assert [(f.reason, f.charged) for f in decision.status.failures] == [("ExitCode(3)", True)]


@pytest.mark.parametrize("second_delete", ["kubelet", "force"])
def test_a_deletion_first_seen_after_a_clamped_second_delete_is_deleted(
    second_delete: str,
) -> None:
    """Since 1.33 a shorter second delete moves deletionTimestamp to its own time, not into the
    past (issue 14 point 10): the request time cannot be read back from it. The kubelet's own
    final delete is such a delete."""
    world = cluster()
    world.user_delete(name(1))  # kubectl delete pod: grace 30
    world.advance(5)
    world.kill_containers(name(1), code=137)  # the agent took too long: SIGKILL
    world.pods[name(1)]["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = (
        stamp(world.now)
    )
    world.advance(3)
    if second_delete == "kubelet":
        world.kubelet_confirm(name(1))
    else:
        world.delete(name(1), grace=0)  # kubectl delete --force
    meta = world.pods[name(1)]["metadata"]
    assert (meta["deletionTimestamp"], meta["deletionGracePeriodSeconds"]) == (stamp(world.now), 0)
    decision = world.operator_pass()  # the operator's first look at it
    assert [(f.reason, f.charged) for f in decision.status.failures] == [("Deleted", False)]


@pytest.mark.parametrize(
    ("grace", "ended_before", "reason"),
    [
        (30, 1, "ExitCode(137)"),  # exact request time: the trainer ended 1 s before it
        (30, -1, "Deleted"),
        (2, 1, "ExitCode(137)"),
        (1, 1, "Deleted"),  # a grace of 0 or 1 may be clamped: only well before counts
        (0, 5, "Deleted"),
        (0, 31, "ExitCode(137)"),
        (1, 31, "ExitCode(137)"),
    ],
)
def test_deletion_request_time_table(grace: int, ended_before: int, reason: str) -> None:
    requested = T0
    pod = ObservedPod(
        name="p",
        index=1,
        uid="u",
        phase=PodPhase.FAILED,
        deleting=True,
        deletion_timestamp=requested + dt.timedelta(seconds=grace),
        deletion_grace_seconds=grace,
        exit_code=137,
        finished_at=requested - dt.timedelta(seconds=ended_before),
    )
    assert classify(pod) == reason


# ---- 5. sidecars ------------------------------------------------------------------------------


def test_trainer_done_while_a_sidecar_runs_counts_as_finished() -> None:
    world = cluster()
    for i in (0, 1):
        world.start(name(i), sidecar=True)
    world.succeed(name(0))
    world.succeed(name(1))
    assert world.pods[name(0)]["status"]["phase"] == "Running"  # the sidecar keeps it up
    decision = world.operator_pass()
    assert decision.status.phase is api.JobPhase.SUCCEEDED
    # cleanPodPolicy Running: the pods still hold their resources, so they are deleted.
    deletes = [a for a in decision.actions if isinstance(a, DeletePod)]
    assert {a.why for a in deletes} == {DeleteWhy.CLEANUP} and len(deletes) == 2


def test_a_finished_pod_whose_kubelet_is_still_tearing_down_is_kept() -> None:
    """A real kubelet reports the trainer terminated (exit 0) a moment before the pod's phase
    goes terminal: it stops every container and the sandbox first (seen on kind). With no other
    container running, the pod holds nothing: cleanPodPolicy Running keeps it, and its log.
    (Before, it was taken for a pod with a sidecar and deleted.)"""
    world = cluster()
    for i in (0, 1):
        world.start(name(i))
    world.succeed(name(0))
    world.succeed(name(1))
    for i in (0, 1):
        world.pods[name(i)]["status"]["phase"] = "Running"  # not written yet by the kubelet
    decision = world.operator_pass()
    assert decision.status.phase is api.JobPhase.SUCCEEDED
    assert [a for a in decision.actions if isinstance(a, DeletePod)] == []


def test_trainer_failed_while_a_sidecar_runs_is_replaced() -> None:
    world = cluster()
    world.start(name(1), sidecar=True)
    world.fail(name(1), code=2)
    assert world.pods[name(1)]["status"]["phase"] == "Running"
    decision = world.operator_pass()
    assert [f.reason for f in decision.status.failures] == ["ExitCode(2)"]
    assert [a.why for a in decision.actions if isinstance(a, DeletePod)] == [DeleteWhy.REPLACE]


# ---- 6. a DDPJob being deleted creates nothing --------------------------------------------


def test_a_job_being_deleted_creates_nothing_and_releases_its_pods() -> None:
    world = cluster()
    world.fail(name(1))
    meta = world.job.metadata.model_copy(update={"deletion_timestamp": world.now})
    world.job = world.job.model_copy(update={"metadata": meta})
    decision = world.operator_pass()
    assert not [a for a in decision.actions if not isinstance(a, RemoveFinalizer)]
    assert sorted(a.index for a in decision.actions if isinstance(a, RemoveFinalizer)) == [0, 1]
    fresh = reconcile(world.job, Observed(()), world.now)
    assert fresh.actions == ()


# ---- 7. suspend --------------------------------------------------------------------------------


def test_suspending_a_completing_job_keeps_succeeded_pods_and_completion() -> None:
    world = cluster(replicas=3, minReplicas=1, maxReplicas=3)
    world.succeed(name(0))
    world.operator_pass()
    world.set_spec(suspend=True)
    suspended = world.operator_pass()
    assert sorted(a.index for a in suspended.actions if isinstance(a, DeletePod)) == [1, 2]
    world.kubelet_tick()
    world.set_spec(suspend=False)
    settle(world)
    assert world.job.status.phase is api.JobPhase.SUCCEEDED
    assert world.job.status.restarts == 0
    assert name(0) in world.pods  # kept for its logs
    assert world.created == 3  # nothing was created after the first success


def test_resume_does_not_claim_restarting() -> None:
    world = cluster()
    world.fail(name(1))
    world.operator_pass()
    assert world.job.status.phase is api.JobPhase.RUNNING
    world.lose_node(name(0))
    world.operator_pass()
    world.set_spec(suspend=True)
    world.operator_pass()
    world.set_spec(suspend=False)
    resumed = world.operator_pass()
    assert resumed.status.phase is api.JobPhase.PENDING
    assert all(c.status == "False" for c in resumed.status.conditions if c.type == "Restarting")
    assert resumed.status.below_min_since is None


# ---- 8. pending pods never fail a job in silence ----------------------------------------------


def test_pods_that_never_started_report_why_and_start_no_clock() -> None:
    world = Cluster(make_job(rendezvous={"joinTimeoutSeconds": 60}))
    world.operator_pass()
    world.pods[name(0)]["status"] = {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
            }
        ],
    }
    world.pods[name(1)]["spec"]["nodeName"] = "node-a"
    world.pods[name(1)]["status"] = {
        "phase": "Pending",
        "containerStatuses": [
            {
                "name": "trainer",
                "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling"}},
            }
        ],
    }
    first = world.operator_pass()
    assert [(w.pod, w.reason) for w in first.status.waiting] == [
        (name(0), "Unschedulable"),
        (name(1), "ImagePullBackOff"),
    ]
    assert [e.reason for e in first.events].count("PodWaiting") == 2
    running = next(c for c in first.status.conditions if c.type == "Running")
    assert "Insufficient nvidia.com/gpu" in running.message
    assert "ImagePullBackOff" in running.message
    world.advance(3600)  # an hour of image pulls and node provisioning
    later = world.operator_pass()
    assert later.status.phase is api.JobPhase.PENDING and later.status.below_min_since is None
    assert "PodWaiting" not in [e.reason for e in later.events]  # no event spam


def test_below_min_failure_names_the_waiting_reason() -> None:
    world = cluster(minReplicas=2, rendezvous={"joinTimeoutSeconds": 120})
    world.lose_node(name(1))
    settle(world, passes=1)
    world.advance(GRACE + 31)
    world.operator_pass()  # force delete
    world.operator_pass()  # replacement created
    world.pods[name(1)]["status"] = {
        "phase": "Pending",
        "containerStatuses": [
            {"name": "trainer", "state": {"waiting": {"reason": "ErrImagePull"}}}
        ],
    }
    world.advance(61)
    decision = world.operator_pass()
    assert decision.status.phase is api.JobPhase.FAILED
    failed = next(c for c in decision.status.conditions if c.type == "Failed")
    assert failed.reason == "BelowMinReplicas" and "ErrImagePull" in failed.message


# ---- 9. the default security context works with root images ---------------------------------


def test_default_profile_tolerates_root_images() -> None:
    pod = builders.build_pod(make_job(), 0)
    assert "runAsNonRoot" not in pod["spec"]["securityContext"]
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    trainer = pod["spec"]["containers"][0]["securityContext"]
    assert trainer == {"allowPrivilegeEscalation": False}


def test_restricted_profile_is_a_switch_per_job_or_per_operator() -> None:
    template = {
        "spec": {
            "containers": [{"name": "trainer", "image": "x"}, {"name": "logs", "image": "y"}],
            "initContainers": [{"name": "init", "image": "z"}],
        }
    }
    restricted = builders.build_pod(make_job(template=template, securityProfile="Restricted"), 0)
    via_operator = builders.build_pod(
        make_job(template=template), 0, default_profile=api.SecurityProfile.RESTRICTED
    )
    assert restricted == via_operator
    assert restricted["spec"]["securityContext"]["runAsNonRoot"] is True
    for key in ("containers", "initContainers"):
        for container in restricted["spec"][key]:
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
                "runAsNonRoot": True,
            }


def test_a_pod_refused_for_running_as_root_names_the_fix() -> None:
    pod = _pod_object(
        phase="Pending",
        trainer={
            "waiting": {
                "reason": "CreateContainerConfigError",
                "message": "container has runAsNonRoot and image will run as root",
            }
        },
    )
    observed = observe_pod(pod)
    assert observed is not None and observed.waiting_reason == "CreateContainerConfigError"
    assert "runAsUser" in observed.waiting_message and "Baseline" in observed.waiting_message


# ---- 10. lenient status -----------------------------------------------------------------------


def test_status_written_by_someone_else_still_parses() -> None:
    document = make_job().model_dump(by_alias=True, mode="json")
    document["status"] = {
        "phase": "Running",
        "conditions": [
            {
                "type": "QueueAdmitted",
                "status": "True",
                "reason": "Kueue",
                "lastTransitionTime": stamp(T0),
            }
        ],
        "failures": [
            {
                "pod": "demo-worker-1",
                "index": 1,
                "reason": "GPUXidError",
                "charged": True,
                "time": stamp(T0),
                "futureField": 1,
            }
        ],
        "somethingNew": {"a": 1},
    }
    job = parse_job(document)
    assert job.status.conditions[0].type == "QueueAdmitted"
    assert job.status.failures[0].reason == "GPUXidError"


# ---- helpers -------------------------------------------------------------------------------


def _pod_object(
    phase: str,
    conditions: list[dict[str, Any]] | None = None,
    trainer: dict[str, Any] | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    pod = builders.build_pod(make_job(), 1)
    status: dict[str, Any] = {"phase": phase, "conditions": conditions or []}
    if trainer is not None:
        status["containerStatuses"] = [{"name": "trainer", "state": trainer}]
    if reason is not None:
        status["reason"] = reason
    pod["status"] = status
    pod["metadata"]["uid"] = "u1"
    return pod


def test_observed_pod_deletion_request_time() -> None:
    pod = ObservedPod(
        name="p",
        index=0,
        uid="u",
        phase=PodPhase.RUNNING,
        deleting=True,
        deletion_timestamp=T0,
        deletion_grace_seconds=30,
    )
    assert pod.deletion_requested_at == T0 - dt.timedelta(seconds=30)
