"""Hollow nodes (``tests.harness.kube.hollow_nodes``) under the real operator: a small smoke test.

Two hollow nodes join the session's cluster (tainted, so only pods that tolerate it land
there). A DDPJob of 8 pods runs on them, asked by the operator through the hollow agents
(``--ask-agents``, from the cluster's network); a hollow pod exits 3 and is replaced, charged;
a hollow node is lost and its pods are replaced, uncharged; the node comes back; the job is
deleted. The scale runs of hollow nodes are benchmarks (``bench/bench_operator.py --hollow``),
not tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.kube.controlplane import HOLLOW_TAINT
from tests.harness.kube.fixtures import KubeTest
from tests.harness.operator_env import RealEnv, real_env, wait_for

PODS = 8


@pytest.fixture
def hollow(kube: KubeTest) -> Iterator[list[str]]:
    nodes = kube.cluster.add_hollow_nodes(2)
    try:
        yield nodes
    finally:
        kube.stop_operators()
        kube.release_pods()
        for node in nodes:
            with contextlib.suppress(Exception):
                pods = kube.api.get("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")
                for found in pods.get("items") or []:
                    meta = found["metadata"]
                    path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
                    kube.api.delete(path, {"gracePeriodSeconds": 0})
        kube.cluster.remove_hollow_nodes()


def hollow_job(env: RealEnv, name: str) -> dict[str, Any]:
    template = {
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": {"ddpjob.io/hollow": "true"},
            "tolerations": [{**HOLLOW_TAINT, "operator": "Equal"}],
            "containers": [
                {"name": "trainer", "image": "ddpjob/worker-cpu:test", "command": ["ddpjob-agent"]}
            ],
        }
    }
    return env.create_job(
        name,
        replicas=PODS,
        maxReplicas=PODS,
        minReplicas=1,
        nodeLostTolerationSeconds=1,
        forceDeleteAfterSeconds=1,
        template=template,
    )


def running(env: RealEnv, name: str) -> list[dict[str, Any]] | None:
    pods = [p for p in env.pods(name) if not p["metadata"].get("deletionTimestamp")]
    ok = len(pods) == PODS and all(
        p.get("status", {}).get("phase") == "Running" and p["status"].get("podIP") for p in pods
    )
    return pods if ok else None


def test_a_job_on_hollow_nodes_runs_fails_loses_a_node_and_goes(
    kube: KubeTest, hollow: list[str], tmp_path: Path
) -> None:
    env = real_env(kube, tmp_path, fake_trainer=False)
    env.in_cluster_network()
    env.start_operator("--ask-agents")
    hollow_job(env, "hollow")
    pods = wait_for(lambda: running(env, "hollow"), "8 hollow pods Running", timeout=60)
    assert {p["spec"]["nodeName"] for p in pods} <= set(hollow)
    # The hollow agents answer the operator: the world is theirs, and pod 0 hosts the store.
    wait_for(
        lambda: (
            (s := env.status("hollow")).get("worldSize") == PODS
            and s.get("storeHost") == "hollow-worker-0"
        ),
        "the agents' world and store host in the status",
        timeout=30,
    )

    # A container exits 3: charged, replaced.
    victim = next(p for p in pods if p["metadata"]["name"] == "hollow-worker-3")
    assert kube.cluster.hollow_exit(kube.namespace, ["hollow-worker-3"], code=3) == 1
    wait_for(lambda: env.status("hollow").get("backoffCount") == 1, "the exit counted", timeout=30)
    failure = env.status("hollow")["failures"][-1]
    assert (failure["pod"], failure["reason"], failure["charged"]) == (
        "hollow-worker-3",
        "ExitCode(3)",
        True,
    )
    env.replacement(victim, "pod 3 again", timeout=30)

    # A node lost: its pods are counted once as NodeLost, uncharged, and replaced elsewhere.
    pods = wait_for(lambda: running(env, "hollow"), "8 pods Running again", timeout=60)
    lost = max(hollow, key=lambda node: sum(p["spec"]["nodeName"] == node for p in pods))
    on_it = {p["metadata"]["name"]: p for p in pods if p["spec"]["nodeName"] == lost}
    before = env.status("hollow")
    kube.cluster.lose_node(lost)  # the hollow fixture removes it, lost or not
    for old in on_it.values():
        env.replacement(old, f"a replacement of {lost}'s pods", timeout=90)
    after = env.status("hollow")
    assert after["restarts"] - before["restarts"] == len(on_it)
    assert after["backoffCount"] == before["backoffCount"]
    assert {f["reason"] for f in after["failures"][-len(on_it) :]} == {"NodeLost"}
    kube.cluster.revive_node(lost)
    wait_for(lambda: running(env, "hollow"), "8 pods Running after the node came back", 60)

    env.delete_job("hollow")
    wait_for(lambda: not env.pods("hollow"), "every pod gone", timeout=60)
