"""pytest fixtures for the real Kueue controller (``tests/conftest.py`` re-exports them).

* ``kueue`` (session): one :class:`~tests.harness.kueue.process.Kueue` on the session's
  ``kube_cluster``, built if missing and started once; stopped (its webhooks removed first)
  at the end. Its log is ``logs/kueue.log`` of the cluster, and its last lines are in the
  report of any failed test that uses the cluster.
* ``kueue_queues`` (function): a factory
  ``make(namespace, quota, *, node_labels=None, preemption=None) -> Queues`` that makes a
  ResourceFlavor (with those node labels), a ClusterQueue with that quota of the flavor (every
  namespace may use it; ``preemption`` is its ``spec.preemption``) and a LocalQueue in
  ``namespace``; the test's Workloads of that LocalQueue (finalizers and all) and the three
  objects are deleted afterwards.

A machine where Kueue does not build or start fails these tests with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from tests.harness.kube.build import BuildError
from tests.harness.kube.client import ApiError
from tests.harness.kube.controlplane import ControlPlane
from tests.harness.kueue import build
from tests.harness.kueue.process import GROUP, VERSION, Kueue, KueueError

KUEUE = pytest.StashKey[Kueue]()


@dataclasses.dataclass(frozen=True)
class Queues:
    """The names of what :func:`kueue_queues` made."""

    flavor: str
    cluster_queue: str
    local_queue: str
    namespace: str


MakeQueues = Callable[..., Queues]
"""``make(namespace: str, quota: Mapping[str, str | int], *,
node_labels: Mapping[str, str] | None = None, preemption: Mapping[str, str] | None = None)
-> Queues``."""


@pytest.fixture(scope="session")
def kueue(kube_cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[Kueue]:
    try:
        build.build()
    except BuildError as exc:
        pytest.fail(f"Kueue did not build: {exc}", pytrace=False)
    instance = Kueue(kube_cluster)
    try:
        instance.start()
    except (BuildError, KueueError) as exc:
        pytest.fail(f"Kueue did not start: {exc}", pytrace=False)
    request.config.stash[KUEUE] = instance
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture
def kueue_queues(kueue: Kueue) -> Iterator[MakeQueues]:
    made: list[Queues] = []

    def make(
        namespace: str,
        quota: Mapping[str, str | int],
        *,
        node_labels: Mapping[str, str] | None = None,
        preemption: Mapping[str, str] | None = None,
    ) -> Queues:
        suffix = uuid.uuid4().hex[:6]
        queues = Queues(f"flavor-{suffix}", f"cq-{suffix}", f"lq-{suffix}", namespace)
        flavor_spec = {"nodeLabels": dict(node_labels)} if node_labels else {}
        kueue.apply(
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "ResourceFlavor",
                "metadata": {"name": queues.flavor},
                "spec": flavor_spec,
            }
        )
        made.append(queues)
        kueue.apply(
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "ClusterQueue",
                "metadata": {"name": queues.cluster_queue},
                "spec": {
                    **({"preemption": dict(preemption)} if preemption else {}),
                    "namespaceSelector": {},  # every namespace (nil would match none)
                    "resourceGroups": [
                        {
                            "coveredResources": list(quota),
                            "flavors": [
                                {
                                    "name": queues.flavor,
                                    "resources": [
                                        {"name": name, "nominalQuota": str(value)}
                                        for name, value in quota.items()
                                    ],
                                }
                            ],
                        }
                    ],
                },
            }
        )
        kueue.apply(
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "LocalQueue",
                "metadata": {"name": queues.local_queue, "namespace": namespace},
                "spec": {"clusterQueue": queues.cluster_queue},
            }
        )
        return queues

    yield make
    for queues in made:
        _delete(kueue, queues)


def _delete(kueue: Kueue, queues: Queues) -> None:
    """The LocalQueue's Workloads (finalizers and all), then the queues and the flavor, without
    waiting (Kueue holds a ClusterQueue or flavor in use until its Workloads are gone)."""
    admin = kueue.cluster.admin()
    listed: dict[str, Any] = {}
    with contextlib.suppress(ApiError):
        listed = admin.get(kueue.path("workloads", namespace=queues.namespace))
    for workload in listed.get("items") or []:
        if (workload.get("spec") or {}).get("queueName") != queues.local_queue:
            continue
        path = kueue.path("workloads", workload["metadata"]["name"], queues.namespace)
        with contextlib.suppress(ApiError):
            if workload["metadata"].get("finalizers"):
                admin.patch(path, {"metadata": {"finalizers": None}}, kind="merge-patch")
            admin.delete(path)
    for path in (
        kueue.path("localqueues", queues.local_queue, queues.namespace),
        kueue.path("clusterqueues", queues.cluster_queue),
        kueue.path("resourceflavors", queues.flavor),
    ):
        with contextlib.suppress(ApiError):
            admin.delete(path)
