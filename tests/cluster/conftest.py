"""Fixtures of the real control plane's tier: the trainer logs of a job's pods
(:mod:`tests.harness.podlogs`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.harness import tools
from tests.harness.kube.fixtures import KubeTest
from tests.harness.kubectl import Kube
from tests.harness.operator_env import RealEnv
from tests.harness.podlogs import PodLogs

StartLogs = Callable[[RealEnv, str], PodLogs]


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
