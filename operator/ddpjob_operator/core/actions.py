"""The core's vocabulary: what a pass sees (:class:`Observed`), the actions it decides, and
the :class:`Decision` an executor carries out (:mod:`ddpjob_operator.core.reconcile` says in
what order)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

from ddpjob_operator.api import DDPJobStatus
from ddpjob_operator.core import queue
from ddpjob_operator.core.events import Event
from ddpjob_operator.observe import ObservedPod

JSON = dict[str, Any]


class DeleteWhy(enum.StrEnum):
    REPLACE = "Replace"
    SCALE_DOWN = "ScaleDown"
    SUSPEND = "Suspend"
    QUEUE = "Queue"
    """Kueue evicted the job (a preemption, say): its pods go, uncharged."""
    CLEANUP = "Cleanup"
    STUCK = "Stuck"
    """Force-delete a pod stuck Terminating past its bound (``force`` is set)."""
    STORE_HOST = "StoreHost"
    """Make room for pod 0, the first store's host, which the scheduler left waiting: the pod
    is created again once pod 0 is placed (:func:`store_host_unplaced`)."""


@dataclasses.dataclass(frozen=True)
class CreateService:
    service: JSON


@dataclasses.dataclass(frozen=True)
class CreatePod:
    index: int
    pod: JSON

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])


@dataclasses.dataclass(frozen=True)
class DeletePod:
    """Delete one pod, with a uid precondition. ``force``: ``gracePeriodSeconds: 0``."""

    name: str
    uid: str
    index: int
    why: DeleteWhy
    force: bool = False


@dataclasses.dataclass(frozen=True)
class RemoveFinalizer:
    """Remove :data:`~ddpjob_operator.api.POD_FINALIZER` from a pod whose outcome is counted."""

    name: str
    uid: str
    index: int


@dataclasses.dataclass(frozen=True)
class DeleteJob:
    """``ttlSecondsAfterFinished`` has passed: delete the DDPJob itself."""


Action = CreateService | CreatePod | DeletePod | RemoveFinalizer | DeleteJob


@dataclasses.dataclass(frozen=True)
class Observed:
    """Everything of the job's world the reconciler looks at."""

    pods: tuple[ObservedPod, ...] = ()
    service: bool = False
    pod_groups: bool | None = None
    """The cluster serves the native PodGroup API (asked only for a job with
    ``gangScheduling: Native``; ``None``: not asked, as by the local runner)."""
    queue: queue.Admission | None = None
    """What Kueue admits, for a job that names a Kueue queue (``None``: not a Kueue job)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    actions: tuple[Action, ...]
    status: DDPJobStatus
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None
    """Seconds until a time-based rule (deadline, below-min, stuck pod, TTL) is due, if any."""
    desired: int = 0
    """The pods the job wants now: the spec's replicas within min and max, at most as many as
    Kueue admits (0 for a job being deleted)."""


def told_first(events: Sequence[Event], decision: Decision) -> Decision:
    """The decision, with ``events`` (of the pass's earlier rules) before its own."""
    return dataclasses.replace(decision, events=(*events, *decision.events))


def also(decision: Decision, actions: Sequence[Action]) -> Decision:
    return dataclasses.replace(decision, actions=decision.actions + tuple(actions))


def sooner(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)
