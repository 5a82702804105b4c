"""The real ``ddpjob operator`` process, on the API emulator and on the real control plane.

Every scenario of the operator issue is a test here: create, failure, preemption, budget,
scaling through the scale subresource, suspend/resume, deadline, pod 0 deleted, pod 0's node
lost, SIGKILL mid-reconcile, injected 500/409/watch drops, an invalid spec next to a healthy job,
namespaces, success with cleanup, and deletion.

Scenarios that need no fault injection run on both backends (``[emulator]`` and ``[real]``,
:mod:`.operator_env`): on the real one, a real kube-apiserver, controllers and scheduler, and
process kubelets running each pod as a real process (a stand-in trainer that exits as told).
Injected 500s, 409 storms, watch drops and refused pods stay emulator-only; the real
control plane's own faults (node loss, the operator SIGKILLed mid-scale) are in
``test_real_cluster.py``.
"""

from __future__ import annotations

import base64
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.harness.agents import processes_with_env
from tests.harness.operator_env import EmulatorEnv, OperatorEnv, operator_env, real_env, wait_for

pytestmark = pytest.mark.slow

FINALIZER = "ddpjob.io/pod-tracking"
BACKENDS = ["emulator", "real"]


@pytest.fixture(params=BACKENDS)
def world(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OperatorEnv]:
    """A backend with no operator running yet."""
    if request.param == "emulator":
        with operator_env(tmp_path) as emulated:
            yield emulated
        return
    yield real_env(request.getfixturevalue("kube"), tmp_path)


@pytest.fixture
def env(world: OperatorEnv) -> OperatorEnv:
    world.start_operator()
    return world


@pytest.fixture
def emulated(tmp_path: Path) -> Iterator[EmulatorEnv]:
    """The emulator only: for injected faults the real server will not produce on demand."""
    with operator_env(tmp_path) as emulator:
        emulator.start_operator()
        yield emulator


def names(pods: list[dict[str, Any]]) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


def live(env: OperatorEnv, job: str, namespace: str | None = None) -> list[str]:
    return names(
        [p for p in env.pods(job, namespace) if not p["metadata"].get("deletionTimestamp")]
    )


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]
    }


def running_job(env: OperatorEnv, name: str, replicas: int = 2, **spec: Any) -> None:
    env.create_job(name, replicas=replicas, **spec)
    wait_for(lambda: len(env.pods(name)) == replicas, f"{replicas} pods of {name}")
    env.run_pods(name)
    wait_for(lambda: env.status(name).get("phase") == "Running", f"{name} Running")


def phase_of(env: OperatorEnv, pod: str) -> str | None:
    found = env.pod(pod)
    return None if found is None else found.get("status", {}).get("phase")


def counts(env: OperatorEnv, name: str) -> tuple[int, int]:
    status = env.status(name)
    return status.get("restarts", 0), status.get("backoffCount", 0)


def test_create_makes_the_service_and_every_pod_with_the_env(env: OperatorEnv) -> None:
    created = env.create_job("alpha", replicas=3)
    pods = wait_for(lambda: len(env.pods("alpha")) == 3 and env.pods("alpha"), "3 pods")
    assert names(pods) == ["alpha-worker-0", "alpha-worker-1", "alpha-worker-2"]
    service = wait_for(lambda: env.get_object("v1/services", env.namespace, "alpha"), "the Service")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    uid = created["metadata"]["uid"]
    for index, pod in enumerate(pods):
        meta = pod["metadata"]
        assert meta["labels"]["ddpjob.io/job-name"] == "alpha"
        assert meta["labels"]["ddpjob.io/replica-index"] == str(index)
        assert meta["finalizers"] == [FINALIZER]
        assert meta["ownerReferences"][0]["uid"] == uid
        assert pod["spec"]["hostname"] == f"alpha-worker-{index}"
        assert pod["spec"]["subdomain"] == "alpha"
        variables = env_of(pod)
        assert variables["PET_RDZV_ENDPOINT"] == f"alpha-worker-0.alpha.{env.namespace}.svc:29400"
        assert variables["DDPJOB_STORE_KEY"] == {
            "secretKeyRef": {"name": "alpha-store-key", "key": "key"}
        }
        assert variables["PET_NNODES"] == "1:4"
        assert variables["DDPJOB_RDZV_HOST"] == ("1" if index == 0 else "0")
    status = wait_for(lambda: env.status("alpha").get("selector") and env.status("alpha"), "status")
    # The emulator runs no pod until the test does; real kubelets may have started them all.
    started = ("Pending",) if env.backend == "emulator" else ("Pending", "Running")
    assert status["phase"] in started
    assert status["observedGeneration"] == 1
    # The job gets our finalizer (not kopf's), and no kopf annotation under kopf's prefix.
    job = env.job("alpha")
    assert job is not None
    assert job["metadata"]["finalizers"] == ["ddpjob.io/operator"]
    assert not [a for a in job["metadata"].get("annotations", {}) if a.startswith("kopf.")]
    env.run_pods("alpha")
    running = wait_for(
        lambda: env.status("alpha").get("readyReplicas") == 3 and env.status("alpha"), "3 ready"
    )
    assert running["phase"] == "Running"
    assert env.events(reason="CreatedPods")
    # The store key: the job's own Secret, made before its pods, which read it (on the real
    # backend the process kubelet put it into every trainer's environment).
    secret = env.get_object("v1/secrets", env.namespace, "alpha-store-key")
    assert secret is not None
    assert secret["metadata"]["ownerReferences"][0]["uid"] == uid
    assert (secret["type"], secret["immutable"], list(secret["data"])) == ("Opaque", True, ["key"])
    key = base64.b64decode(secret["data"]["key"]).decode()
    assert len(key) == 43
    if env.backend == "real":
        keyed = {pid for pid, _ in processes_with_env("DDPJOB_STORE_KEY", key)}
        for pod in env.pods("alpha"):
            trainer = {pid for pid, _ in processes_with_env("POD_UID", pod["metadata"]["uid"])}
            assert trainer and trainer <= keyed, pod["metadata"]["name"]


def test_a_failed_pod_is_replaced_and_counted_once(env: OperatorEnv) -> None:
    running_job(env, "beta")
    old = env.pod("beta-worker-1")
    assert old is not None
    env.finish_pod("beta-worker-1", exit_code=1)
    wait_for(lambda: counts(env, "beta") == (1, 1), "restarts and backoffCount at 1")
    replacement = env.replacement(old, "a new beta-worker-1")
    assert replacement["metadata"]["finalizers"] == [FINALIZER]
    [failure] = env.status("beta")["failures"]
    assert (failure["pod"], failure["reason"], failure["charged"]) == (
        "beta-worker-1",
        "ExitCode(1)",
        True,
    )
    wait_for(lambda: env.events(reason="PodFailed"), "the PodFailed event")
    time.sleep(1.0)
    assert counts(env, "beta") == (1, 1)  # later passes never count it again
    assert len(env.pods("beta")) == 2


def test_a_preempted_pod_is_replaced_for_free(env: OperatorEnv) -> None:
    running_job(env, "gamma")
    env.mark_disruption("gamma-worker-1", "PreemptionByScheduler")
    assert env.delete_pod("gamma-worker-1") == 200
    wait_for(lambda: env.status("gamma").get("restarts") == 1, "the preemption counted")
    assert env.status("gamma")["backoffCount"] == 0
    assert env.status("gamma")["failures"][0]["reason"] == "Preempted"
    env.confirm_deletions("gamma")
    wait_for(lambda: "gamma-worker-1" in live(env, "gamma"), "gamma-worker-1 recreated")
    assert counts(env, "gamma") == (1, 0)


def test_the_budget_spent_fails_the_job(env: OperatorEnv) -> None:
    running_job(env, "delta", backoffLimit=1)
    old = env.pod("delta-worker-1")
    last = env.pod("delta-worker-0")
    assert old is not None and last is not None
    env.finish_pod("delta-worker-1", exit_code=3)
    wait_for(lambda: counts(env, "delta") == (1, 1), "first failure")
    env.replacement(old, "delta-worker-1 replaced")
    env.run_pods("delta")
    env.finish_pod("delta-worker-0", exit_code=3)
    status = wait_for(
        lambda: env.status("delta").get("phase") == "Failed" and env.status("delta"), "Failed"
    )
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert status["backoffCount"] == 2
    # cleanPodPolicy Running: the pod still running is deleted, the failed one kept for logs
    # (the same pod, Failed, released: nothing holds it but its logs' worth).
    wait_for(lambda: "delta-worker-1" not in live(env, "delta"), "cleanup")
    env.confirm_deletions("delta")
    wait_for(lambda: names(env.pods("delta")) == ["delta-worker-0"], "the running pod gone")
    kept = wait_for(
        lambda: (
            (pod := env.pod("delta-worker-0")) and not pod["metadata"].get("finalizers") and pod
        ),
        "the failed pod released",
    )
    assert kept["metadata"]["uid"] == last["metadata"]["uid"]
    assert (kept["status"]["phase"], kept["metadata"].get("deletionTimestamp")) == ("Failed", None)


def test_scale_up_then_down_through_the_scale_subresource(env: OperatorEnv) -> None:
    running_job(env, "eps")
    env.scale("eps", 4)
    wait_for(lambda: len(live(env, "eps")) == 4, "4 pods")
    env.run_pods("eps")
    wait_for(lambda: env.status("eps").get("replicas") == 4, "status.replicas 4")
    env.scale("eps", 1)
    wait_for(lambda: live(env, "eps") == ["eps-worker-0"], "scaled to pod 0 only")
    env.confirm_deletions("eps")
    wait_for(lambda: names(env.pods("eps")) == ["eps-worker-0"], "the others gone")
    assert counts(env, "eps") == (0, 0)
    assert env.status("eps")["failures"] == []
    # Events come from kopf's queue after the pass's actions.
    wait_for(lambda: env.events(reason="ScalingDown"), "the ScalingDown event")
    over = env.api(
        "GET", f"/apis/ddpjob.io/v1alpha1/namespaces/{env.namespace}/ddpjobs/eps/scale"
    ).json()
    assert over["spec"]["replicas"] == 1


def test_suspend_then_resume(env: OperatorEnv) -> None:
    running_job(env, "zeta")
    env.patch_job("zeta", {"spec": {"suspend": True}})
    wait_for(lambda: env.status("zeta").get("phase") == "Suspended", "Suspended")
    wait_for(lambda: live(env, "zeta") == [], "every pod deleted")
    env.confirm_deletions("zeta")
    wait_for(lambda: env.pods("zeta") == [], "the pods gone")
    env.patch_job("zeta", {"spec": {"suspend": False}})
    wait_for(lambda: len(live(env, "zeta")) == 2, "pods again")
    env.run_pods("zeta")
    status = wait_for(
        lambda: env.status("zeta").get("phase") == "Running" and env.status("zeta"), "Running"
    )
    assert (status["restarts"], status["backoffCount"]) == (0, 0)
    assert all(c["status"] == "False" for c in status["conditions"] if c["type"] == "Restarting")


def test_the_deadline_passes(env: OperatorEnv) -> None:
    running_job(env, "eta", activeDeadlineSeconds=2)
    status = wait_for(
        lambda: env.status("eta").get("phase") == "Failed" and env.status("eta"),
        "Failed",
        timeout=15,
    )
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded"
    wait_for(lambda: live(env, "eta") == [], "running pods cleaned up")


def test_pod0_deleted_by_a_user_comes_back_under_the_same_name(env: OperatorEnv) -> None:
    running_job(env, "theta")
    old, other = env.pod("theta-worker-0"), env.pod("theta-worker-1")
    assert old is not None and other is not None
    assert env.delete_pod("theta-worker-0") == 200
    wait_for(lambda: env.status("theta").get("restarts") == 1, "the deletion counted")
    env.confirm_deletions("theta")
    new = env.replacement(old, "pod 0 recreated")
    assert (new["spec"]["hostname"], new["spec"]["subdomain"]) == ("theta-worker-0", "theta")
    assert env.status("theta")["failures"][0]["reason"] == "Deleted"
    assert counts(env, "theta") == (1, 0)
    untouched = env.pod("theta-worker-1")  # the same pod, never deleted
    assert untouched is not None and not untouched["metadata"].get("deletionTimestamp")
    assert untouched["metadata"]["uid"] == other["metadata"]["uid"]


def test_pod0_on_a_lost_node_recovers_within_the_bound(emulated: EmulatorEnv) -> None:
    """The emulated node controllers; the real ones: test_real_cluster.py."""
    env = emulated
    running_job(env, "iota", forceDeleteAfterSeconds=2)
    pod = env.pod("iota-worker-0")
    assert pod is not None
    # The node lifecycle controller: DisruptionTarget, then a graceful delete no kubelet confirms.
    env.control.set_pod_phase(
        "default",
        "iota-worker-0",
        "Running",
        conditions=[
            {"type": "Ready", "status": "False"},
            {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"},
        ],
    )
    assert env.delete("/api/v1/namespaces/default/pods/iota-worker-0", gracePeriodSeconds=1) == 200
    started = time.monotonic()
    env.replacement(pod, "pod 0 replaced", timeout=20)
    elapsed = time.monotonic() - started
    assert elapsed < 1 + 2 + 5, f"replaced after {elapsed:.1f}s; the bound is grace 1 s + 2 s"
    status = env.status("iota")
    assert status["failures"][0]["reason"] == "NodeLost"
    assert (status["restarts"], status["backoffCount"]) == (1, 0)


def test_sigkill_mid_reconcile_then_restart_makes_no_duplicates_and_exact_counts(
    emulated: EmulatorEnv,
) -> None:
    env = emulated
    running_job(env, "kappa", replicas=3)
    old = [env.pod(f"kappa-worker-{index}") for index in (1, 2)]
    # Hold every pod creation for 3 s, so the operator is mid-pass when it dies.
    env.control.add_fault("POST", r"/pods$", 0, count=100, delay=3)  # 0: delay only
    env.finish_pod("kappa-worker-2", exit_code=1)
    wait_for(lambda: counts(env, "kappa") == (1, 1), "failure counted")
    time.sleep(0.5)
    env.stop_operator(signal.SIGKILL)
    env.control.clear_faults()
    env.finish_pod("kappa-worker-1", exit_code=137, reason="OOMKilled")
    env.start_operator()
    wait_for(lambda: counts(env, "kappa") == (2, 2), "second failure counted once", timeout=30)
    # The killed operator's held create of worker-2 may still land after the kill: either way
    # each failed pod gets one replacement (a new uid), and the failed ones are never live.
    for pod in old:
        assert pod is not None
        env.replacement(pod, f"a new {pod['metadata']['name']}", timeout=30)
    wait_for(lambda: len(live(env, "kappa")) == 3, "3 live pods", timeout=30)
    env.run_pods("kappa")
    wait_for(lambda: env.status("kappa").get("phase") == "Running", "Running again")

    def creates() -> int:
        return int(env.control.count_requests("create", "pods", status=201))

    # The first three, then one replacement per failed pod.
    wait_for(lambda: creates() == 3 + 2, "5 pod creations")
    time.sleep(1.5)  # a duplicate creation or a recount would show by now
    assert counts(env, "kappa") == (2, 2)
    assert names(env.pods("kappa")) == ["kappa-worker-0", "kappa-worker-1", "kappa-worker-2"]
    reasons = sorted(f["reason"] for f in env.status("kappa")["failures"])
    assert reasons == ["ExitCode(1)", "OOMKilled"]
    assert creates() == 3 + 2
    # The store-key Secret was made once; the restarted operator posted it again and took the
    # 409 for the job's own Secret as success (its replacements read the same key).
    assert env.control.count_requests("create", "secrets", status=201) == 1
    assert env.control.count_requests("create", "secrets", status=409) == 1


def test_injected_500s_409s_and_watch_drops_converge(emulated: EmulatorEnv) -> None:
    env = emulated
    env.control.add_fault("POST", r"/pods$", 500, count=3)
    env.control.add_fault("PATCH", r"/ddpjobs/lam/status$", 409, count=2)
    env.create_job("lam", replicas=3)
    wait_for(lambda: len(env.pods("lam")) == 3, "3 pods despite 500s")
    env.control.drop_watches()
    env.run_pods("lam")
    wait_for(lambda: env.status("lam").get("phase") == "Running", "Running despite 409s and drops")
    env.control.add_fault("DELETE", r"/pods/lam-worker-2$", 500, count=2)
    env.control.drop_watches(abort=True)
    old = env.pod("lam-worker-2")
    assert old is not None
    env.finish_pod("lam-worker-2", exit_code=1)
    wait_for(lambda: counts(env, "lam") == (1, 1), "failure counted")

    def deleting() -> bool:  # gone, replaced already, or awaiting the kubelet
        pod = env.pod("lam-worker-2")
        return (
            pod is None
            or pod["metadata"]["uid"] != old["metadata"]["uid"]
            or bool(pod["metadata"].get("deletionTimestamp"))
        )

    wait_for(deleting, "the failed pod deleted despite two 500s")
    env.confirm_deletions("lam")
    env.replacement(old, "a new lam-worker-2")
    wait_for(lambda: len(live(env, "lam")) == 3, "3 live pods")
    assert env.control.count_requests("delete", "pods", status=500) == 2  # both faults met
    assert counts(env, "lam") == (1, 1)
    assert 'ddpjob_api_errors_total{code="500"}' in env.metrics()


def test_an_invalid_spec_is_reported_on_that_job_only(emulated: EmulatorEnv) -> None:
    """The real server refuses such a spec at the door (test_real_cluster.py); a spec that
    slipped past an older CRD is what this covers. It is not terminal (a newer CRD or operator
    may read it): an InvalidSpec condition names the fields, no pod is made, and the other
    job is served."""
    env = emulated
    env.expect_failures(
        r"error: invalid DDPJob: spec\.nprocPerNode: must be an integer >= 1 or 'auto' \(got 0\)"
        r".* \[DDPJob default/mu\]$"
    )
    bad = {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": "mu", "namespace": "default"},
        "spec": {"replicas": 2, "nprocPerNode": 0, "template": {"spec": {"containers": []}}},
    }
    response = env.api("POST", "/apis/ddpjob.io/v1alpha1/namespaces/default/ddpjobs", bad)
    assert response.status_code == 201  # the emulator has no schema: it slipped past
    running_job(env, "nu")

    def invalid() -> dict[str, Any] | None:
        conditions = env.status("mu").get("conditions") or []
        return next((c for c in conditions if c["type"] == "InvalidSpec"), None)

    condition = wait_for(invalid, "mu's InvalidSpec condition")
    assert (condition["status"], condition["reason"]) == ("True", "InvalidSpec")
    message = condition["message"]
    assert "spec.nprocPerNode" in message and "spec.template.spec.containers" in message
    assert env.status("mu").get("phase") != "Failed"
    wait_for(lambda: env.events(reason="InvalidSpec"), "the InvalidSpec event")
    assert env.pods("mu") == []
    env.finish_pod("nu-worker-1", exit_code=1)
    wait_for(lambda: counts(env, "nu") == (1, 1), "the other job still served")


def test_a_namespace_the_operator_does_not_watch_is_untouched(world: OperatorEnv) -> None:
    team_a, team_b = world.add_namespace("team-a"), world.add_namespace("team-b")
    world.start_operator(namespaces=(team_a,))
    world.create_job("xi", namespace=team_b)
    world.create_job("xi", namespace=team_a)
    wait_for(lambda: len(world.pods("xi", team_a)) == 2, "team-a served")
    time.sleep(1.5)
    assert world.pods("xi", team_b) == []
    assert world.status("xi", team_b) == {}
    job = world.job("xi", team_b)
    assert job is not None and not job["metadata"].get("finalizers")


@pytest.mark.parametrize(("policy", "kept"), [("Running", 2), ("All", 0)])
def test_all_pods_succeed_then_cleanup_follows_the_policy(
    env: OperatorEnv, policy: str, kept: int
) -> None:
    running_job(env, "omicron", cleanPodPolicy=policy)
    env.finish_pod("omicron-worker-0", exit_code=0, reason="Completed")
    wait_for(lambda: env.status("omicron").get("succeeded") == 1, "completing")
    env.finish_pod("omicron-worker-1", exit_code=0, reason="Completed")
    status = wait_for(
        lambda: env.status("omicron").get("phase") == "Succeeded" and env.status("omicron"),
        "Succeeded",
    )
    assert status["completionTime"]
    wait_for(lambda: len(env.pods("omicron")) == kept, f"{kept} pods kept")
    for pod in env.pods("omicron"):
        assert pod["metadata"].get("finalizers") in (None, [])  # released
    # kopf posts events from a queue of its own, after the pass's actions: it may come later.
    wait_for(lambda: env.events(reason="Succeeded"), "the Succeeded event")


def test_a_deleted_job_recreates_nothing_and_releases_its_pods(env: OperatorEnv) -> None:
    running_job(env, "pi")
    assert env.delete_job("pi") == 200
    wait_for(lambda: env.job("pi") is None, "the job gone (our finalizer released)")
    env.confirm_deletions("pi")
    wait_for(lambda: env.pods("pi") == [], "its pods garbage-collected and released", timeout=30)
    time.sleep(1.0)
    assert env.pods("pi") == []
    assert env.pod_creations() == 2


def test_metrics_liveness_and_json_logs(env: OperatorEnv) -> None:
    running_job(env, "rho")
    env.finish_pod("rho-worker-1", exit_code=1)
    wait_for(lambda: counts(env, "rho") == (1, 1), "failure counted")
    text = wait_for(
        lambda: (
            'ddpjob_pods_replaced_total{reason="ExitCode(1)"} 1.0' in (t := env.metrics()) and t
        ),
        "metrics",
    )
    assert 'ddpjob_jobs{phase="Running"} 1.0' in text
    assert "ddpjob_reconcile_seconds_count" in text
    health = requests.get(f"http://127.0.0.1:{env.health_port}/healthz", timeout=10)
    assert health.status_code == 200 and json.loads(health.text)["reconcile"] == "ok"
    lines = [json.loads(line) for line in env.log().splitlines() if line.startswith("{")]
    about_rho = [line for line in lines if line.get("object", {}).get("name") == "rho"]
    assert about_rho and all(line["object"]["namespace"] == env.namespace for line in about_rho)
    assert any("actions" in line["message"] for line in about_rho)


def test_refuses_to_start_without_the_crd(tmp_path: Path) -> None:
    with operator_env(tmp_path, with_ddpjob_crd=False) as world:
        world.expect_failures(r"exited by itself with code 2$")
        world.start_operator()
        assert world.process is not None
        assert world.process.wait(timeout=30) == 2
        assert "the DDPJob CRD (ddpjobs.ddpjob.io, v1alpha1) is not installed" in world.log()


def resumed_marker_absent(log: str) -> bool:
    """The standby never resumed while the active replica lived, and wrote no status."""
    return "Resuming the watch-stream for ddpjobs" not in log and "actions:" not in log


def replace_one(env: OperatorEnv, name: str) -> None:
    """The trainer of pod ``name`` fails; returns once a new pod of that name is live and the
    API server's record of its creation can be read. (Two live pods alone can be the failed pod
    before its deletion, and the audit log is written after the client has its answer.)"""
    before = env.pod(name)
    assert before is not None, f"no pod {name}"
    creations = env.pod_creations()
    env.finish_pod(name, exit_code=1)
    env.replacement(before, f"{name} replaced")
    wait_for(lambda: env.pod_creations() > creations, f"the creation of the new {name} recorded")


def test_two_replicas_with_peering_one_active_then_handover(world: OperatorEnv) -> None:
    world.create_peering("ddpjob")
    world.start_operator("--peering", "ddpjob", "--priority", "100")
    active = world.process
    running_job(world, "sigma")
    # A standby with a lower priority: it must pause, not act.
    world.process = None
    world.start_operator("--peering", "ddpjob", "--priority", "50", "--verbose")
    standby_log = world.starts
    paused = (
        f"Pausing the watch-stream for ddpjobs.v1alpha1.ddpjob.io in '{world.namespace}' (blockers"
    )
    wait_for(lambda: paused in world.log(standby_log), "the standby pauses")
    replace_one(world, "sigma-worker-1")
    wait_for(lambda: counts(world, "sigma") == (1, 1), "the active replica counts it")
    assert resumed_marker_absent(world.log(standby_log))
    assert world.pod_creations() == 3
    # The active replica leaves (a rolling update): the standby takes over.
    assert active is not None
    active.send_signal(signal.SIGTERM)
    assert active.wait(timeout=30) == 0
    resumed = "Resuming the watch-stream for ddpjobs.v1alpha1.ddpjob.io"
    wait_for(lambda: resumed in world.log(standby_log), "the standby resumes", timeout=30)
    world.run_pods("sigma")
    replace_one(world, "sigma-worker-0")
    wait_for(lambda: counts(world, "sigma") == (2, 2), "the new active replica counts it")
    assert world.pod_creations() == 4


def test_ttl_after_finished_deletes_the_job(env: OperatorEnv) -> None:
    running_job(env, "tau", ttlSecondsAfterFinished=3)
    for index in (0, 1):
        env.finish_pod(f"tau-worker-{index}", exit_code=0, reason="Completed")
    wait_for(lambda: env.status("tau").get("phase") == "Succeeded", "Succeeded", every=0.05)
    finished = time.monotonic()
    wait_for(lambda: env.job("tau") is None, "the job deleted by its TTL", timeout=15)
    assert time.monotonic() - finished > 2.0, "deleted before its TTL"
    wait_for(lambda: env.pods("tau") == [], "its pods garbage-collected")


def test_network_policy_by_flag_and_per_job_override(world: OperatorEnv) -> None:
    world.start_operator("--network-policy")
    template = {
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "image": "ddpjob/worker-cpu:test",
                    "ports": [{"containerPort": 6006, "name": "tensorboard"}],
                }
            ]
        }
    }
    world.create_job("upsilon", template=template)
    world.create_job("phi", networkPolicy=False)
    policy = wait_for(
        lambda: world.get_object(
            "networking.k8s.io/v1/networkpolicies", world.namespace, "upsilon-ddpjob"
        ),
        "the NetworkPolicy",
    )
    assert policy["spec"]["podSelector"] == {"matchLabels": {"ddpjob.io/job-name": "upsilon"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"ddpjob.io/job-name": "upsilon"}}}]},
        {"ports": [{"port": 29401, "protocol": "TCP"}, {"port": 6006, "protocol": "TCP"}]},
    ]
    wait_for(lambda: len(world.pods("phi")) == 2, "phi's pods")
    assert (
        world.get_object("networking.k8s.io/v1/networkpolicies", world.namespace, "phi-ddpjob")
        is None
    )


def test_the_chart_grants_every_request_of_a_recorded_run(tmp_path: Path) -> None:
    """Record every request the operator (kopf included) makes over a whole lifecycle, with
    every option on, and check that the Helm chart's RBAC grants each one: no more is needed
    than what the chart gives (the chart's own tests check it gives no more than the code uses).
    """
    from tests.harness.tools import rendered_rbac_rules  # noqa: PLC0415 - extracts helm on first use

    with operator_env(tmp_path) as world:
        peering = {
            "apiVersion": "kopf.dev/v1",
            "kind": "KopfPeering",
            "metadata": {"name": "ddpjob", "namespace": "default"},
        }
        world.api("POST", "/apis/kopf.dev/v1/namespaces/default/kopfpeerings", peering)
        world.start_operator("--peering", "ddpjob", "--network-policy")
        running_job(world, "chi", ttlSecondsAfterFinished=1)
        world.finish_pod("chi-worker-1", exit_code=1)
        wait_for(lambda: counts(world, "chi") == (1, 1), "failure")
        world.scale("chi", 3)
        wait_for(lambda: len(live(world, "chi")) == 3, "scaled up")
        world.run_pods("chi")
        world.control.set_pod_phase(
            "default",
            "chi-worker-2",
            "Running",
            conditions=[
                {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}
            ],
        )
        lost = world.pod("chi-worker-2")
        assert lost is not None
        world.delete("/api/v1/namespaces/default/pods/chi-worker-2", gracePeriodSeconds=0)
        world.replacement(lost, "chi-worker-2 released and replaced")
        for name in live(world, "chi"):
            world.finish_pod(name, exit_code=0, reason="Completed")
        wait_for(lambda: world.job("chi") is None, "the job TTL-deleted", timeout=20)
        assert world.process is not None
        operator_requests = [
            entry
            for entry in world.control.requests()
            if str(entry.get("agent") or "").startswith(("ddpjob-operator", "kopf/"))
            and entry.get("resource")
        ]
    used = {
        (
            entry["group"] or "",
            entry["resource"] + (f"/{entry['subresource']}" if entry["subresource"] else ""),
            entry["verb"],
        )
        for entry in operator_requests
    }
    granted = rendered_rbac_rules(
        {"networkPolicy": {"enabled": True}, "replicaCount": 2, "clusterWide": False}
    )
    assert used, "no request recorded"
    assert used <= granted, sorted(used - granted)
    # The run exercised what the chart grants for these options.
    assert ("", "pods", "create") in used and ("ddpjob.io", "ddpjobs/status", "patch") in used
    assert ("networking.k8s.io", "networkpolicies", "create") in used
    assert ("", "secrets", "create") in used
    assert ("kopf.dev", "kopfpeerings", "patch") in used


def test_a_pod_the_api_server_refuses_is_reported_on_the_job(emulated: EmulatorEnv) -> None:
    """Reported by an Event (one per distinct error of a pass) and the log; the pass is retried.
    The status has no condition for it (api.ConditionType has none): it counts no failure."""
    env = emulated
    refused = '422 Invalid: Pod "x" is invalid: bad'
    env.expect_failures(rf"warn: reconcile failed \({refused}; {refused}\); retrying in 1s")
    env.control.add_fault("POST", r"/pods$", 422, count=2, message='Pod "x" is invalid: bad')
    env.create_job("psi")
    wait_for(lambda: env.events(reason="ActionFailed"), "an ActionFailed event")
    wait_for(lambda: len(env.pods("psi")) == 2, "created once the API accepts them", timeout=30)
    # Both creates of the first pass were refused, with one message: one Event, on the job.
    [event] = env.events(reason="ActionFailed")
    assert (event["type"], event["message"]) == ("Warning", refused)
    assert (event["involvedObject"]["kind"], event["involvedObject"]["name"]) == ("DDPJob", "psi")
    assert env.control.count_requests("create", "pods", status=422) == 2
    status = env.status("psi")
    assert (status.get("restarts", 0), status.get("backoffCount", 0), status["failures"]) == (
        0, 0, [],
    ), status  # fmt: skip
