"""Fixtures every tier may use: the real control plane (:mod:`tests.harness.kube.fixtures`) and the
real Kueue controller on it (:mod:`tests.harness.kueue.fixtures`)."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests.harness.kube.fixtures import control_plane_report, kube, kube_cluster
from tests.harness.kueue.fixtures import kueue, kueue_queues

__all__ = ["kube", "kube_cluster", "kueue", "kueue_queues"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    control_plane_report(item, report)
    return report
