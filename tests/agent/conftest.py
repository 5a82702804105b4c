"""Fixtures of the agent tier: local agent "nodes" (:mod:`tests.harness.agents`), none left
running after a test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.harness.agents import Cluster


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
