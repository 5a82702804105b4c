"""When a pass's status is written: now, or after its counts have settled.

A job of up to :data:`SETTLE_PODS` pods writes each change at once, and every job writes at
once anything but its counts of pods as they come and go. A large job's counts wait, so that a
burst of changes (a start, a lost node's agents falling silent, replacements coming up) is
written once; a status in which the job is whole is written at once. Pure.
"""

from __future__ import annotations

import math

from ddpjob_operator import api
from ddpjob_operator.core.facts import LARGE_JOB_PODS

SETTLE_PODS = LARGE_JOB_PODS
"""A job of more pods than this writes a status that only moves its counts (see
:func:`counts_only`) :data:`SETTLE_SECONDS` after the first such change that it did not write;
a smaller job writes each change."""


SETTLE_SECONDS = 10.0
"""How long a large job's new counts wait to be written. A pass per pod event wrote the status
of a 1,024-pod job every 0.55 s for 30 s after a node was lost (each pass found one more silent
agent: 50 writes); the Job controller batches its syncs by the second."""


ALONE = math.inf
""":func:`settle_for`'s answer for a change that is never written alone (it waits for the next
write that something else makes)."""


def counts_only(old: api.DDPJobStatus, new: api.DDPJobStatus) -> bool:
    """Whether ``new`` differs from ``old`` only in its counts of pods as they come and go:
    ``replicas``, ``readyReplicas``, ``worldSize``, the store's host (what the agents say, which
    nothing acts on: unknown for a moment when its pod falls silent, then its successor) and the
    conditions' messages, and in uids that left ``accountedPods`` (their pods no longer carry
    our finalizer: nothing is left to do with them). Everything else is written at once: the
    phase, a condition's status or reason, what was counted and charged, a uid that joins
    ``accountedPods`` and the back-off (a pass acts only once its status says so), the waiting
    pods (their Events follow what the status lists), the generation seen."""
    if not set(new.accounted_pods) <= set(old.accounted_pods):
        return False
    return _without_counts(old) == _without_counts(new)


def _without_counts(status: api.DDPJobStatus) -> api.DDPJobStatus:
    return status.model_copy(
        update={
            "replicas": 0,
            "ready_replicas": 0,
            "world_size": 0,
            "store_host": None,
            "accounted_pods": [],
            "conditions": [c.model_copy(update={"message": ""}) for c in status.conditions],
        }
    )


def whole(status: api.DDPJobStatus, desired: int, nproc: int) -> bool:
    """The job is whole: every one of its ``desired`` pods there and ready, and the world they
    train in (as their agents say, when asked) all of them and no more. Not merely every pod
    that is left: a lost node's pods, once deleted, are no longer counted in ``replicas``, and
    the rest are all ready. Not a world larger than the job either: after a scale-down the
    agents leave the old world over a second or two, and each step of it (1,024 -> 512: 706,
    636, 623, ... 512) was written at once."""
    return (
        desired > 0
        and status.replicas == desired
        and status.ready_replicas >= desired
        and status.world_size == desired * nproc
    )


def settle_for(
    old: api.DDPJobStatus,
    new: api.DDPJobStatus,
    pods: int,
    pending_since: float | None,
    now: float,
    complete: bool = False,
) -> float | None:
    """Seconds the write of ``new`` over ``old`` waits, or None: write now.

    A job of up to :data:`SETTLE_PODS` pods writes each change now, and so does every job for
    anything but its counts (:func:`counts_only`). A large job's counts wait
    :data:`SETTLE_SECONDS` from ``pending_since``, when it first saw counts it did not write
    (None: now), so that a burst of changes (a start, a lost node's agents falling silent,
    replacements coming up) is written once; a ``complete`` status, in which the job is
    :func:`whole`, is written now: the end of a start or of a recovery, which users wait for
    (and which, deferred, landed in the steady state). A status that only lets uids go from
    ``accountedPods`` is never written alone (:data:`ALONE`): the next write takes it along."""
    if pods <= SETTLE_PODS or not counts_only(old, new):
        return None
    if _without_uids(old) == _without_uids(new):
        return ALONE
    if complete:
        return None
    since = now if pending_since is None else pending_since
    left = since + SETTLE_SECONDS - now
    return left if left > 0 else None


def _without_uids(status: api.DDPJobStatus) -> api.DDPJobStatus:
    return status.model_copy(update={"accounted_pods": []})
