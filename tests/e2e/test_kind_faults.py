"""Real faults on real kind nodes: a node killed, frozen or cut off, pod 0's and another pod's.

The offline kind cluster (tests/harness/kind) has the control plane, which runs the operator, and three
workers. A job of three pods (one per worker: a required anti-affinity; ``minReplicas: 2``)
trains examples/train.py
from the worker-cpu image with checkpoints on a directory every node shares. One worker is then
hit, as a machine is in a data centre:

* ``kill``: ``docker kill`` of the node's container. Its kubelet, runtime and pods die at once
  and its network namespace goes with them: its peers see no reset, their packets go nowhere;
* ``pause``: ``docker pause`` (the freezer cgroup). Every process of the node stops, its network
  stays: the kernel still takes packets, and nothing answers them;
* ``disconnect``: ``docker network disconnect``. The node runs on, cut off from everyone.

Pod 0 hosts the job's rendezvous store, so a fault on its node is the hard case. What must
hold, each time: the two pods on the other workers, a majority of the last round, train on at
world 2 long before the cluster reacts (the node controller marks the node NotReady after its
grace period); once the node is back, the job grows to world 3 again and succeeds; the lost pod is counted as a ``NodeLost`` or
``Deleted`` failure that is not charged (``backoffCount`` stays 0); and every step is done
exactly once over every run of rank 0 (``lineage_problems``): no lost step, and no two groups
training at once while the node was away.

Needs a kind cluster with three workers: the offline one has them; on a user's single-node kind
these tests are skipped with the reason. (With two pods, the survivor of a lost store host is
no majority and rightly waits for the node to come back: the agents never let a minority train
on, as a partitioned one could while the rest of the job trains too.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import yaml

from tests.e2e.test_kind_operator import EXAMPLE, Job, pod_logs
from tests.harness.kubectl import Installed, Kube, wait_until
from tests.harness.podlogs import STEP_RE, PodLogs, lineage_problems, rank0_runs

if TYPE_CHECKING:
    from tests.e2e.conftest import KindBackend

pytestmark = pytest.mark.e2e

__all__ = ["pod_logs"]  # the fixture, used by name

STEPS = 240
CKPT_EVERY = 20
STEP_SLEEP = 0.25
START_TIMEOUT = 600
SURVIVOR_TIMEOUT = 120
"""The survivors must step at world 2 well inside this: the agents find a silent or dead peer
within seconds, while the cluster's node controller takes about a minute to react."""
HEAL_TIMEOUT = 300
FINISH_TIMEOUT = 900


def job_name(fault: str, victim: int) -> str:
    return f"faults-{fault}-{victim}"


def manifest(name: str, worker_image: str) -> str:
    """examples/kind-cpu.yaml as three pods, one per worker, with a 2 s toleration for a lost
    node (the operator replaces a pod of a NotReady node 2 s after the taint)."""
    document = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"]["name"] = name
    spec = document["spec"]
    spec.update(replicas=3, minReplicas=2, maxReplicas=3, nodeLostTolerationSeconds=2)
    pod = spec["template"]["spec"]
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        container["image"] = worker_image
    pod["containers"][0]["args"] = [
        "/opt/ddpjob/examples/train.py",
        f"--steps={STEPS}",
        f"--step-sleep={STEP_SLEEP}",
        f"--ckpt-every={CKPT_EVERY}",
        "--ckpt-dir=/ckpt/$(PET_RDZV_ID)",
    ]
    pod["affinity"] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"ddpjob.io/job-name": name}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }
    return yaml.safe_dump(document, sort_keys=False)


def describe(job: Job, logs: PodLogs) -> Callable[[], str]:
    def text() -> str:
        nodes = [f"{name} on {p['spec'].get('nodeName')}" for name, p in sorted(job.pods().items())]
        return f"{job.describe()}\nnodes: {', '.join(nodes)}\n{logs.describe()}"

    return text


def steps_at(logs: PodLogs, pod: str, world: int, after: float) -> int:
    """Step lines at ``world`` that the pod's streams read after ``after`` (monotonic)."""
    count = 0
    for log in list(logs.logs.values()):
        if log.name != pod:
            continue
        for seen_at, line in list(log.lines):
            if seen_at > after:
                found = STEP_RE.search(line)
                if found and int(found.group(3)) == world:
                    count += 1
    return count


@pytest.mark.parametrize("victim", [0, 1], ids=["pod0-node", "pod1-node"])
@pytest.mark.parametrize("fault", ["kill", "pause", "disconnect"])
def test_a_lost_node_costs_no_step_and_no_charge(
    kind_backend: KindBackend,
    kind_install: Installed,
    pod_logs: Callable[[Kube, str, str], PodLogs],
    fault: str,
    victim: int,
) -> None:
    cluster = kind_backend.offline
    if cluster is None or len(kind_backend.workers()) < 3:
        pytest.skip("needs a kind cluster with three workers (DDPJOB_KIND=offline makes one)")
    kube = kind_install.kube
    name = job_name(fault, victim)
    kube.kubectl("delete", "ddpjob", name, "--ignore-not-found", "--timeout=300s", timeout=330)
    kube.kubectl("apply", "-f", "-", stdin=manifest(name, kind_install.worker_image))
    logs = pod_logs(kube, name, kube.get("ddpjob", name)["metadata"]["uid"])
    job = Job(kube, name)
    say = describe(job, logs)
    target = f"{name}-worker-{victim}"
    survivors = [f"{name}-worker-{i}" for i in range(3) if i != victim]

    # Training at world 3, one pod per worker, and a checkpoint to come back to.
    wait_until(
        lambda: all(steps_at(logs, pod, 3, 0.0) for pod in [target, *survivors]),
        timeout=START_TIMEOUT,
        what="every pod stepping at world 3",
        describe=say,
    )
    logs.wait_new_checkpoint(say)
    placed = {pod: p["spec"]["nodeName"] for pod, p in job.pods().items()}
    node = placed[target]
    assert len(set(placed.values())) == 3, placed

    # The fault. The survivors must train on at world 2, without waiting for the cluster.
    hit_at = time.monotonic()
    if fault == "pause":
        print(f"paused {node}: {cluster.pause(node)}")
    else:
        {"kill": cluster.kill, "disconnect": cluster.disconnect}[fault](node)
    try:
        wait_until(
            lambda: all(steps_at(logs, pod, 2, hit_at) >= 5 for pod in survivors),
            timeout=SURVIVOR_TIMEOUT,
            what=f"{survivors} stepping at world 2 after the {fault} of {node}",
            describe=say,
        )
        print(f"{fault} of {target}'s node: the survivors trained at world 2 "
              f"{time.monotonic() - hit_at:.1f} s later")  # fmt: skip
    finally:
        {"kill": cluster.restart, "pause": cluster.unpause, "disconnect": cluster.connect}[fault](
            node
        )
    healed_at = time.monotonic()

    # Back to world 3 once the node is back (a replacement pod, or the old one rejoining).
    wait_until(
        lambda: all(steps_at(logs, pod, 3, healed_at) for pod in [target, *survivors]),
        timeout=HEAL_TIMEOUT,
        what="every pod stepping at world 3 again after the heal",
        describe=say,
    )
    wait_until(
        lambda: job.status().get("phase") in ("Succeeded", "Failed"),
        timeout=FINISH_TIMEOUT,
        what="the job to finish",
        describe=say,
    )
    final = job.status()
    assert final["phase"] == "Succeeded", say()
    assert final.get("backoffCount", 0) == 0, say()
    charged = [f for f in final.get("failures", []) if f.get("charged")]
    assert charged == [], f"a lost node is never charged: {charged}\n{say()}"

    logs.finish()
    runs = [run for log in logs.logs.values() for run in rank0_runs(log)]
    summary = "\n".join(str(run) for run in sorted(runs, key=lambda run: run.began))
    problems = lineage_problems(runs, STEPS, CKPT_EVERY)
    assert not problems, (
        "not every step done once:\n  " + "\n  ".join(problems)
        + f"\nruns of rank 0, in order:\n{summary}\n{say()}"
    )  # fmt: skip
    kube.kubectl("delete", "ddpjob", name, "--timeout=300s", timeout=330)
