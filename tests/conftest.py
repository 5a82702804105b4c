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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the real control plane run last, in their collected order: the session's
    control plane (etcd, the API server, the controllers, three process kubelets) is started by
    the first test that asks for it and runs until the session ends, so on a 2-core machine every
    test after that one shares the CPU with it."""
    items.sort(key=_on_control_plane)


def _on_control_plane(item: pytest.Item) -> bool:
    if "kube_cluster" in getattr(item, "fixturenames", ()):
        return True
    # Those that ask for it by name at run time: the operator's scenarios on the real backend
    # (tests/operator/test_operator.py) and the e2e suite (tests/e2e/conftest.py).
    callspec = getattr(item, "callspec", None)
    real = callspec is not None and callspec.params.get("world") == "real"
    return real or item.get_closest_marker("e2e") is not None
