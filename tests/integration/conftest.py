"""Fixtures for the integration tests: the agent harness (:mod:`tests.harness`), and the
trainer logs of a job's pods on the real control plane."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import tools
from tests.e2e.cluster import Kube
from tests.e2e.test_kind_operator import PodLogs
from tests.harness import Cluster
from tests.kube.fixtures import KubeTest

from .operator_env import RealEnv

StartLogs = Callable[[RealEnv, str], PodLogs]


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    clusters: list[Cluster] = []

    def make(**kwargs: int) -> Cluster:
        cluster = Cluster(tmp_path / f"c{len(clusters)}", **kwargs)
        cluster.tmp.mkdir(parents=True)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.kill_all()
    for cluster in clusters:
        left = cluster.leftovers()
        assert not left, f"processes outlived the test even after SIGKILL: {left}"


@pytest.fixture
def job_logs(kube: KubeTest) -> Iterator[StartLogs]:
    """Start streaming the trainer log of every pod of a job, from each pod's start (the e2e
    suite's :class:`PodLogs`: a pod's log is kept after the pod is gone, so that rank 0's runs
    can be replayed with ``lineage_problems``); every stream is closed after the test."""
    started: list[PodLogs] = []

    def start(env: RealEnv, job: str) -> PodLogs:
        found = env.job(job)
        assert found is not None, f"no job {job}"
        kubectl, helm = str(tools.tool("kubectl")), str(tools.tool("helm"))
        where = Kube(kube.cluster.kubeconfig, kubectl, helm, namespace=env.namespace)
        started.append(PodLogs(where, job, found["metadata"]["uid"]).start())
        return started[-1]

    yield start
    for collector in started:
        print(collector.tails())  # shown by pytest when the test failed
        collector.close()
