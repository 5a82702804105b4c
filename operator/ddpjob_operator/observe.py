"""What the reconciler sees of a pod, and why a pod failed. Pure: no I/O.

The Kubernetes executor turns Pod objects into :class:`ObservedPod` with :func:`observe_pod`;
the local runner builds them from its processes. The reconciler only ever sees these.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from ddpjob_operator import api
from ddpjob_worker import contract


class PodPhase(enum.StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNKNOWN = "Unknown"

    @property
    def terminated(self) -> bool:
        return self in (PodPhase.SUCCEEDED, PodPhase.FAILED)


class Reason(enum.StrEnum):
    """Classified failure reasons. ``ExitCode(n)`` is built by :func:`exit_code_reason`."""

    PREEMPTED = "Preempted"
    EVICTED = "Evicted"
    OOM_KILLED = "OOMKilled"
    NODE_LOST = "NodeLost"
    DELETED = "Deleted"


DISRUPTIONS = frozenset({Reason.PREEMPTED, Reason.EVICTED, Reason.NODE_LOST, Reason.DELETED})
"""Failures caused by the platform, not the training: replaced without charging backoffLimit."""


def exit_code_reason(code: int) -> str:
    return f"ExitCode({code})"


@dataclasses.dataclass(frozen=True)
class ObservedPod:
    """One pod of the job as observed now.

    ``disruption`` is the reason of a ``DisruptionTarget`` condition (or the pod's own status
    reason) when the platform, not the trainer, ended the pod. ``world_size`` is what the pod's
    agent reports, when known.
    """

    name: str
    index: int
    uid: str
    phase: PodPhase
    ready: bool = False
    deleting: bool = False
    exit_code: int | None = None
    container_reason: str | None = None
    disruption: str | None = None
    message: str = ""
    node: str | None = None
    world_size: int | None = None

    @property
    def live(self) -> bool:
        """Pending or running, and not on its way out."""
        return not self.deleting and not self.phase.terminated


def classify(pod: ObservedPod) -> str:
    """Why a pod ended: Preempted, Evicted, OOMKilled, NodeLost, Deleted, or ExitCode(n)."""
    disruption = (pod.disruption or "").lower()
    if "preempt" in disruption or "shutdown" in disruption or "terminationbykubelet" in disruption:
        return Reason.PREEMPTED
    if "evict" in disruption:
        return Reason.EVICTED
    if "nodelost" in disruption or "taintmanager" in disruption or "unreachable" in disruption:
        return Reason.NODE_LOST
    if pod.container_reason == "OOMKilled":
        return Reason.OOM_KILLED
    if pod.exit_code == contract.EXIT_STOPPED_BY_SIGNAL:
        return Reason.PREEMPTED  # the agent stopped gracefully on SIGTERM
    if pod.exit_code is not None and pod.exit_code != 0:
        return exit_code_reason(pod.exit_code)
    if pod.deleting or pod.phase is PodPhase.UNKNOWN:
        return Reason.DELETED if pod.deleting else Reason.NODE_LOST
    return exit_code_reason(pod.exit_code or 1)


def _terminated_state(status: Mapping[str, Any]) -> Mapping[str, Any]:
    """The trainer container's terminated state (first container), if any."""
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        if "terminated" in state:
            return dict(state["terminated"])
        last = container.get("lastState") or {}
        if "terminated" in last:
            return dict(last["terminated"])
        return {}
    return {}


def observe_pod(pod: Mapping[str, Any]) -> ObservedPod | None:
    """Read a core/v1 Pod dict. ``None`` when it is not one of a DDPJob's pods."""
    meta = pod.get("metadata") or {}
    index_text = (meta.get("labels") or {}).get(api.LABEL_INDEX, "")
    if not index_text.isdigit():
        return None
    status = pod.get("status") or {}
    try:
        phase = PodPhase(status.get("phase") or "Pending")
    except ValueError:
        phase = PodPhase.UNKNOWN
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = (conditions.get("Ready") or {}).get("status") == "True"
    disruption_condition = conditions.get("DisruptionTarget") or {}
    disruption = None
    if disruption_condition.get("status") == "True":
        disruption = str(disruption_condition.get("reason") or "DisruptionTarget")
    elif status.get("reason") in ("Evicted", "NodeLost", "Shutdown", "Terminated", "Preempting"):
        disruption = str(status["reason"])
    terminated = _terminated_state(status)
    exit_code = terminated.get("exitCode")
    return ObservedPod(
        name=str(meta.get("name", "")),
        index=int(index_text),
        uid=str(meta.get("uid") or meta.get("name", "")),
        phase=phase,
        ready=ready,
        deleting=meta.get("deletionTimestamp") is not None,
        exit_code=int(exit_code) if exit_code is not None else None,
        container_reason=terminated.get("reason"),
        disruption=disruption,
        message=str(status.get("message") or terminated.get("message") or "")[:500],
        node=(pod.get("spec") or {}).get("nodeName"),
    )
