"""What the reconciler sees of a pod, and why a pod failed. Pure: no I/O.

The Kubernetes executor turns Pod objects into :class:`ObservedPod` with :func:`observe_pod`;
the local runner builds them from its processes. The reconciler only ever sees these, and every
classification rule lives here, in :func:`classify`.

Pods are read the way the kubelet and the controllers write them:

* the trainer is found **by name** (the first container of the pod spec): the kubelet sorts
  ``containerStatuses`` by name, so an ``istio-proxy`` sidecar may come first;
* a pod whose trainer has terminated counts as finished with the trainer's exit code, even while
  an ordinary (non-native) sidecar keeps the pod ``Running``;
* ``DisruptionTarget`` conditions and the pod's ``status.reason`` are mapped with exact tables;
* ``deletionTimestamp`` is when the grace period ends, so a pod still there well after it is
  stuck (its node is lost); it is *not* always the deletion request plus the grace period (see
  :func:`_failed_before_deletion`);
* a pod carries :data:`~ddpjob_operator.api.POD_FINALIZER` until its outcome is counted;
* a pod belongs to the DDPJob its controller owner reference names (``owner_uid``), not to any
  job of the name its label gives: a job re-created under the same name must not adopt the pods
  of the one before.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
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

DISRUPTION_TARGET_REASONS: Mapping[str, Reason] = {
    "PreemptionByScheduler": Reason.PREEMPTED,
    "PreemptionByKubeScheduler": Reason.PREEMPTED,  # its name in Kubernetes 1.26
    "EvictionByEvictionAPI": Reason.EVICTED,
    "TerminationByKubelet": Reason.EVICTED,  # node-pressure eviction, graceful node shutdown
    "DeletionByTaintManager": Reason.NODE_LOST,
    "DeletionByPodGC": Reason.NODE_LOST,  # the pod's node is gone
}
"""The reasons of a ``DisruptionTarget`` condition. Any other reason is still a disruption and
reads as ``Evicted``."""

STATUS_REASONS: Mapping[str, Reason] = {
    "Evicted": Reason.EVICTED,  # kubelet node-pressure eviction
    "NodeLost": Reason.NODE_LOST,
    "Shutdown": Reason.EVICTED,  # graceful node shutdown (Kubernetes < 1.22)
    "Terminated": Reason.EVICTED,  # graceful node shutdown
    "UnexpectedAdmissionError": Reason.EVICTED,  # the kubelet rejected the pod at admission
    "NodeAffinity": Reason.EVICTED,
}
"""A failed pod's ``status.reason``, set by the kubelet or the node controller. Reasons of the
form ``OutOf<resource>`` (kubelet admission) read as ``Evicted`` too."""

DELETION_CLAMP_SLACK = dt.timedelta(seconds=30)
"""How long before ``deletionTimestamp`` a trainer must have ended to count as ended before a
deletion whose request time is unknown (see :func:`_failed_before_deletion`)."""

BENIGN_WAITING = frozenset({"ContainerCreating", "PodInitializing"})
"""Waiting reasons that are part of every start: not reported as trouble."""

SECURITY_HINT = (
    "the image runs as root but the pod requires runAsNonRoot: set securityContext.runAsUser "
    "(a non-root UID the image supports) in the template, or use spec.securityProfile: Baseline, "
    "which works with root images"
)


def exit_code_reason(code: int) -> str:
    return f"ExitCode({code})"


@dataclasses.dataclass(frozen=True)
class ObservedPod:
    """One pod of the job as observed now.

    ``phase`` is the pod's phase as far as training goes: ``Succeeded``/``Failed`` as soon as
    the trainer container has terminated, even while a sidecar keeps the pod ``Running``
    (``sidecars_running`` then says so). ``disruption`` is the raw reason of a
    ``DisruptionTarget`` condition or of the pod's own ``status.reason`` when the platform, not
    the trainer, ended the pod. ``deletion_timestamp`` is Kubernetes': when the grace period of
    a requested deletion ends. ``tracked``: the pod still carries our finalizer, so its outcome
    has not been counted and removed from our books yet. ``world_size`` is what the pod's agent
    reports, when known. ``owner_uid`` is the uid of the pod's controller (its owner reference
    with ``controller: true``): ``""`` when it has none, ``None`` when unknown (the local runner,
    whose pods have no owner references). ``started``: the trainer container ever started (a pod
    the kubelet rejected at admission never did).
    """

    name: str
    index: int
    uid: str
    phase: PodPhase
    ready: bool = False
    deleting: bool = False
    deletion_timestamp: dt.datetime | None = None
    deletion_grace_seconds: float | None = None
    tracked: bool = True
    exit_code: int | None = None
    container_reason: str | None = None
    finished_at: dt.datetime | None = None
    disruption: str | None = None
    message: str = ""
    node: str | None = None
    world_size: int | None = None
    waiting_reason: str | None = None
    waiting_message: str = ""
    sidecars_running: bool = False
    owner_uid: str | None = None
    started: bool = True
    started_at: dt.datetime | None = None
    """When the trainer (last) started running, by the same clock as ``finished_at`` (the
    kubelet's): how long a pod ran is ``finished_at - started_at``, free of clock skew."""
    ip: str | None = None
    store_host: bool = False
    """Its agent says it hosts the job's rendezvous store (generation ``store_gen``)."""
    store_gen: int = 0
    store_keyed: bool | None = None
    """Its trainer's env sets ``DDPJOB_STORE_KEY`` (its agent signs what it writes to the
    rendezvous store); ``None`` when unknown (a pod expected but not seen yet, a local pod)."""
    pod_group: str | None = None
    """The PodGroup the pod names (``spec.schedulingGroup.podGroupName``): ``""`` when it
    names none, ``None`` when unknown (a pod expected but not seen yet, a local pod)."""

    def ran_for(self, now: dt.datetime) -> float:
        """Seconds the trainer has run (0 when unknown): to its end, by the kubelet's clock
        alone, once it ended; else until ``now``."""
        if self.started_at is None:
            return 0.0
        end = self.finished_at if self.finished_at is not None else now
        return max(0.0, (end - self.started_at).total_seconds())

    @property
    def live(self) -> bool:
        """Pending or running, and not on its way out."""
        return not self.deleting and not self.phase.terminated

    @property
    def ended(self) -> bool:
        """Its outcome is known: the trainer terminated, or the pod is being deleted."""
        return self.deleting or self.phase.terminated

    @property
    def holds_resources(self) -> bool:
        """Some container may still run (the pod is not terminal as far as the node goes)."""
        return not self.phase.terminated or self.sidecars_running

    @property
    def deletion_requested_at(self) -> dt.datetime | None:
        """When the deletion was requested, at the latest (exact unless a later, shorter delete
        was clamped: see :func:`_failed_before_deletion`)."""
        if self.deletion_timestamp is None:
            return None
        return self.deletion_timestamp - dt.timedelta(seconds=self.deletion_grace_seconds or 0)

    def owned_by(self, job_uid: str | None) -> bool:
        """The pod is this job's: its controller is the job (or ownership is unknown)."""
        return self.owner_uid is None or job_uid is None or self.owner_uid == job_uid


LOST_CONTAINER_REASONS = frozenset({"Unknown", "ContainerStatusUnknown"})
"""A terminated container's ``reason`` when nobody saw it exit: containerd gives ``Unknown``
(exit code 255) to the containers whose tasks it lost, after a reboot of the node or a restart
of the runtime, and the kubelet gives ``ContainerStatusUnknown`` (137) to one it cannot find any
more. The node went down under the trainer (a real kubelet on kind, the node killed and started
again, reported 255 ``Unknown``, and the job was charged for it): not the trainer's failure."""


def _disruption_reason(raw: str) -> Reason | None:
    if raw in DISRUPTION_TARGET_REASONS:
        return DISRUPTION_TARGET_REASONS[raw]
    if raw in STATUS_REASONS:
        return STATUS_REASONS[raw]
    if raw.startswith("OutOf"):
        return Reason.EVICTED
    return None


def _failed_before_deletion(pod: ObservedPod) -> bool:
    """The trainer had already terminated when someone asked to delete the pod.

    A deletion's request time is ``deletionTimestamp - deletionGracePeriodSeconds`` only while
    no later delete shortened the grace period into the past: since Kubernetes 1.33 the API
    server then sets ``deletionTimestamp`` to the time of that later delete and the grace period
    to 0 (or 1), instead of moving the timestamp into the past. The kubelet's own final delete,
    once the containers are gone, is such a delete, so a pod whose deletion the kubelet carried
    out carries the time it did so, which is always after the trainer was killed. With a grace
    period of 2 s or more the request time is exact. With 0 or 1 it is at most the timestamp,
    and the trainer counts as ended before the deletion only if it ended well before
    (:data:`DELETION_CLAMP_SLACK`): a kubelet confirms within seconds of the kill. A pod that
    failed on its own and was deleted by someone within that slack, before the operator saw it
    fail, counts as Deleted (not charged): the opposite mistake would charge, or under
    ``restartPolicy: ExitCode`` fail, a job for a deletion.
    """
    timestamp = pod.deletion_timestamp
    if not pod.phase.terminated or pod.finished_at is None or timestamp is None:
        return False
    grace = pod.deletion_grace_seconds
    if grace is not None and grace > 1:
        return pod.finished_at < timestamp - dt.timedelta(seconds=grace)
    return pod.finished_at < timestamp - DELETION_CLAMP_SLACK


def classify(pod: ObservedPod) -> str:
    """Why a pod ended: Preempted, Evicted, OOMKilled, NodeLost, Deleted, or ExitCode(n).

    The operator's own deletions never get here (they are not failures). In order:

    1. a disruption (``DisruptionTarget`` condition or ``status.reason``), by the exact tables;
    2. deleted by someone else (``kubectl delete``) and the trainer had not terminated before
       that: ``Deleted``, whatever exit code the kill left behind;
    3. the trainer was OOM-killed: ``OOMKilled``; its runtime lost it (the node restarted:
       :data:`LOST_CONTAINER_REASONS`): ``NodeLost``;
    4. the agent stopped gracefully on a signal (exit 143) with no other explanation:
       ``Preempted``;
    5. the trainer's exit code: ``ExitCode(n)``;
    6. a pod in phase ``Unknown`` (its node stopped reporting): ``NodeLost``.
    """
    if pod.disruption is not None:
        return _disruption_reason(pod.disruption) or Reason.EVICTED
    if pod.deleting and not _failed_before_deletion(pod):
        return Reason.DELETED
    if pod.container_reason == "OOMKilled":
        return Reason.OOM_KILLED
    if pod.container_reason in LOST_CONTAINER_REASONS:
        return Reason.NODE_LOST
    if pod.exit_code == contract.EXIT_STOPPED_BY_SIGNAL:
        return Reason.PREEMPTED
    if pod.exit_code is not None and pod.exit_code != 0:
        return exit_code_reason(pod.exit_code)
    if pod.phase is PodPhase.UNKNOWN:
        return Reason.NODE_LOST
    return exit_code_reason(pod.exit_code or 1)


# ---- reading a core/v1 Pod ----------------------------------------------------------------------


def parse_time(value: object) -> dt.datetime | None:
    """An RFC 3339 timestamp as Kubernetes writes it (``2026-11-22T12:00:00Z``)."""
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def _container_status(statuses: object, name: str) -> Mapping[str, Any]:
    for status in statuses if isinstance(statuses, list) else []:
        if isinstance(status, Mapping) and status.get("name") == name:
            return status
    return {}


def _others_may_run(spec: Mapping[str, Any], status: Mapping[str, Any], trainer: str) -> bool:
    """A container besides the trainer may still run: a regular one, or a native sidecar (an
    init container with ``restartPolicy: Always``), whose status says running or is missing.

    A real kubelet reports the trainer terminated before it gives the pod a terminal phase: it
    first stops every container and tears the sandbox down (seen on kind: about a second with
    phase Running and no container left). Such a pod holds nothing any more; only a container
    that still runs does.
    """
    others = [
        (c.get("name"), "containerStatuses")
        for c in spec.get("containers") or []
        if isinstance(c, Mapping) and c.get("name") != trainer
    ] + [
        (c.get("name"), "initContainerStatuses")
        for c in spec.get("initContainers") or []
        if isinstance(c, Mapping) and c.get("restartPolicy") == "Always"
    ]
    for name, field in others:
        found = _container_status(status.get(field), str(name))
        if not found or "running" in (found.get("state") or {}):
            return True
    listed = [
        c
        for field in ("containerStatuses", "initContainerStatuses")
        for c in status.get(field) or []
        if isinstance(c, Mapping) and c.get("name") != trainer
    ]
    return any("running" in (c.get("state") or {}) for c in listed)


def _terminated(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    state = status.get("state") or {}
    if "terminated" in state:
        return dict(state["terminated"] or {})
    return None


def _waiting(
    status: Mapping[str, Any], conditions: Mapping[str, Mapping[str, Any]]
) -> tuple[str | None, str]:
    """Why a pod that is not running yet cannot start: scheduling first, then its containers."""
    scheduled = conditions.get("PodScheduled") or {}
    if scheduled.get("status") == "False" and scheduled.get("reason"):
        return str(scheduled["reason"]), str(scheduled.get("message") or "")
    for key in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(key) or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason and reason not in BENIGN_WAITING:
                message = str(waiting.get("message") or "")
                if reason == "CreateContainerConfigError" and "runAsNonRoot" in message:
                    message = f"{message} (fix: {SECURITY_HINT})"
                return str(reason), f"container {container.get('name')}: {message}".strip()
    return None, ""


def _effective_phase(phase: PodPhase, terminated: Mapping[str, Any] | None) -> PodPhase:
    if phase.terminated or terminated is None:
        return phase
    # The trainer has terminated (pods run with restartPolicy Never) while a sidecar runs on.
    return PodPhase.SUCCEEDED if terminated.get("exitCode") == 0 else PodPhase.FAILED


def observe_pod(pod: Mapping[str, Any]) -> ObservedPod | None:
    """Read a core/v1 Pod dict. ``None`` when it is not one of a DDPJob's pods."""
    meta = pod.get("metadata") or {}
    index_text = (meta.get("labels") or {}).get(api.LABEL_INDEX, "")
    if not index_text.isdigit():
        return None
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    try:
        k8s_phase = PodPhase(status.get("phase") or "Pending")
    except ValueError:
        k8s_phase = PodPhase.UNKNOWN
    conditions: dict[str, Mapping[str, Any]] = {
        str(c.get("type")): c for c in status.get("conditions") or [] if isinstance(c, Mapping)
    }
    ready = (conditions.get("Ready") or {}).get("status") == "True"
    disruption = None
    disruption_condition = conditions.get("DisruptionTarget") or {}
    if disruption_condition.get("status") == "True":
        disruption = str(disruption_condition.get("reason") or "DisruptionTarget")
    elif status.get("reason") and _disruption_reason(str(status["reason"])) is not None:
        disruption = str(status["reason"])
    containers = spec.get("containers") or [{}]
    trainer_name = containers[0].get("name")
    trainer = _container_status(status.get("containerStatuses"), str(trainer_name))
    terminated = _terminated(trainer)
    last = dict((trainer.get("lastState") or {}).get("terminated") or {})
    ended = terminated if terminated is not None else last
    phase = _effective_phase(k8s_phase, terminated)
    exit_code = ended.get("exitCode")
    waiting_reason, waiting_message = (
        (None, "") if phase.terminated else _waiting(status, conditions)
    )
    grace = meta.get("deletionGracePeriodSeconds")
    controller = next(
        (
            o
            for o in meta.get("ownerReferences") or []
            if isinstance(o, Mapping) and o.get("controller")
        ),
        None,
    )
    return ObservedPod(
        name=str(meta.get("name", "")),
        index=int(index_text),
        uid=str(meta.get("uid") or meta.get("name", "")),
        phase=phase,
        ready=ready and not phase.terminated,
        deleting=meta.get("deletionTimestamp") is not None,
        deletion_timestamp=parse_time(meta.get("deletionTimestamp")),
        deletion_grace_seconds=float(grace) if grace is not None else None,
        tracked=api.POD_FINALIZER in (meta.get("finalizers") or []),
        exit_code=int(exit_code) if exit_code is not None else None,
        container_reason=ended.get("reason"),
        finished_at=parse_time(ended.get("finishedAt")),
        disruption=disruption,
        message=str(status.get("message") or ended.get("message") or "")[:500],
        node=spec.get("nodeName"),
        ip=status.get("podIP") or None,
        waiting_reason=waiting_reason,
        waiting_message=waiting_message[:500],
        sidecars_running=phase.terminated
        and not k8s_phase.terminated
        and _others_may_run(spec, status, str(trainer_name)),
        owner_uid=str(controller.get("uid") or "") if controller is not None else "",
        started=_started(trainer),
        started_at=_started_at(trainer),
        store_keyed=any(
            isinstance(e, Mapping) and e.get("name") == api.STORE_KEY_ENV
            for e in containers[0].get("env") or []
        ),
        pod_group=str((spec.get("schedulingGroup") or {}).get("podGroupName") or ""),
    )


def _started(trainer: Mapping[str, Any]) -> bool:
    """The trainer container ran at some point (it has, or had, a running or terminated state)."""
    state = trainer.get("state") or {}
    last = trainer.get("lastState") or {}
    return "running" in state or "terminated" in state or "terminated" in last


def _started_at(trainer: Mapping[str, Any]) -> dt.datetime | None:
    """When the trainer's current (or last) run started."""
    state = trainer.get("state") or {}
    for key in ("running", "terminated"):
        if isinstance(state.get(key), Mapping) and state[key].get("startedAt"):
            return parse_time(state[key]["startedAt"])
    last = (trainer.get("lastState") or {}).get("terminated") or {}
    return parse_time(last.get("startedAt")) if isinstance(last, Mapping) else None
