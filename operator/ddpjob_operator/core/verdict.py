"""The job's verdict (failed: budget, permanent exit code, deadline, below minReplicas;
succeeded: no pod left pending or running), and what a finished job still does: clean up per
``cleanPodPolicy``, release every finalizer, honour ``ttlSecondsAfterFinished``."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from typing import Literal

from ddpjob_operator import api
from ddpjob_operator.api import (
    CleanPodPolicy,
    ConditionType,
    DDPJobStatus,
    JobPhase,
    PodFailure,
    PodWaiting,
    RestartPolicy,
    set_condition,
)
from ddpjob_operator.core import gang
from ddpjob_operator.core.accounting import force_stuck, release_all
from ddpjob_operator.core.actions import (
    Action,
    Decision,
    DeleteJob,
    DeletePod,
    DeleteWhy,
    sooner,
    told_first,
)
from ddpjob_operator.core.events import (
    Event,
    waiting_summary,
)
from ddpjob_operator.observe import ObservedPod

STRANDED_AFTER_SECONDS = 30.0
"""How long a completing job still waits for its pods that are not ready after its first pod
succeeded: a member of the last round may still be on its way out (a pod succeeds after the
round's exit barrier, so every member had finished training by then)."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    phase: JobPhase
    reason: str
    message: str


def failure_verdict(
    job: api.DDPJob,
    new: Sequence[PodFailure],
    status: DDPJobStatus,
    now: dt.datetime,
    running: int,
    waiting: Sequence[PodWaiting],
) -> Verdict | None:
    spec = job.spec
    for failure in new:
        if spec.restart_policy.fails_job(failure):
            return Verdict(
                JobPhase.FAILED,
                "PodFailed" if spec.restart_policy is RestartPolicy.NEVER else "PermanentExitCode",
                f"pod {failure.pod} failed with {failure.reason} under restartPolicy "
                f"{spec.restart_policy.value}",
            )
    if status.backoff_count > spec.backoff_limit:
        last = next((f for f in reversed(status.failures) if f.charged), None)
        why = f"; last: pod {last.pod} {last.reason}" if last else ""
        return Verdict(
            JobPhase.FAILED,
            "BackoffLimitExceeded",
            f"{status.backoff_count} charged pod failures exceed backoffLimit "
            f"{spec.backoff_limit}{why}",
        )
    deadline = spec.active_deadline_seconds
    start = status.start_time
    if deadline is not None and start is not None and now >= start + dt.timedelta(seconds=deadline):
        return Verdict(
            JobPhase.FAILED,
            "DeadlineExceeded",
            f"the job ran longer than {deadline}s{waiting_summary(waiting)}",
        )
    timeout = spec.rendezvous.join_timeout_seconds
    since = status.below_min_since
    if since is not None and now >= since + dt.timedelta(seconds=timeout):
        return Verdict(
            JobPhase.FAILED,
            "BelowMinReplicas",
            f"only {running} of minReplicas {spec.effective_min} pods ran for longer than "
            f"rendezvous.joinTimeoutSeconds ({timeout}s){waiting_summary(waiting)}",
        )
    return None


def cleanup(pods: Sequence[ObservedPod], policy: CleanPodPolicy) -> list[Action]:
    if policy is CleanPodPolicy.NONE:
        return []
    doomed = [
        p for p in pods if not p.deleting and (policy is CleanPodPolicy.ALL or p.holds_resources)
    ]
    return [
        DeletePod(p.name, p.uid, p.index, DeleteWhy.CLEANUP)
        for p in sorted(doomed, key=lambda p: -p.index)
    ]


def success(
    succeeded: Sequence[ObservedPod], live: Sequence[ObservedPod], now: dt.datetime
) -> tuple[Verdict | None, float | None]:
    """A completing job's success: once no pod is live, or once the only live pods are not
    ready ``STRANDED_AFTER_SECONDS`` after the first pod succeeded (they can never join a
    round: the last round is over, whichever pod hosted its store). Else no verdict, and the
    seconds until that check is due (``None`` when it never will be: no succeeded pod's end is
    known, or a live pod is ready)."""
    if not live:
        return Verdict(
            JobPhase.SUCCEEDED, "Succeeded", "every pod of the job terminated successfully"
        ), None
    ends = [p.finished_at for p in succeeded if p.finished_at is not None]
    if not ends or any(p.ready for p in live):
        return None, None
    left = STRANDED_AFTER_SECONDS - (now - min(ends)).total_seconds()
    if left > 0:
        return None, left
    names = ", ".join(p.name for p in live)
    message = (
        f"the last round succeeded; {names} never joined it and no longer can (its store is "
        f"gone with it): left to cleanPodPolicy"
    )
    return Verdict(JobPhase.SUCCEEDED, "Succeeded", message), None


def finish(
    job: api.DDPJob,
    pods: Sequence[ObservedPod],
    status: DDPJobStatus,
    verdict: Verdict,
    now: dt.datetime,
) -> Decision:
    """The verdict: the job's phase and conditions say it, and so does an event."""
    conditions = set_condition(
        status.conditions,
        ConditionType(verdict.phase.value),
        True,
        verdict.reason,
        verdict.message,
        now,
    )
    conditions = set_condition(conditions, ConditionType.RUNNING, False, verdict.reason, "", now)
    conditions = set_condition(conditions, ConditionType.RESTARTING, False, verdict.reason, "", now)
    status = status.model_copy(
        update={
            "phase": verdict.phase,
            "conditions": conditions,
            "completion_time": now,
            "below_min_since": None,
            "ready_replicas": 0,
            "world_size": 0,
            "store_host": None,
        }
    )
    kind: Literal["Normal", "Warning"] = (
        "Normal" if verdict.phase is JobPhase.SUCCEEDED else "Warning"
    )
    return told_first(
        [Event(kind, verdict.reason, verdict.message)], finished(job, pods, status, now)
    )


def finished(
    job: api.DDPJob,
    pods: Sequence[ObservedPod],
    status: DDPJobStatus,
    now: dt.datetime,
) -> Decision:
    """After the verdict: clean up, release every finalizer, honour the TTL."""
    actions = cleanup(pods, job.spec.clean_pod_policy)
    stuck, requeue = force_stuck(job, pods, now)
    actions += stuck + release_all(pods)
    status = status.model_copy(
        update={
            "conditions": gang.ended(status.conditions, status.phase, now),
            "replicas": sum(p.live for p in pods),
            "accounted_pods": [],
            "waiting": [],
            "pod_backoff": [],
        }
    )
    ttl = job.spec.ttl_seconds_after_finished
    if ttl is not None and status.completion_time is not None:
        expires = status.completion_time + dt.timedelta(seconds=ttl)
        if now >= expires:
            actions.append(DeleteJob())
        else:
            requeue = sooner(requeue, (expires - now).total_seconds())
    return Decision(tuple(actions), status, (), requeue)
