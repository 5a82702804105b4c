"""What both kubelets of the tests write the same way (the process kubelet, kubelet.py, and the
hollow one, hollow.py): times as the API takes them, a pod's conditions and the shape of its
status, and the watch of the pods bound to a node."""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any, Protocol

from tests.harness.kube.client import Client

JSON = dict[str, Any]
KUBELET_OWNED = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")
"""The pod conditions a kubelet owns (others are the scheduler's, the controllers')."""


def rfc3339(when: float | None = None) -> str:
    moment = dt.datetime.fromtimestamp(time.time() if when is None else when, dt.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def condition(
    transitions: dict[str, tuple[str, str]],
    kind: str,
    value: bool,
    reason: str = "",
    message: str = "",
) -> JSON:
    """A pod condition; ``transitions`` (the pod's, by kind: status and when it took it) keeps
    ``lastTransitionTime`` until the status changes."""
    status = "True" if value else "False"
    previous = transitions.get(kind)
    if previous is None or previous[0] != status:
        transitions[kind] = (status, rfc3339())
    # null, not absent: a strategic merge patch keeps the fields it is not told to delete.
    return {
        "type": kind,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": transitions[kind][1],
        "reason": reason or None,
        "message": message or None,
    }


def pod_status(
    phase: str,
    host_ip: str,
    ip: str | None,
    start_time: str | None,
    conditions: list[JSON],
    containers: list[JSON],
    init: list[JSON] | None = None,
) -> JSON:
    """A pod's status as a kubelet writes it: its containers by name (the kubelet's order)."""
    status: JSON = {
        "phase": phase,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "startTime": start_time,
        "conditions": conditions,
        "containerStatuses": sorted(containers, key=lambda s: str(s["name"])),
    }
    if init:
        status["initContainerStatuses"] = init
    return status


class BoundPods(Protocol):
    """A kubelet's view of the pods bound to its node, as :func:`watch_bound` keeps it."""

    lock: threading.Lock
    seen: dict[str, JSON]
    """The API's pods, by uid."""
    deleted: set[str]
    """Uids the API no longer has: a stale watch event never brings one back (never reused)."""
    wake: threading.Event
    """Set on every change."""


def watch_bound(api: Client, node: str, pods: BoundPods, stop: threading.Event) -> None:
    """The kubelet's own watch: the pods with ``spec.nodeName`` ``node``, until ``stop``."""

    def listed(items: list[JSON]) -> None:
        with pods.lock:
            pods.seen = {
                p["metadata"]["uid"]: p for p in items if p["metadata"]["uid"] not in pods.deleted
            }
        pods.wake.set()

    def event(kind: str, pod: JSON) -> None:
        uid = pod["metadata"]["uid"]
        with pods.lock:
            if kind == "DELETED":
                pods.seen.pop(uid, None)
                pods.deleted.add(uid)
            elif uid not in pods.deleted:
                pods.seen[uid] = pod
        pods.wake.set()

    api.watch("/api/v1/pods", listed, event, stop, fieldSelector=f"spec.nodeName={node}")
