"""DDPJobs under the real Kueue (v0.19.2, built here) on the real control plane.

Kueue runs with ``externalFrameworks: ["DDPJob.v1alpha1.ddpjob.io"]`` (``tests/harness/kueue``); the
operator makes, follows and finishes each job's Workloads (``ddpjob_operator.core.queue``). Each
test has its own ClusterQueue and nodes (labelled and tainted for its namespace, as in
``test_gang``); the ResourceFlavor's node label is the only thing that sends a pod there (the
templates only tolerate the taint), so a pod that runs shows that the flavor was applied.

* Two jobs on quota for one: the second waits with no pod, its Workload pending; when the first
  succeeds its Workload is Finished and released, and the second is admitted and runs.
  Suspending it gives the quota back (``spec.active``), resuming takes it again; deleting it
  finishes and releases its Workload.
* A running job whose queue label is removed leaves Kueue: its Workload is Finished
  (``QueueLabelRemoved``) and released, a waiting job gets the quota, and it trains on.
* A higher-priority job preempts a training one: its pods go, uncharged; it waits Queued with
  ``Admitted=False/Preempted``; when the preemptor ends it is admitted again and resumes from its
  checkpoint (real training), every step done.
* Elastic: a scale down gives quota back at once, and a waiting job gets it; a scale up beyond
  the quota asks for a bigger slice and keeps running at the old size until the quota is
  there (another job ends), then the bigger slice is admitted and the new pod made.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.kube.client import ApiError
from tests.harness.kube.fixtures import KubeTest
from tests.harness.kueue.fixtures import MakeQueues, Queues
from tests.harness.kueue.process import Kueue
from tests.harness.operator_env import EmulatorEnv, RealEnv, operator_env, real_env, wait_for
from tests.harness.podlogs import lineage_problems, rank0_runs

from .conftest import StartLogs
from .test_gang import POOL_LABEL, bound, live, pool
from .test_real_cluster import last_world

pytestmark = pytest.mark.slow
JSON = dict[str, Any]
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
WORKER_IMAGE = "ghcr.io/ddpjob/ddpjob-worker-cpu:0.1.0"
CKPT_EVERY = 10
QUOTA_MEMORY = "64Gi"  # every requested resource must be covered; memory is not what is tested


@pytest.fixture
def real(kube: KubeTest, kueue: Kueue, tmp_path: Path) -> RealEnv:
    assert kueue.alive()
    return real_env(kube, tmp_path)


def queues_for(kube: KubeTest, make: MakeQueues, cpu: int, **kwargs: Any) -> Queues:
    """A ClusterQueue of ``cpu`` CPUs on a flavor that puts pods on the test's own nodes."""
    return make(
        kube.namespace,
        {"cpu": cpu, "memory": QUOTA_MEMORY},
        node_labels={POOL_LABEL: kube.namespace},
        **kwargs,
    )


def template(cpu: str = "1", **container: Any) -> JSON:
    """Pods that tolerate the test's nodes; only the admitted flavor sends them there."""
    trainer = {
        "name": "trainer",
        "image": WORKER_IMAGE,
        "command": ["ddpjob-agent"],
        "args": ["/opt/ddpjob/examples/train.py"],
        "resources": {"requests": {"cpu": cpu}},
        **container,
    }
    return {
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "tolerations": [{"key": POOL_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [trainer],
        }
    }


def queued_job(env: RealEnv, name: str, queues: Queues, **spec: Any) -> JSON:
    manifest = env.manifest(name, env.namespace, **spec)
    manifest["metadata"]["labels"] = {QUEUE_LABEL: queues.local_queue}
    response = env.create_raw(manifest)
    assert response.status_code == 201, response.text
    return dict(response.json())


def workloads(env: RealEnv, kueue: Kueue, job: JSON) -> list[JSON]:
    """The job's Workloads, oldest first."""
    uid = job["metadata"]["uid"]
    found = env.k.get(
        kueue.path("workloads", namespace=env.namespace)
        + f"?labelSelector=kueue.x-k8s.io/job-uid={uid}"
    )
    items = list((found or {}).get("items") or [])
    return sorted(items, key=lambda w: (w["metadata"]["creationTimestamp"], w["metadata"]["name"]))


def usage(env: RealEnv, kueue: Kueue, queues: Queues) -> tuple[int, int, str | None]:
    """The ClusterQueue's Workloads with quota reserved, and admitted, and the CPU they hold."""
    found = env.k.get(kueue.path("clusterqueues", queues.cluster_queue)) or {}
    status = found.get("status") or {}
    cpu = [
        str(r["total"])
        for flavor in status.get("flavorsReservation") or []
        for r in flavor.get("resources") or []
        if r["name"] == "cpu"
    ]
    return (
        int(status.get("reservingWorkloads", 0)),
        int(status.get("admittedWorkloads", 0)),
        cpu[0] if len(cpu) == 1 else None,
    )


def released(env: RealEnv, kueue: Kueue, job: JSON) -> JSON:
    """The job's one Workload, once Kueue's finalizer is off it."""

    def found() -> JSON | None:
        [wl] = workloads(env, kueue, job)
        return None if wl["metadata"].get("finalizers") else wl

    name = job["metadata"]["name"]
    return dict(wait_for(found, f"the {name} job's Workload released", timeout=30))


def condition(obj: JSON | None, type_: str) -> JSON:
    found = [
        c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_
    ]
    return found[0] if found else {}


def is_true(obj: JSON | None, type_: str) -> bool:
    return condition(obj, type_).get("status") == "True"


def stays(check: Any, what: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert check(), what
        time.sleep(0.5)


def test_two_jobs_queue_for_one_quota_and_run_one_after_the_other(
    real: RealEnv, kueue: Kueue, kueue_queues: MakeQueues
) -> None:
    kube = real.k
    pool(kube, 2)
    queues = queues_for(kube, kueue_queues, cpu=2)
    real.start_operator()
    two: JSON = {"replicas": 2, "minReplicas": 2, "maxReplicas": 2, "template": template()}
    first = queued_job(real, "first", queues, **two)
    wait_for(lambda: len(bound(real, "first")) == 2, "the first job's 2 pods bound", timeout=60)
    second = queued_job(real, "second", queues, **two)

    # The first job's Workload: exactly what Kueue's job framework would make.
    [wl] = workloads(real, kueue, first)
    meta, spec = wl["metadata"], wl["spec"]
    assert (
        meta["name"].startswith("ddpjob-first-") and len(meta["name"]) == len("ddpjob-first-") + 5
    )
    assert meta["labels"] == {"kueue.x-k8s.io/job-uid": first["metadata"]["uid"]}
    assert meta["finalizers"] == ["kueue.x-k8s.io/resource-in-use"]
    [owner] = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "DDPJob", "first", first["metadata"]["uid"], True,
    )  # fmt: skip
    assert meta["annotations"]["kueue.x-k8s.io/elastic-job"] == "true"
    assert (spec["queueName"], spec["active"], spec["priority"]) == (queues.local_queue, True, 0)
    [pod_set] = spec["podSets"]
    assert (pod_set["name"], pod_set["count"]) == ("main", 2)
    requests = pod_set["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests["cpu"] == "1"
    assert is_true(wl, "Admitted")
    assert wl["status"]["admission"]["podSetAssignments"][0]["count"] == 2

    # Its pods carry the flavor (the only way they could reach the test's nodes) and Kueue's labels.
    for pod in live(real, "first"):
        assert pod["spec"]["nodeSelector"] == {POOL_LABEL: kube.namespace}
        labels = pod["metadata"]["labels"]
        assert labels["kueue.x-k8s.io/podset"] == "main"
        assert labels["kueue.x-k8s.io/local-queue-name"] == queues.local_queue
        assert labels["kueue.x-k8s.io/cluster-queue-name"] == queues.cluster_queue
        assert pod["metadata"]["annotations"]["kueue.x-k8s.io/workload"] == meta["name"]
    admitted = condition(real.job("first"), "Admitted")
    assert admitted["status"] == "True", admitted
    assert admitted["message"] == (
        f"admitted by ClusterQueue {queues.cluster_queue} (flavors: {queues.flavor}) for 2 pods"
    )

    # The second waits in line, with no pod.
    said = wait_for(
        lambda: (
            condition(real.job("second"), "Admitted").get("reason") == "Queued"
            and "insufficient unused quota" in condition(real.job("second"), "Admitted")["message"]
            and condition(real.job("second"), "Admitted")
        ),
        "the second job Queued with Kueue's reason",
        timeout=30,
    )
    assert said["status"] == "False"
    assert real.status("second")["phase"] == "Queued"
    stays(lambda: real.pods("second") == [], "the second job made a pod before admission", 5)
    [waiting] = workloads(real, kueue, second)
    assert condition(waiting, "QuotaReserved")["status"] == "False"
    assert not is_true(waiting, "Admitted")

    # The first succeeds: its Workload is Finished and released; the second is admitted.
    real.run_pods("first")
    for pod in live(real, "first"):
        real.finish_pod(pod["metadata"]["name"], exit_code=0, reason="Completed")
    wait_for(lambda: real.status("first").get("phase") == "Succeeded", "first Succeeded", 60)

    finished = condition(released(real, kueue, first), "Finished")
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded"), finished
    wait_for(lambda: len(bound(real, "second")) == 2, "the second job's pods bound", timeout=60)
    real.run_pods("second")
    wait_for(lambda: real.status("second").get("phase") == "Running", "second Running", 30)

    # Suspending it gives the quota back through spec.active; resuming takes it again.
    real.patch_job("second", {"spec": {"suspend": True}})
    wait_for(lambda: live(real, "second") == [], "the suspended job's pods gone", timeout=60)
    wait_for(
        lambda: workloads(real, kueue, second)[0]["spec"]["active"] is False,
        "the suspended job's Workload inactive",
        timeout=30,
    )
    wait_for(
        lambda: not is_true(workloads(real, kueue, second)[0], "QuotaReserved"),
        "the suspended job's quota given back",
        timeout=30,
    )
    real.patch_job("second", {"spec": {"suspend": False}})
    wait_for(lambda: len(bound(real, "second")) == 2, "the resumed job's pods bound", timeout=60)
    [wl] = workloads(real, kueue, second)
    assert wl["spec"]["active"] is True and is_true(wl, "Admitted")
    status = real.status("second")
    assert (status.get("restarts", 0), status.get("backoffCount", 0)) == (0, 0), status

    # Deleted: its Workload is Finished (OwnerNotFound), released, and garbage-collected, and
    # its quota is given back. (Kueue's Finished condition lives only as long as the Workload,
    # which the garbage collector removes at once; the audit log keeps no bodies: what can be
    # seen is the Workload gone and the ClusterQueue's usage back to nothing.)
    # Kueue writes the ClusterQueue's usage on its own pass, after the Workload's admission.
    wait_for(
        lambda: usage(real, kueue, queues) == (1, 1, "2"),
        "the ClusterQueue holding the resumed job's Workload and its 2 CPU",
        timeout=30,
    )
    name = wl["metadata"]["name"]
    assert real.delete_job("second") == 200
    wait_for(lambda: workloads(real, kueue, second) == [], "the deleted job's Workload gone", 60)
    assert kube.get(kueue.path("workloads", name, real.namespace)) is None
    wait_for(
        lambda: usage(real, kueue, queues) == (0, 0, "0"),
        "the ClusterQueue holding no Workload and no CPU",
        timeout=30,
    )


def test_a_job_whose_queue_label_is_removed_leaves_kueue_and_gives_its_quota_back(
    real: RealEnv, kueue: Kueue, kueue_queues: MakeQueues
) -> None:
    kube = real.k
    pool(kube, 2)  # room for 4 pods: only the quota (2 CPU) holds the second job back
    queues = queues_for(kube, kueue_queues, cpu=2)
    real.start_operator()
    two: JSON = {"replicas": 2, "minReplicas": 2, "maxReplicas": 2, "template": template()}
    first = queued_job(real, "first", queues, **two)
    wait_for(lambda: len(bound(real, "first")) == 2, "the first job's 2 pods bound", timeout=60)
    pods = {p["metadata"]["uid"] for p in live(real, "first")}
    second = queued_job(real, "second", queues, **two)
    wait_for(lambda: real.status("second").get("phase") == "Queued", "second Queued", 30)

    real.patch_job("first", {"metadata": {"labels": {QUEUE_LABEL: None}}})

    finished = condition(released(real, kueue, first), "Finished")
    assert (finished["status"], finished["reason"]) == ("True", "QueueLabelRemoved"), finished
    wait_for(lambda: len(bound(real, "second")) == 2, "the second job's pods bound", timeout=60)
    # The first runs on, without Kueue: the same pods, nothing charged, no Admitted condition.
    assert {p["metadata"]["uid"] for p in live(real, "first")} == pods
    status = real.status("first")
    assert (status.get("restarts", 0), status.get("backoffCount", 0)) == (0, 0), status
    assert "Admitted" not in {c["type"] for c in status.get("conditions") or []}
    [wl] = workloads(real, kueue, second)
    assert is_true(wl, "Admitted")


@pytest.fixture
def priority_classes(kube: KubeTest) -> Iterator[tuple[str, str]]:
    low, high = f"{kube.namespace}-low", f"{kube.namespace}-high"
    admin = kube.cluster.admin()
    for name, value in ((low, 100), (high, 1000)):
        admin.request(
            "POST",
            "/apis/scheduling.k8s.io/v1/priorityclasses",
            {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
             "metadata": {"name": name}, "value": value},
        )  # fmt: skip
    yield low, high
    for name in (low, high):
        with contextlib.suppress(ApiError):
            admin.request("DELETE", f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")


def checkpoint_step(ckpt: Path) -> int:
    """The step of the newest checkpoint in ``ckpt`` (examples/train.py's, written atomically)."""
    state = torch.load(ckpt / "latest.pt", map_location="cpu", weights_only=True)
    return int(state["step"])


def training(steps: int, ckpt: Path, **spec: Any) -> JSON:
    args = [
        "/opt/ddpjob/examples/train.py", f"--steps={steps}", "--step-sleep=0.2",
        f"--ckpt-every={CKPT_EVERY}", "--ckpt-dir=/ckpt",
    ]  # fmt: skip
    body = template(args=args, volumeMounts=[{"name": "ckpt", "mountPath": "/ckpt"}])
    body["spec"]["volumes"] = [
        {"name": "ckpt", "hostPath": {"path": str(ckpt), "type": "DirectoryOrCreate"}}
    ]
    body["spec"].update(spec)
    return body


def test_a_higher_priority_job_preempts_and_the_preempted_one_resumes_from_its_checkpoint(
    kube: KubeTest,
    kueue: Kueue,
    kueue_queues: MakeQueues,
    priority_classes: tuple[str, str],
    job_logs: StartLogs,
    tmp_path: Path,
) -> None:
    low, high = priority_classes
    env = real_env(kube, tmp_path, fake_trainer=False)
    pool(kube, 2)
    queues = queues_for(
        kube, kueue_queues, cpu=2, preemption={"withinClusterQueue": "LowerPriority"}
    )
    env.start_operator()
    steps = 400  # 80 s of training: preempted well before its end
    common: JSON = {"minReplicas": 1, "maxReplicas": 2, "rendezvous": {"lastCallSeconds": 2}}
    victim = queued_job(
        env, "victim", queues, replicas=2, **common,
        template=training(steps, tmp_path / "victim", priorityClassName=low),
    )  # fmt: skip
    # Every pod's log, from its start: the preempted pods' logs are gone with them.
    logs = job_logs(env, "victim")
    pods = ["victim-worker-0", "victim-worker-1"]
    wait_for(lambda: all(last_world(kube, p) == 2 for p in pods), "victim at world 2", 240)
    [wl] = workloads(env, kueue, victim)
    assert wl["spec"]["priority"] == 100
    assert wl["spec"]["priorityClassRef"] == {
        "group": "scheduling.k8s.io", "kind": "PriorityClass", "name": low,
    }  # fmt: skip
    preempted = {p["metadata"]["uid"] for p in live(env, "victim")}
    logs.wait_new_checkpoint(lambda: str(env.status("victim")))  # by rank 0, on either pod
    before = env.status("victim")
    assert (before.get("restarts", 0), before.get("backoffCount", 0), before["failures"]) == (
        0, 0, [],
    ), before  # fmt: skip

    preemptor = queued_job(
        env, "preemptor", queues, replicas=2, **common,
        template=training(30, tmp_path / "preemptor", priorityClassName=high),
    )  # fmt: skip
    said = wait_for(
        lambda: (
            condition(env.job("victim"), "Admitted").get("reason") == "Preempted"
            and condition(env.job("victim"), "Admitted")
        ),
        "the victim preempted",
        timeout=60,
    )
    assert said["status"] == "False" and "evicted by Kueue (Preempted)" in said["message"], said
    wait_for(lambda: env.pods("victim") == [], "the victim's pods gone", timeout=60)
    # Its pods went uncharged: no failure, no restart, as the unit contract says
    # (test_queue.py, test_a_job_kueue_does_not_admit_deletes_its_pods_uncharged_and_is_queued).
    status = env.status("victim")
    assert status["phase"] == "Queued"
    assert (status.get("restarts", 0), status.get("backoffCount", 0), status["failures"]) == (
        0, 0, [],
    ), status  # fmt: skip
    # The newest checkpoint the victim wrote (logged or not): where it must resume.
    newest = checkpoint_step(tmp_path / "victim")
    evicted = wait_for(
        lambda: (w := workloads(env, kueue, victim)[0]) and is_true(w, "Requeued") and w,
        "the victim's reservation given back (Requeued=True)",
        timeout=60,
    )
    assert condition(evicted, "Evicted")["reason"] == "Preempted"
    assert condition(evicted, "QuotaReserved")["status"] == "False"
    assert "admission" not in evicted["status"]

    # The preemptor trains and ends; the victim is admitted again and resumes.
    wait_for(lambda: env.status("preemptor").get("phase") == "Succeeded", "preemptor done", 400)
    wait_for(
        lambda: is_true(workloads(env, kueue, preemptor)[0], "Finished"),
        "the preemptor's Workload Finished once its pods stopped",
        timeout=60,
    )
    wait_for(lambda: len(bound(env, "victim")) == 2, "the victim admitted again", timeout=120)
    status = wait_for(
        lambda: (
            env.status("victim").get("phase") in ("Succeeded", "Failed") and env.status("victim")
        ),
        "the victim to finish",
        timeout=600,
    )
    assert status["phase"] == "Succeeded", status
    assert (status.get("restarts", 0), status.get("backoffCount", 0), status["failures"]) == (
        0, 0, [],
    ), status  # fmt: skip
    # Every step done once over the runs of rank 0 of all four pods (the two preempted ones
    # included): each run resumes at the newest checkpoint, none overlaps another.
    logs.finish()
    assert logs.errors == [], logs.describe()
    names = sorted(log.name for log in logs.logs.values())
    assert names == sorted(pods * 2), logs.describe()
    runs = [run for log in logs.logs.values() for run in rank0_runs(log)]
    summary = "\n".join(str(run) for run in sorted(runs, key=lambda run: run.began))
    problems = lineage_problems(runs, steps, CKPT_EVERY)
    assert not problems, "\n".join(problems) + f"\n{summary}\n{logs.describe()}"
    # The readmitted pods' first run of rank 0 resumed where the preempted ones stopped.
    [resumed, *_] = sorted(
        (run for run in runs if run.uid not in preempted), key=lambda run: run.began
    )
    assert 0 < resumed.resume == newest, summary
    print(f"every step done once over {len(runs)} runs of rank 0:\n{summary}")


def test_a_scale_down_gives_quota_to_a_waiting_job_and_a_scale_up_waits_for_quota(
    real: RealEnv, kueue: Kueue, kueue_queues: MakeQueues
) -> None:
    kube = real.k
    pool(kube, 2)
    queues = queues_for(kube, kueue_queues, cpu=4)
    real.start_operator()
    elastic: JSON = {"minReplicas": 1, "maxReplicas": 3, "template": template()}
    grower = queued_job(real, "grower", queues, replicas=2, **elastic)
    shrinker = queued_job(real, "shrinker", queues, replicas=2, **elastic)
    wait_for(lambda: len(bound(real, "grower")) == 2, "the grower's 2 pods bound", 60)
    wait_for(lambda: len(bound(real, "shrinker")) == 2, "the shrinker's 2 pods bound", 60)
    real.run_pods("grower")
    real.run_pods("shrinker")
    [first_slice] = workloads(real, kueue, grower)

    # The quota is full: a third job waits, with no pod.
    one: JSON = {"replicas": 1, "minReplicas": 1, "maxReplicas": 1, "template": template()}
    waiter = queued_job(real, "waiter", queues, **one)
    wait_for(lambda: real.status("waiter").get("phase") == "Queued", "the waiter Queued", 30)
    stays(lambda: real.pods("waiter") == [], "the waiter made a pod before admission", 5)

    # A scale down: the surplus pod goes, the slice's count drops to 1, and the freed CPU goes
    # to the waiting job.
    real.scale("shrinker", 1)
    wait_for(lambda: len(live(real, "shrinker")) == 1, "the shrinker at 1 pod", timeout=60)
    wait_for(
        lambda: workloads(real, kueue, shrinker)[0]["spec"]["podSets"][0]["count"] == 1,
        "the shrinker's slice lowered to 1",
        timeout=30,
    )
    wait_for(lambda: len(bound(real, "waiter")) == 1, "the waiter admitted and bound", 60)
    [admitted_waiter] = workloads(real, kueue, waiter)
    assert is_true(admitted_waiter, "Admitted")
    assert len(live(real, "shrinker")) == 1 and real.status("shrinker")["phase"] == "Running"

    # A scale up beyond the quota: a bigger slice is asked for, and the job keeps its 2 pods.
    real.scale("grower", 3)
    asked = wait_for(
        lambda: len(w := workloads(real, kueue, grower)) == 2 and w[1],
        "a second slice for 3 pods",
        timeout=30,
    )
    assert asked["spec"]["podSets"][0]["count"] == 3
    assert asked["metadata"]["annotations"]["kueue.x-k8s.io/workload-slice-replacement-for"] == (
        f"{real.namespace}/{first_slice['metadata']['name']}"
    )
    wait_for(
        lambda: (
            condition(workloads(real, kueue, grower)[1], "QuotaReserved").get("status") == "False"
        ),
        "the bigger slice pending",
        timeout=30,
    )
    stays(lambda: len(live(real, "grower")) == 2, "the grower's pod count changed", 5)
    assert real.status("grower")["phase"] == "Running"
    said = condition(real.job("grower"), "Admitted")
    assert said["status"] == "True" and "asking Kueue for 3" in said["message"], said

    # The waiter ends: its CPU lets Kueue admit the bigger slice, which replaces the first one,
    # and only then is the third pod made.
    real.run_pods("waiter")
    real.finish_pod("waiter-worker-0", exit_code=0, reason="Completed")
    wait_for(lambda: real.status("waiter").get("phase") == "Succeeded", "waiter Succeeded", 60)
    wait_for(lambda: len(bound(real, "grower")) == 3, "the grower's 3rd pod bound", timeout=60)
    slices = workloads(real, kueue, grower)
    old = next(w for w in slices if w["metadata"]["name"] == first_slice["metadata"]["name"])
    new = next(w for w in slices if w["metadata"]["name"] != first_slice["metadata"]["name"])
    assert is_true(new, "Admitted")
    assert is_true(old, "Finished")
    wait_for(
        lambda: (
            not any(
                w["metadata"].get("finalizers")
                for w in workloads(real, kueue, grower)
                if is_true(w, "Finished")
            )
        ),
        "the replaced slice released",
        timeout=30,
    )
    real.run_pods("grower")
    status = real.status("grower")
    assert (status["phase"], status.get("restarts", 0)) == ("Running", 0), status


@pytest.fixture
def emulated(tmp_path: Path) -> Iterator[EmulatorEnv]:
    with operator_env(tmp_path) as emulator:
        emulator.start_operator()
        yield emulator


def test_without_kueue_a_labelled_job_runs_and_says_why(emulated: EmulatorEnv) -> None:
    """The emulator serves no kueue.x-k8s.io: the label cannot be honoured, and the job says so
    rather than wait for ever."""
    manifest = emulated.manifest("labelled", emulated.namespace, replicas=2, minReplicas=2)
    manifest["metadata"]["labels"] = {QUEUE_LABEL: "team-a"}
    assert emulated.create_raw(manifest).status_code == 201
    wait_for(lambda: len(live(emulated, "labelled")) == 2, "2 pods created", timeout=30)
    said = wait_for(
        lambda: condition(emulated.job("labelled"), "Admitted"), "the Admitted condition", 30
    )
    assert (said["status"], said["reason"]) == ("False", "KueueNotServed")
    assert said["message"].startswith("the job names LocalQueue team-a (kueue.x-k8s.io/queue-name)")
    emulated.run_pods("labelled")
    wait_for(lambda: emulated.status("labelled").get("phase") == "Running", "Running", 30)
