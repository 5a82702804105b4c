"""The pure reconciler: ``(job, observed, now) -> Decision(actions, status, events)``.

It decides; it does nothing. An executor (the kopf operator's ``kube`` module, or the local
runner) carries the decision out in this order:

1. write ``decision.status`` (one write per pass, with a resourceVersion precondition),
2. apply ``decision.actions`` in order,
3. emit ``decision.events``,
4. reconcile again after ``decision.requeue_after`` seconds at the latest.

Counting is exact, the way the Job controller tracks pods with finalizers: every pod carries
:data:`~ddpjob_operator.api.POD_FINALIZER`, so it cannot vanish before it is seen. A pod whose
outcome is known (its trainer terminated, or it is being deleted) is counted once, its uid goes
into ``status.accountedPods`` in the same status write, and only then is its finalizer removed.
A pod with the finalizer whose uid is already accounted is never counted again; a pod without it
was counted already. The operator's own deletions (scale-down, suspend, cleanup) put the pod's
uid into ``accountedPods`` *before* the delete, so they are never failures.

Each pass sorts the pods into buckets once (:func:`~ddpjob_operator.core.facts.sort_pods`), as
JobSet and the Job controller do, and the rules read the buckets. Every classification rule
lives in :func:`ddpjob_operator.observe.classify`. The rules have rooms of their own: counting
(:mod:`~ddpjob_operator.core.accounting`), the verdict and what a finished job does
(:mod:`~ddpjob_operator.core.verdict`), suspend and Kueue's hold
(:mod:`~ddpjob_operator.core.holding`), pod 0's placement (:mod:`~ddpjob_operator.core.storehost`),
the running job (:mod:`~ddpjob_operator.core.running`); beside them the back-off
(:mod:`~ddpjob_operator.core.backoff`), the gang (:mod:`~ddpjob_operator.core.gang`), Kueue's side
(:mod:`~ddpjob_operator.core.queue`) and the words (:mod:`~ddpjob_operator.core.events`).
Rules, in the order they apply:

* A DDPJob being deleted creates nothing; it only releases its pods' finalizers.
* A job that an older operator marked ``Failed`` only because its spec did not parse
  (``InvalidSpec``: it was never terminal) is taken up again once the spec parses.
* A finished job (Succeeded/Failed) only cleans up per ``cleanPodPolicy`` and honours
  ``ttlSecondsAfterFinished``; its ``GangScheduled`` condition, if any, says it ended.
* Only the job's own pods count: a pod whose controller is another object (an earlier job of
  the same name, still being deleted) or none is never counted or adopted; its name is not
  reused until it is gone, and our finalizer, if it has one, is removed (its job is gone).
* Every ended pod is accounted exactly once with a classified reason, and charged to
  ``backoffLimit`` unless it was a disruption (see :class:`~ddpjob_operator.api.RestartPolicy`).
* ``suspend`` deletes every pod that holds resources and keeps Succeeded ones; resuming starts
  over at Pending (no condition claims Restarting).
* A Kueue job (one that names a LocalQueue) runs only as Kueue admits it (``observed.queue``):
  not admitted, or evicted, it is ``Queued`` as if suspended (its pods deleted uncharged, none
  made), and its ``Admitted`` condition says why; once admitted it runs at most the admitted
  count of pods (it caps ``desired``), new pods placed on the admitted flavors (none while a
  flavor cannot be read). Other jobs never get ``Admitted``.
* The job fails when the budget is spent, on a permanent exit code (``ExitCode`` policy), on
  any failure (``Never`` policy), when ``activeDeadlineSeconds`` passes, or when, after it has
  run, running pods stay below ``minReplicas`` for longer than ``rendezvous.joinTimeoutSeconds``.
  Pods that never started do not start that clock: their waiting reasons (image pulls,
  scheduling, config errors) are in ``status.waiting``, the Running condition and Events.
* Once any pod has succeeded the job is completing: nothing is created or replaced, and the job
  succeeds when no pod is left pending or running (Kubeflow trainer#1982 marks it Succeeded as
  soon as one worker does, while others still hold GPUs). A pod that is not ready once a pod
  has succeeded can never join a round (the last round is over, whichever pod hosted its store,
  and nothing is re-created): a pod created by a late scale-up or replacement, still waiting to
  join. It is no longer waited for ``STRANDED_AFTER_SECONDS`` after the first pod finished
  successfully, and the job's cleanup (``cleanPodPolicy``) removes it, instead of it holding its
  node until its agent's join timeout.
* Otherwise: create the Service and every missing pod ``0..desired-1``, delete failed pods so
  they can be recreated under the same name, and scale down by deleting the highest indices
  first (pod 0, which bootstraps the job's first store, is never removed while the job runs;
  any pod may host the store later: docs/concepts/store-failover.md). New pods carry the job's
  store key unless a pod made without it may still run (:func:`store_keyed`), and name the
  job's PodGroup if it asks for a gang, the cluster serves PodGroups and no live pod was made
  without the group; ``GangScheduled`` says where the gang is.
* A pod still Terminating ``forceDeleteAfterSeconds`` after its grace period ended (its node is
  lost; no kubelet will confirm) is force-deleted once it is counted, and the pass asks to be
  requeued when that is due, so the job never wedges (kubeflow trainer#2072).
* A job of more than :data:`LARGE_JOB_PODS` pods counts the pods that others delete while their
  containers still run (no kubelet has confirmed the end) once such deletions stop coming
  (:func:`held_deletions`): the taint manager deletes a lost node's 64 pods over seconds, and
  each pass that saw a few more wrote a status to count them. They are counted together, at
  most :data:`DELETION_BATCH_SECONDS` after the first; a pod whose kubelet confirms its end is
  counted at once (its replacement waits for it), and nothing is done to a held pod meanwhile.
* Back-off per pod index (``spec.podBackoff``): after a charged failure, or one whose trainer
  never started (the kubelet rejected it at admission: ``OutOfcpu``,
  ``UnexpectedAdmissionError``...; the same node would reject the next one in a tight loop),
  the next pod of that index waits, 10 s doubling up to 360 s, as the Job controller does. The
  state is in ``status.podBackoff``, moved only when a pod is counted (exactly once).
  Disruptions are replaced at once. The deadline and ``suspend`` win over a pending back-off.
* Sizes stay bounded however large the job: ``status.waiting`` lists at most :data:`MAX_WAITING`
  pods (the Running condition counts all of them, by reason), a pass emits at most
  :data:`~ddpjob_operator.core.events.MAX_EVENT_PODS` events of a kind (then one that sums up the
  rest), and it adds at most :data:`MAX_NEW_ACCOUNTED` uids to ``accountedPods`` (as the Job
  controller bounds ``uncountedTerminatedPods``): the rest is counted or deleted in the next passes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from typing import Any

from ddpjob_operator import api, builders
from ddpjob_operator.api import (
    ConditionType,
    DDPJobStatus,
    JobPhase,
    condition_true,
    set_condition,
)
from ddpjob_operator.core.accounting import account, release_all
from ddpjob_operator.core.actions import Decision, Observed, RemoveFinalizer, also, told_first
from ddpjob_operator.core.events import failure_events
from ddpjob_operator.core.facts import Facts
from ddpjob_operator.core.holding import resumed, suspend, without_admitted
from ddpjob_operator.core.running import run
from ddpjob_operator.core.verdict import finished
from ddpjob_operator.observe import ObservedPod

INVALID_SPEC = "InvalidSpec"
"""The condition (and reason) of a spec the operator cannot parse; never terminal."""


def reconcile(
    job: api.DDPJob,
    observed: Observed,
    now: dt.datetime,
    network: builders.Network = builders.CLUSTER,
    default_profile: api.SecurityProfile = api.SecurityProfile.BASELINE,
) -> Decision:
    """Decide what the job needs now. Pure and deterministic."""
    status = job.status.model_copy(
        update={
            "observed_generation": job.metadata.generation,
            "selector": api.job_selector(job.name),
        }
    )
    if job.metadata.deletion_timestamp is not None:
        return _being_deleted(observed.pods, status)
    status = _spec_parses(status, now)
    facts = Facts.start(job, observed, status, now, network, default_profile)
    if status.phase.is_finished:
        decision = finished(job, facts.pods, status, now)
    else:
        decision = _unfinished(facts, status)
    # Our finalizer on a pod that is not this job's: its own job is gone, nobody counts it.
    decision = also(
        decision, [RemoveFinalizer(p.name, p.uid, p.index) for p in facts.foreign if p.tracked]
    )
    return dataclasses.replace(decision, desired=facts.desired)


def _unfinished(facts: Facts, status: DDPJobStatus) -> Decision:
    """Count every pod that ended, then hold the job (suspended, or queued by Kueue) or run it."""
    status, failures = account(facts.job, facts.buckets, status, facts.now)
    told = failure_events(facts.job, failures, status)
    admission = facts.observed.queue
    if facts.job.spec.suspend:
        # A job that is not (or no longer) a Kueue job has no Admitted condition.
        unqueued = status if admission is not None else without_admitted(status)
        return told_first(told, suspend(facts, unqueued))
    status, told_resumed = resumed(status, admission, facts.now)
    if admission is not None and admission.count == 0:
        return told_first(told + told_resumed, suspend(facts, status, admission))
    return told_first(told + told_resumed, run(facts, status, failures))


def _being_deleted(pods: Sequence[ObservedPod], status: DDPJobStatus) -> Decision:
    """The DDPJob has a deletionTimestamp: create nothing, let go of the pods."""
    return Decision(tuple(release_all(pods)), status.model_copy(update={"accounted_pods": []}))


def _spec_parses(status: DDPJobStatus, now: dt.datetime) -> DDPJobStatus:
    """The spec parses (reconcile runs): clear an InvalidSpec condition, and take up a job an
    older operator marked Failed only for an invalid spec (that was never terminal)."""
    conditions = list(status.conditions)
    if condition_true(conditions, ConditionType.INVALID_SPEC):
        conditions = set_condition(
            conditions, ConditionType.INVALID_SPEC, False, "SpecValid", "", now
        )
    failed = next((c for c in conditions if c.type == ConditionType.FAILED), None)
    update: dict[str, Any] = {"conditions": conditions}
    if (
        status.phase is JobPhase.FAILED
        and failed is not None
        and failed.status == "True"
        and failed.reason == INVALID_SPEC
    ):
        update["conditions"] = set_condition(
            conditions, ConditionType.FAILED, False, "SpecValid", "", now
        )
        update["phase"] = JobPhase.PENDING
        update["completion_time"] = None
    if update["conditions"] == list(status.conditions) and len(update) == 1:
        return status
    return status.model_copy(update=update)
