"""What the operator benchmarks on the real control plane share (bench_operator.py,
scale_job.py): the namespace they run in, the DDPJob they apply, and the API server's audit
log, read for who asked for what, and when."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from tests.harness.kube import fixtures
from tests.harness.kube.controlplane import ControlPlane

JSON = dict[str, Any]


def stamp(value: str) -> float:
    """An audit timestamp (RFC 3339, micro-seconds) as seconds since the epoch."""
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def when(entry: JSON) -> float:
    """When the API server answered the request (else when it received it)."""
    return stamp(str(entry.get("stageTimestamp") or entry.get("requestReceivedTimestamp")))


def requests_by(entries: Iterable[JSON], user: str) -> dict[str, int]:
    """``user``'s requests by verb and resource (``patch ddpjobs/status``), watches and
    discovery left out."""
    out: dict[str, int] = {}
    for e in entries:
        if (e.get("user") or {}).get("username") != user or e.get("verb") == "watch":
            continue
        ref = e.get("objectRef") or {}
        if not ref.get("resource"):
            continue  # discovery
        key = f"{e['verb']} {ref['resource']}" + (
            f"/{ref['subresource']}" if ref.get("subresource") else ""
        )
        out[key] = out.get(key, 0) + 1
    return out


def creates_by(
    entries: Iterable[JSON], user: str, resource: str = "pods"
) -> list[tuple[str, float]]:
    """(name, when) of each object of ``resource`` that ``user`` created (201)."""
    return [
        (str((e.get("objectRef") or {}).get("name") or ""), when(e))
        for e in entries
        if (e.get("user") or {}).get("username") == user
        and e.get("verb") == "create"
        and (e.get("objectRef") or {}).get("resource") == resource
        and not (e.get("objectRef") or {}).get("subresource")
        and (e.get("responseStatus") or {}).get("code") == 201
    ]


def ddpjob(name: str, namespace: str, pods: int, container: JSON) -> JSON:
    """A DDPJob of ``pods`` pods (elastic down to 1), one process a pod."""
    return {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": pods,
            "minReplicas": 1,
            "maxReplicas": pods,
            "nprocPerNode": 1,
            "template": {"spec": {"containers": [container]}},
        },
    }


def prepare(cluster: ControlPlane, namespace: str) -> None:
    """The chart's RBAC and ``namespace``, once its default ServiceAccount exists."""
    fixtures.install_rbac(cluster)
    fixtures.kubectl_run(cluster, "create", "namespace", namespace)
    admin = cluster.admin()
    fixtures.wait_for(
        lambda: (
            admin.session.get(
                f"{cluster.server}/api/v1/namespaces/{namespace}/serviceaccounts/default"
            ).ok
        ),
        "the namespace's default ServiceAccount",
    )
