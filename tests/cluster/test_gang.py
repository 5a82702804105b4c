"""Native gang scheduling (``gangScheduling: Native``) against the real scheduler.

The shared control plane runs with the ``GenericWorkload`` feature gate and serves
``scheduling.k8s.io/v1beta1`` (``tests/harness/kube/controlplane.py``). Each test gets nodes of its own
(:func:`pool`): labelled and tainted for its namespace, so only its pods go there. A node has 8
CPUs and every pod asks for 3: two pods per node, a *slot* each.

* 7 pods, 6 slots: without a gang the scheduler binds 6 and leaves 1 pending (training at
  world 6 would hold six nodes' worth of GPUs for a job that may need 7); with a gang of 7 none
  is bound until a 4th node comes, then all 7 are.
* Two gangs of 4 on 6 slots: one is bound whole, the other waits with none bound (no 3 + 3
  deadlock), and is bound when the first finishes.
* An elastic gang (``minReplicas: 2``, ``replicas: 5``) on 4 slots: real training at world 4,
  the 5th pod waiting alone; a pod of it deleted, and the freed slot is filled by one pod alone.
* A suspended gang resumes with a new ``minReplicas``: the same PodGroup, its ``minCount``
  set to the new minimum.
* Where PodGroups are not served (the emulator serves no ``scheduling.k8s.io``), the job says
  so in its ``GangScheduled`` condition and runs without a gang.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.kube.fixtures import KubeTest
from tests.harness.operator_env import EmulatorEnv, RealEnv, operator_env, real_env, wait_for
from tests.harness.podlogs import RESUME_RE, STEP_RE

from .test_real_cluster import last_world

pytestmark = pytest.mark.slow
JSON = dict[str, Any]
POOL_LABEL = "ddpjob.io/test-pool"
PODGROUPS = "scheduling.k8s.io/v1beta1/podgroups"
WORKER_IMAGE = "ghcr.io/ddpjob/ddpjob-worker-cpu:0.1.0"


@pytest.fixture
def real(kube: KubeTest, tmp_path: Path) -> RealEnv:
    return real_env(kube, tmp_path)


def pool(kube: KubeTest, count: int) -> list[str]:
    """``count`` nodes of the test's own, for its pods only (label and taint)."""
    names = []
    for _ in range(count):
        name = kube.spare_node()
        kube.api.patch(
            f"/api/v1/nodes/{name}",
            {
                "metadata": {"labels": {POOL_LABEL: kube.namespace}},
                "spec": {
                    "taints": [{"key": POOL_LABEL, "value": kube.namespace, "effect": "NoSchedule"}]
                },
            },
        )
        names.append(name)
    return names


def template(kube: KubeTest, **container: Any) -> JSON:
    trainer = {
        "name": "trainer",
        "image": WORKER_IMAGE,
        "command": ["ddpjob-agent"],
        "args": ["/opt/ddpjob/examples/train.py"],
        "resources": {"requests": {"cpu": "3"}},
        **container,
    }
    return {
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "nodeSelector": {POOL_LABEL: kube.namespace},
            "tolerations": [{"key": POOL_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [trainer],
        }
    }


def live(env: RealEnv | EmulatorEnv, job: str) -> list[JSON]:
    return [p for p in env.pods(job) if not p["metadata"].get("deletionTimestamp")]


def bound(env: RealEnv, job: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in live(env, job) if p["spec"].get("nodeName"))


def condition(env: RealEnv | EmulatorEnv, job: str, type_: str = "GangScheduled") -> JSON:
    found = [c for c in env.status(job).get("conditions") or [] if c["type"] == type_]
    return found[0] if found else {}


def group_condition(env: RealEnv, job: str) -> JSON:
    group = env.get_object(PODGROUPS, env.namespace, job) or {}
    found = [
        c
        for c in (group.get("status") or {}).get("conditions") or []
        if c["type"] == "PodGroupInitiallyScheduled"
    ]
    return found[0] if found else {}


def stays_unbound(env: RealEnv, jobs: list[str], seconds: float) -> None:
    """No pod of ``jobs`` gets a node for ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for job in jobs:
            assert bound(env, job) == [], f"{job}: pods bound while the gang cannot be placed"
        time.sleep(0.5)


def test_seven_pods_on_six_slots_bind_six_alone_and_none_as_a_gang_until_a_node_comes(
    real: RealEnv,
) -> None:
    kube = real.k
    pool(kube, 3)
    real.start_operator()
    seven: JSON = {"replicas": 7, "minReplicas": 7, "maxReplicas": 7, "template": template(kube)}

    # Without a gang: six bound, the seventh pending, a job that holds six nodes' worth and
    # cannot train at the size it asks for.
    real.create_job("alone", **seven)
    wait_for(lambda: len(bound(real, "alone")) == 6, "6 of 7 pods bound", timeout=60)

    def seventh_refused() -> JSON | None:
        pending = [p for p in live(real, "alone") if not p["spec"].get("nodeName")]
        conditions = [
            c for p in pending for c in p.get("status", {}).get("conditions") or []
            if c["type"] == "PodScheduled" and c["status"] == "False"
        ]  # fmt: skip
        return conditions[0] if len(pending) == 1 and conditions else None

    refused = wait_for(seventh_refused, "the 7th pod refused by the scheduler", timeout=30)
    assert refused["reason"] == "Unschedulable" and "Insufficient cpu" in refused["message"]
    assert len(live(real, "alone")) == 7
    assert all("schedulingGroup" not in p["spec"] for p in live(real, "alone"))
    assert condition(real, "alone") == {}  # no gang asked for, no gang condition
    assert real.get_object(PODGROUPS, real.namespace, "alone") is None
    assert real.delete_job("alone") == 200
    wait_for(lambda: real.pods("alone") == [], "the first job's pods gone", timeout=60)

    # As a gang: the PodGroup first, every pod names it, and none is bound.
    job = real.create_job("gang", gangScheduling="Native", **seven)
    group = wait_for(
        lambda: real.get_object(PODGROUPS, real.namespace, "gang"), "the PodGroup", timeout=30
    )
    assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 7}}
    [owner] = group["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"], owner["controller"]) == (
        "DDPJob",
        job["metadata"]["uid"],
        True,
    )
    wait_for(lambda: len(live(real, "gang")) == 7, "7 pods created", timeout=30)
    assert all(p["spec"]["schedulingGroup"] == {"podGroupName": "gang"} for p in live(real, "gang"))
    said = wait_for(
        lambda: (
            condition(real, "gang").get("reason") == "Unschedulable" and condition(real, "gang")
        ),
        "GangScheduled=False/Unschedulable on the job",
        timeout=60,
    )
    assert said["status"] == "False"
    # The scheduler's verdict from the first refused pod: the group's ("minCount (7) cannot be
    # satisfied") on most, the fit of the one it could not place on that one.
    prefix, _, why = said["message"].partition(": ")
    assert prefix == "gang of 7 cannot be placed", said
    assert (
        why.startswith("pod group is unschedulable, minCount (7) cannot be satisfied")
        or "Insufficient cpu" in why
    ), said
    wait_for(
        lambda: group_condition(real, "gang").get("status") == "False",
        "PodGroupInitiallyScheduled=False on the PodGroup",
        timeout=30,
    )
    stays_unbound(real, ["gang"], 10.0)
    status = real.status("gang")
    assert status["phase"] == "Pending"
    assert [(w["pod"], w["reason"]) for w in status["waiting"]] == [
        (f"gang-worker-{i}", "Unschedulable") for i in range(7)
    ]

    # A 4th node: room for all seven, and all seven are bound.
    pool(kube, 1)
    wait_for(lambda: len(bound(real, "gang")) == 7, "all 7 pods bound", timeout=90)
    real.run_pods("gang", timeout=90)
    placed = wait_for(
        lambda: condition(real, "gang").get("status") == "True" and condition(real, "gang"),
        "GangScheduled=True",
        timeout=30,
    )
    assert (placed["reason"], placed["message"]) == (
        "Placed",
        "gang of 7 placed: 7 of 7 pods bound",
    )
    wait_for(
        lambda: group_condition(real, "gang").get("status") == "True",
        "PodGroupInitiallyScheduled=True on the PodGroup",
        timeout=30,
    )
    wait_for(lambda: real.status("gang").get("phase") == "Running", "the job Running", timeout=30)


def test_two_gangs_of_four_on_six_slots_run_one_after_the_other(real: RealEnv) -> None:
    kube = real.k
    pool(kube, 3)
    real.start_operator()
    four: JSON = {
        "replicas": 4, "minReplicas": 4, "maxReplicas": 4, "gangScheduling": "Native",
        "template": template(kube),
    }  # fmt: skip
    real.create_job("first", **four)
    real.create_job("second", **four)
    wait_for(
        lambda: sorted([len(bound(real, "first")), len(bound(real, "second"))]) == [0, 4],
        "one gang bound whole, the other not at all",
        timeout=90,
    )
    running = "first" if len(bound(real, "first")) == 4 else "second"
    waiting = "second" if running == "first" else "first"
    # It stays so: no pod of the waiting gang takes one of the two free slots (no 3 + 3).
    stays_unbound(real, [waiting], 10.0)
    assert len(bound(real, running)) == 4
    assert condition(real, waiting)["reason"] in ("Unschedulable", "Waiting")
    real.run_pods(running)
    for pod in live(real, running):
        real.finish_pod(pod["metadata"]["name"], exit_code=0, reason="Completed")
    wait_for(lambda: real.status(running).get("phase") == "Succeeded", f"{running} Succeeded", 60)
    wait_for(lambda: len(bound(real, waiting)) == 4, f"{waiting} bound once {running} ended", 120)
    real.run_pods(waiting, timeout=90)
    assert condition(real, waiting)["status"] == "True"


def test_an_elastic_gang_trains_at_the_size_the_cluster_has_room_for(
    kube: KubeTest, tmp_path: Path
) -> None:
    """``minReplicas: 2``, ``replicas: 5`` on 4 slots: the gang of 2 is placed, two more pods
    one by one, and the job trains at world 4 while the 5th waits (real training)."""
    env = real_env(kube, tmp_path, fake_trainer=False)
    pool(kube, 2)
    env.start_operator()
    steps = ["/opt/ddpjob/examples/train.py", "--steps=100000", "--step-sleep=0.2"]
    env.create_job(
        "elastic", replicas=5, minReplicas=2, maxReplicas=5, gangScheduling="Native",
        rendezvous={"lastCallSeconds": 2}, template=template(kube, args=steps),
    )  # fmt: skip
    group = wait_for(lambda: env.get_object(PODGROUPS, env.namespace, "elastic"), "PodGroup", 30)
    assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 2}}

    # The scheduler chooses which pod waits. Where it leaves pod 0, the store host, the
    # others would wait for its store for ever (CI's suite, 2026-11-29: bindings 3, 1, 4, 2):
    # the operator deletes the highest bound pod beyond minReplicas and creates it again once
    # pod 0 is placed.
    def four_with_pod_0() -> list[str] | None:
        placed = bound(env, "elastic")
        return placed if len(placed) == 4 and "elastic-worker-0" in placed else None

    members = wait_for(four_with_pod_0, "4 of 5 pods bound, pod 0 among them", timeout=120)
    wait_for(
        lambda: all(last_world(kube, p) == 4 for p in members), "training at world 4", timeout=240
    )
    assert len(live(env, "elastic")) == 5 and len(bound(env, "elastic")) == 4
    placed = condition(env, "elastic")
    assert (placed["status"], placed["message"]) == ("True", "gang of 2 placed: 4 of 5 pods bound")
    status = env.status("elastic")
    assert status["phase"] == "Running"
    [left] = [p["metadata"]["name"] for p in live(env, "elastic") if not p["spec"].get("nodeName")]
    assert [(w["pod"], w["reason"]) for w in status["waiting"]] == [(left, "Unschedulable")]

    # A pod of the placed gang is deleted: the gang stays placed (3 bound >= 2), and the freed
    # slot goes to one pod alone (the replacement or the 5th), with no gang to wait for.
    victim = next(m for m in members if not m.endswith("-0"))
    uid = (env.pod(victim) or {})["metadata"]["uid"]
    survivors = [m for m in members if m != victim]
    resumed = {p: resumes(kube, p) for p in survivors}
    assert env.delete_pod(victim) == 200

    def refilled() -> bool:
        pods = {p["metadata"]["name"]: p for p in live(env, "elastic")}
        gone = victim not in pods or pods[victim]["metadata"]["uid"] != uid
        return gone and len(bound(env, "elastic")) == 4

    wait_for(refilled, "4 pods bound again after one was deleted", timeout=90)
    assert condition(env, "elastic")["status"] == "True"
    # The survivors kept their slots, and one pod alone took the freed one; the other waits.
    now = bound(env, "elastic")
    [taker] = sorted(set(now) - set(survivors))
    assert taker in (victim, left) and set(survivors) < set(now), (now, survivors)
    [waiting] = sorted({victim, left} - {taker})

    def one_waits() -> JSON | None:
        status = env.status("elastic")
        said = [(w["pod"], w["reason"]) for w in status["waiting"]]
        return status if said == [(waiting, "Unschedulable")] else None

    status = wait_for(one_waits, f"{waiting} the one pod waiting", timeout=30)
    # The deletion counted once, as Deleted and uncharged; the job runs on.
    assert [(f["pod"], f["reason"], f["charged"]) for f in status["failures"]] == [
        (victim, "Deleted", False)
    ], status["failures"]
    assert (status["phase"], status["restarts"], status.get("backoffCount", 0)) == (
        "Running", 1, 0,
    ), status  # fmt: skip
    # Training went on: each survivor's workers began a new run without the deleted pod (the
    # world changed) and stepped in it.
    wait_for(
        lambda: all(stepped_since(kube, p, resumed[p]) for p in survivors),
        "the survivors stepping in a run begun after the deletion",
        timeout=120,
    )


def test_pod_0_left_waiting_by_the_scheduler_gets_the_room_of_a_pod_beyond_min_replicas(
    kube: KubeTest, real: RealEnv
) -> None:
    """The wedge of the elastic gang above, made on purpose: the test is the scheduler (the
    pods name a scheduler of their own; the test binds them as kube-scheduler does, and says
    ``Unschedulable`` for pod 0 as it says where there is no room). The operator deletes the
    bound pod of highest index beyond ``minReplicas``, uncharged, holds it while pod 0 waits,
    and creates it again once pod 0 is placed."""
    real.start_operator()
    spec = {
        "schedulerName": "ddpjob-test-by-hand",
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "trainer", "image": WORKER_IMAGE}],
    }
    real.create_job("wedge", replicas=4, minReplicas=2, maxReplicas=4, template={"spec": spec})
    names = [f"wedge-worker-{i}" for i in range(4)]
    wait_for(lambda: all(real.pod(n) for n in names), "4 pods created", 30)
    nodes = ["node-1", "node-2", "node-3"]

    def bind(name: str, node: str) -> None:
        kube.api.create(
            f"/api/v1/namespaces/{kube.namespace}/pods/{name}/binding",
            {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": name},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            },
        )

    for name, node in zip(names[1:], nodes, strict=True):
        bind(name, node)
    kube.api.patch(
        f"/api/v1/namespaces/{kube.namespace}/pods/{names[0]}/status",
        {
            "status": {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Too many pods.",
                    }
                ]
            }
        },
    )
    old = real.pod(names[3])
    assert old is not None

    def held() -> JSON | None:
        status = real.status("wedge")
        said = [(w["pod"], w["reason"]) for w in status.get("waiting") or []]
        gone = real.pod(names[3]) is None
        return status if gone and said == [
            (names[0], "Unschedulable"), (names[3], "StoreHostUnplaced"),
        ] else None  # fmt: skip

    status = wait_for(held, "pod 3 deleted and held while pod 0 waits", 60)
    assert (status.get("restarts", 0), status.get("failures") or []) == (0, [])
    [event] = real.events(reason="StoreHostUnplaced")
    assert event["type"] == "Warning" and f"deleting {names[3]}" in event["message"]
    assert all((real.pod(n) or {})["spec"].get("nodeName") for n in names[1:3])

    bind(names[0], nodes[2])  # pod 3's node, freed
    new = real.replacement(old, "pod 3 created again once pod 0 is placed", timeout=60)
    assert not new["spec"].get("nodeName")  # the scheduler's to place, as any 4th pod
    status = real.status("wedge")
    assert (status.get("restarts", 0), status.get("failures") or []) == (0, [])


def trainer_log(kube: KubeTest, pod: str) -> str:
    return kube.kubectl("logs", pod, "-c", "trainer", check=False).stdout


def resumes(kube: KubeTest, pod: str) -> int:
    """How many runs the pod's workers have begun (``DDPJOB resume`` lines)."""
    return len(RESUME_RE.findall(trainer_log(kube, pod)))


def stepped_since(kube: KubeTest, pod: str, runs: int) -> bool:
    """The pod's workers began a run after their first ``runs`` and logged a step in their
    newest one."""
    log = trainer_log(kube, pod)
    began = [m.end() for m in RESUME_RE.finditer(log)]
    return len(began) > runs and STEP_RE.search(log, began[-1]) is not None


@pytest.fixture
def emulated(tmp_path: Path) -> Iterator[EmulatorEnv]:
    with operator_env(tmp_path) as emulator:
        emulator.start_operator()
        yield emulator


def test_without_pod_groups_the_job_runs_without_a_gang_and_says_why(
    emulated: EmulatorEnv,
) -> None:
    """Never a field the server would drop silently: no schedulingGroup, no PodGroup."""
    emulated.create_job("plain", gangScheduling="Native", replicas=2, minReplicas=2)
    wait_for(lambda: len(live(emulated, "plain")) == 2, "2 pods created", timeout=30)
    assert all("schedulingGroup" not in p["spec"] for p in live(emulated, "plain"))
    said = wait_for(lambda: condition(emulated, "plain"), "the GangScheduled condition", 30)
    assert (said["status"], said["reason"]) == ("False", "PodGroupsNotServed")
    emulated.run_pods("plain")
    wait_for(lambda: emulated.status("plain").get("phase") == "Running", "the job Running", 30)


def test_a_suspended_gang_resumes_with_its_new_minimum(real: RealEnv) -> None:
    """minReplicas changes only across a suspend; the PodGroup's minCount follows it (the only
    field of a PodGroup that may change), and the resumed pods join the same group."""
    kube = real.k
    pool(kube, 2)
    real.start_operator()
    real.create_job(
        "resize", replicas=2, minReplicas=2, maxReplicas=4, gangScheduling="Native",
        template=template(kube),
    )  # fmt: skip
    real.run_pods("resize")
    group = real.get_object(PODGROUPS, real.namespace, "resize")
    assert group is not None and group["spec"]["schedulingPolicy"]["gang"]["minCount"] == 2
    real.patch_job("resize", {"spec": {"suspend": True}})
    wait_for(lambda: live(real, "resize") == [], "the pods gone while suspended", timeout=60)
    real.patch_job("resize", {"spec": {"minReplicas": 3, "replicas": 3}})
    real.patch_job("resize", {"spec": {"suspend": False}})

    def min_count() -> int:
        found = real.get_object(PODGROUPS, real.namespace, "resize") or {}
        return int(
            found.get("spec", {}).get("schedulingPolicy", {}).get("gang", {}).get("minCount", 0)
        )

    wait_for(lambda: min_count() == 3, "the PodGroup's minCount set to 3", timeout=30)
    assert (real.get_object(PODGROUPS, real.namespace, "resize") or {})["metadata"]["uid"] == group[
        "metadata"
    ]["uid"]
    wait_for(lambda: len(bound(real, "resize")) == 3, "3 pods bound", timeout=60)
    assert all(
        p["spec"]["schedulingGroup"] == {"podGroupName": "resize"} for p in live(real, "resize")
    )
    placed = wait_for(
        lambda: condition(real, "resize").get("status") == "True" and condition(real, "resize"),
        "GangScheduled=True",
        timeout=30,
    )
    assert placed["message"] == "gang of 3 placed: 3 of 3 pods bound"
