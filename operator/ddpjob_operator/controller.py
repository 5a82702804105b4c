"""One loop per DDPJob: observe -> ``reconcile()`` -> write the status -> carry out the actions.

The kopf handlers (:mod:`ddpjob_operator.handlers`) run :meth:`Controller.run_job` as a daemon
per job and wake it on every event of the job, its pods and its Service. A pass:

1. takes the job as kopf last saw it (or as our own last status write returned it, when kopf's
   copy is still older), and the job's pods from a kopf index of small records, never whole pod
   bodies;
2. decides with the pure core;
3. writes the whole status to the status subresource with a resourceVersion precondition,
   *before* any action runs (a stale write gets a 409: read the job again, decide again);
4. carries out the actions (independent ones concurrently), then emits the events;
5. sleeps until the next event, or until ``requeue_after`` when a time-based rule is due.

There is no polling: a job with nothing due makes no API request at all, except a Kueue job
(label ``kueue.x-k8s.io/queue-name``), whose Workloads are read on every pass, and as often as
:func:`ddpjob_operator.core.queue.poll_after` says (every few seconds while it waits on Kueue or is
admitted: an eviction is seen that late at most). Nothing here holds
state that matters across a restart: counts and intents are in the job's status and in the pods'
finalizers, so the operator can be killed at any point and resume.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from ddpjob_operator import agents, api, builders, slowstart
from ddpjob_operator.core import gang, queue
from ddpjob_operator.core.actions import (
    Action,
    CreatePod,
    CreateService,
    Decision,
    DeleteJob,
    DeletePod,
    Observed,
    RemoveFinalizer,
)
from ddpjob_operator.core.facts import LARGE_JOB_PODS, desired_replicas
from ddpjob_operator.core.reconcile import INVALID_SPEC, reconcile
from ddpjob_operator.errors import SpecError
from ddpjob_operator.kube import ApiError, ConflictError, KubeApi, controller_uid
from ddpjob_operator.metrics import Metrics
from ddpjob_operator.observe import ObservedPod, PodPhase, observe_pod

JSON = dict[str, Any]
Key = tuple[str, str]
T = TypeVar("T")
logger = logging.getLogger(__name__)
MAX_CONFLICT_RETRIES = 5
ERROR_BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0)
CONCURRENCY = 48
"""API calls in flight at once for one pass (pod creations of a large job go in parallel, after
a slow start: :mod:`~ddpjob_operator.slowstart`). At 1,024 hollow pods on the real API server
(bench/bench_operator.py --hollow), 16 created them in 11-16 s, 32 in 10.9 s, 48 in 4.1-6.9 s,
64 in 8.1 s."""
SLOW_START_FIRST = 16
"""Pod creations a pass starts at once before any has succeeded: a template the API refuses
costs at most this many requests a pass. 1 (the Job controller's) took a 64-pod job's
creations from 0.4 s to 0.6-1.1 s here (seven round trips instead of two)."""
SERVED_CHECK_SECONDS = 300.0
"""How long the answer to "does the cluster serve PodGroups (or Kueue's Workloads)?" is kept
(asked only for jobs that want a gang, or name a queue)."""
FLAVOR_SECONDS = 60.0
"""How long a ResourceFlavor read is kept."""
STUCK_PASS_SECONDS = 120.0
"""A pass running longer than this makes the liveness probe fail."""
MAX_FAILED_ACTION_EVENTS = 10
"""ActionFailed events a pass emits (one per distinct error); the rest go to the log only."""
EXPECTATION_SECONDS = 15.0
"""How long a write we made may take to show in kopf's indexes before we act again."""
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


@dataclasses.dataclass
class Expectations:
    """Writes we made that the watch has not shown us yet (controller-runtime's expectations).

    kopf's indexes lag our own writes by a watch round-trip, so a pass that runs in between
    would create a pod again (409) or remove a finalizer again. A pod we created counts as
    present (Pending) until the index shows it; a delete or finalizer removal is not repeated
    for the same uid. Each expectation lapses after :data:`EXPECTATION_SECONDS`, so a write that
    silently did not happen is retried.
    """

    created: dict[str, float] = dataclasses.field(default_factory=dict)
    done: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)

    def prune(self, now: float, seen: Iterable[ObservedPod]) -> None:
        names = {p.name for p in seen}
        self.created = {
            n: t
            for n, t in self.created.items()
            if n not in names and now - t < EXPECTATION_SECONDS
        }
        self.done = {k: t for k, t in self.done.items() if now - t < EXPECTATION_SECONDS}

    def pending_pods(self, index_of: Callable[[str], int]) -> tuple[ObservedPod, ...]:
        return tuple(
            ObservedPod(
                name=name, index=index_of(name), uid=f"expected:{name}", phase=PodPhase.PENDING
            )
            for name in sorted(self.created)
        )


class _Kept(Generic[T]):
    """Answers kept for a while, by key."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._kept: dict[str, tuple[T, float]] = {}

    async def get(self, key: str, fetch: Callable[[], Awaitable[T]]) -> T:
        now = time.monotonic()
        known = self._kept.get(key)
        if known is None or now - known[1] > self.seconds:
            known = (await fetch(), now)
            self._kept[key] = known
        return known[0]


class ActionsFailedError(Exception):
    """Some actions of a pass failed (the others were carried out)."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors[:3]))


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    """Operator-wide defaults for jobs, from ``ddpjob operator``'s flags."""

    network_policy: bool = False
    ask_agents: bool = False
    """Ask the pods' agents what they do (:mod:`~ddpjob_operator.agents`): the operator must
    reach the pods' addresses."""
    security_profile: api.SecurityProfile = api.SecurityProfile.BASELINE


@dataclasses.dataclass(frozen=True)
class PodRecord:
    """What the operator keeps of a pod: the observation plus its finalizers (for a guarded
    finalizer removal). Small, so that thousands of pods cost little memory."""

    observed: ObservedPod
    finalizers: tuple[str, ...]


def pod_record(body: Mapping[str, Any]) -> PodRecord | None:
    observed = observe_pod(body)
    if observed is None:
        return None
    finalizers = tuple((body.get("metadata") or {}).get("finalizers") or ())
    return PodRecord(observed, finalizers)


class Emit(Protocol):
    def __call__(self, kind: str, reason: str, message: str) -> None: ...


@dataclasses.dataclass(frozen=True)
class _Pass:
    """A job's pass under way: when it started, and an event set when it ends."""

    started: float
    ended: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


@dataclasses.dataclass
class _Written:
    """Our last status write for a job: the resourceVersion it replaced, and the result."""

    replaced: str
    job: JSON


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


class Controller:
    """The operator's per-job loops, sharing one API client and one set of metrics."""

    def __init__(self, kube: KubeApi, metrics: Metrics, config: OperatorConfig) -> None:
        self.kube = kube
        self.metrics = metrics
        self.config = config
        self.exiting = False
        """The operator is exiting: a job loop that kopf starts now must not run a pass."""
        self._wakeups: dict[Key, asyncio.Event] = {}
        self._written: dict[Key, _Written] = {}
        self._unwritten: dict[Key, float] = {}
        """When a large job first had counts that it did not write (:func:`settle_for`)."""
        self._phases: dict[Key, api.JobPhase] = {}
        self._in_flight: dict[Key, _Pass] = {}
        self._policies: set[Key] = set()
        self._store_keys: set[Key] = set()
        self._pod_groups: dict[Key, gang.Posted] = {}
        """Each job's PodGroup as last made or resized."""
        self._served: _Kept[bool] = _Kept(SERVED_CHECK_SECONDS)
        """Whether the cluster serves PodGroups, and Kueue's Workloads (discovery)."""
        self._flavors: _Kept[JSON | None] = _Kept(FLAVOR_SECONDS)
        self._priorities: dict[Key, queue.Priority] = {}
        self._labelled: dict[Key, bool] = {}
        """Whether the job named a LocalQueue in its last pass (see :meth:`_unqueued`)."""
        self._expected: dict[Key, Expectations] = {}
        self._ignored: dict[Key, list[str]] = {}
        self._surveys: dict[Key, agents.Survey] = {}
        """What each job's agents said (``--ask-agents``)."""
        self._asks = agents.Budget(now=time.monotonic())
        """How many agents the operator may ask now, for every job together."""

    # ---- wiring from the handlers ---------------------------------------------------------

    def wake(self, key: Key) -> None:
        event = self._wakeups.get(key)
        if event is not None:
            event.set()

    def stuck_passes(self, now: float | None = None) -> list[str]:
        """Jobs whose pass has run longer than :data:`STUCK_PASS_SECONDS` (for liveness)."""
        now = time.monotonic() if now is None else now
        return [
            f"{ns}/{name}"
            for (ns, name), running in self._in_flight.items()
            if now - running.started > STUCK_PASS_SECONDS
        ]

    async def run_job(
        self,
        body: Mapping[str, Any],
        stopped: Any,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        pods: Callable[[], Iterable[PodRecord]],
        service: Callable[[], bool],
        emit: Emit,
    ) -> None:
        """The job's loop, until kopf stops it (the job is deleted, or the operator exits)."""
        meta = body["metadata"]
        key: Key = (meta["namespace"], meta["name"])
        wake = self._wakeups.setdefault(key, asyncio.Event())
        failures = 0
        try:
            while not stopped:
                wake.clear()
                try:
                    delay = await self.run_pass(key, body, logger, pods, service, emit)
                    failures = 0
                except Exception as exc:
                    delay = ERROR_BACKOFF[min(failures, len(ERROR_BACKOFF) - 1)]
                    failures += 1
                    logger.warning("reconcile failed (%s); retrying in %.0fs", exc, delay)
                await _wait(wake, stopped, delay)
        finally:
            self._wakeups.pop(key, None)
            self._written.pop(key, None)
            self._unwritten.pop(key, None)
            self._phases.pop(key, None)
            self._policies.discard(key)
            self._store_keys.discard(key)
            self._pod_groups.pop(key, None)
            self._priorities.pop(key, None)
            self._labelled.pop(key, None)
            self._expected.pop(key, None)
            self._ignored.pop(key, None)
            self._surveys.pop(key, None)
            self.metrics.set_phases(self._phases)

    async def run_pass(
        self,
        key: Key,
        body: Mapping[str, Any],
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        pods: Callable[[], Iterable[PodRecord]],
        service: Callable[[], bool],
        emit: Emit,
    ) -> float | None:
        """One pass, with a fresh read and a new decision after each stale status write."""
        running = self._in_flight[key] = _Pass(time.monotonic())
        started = time.perf_counter()
        try:
            raw = self._freshest(key, body)
            for _ in range(MAX_CONFLICT_RETRIES):
                try:
                    return await self._decide_and_do(key, raw, logger, pods, service, emit)
                except ConflictError:
                    self.metrics.status_conflicts.inc()
                    logger.debug("status write was stale: reading the job again")
                    raw = await self.kube.get_job(*key)
            raise ApiError(
                409, "Conflict", f"status still stale after {MAX_CONFLICT_RETRIES} reads"
            )
        finally:
            if self._in_flight.get(key) is running:
                del self._in_flight[key]
            running.ended.set()
            self.metrics.reconcile_seconds.observe(time.perf_counter() - started)

    def _freshest(self, key: Key, body: Mapping[str, Any]) -> JSON:
        """kopf's copy, unless it is still the version our last status write replaced."""
        current = _plain(body)
        written = self._written.get(key)
        version = current.get("metadata", {}).get("resourceVersion")
        if written is not None and version == written.replaced:
            return written.job
        return current

    async def _decide_and_do(
        self,
        key: Key,
        raw: JSON,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        pods: Callable[[], Iterable[PodRecord]],
        service: Callable[[], bool],
        emit: Emit,
    ) -> float | None:
        try:
            job, ignored = api.parse_job_lenient(raw, source=f"DDPJob {key[0]}/{key[1]}")
        except SpecError as exc:
            await self._invalid(key, raw, exc, logger, emit)
            return None
        if ignored and self._ignored.get(key) != ignored:
            logger.warning(
                "ignoring fields this operator does not know (is the CRD newer than the "
                "operator?): %s",
                ", ".join(ignored),
            )
        self._ignored[key] = ignored
        records = {r.observed.name: r for r in pods()}
        expected = self._expected.setdefault(key, Expectations())
        expected.prune(time.monotonic(), (r.observed for r in records.values()))
        seen = tuple(r.observed for r in records.values())
        if self.config.ask_agents:
            seen = await self._ask_agents(key, job, seen)
        served = await self._serves_pod_groups(job)
        everyone = seen + expected.pending_pods(_index_of)
        kueue = await self._queue(key, job, [p for p in everyone if p.owned_by(job.metadata.uid)])
        admission = kueue.admission if kueue is not None else None
        observed = Observed(everyone, service(), served, admission)
        decision = reconcile(
            job,
            observed,
            dt.datetime.now(dt.UTC),
            default_profile=self.config.security_profile,
        )
        desired = desired_replicas(job.spec)
        if admission is not None:
            desired = min(desired, admission.count)
        settle = self._settle(key, job, decision, len(everyone), desired)
        if decision.status != job.status and settle is None:
            await self._write_status(
                key, raw, decision.status.model_dump(by_alias=True, mode="json")
            )
            self._account_metrics(job, decision)
        self._phases[key] = decision.status.phase
        self.metrics.set_phases(self._phases)
        # The job has no pod (but ones going away) and gets its first ones (it starts, resumes,
        # or is admitted again): its NetworkPolicy and Secret are posted again, so one deleted
        # meanwhile is made anew.
        afresh = all(p.deleting for p in everyone) and any(
            isinstance(a, CreatePod) for a in decision.actions
        )
        try:
            await self._execute(
                key,
                job,
                decision.actions,
                records,
                expected,
                self._network_policy(key, job, afresh),
                self._store_key_secret(key, job, afresh),
                gang.to_post(job, served, self._pod_groups.get(key), seen, time.monotonic()),
                kueue.actions if kueue is not None else (),
            )
        except ActionsFailedError as exc:
            # The API refused something (say, a pod the CRD schema let through but the API
            # server rejects, or a NetworkPolicy the operator may not create): tell the user on
            # the job, then retry with backoff.
            messages = sorted({str(e) for e in exc.errors if isinstance(e, ApiError)})
            for message in messages[:MAX_FAILED_ACTION_EVENTS]:
                emit("Warning", "ActionFailed", message)
            if len(messages) > MAX_FAILED_ACTION_EVENTS:
                rest = len(messages) - MAX_FAILED_ACTION_EVENTS
                emit("Warning", "ActionFailed", f"and {rest} more refused actions (see the log)")
                for message in messages[MAX_FAILED_ACTION_EVENTS:]:
                    logger.warning("action failed: %s", message)
            raise
        for event in decision.events:
            emit(event.type, event.reason, event.message)
        _log_decision(logger, decision)
        for action in kueue.actions if kueue is not None else ():
            logger.info("Kueue: %s", _describe_workload(action))
        due = decision.requeue_after
        if self.config.ask_agents and any(p.live for p in seen):
            due = min(due or agents.ASK_EVERY_SECONDS, agents.ASK_EVERY_SECONDS)
        poll = None if kueue is None else queue.poll_after(kueue, job.status.phase.is_finished)
        if poll is not None:
            due = min(due or poll, poll)
        if settle is not None and settle != ALONE:
            due = min(due or settle, settle)
        return due

    def _settle(
        self, key: Key, job: api.DDPJob, decision: Decision, pods: int, desired: int
    ) -> float | None:
        """How long the status the pass decided waits (:func:`settle_for`); None: write it now
        (or there is nothing to write)."""
        settle: float | None = None
        clock = time.monotonic()
        if decision.status != job.status:
            complete = whole(decision.status, desired, builders.nproc_per_node(job.spec))
            settle = settle_for(
                job.status, decision.status, pods, self._unwritten.get(key), clock, complete
            )
        if settle is None or settle == ALONE:
            self._unwritten.pop(key, None)  # no counts wait (or they are written now)
        else:
            self._unwritten.setdefault(key, clock)
        return settle

    async def _ask_agents(
        self, key: Key, job: api.DDPJob, seen: tuple[ObservedPod, ...]
    ) -> tuple[ObservedPod, ...]:
        """``seen`` as the agents describe it: some asked now, as the operator-wide budget
        allows, the others as they answered before (:mod:`~ddpjob_operator.agents`)."""
        survey = self._surveys.setdefault(key, agents.Survey())
        now = time.monotonic()
        asked = survey.pick(seen, self._asks, now)
        if asked:
            port = builders.CLUSTER.directory_port(job, 0)
            survey.record(await agents.ask_pods(asked, port), asked, time.monotonic())
        return agents.apply(seen, survey.answers(seen, time.monotonic()))

    async def _write_status(self, key: Key, raw: JSON, status: JSON) -> None:
        version = str(raw.get("metadata", {}).get("resourceVersion", ""))
        written = await self.kube.write_status(*key, version, status)
        self._written[key] = _Written(replaced=version, job=written)

    def _account_metrics(self, job: api.DDPJob, decision: Decision) -> None:
        new = decision.status.restarts - job.status.restarts
        if new > 0:
            self.metrics.replaced(f.reason for f in decision.status.failures[-new:])

    async def _invalid(
        self,
        key: Key,
        raw: JSON,
        error: SpecError,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        emit: Emit,
    ) -> None:
        """A spec that slipped past the CRD schema: an InvalidSpec condition naming the fields.

        Not terminal, and nothing is done to the job's pods: they keep running (and wait, with
        their tracking finalizer, to be counted) until the spec is fixed or the job deleted, as
        while no operator runs. The phase stays what it was.
        """
        message = "; ".join(str(p) for p in error.problems)
        stated = f"{message} (nothing is done to the job's pods until the spec is fixed)"
        status = dict(raw.get("status") or {})
        generation = raw.get("metadata", {}).get("generation")
        conditions = [c for c in status.get("conditions") or [] if isinstance(c, dict)]
        invalid = next((c for c in conditions if c.get("type") == INVALID_SPEC), None)
        if (
            invalid is not None
            and invalid.get("status") == "True"
            and invalid.get("message") == stated
            and status.get("observedGeneration") == generation
        ):
            return
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        since = (
            invalid.get("lastTransitionTime", now)
            if invalid is not None and invalid.get("status") == "True"
            else now
        )
        status.update(
            observedGeneration=generation,
            conditions=[
                *(c for c in conditions if c.get("type") != INVALID_SPEC),
                {
                    "type": INVALID_SPEC,
                    "status": "True",
                    "reason": INVALID_SPEC,
                    "message": stated,
                    "lastTransitionTime": since,
                },
            ],
        )
        status.setdefault("phase", api.JobPhase.PENDING.value)
        await self._write_status(key, raw, status)
        logger.error("invalid DDPJob: %s", message)
        emit("Warning", INVALID_SPEC, message)

    def _network_policy(self, key: Key, job: api.DDPJob, afresh: bool = False) -> JSON | None:
        """The job's NetworkPolicy, if it wants one that this operator has not made yet (or the
        job gets its first pods ``afresh``)."""
        wanted = job.spec.network_policy
        if wanted is None:
            wanted = self.config.network_policy
        if not wanted or (key in self._policies and not afresh) or job.status.phase.is_finished:
            return None
        return builders.build_network_policy(job)

    def _store_key_secret(self, key: Key, job: api.DDPJob, afresh: bool = False) -> JSON | None:
        """The job's store-key Secret with a new random key, unless this operator has made (or
        found) it already. After a restart, and whenever the job gets its first pods
        (``afresh``), it is posted again: the 409 for the job's own Secret is success, and the
        key in it stays the one its pods read; a Secret deleted meanwhile is made with a new
        key, which no running pod holds an older one of."""
        if (key in self._store_keys and not afresh) or job.status.phase.is_finished:
            return None
        if job.metadata.deletion_timestamp is not None:
            return None
        return builders.build_store_key_secret(job, secrets.token_urlsafe(32))

    async def _serves_pod_groups(self, job: api.DDPJob) -> bool | None:
        """Whether the cluster serves PodGroups, for a job that wants a gang (else None)."""
        if job.spec.gang_scheduling is not api.GangScheduling.NATIVE:
            return None
        return await self._served.get("podgroups", self.kube.pod_groups_served)

    async def _queue(self, key: Key, job: api.DDPJob, pods: list[ObservedPod]) -> queue.Plan | None:
        """What Kueue admits and what to write to the job's Workloads (a Kueue job; else None)."""
        if queue.queue_name(job) is None:
            await self._unqueued(key, job)
            return None
        self._labelled[key] = True
        seen = await self._read_queue(key, job)
        now = dt.datetime.now(dt.UTC)
        desired = desired_replicas(job.spec)
        planned = queue.admit(job, seen, pods, desired, now)
        if planned.wants_priority:
            seen = dataclasses.replace(seen, priority=await self._priority(key, job))
            planned = queue.admit(job, seen, pods, desired, now)
        return planned

    async def _read_queue(self, key: Key, job: api.DDPJob) -> queue.Observation:
        """The job's Workloads and the flavors they were admitted to, as far as this operator
        may read them; the job's priority if it is known already."""
        if not await self._serves_workloads():
            return queue.Observation(served=False)
        uid = job.metadata.uid or ""
        try:
            listed = await self.kube.list_workloads(key[0], uid)
        except ApiError as exc:
            if exc.status != 403:
                raise
            return queue.Observation(served=True, forbidden=str(exc))
        slices = tuple(queue.Slice.of(w) for w in listed if controller_uid(w) == uid)
        flavors: dict[str, JSON] = {}
        for flavor in queue.flavors_to_read(slices):
            try:
                found = await self._flavor(flavor)
            except ApiError as exc:  # only new pods wait for it: nothing else depends on it
                logger.warning("cannot read ResourceFlavor %s: %s", flavor, exc)
                found = None
            if found is not None:
                flavors[flavor] = found
        return queue.Observation(True, slices, None, flavors, self._priorities.get(key))

    async def _unqueued(self, key: Key, job: api.DDPJob) -> None:
        """A job without the queue label whose own Workloads are still open: its label was
        removed (while this operator watched, or before it started). They are finished and
        released, so an admitted one gives its quota back and a waiting one is never admitted
        for a job that no longer asks; the job runs on without Kueue. Looked for once, when the
        label goes: in this operator's passes, or (after a restart) because the job's status
        still has the ``Admitted`` condition, which only a Kueue job gets. Never for other jobs:
        an operator not granted Workloads would get a 403 for each."""
        was_queued = self._labelled.get(key)
        if was_queued is None:
            was_queued = any(c.type == api.ConditionType.ADMITTED for c in job.status.conditions)
        if not was_queued:
            self._labelled[key] = False
            return
        try:
            finished = await self.release_workloads(
                key[0], job.metadata.uid or "", *queue.LABEL_REMOVED
            )
        except ApiError as exc:  # the job itself runs on; tried again on the next pass
            self._labelled[key] = True
            logger.warning("cannot finish the Workloads of a job that left Kueue: %s", exc)
            return
        self._labelled[key] = False
        if finished:
            logger.warning(
                "the job no longer names a LocalQueue (%s): finished %d of its Workloads; it "
                "runs without Kueue",
                queue.QUEUE_LABEL,
                finished,
            )

    async def _serves_workloads(self) -> bool:
        return await self._served.get("workloads", self.kube.workloads_served)

    async def _flavor(self, name: str) -> JSON | None:
        return await self._flavors.get(name, lambda: self.kube.get_resource_flavor(name))

    async def _priority(self, key: Key, job: api.DDPJob) -> queue.Priority | str:
        """The Workload's priority (:func:`queue.priority_class`), kept once found; a class
        that does not exist: why, as a message."""
        known = self._priorities.get(key)
        if known is not None:
            return known
        named = queue.priority_class(job)
        value = 0 if named is None else await self.kube.priority_value(named.kueue, named.name)
        found = queue.priority(named, value)
        if isinstance(found, queue.Priority):
            self._priorities[key] = found
        return found

    def _prerequisites(
        self, key: Key, policy: JSON | None, secret: JSON | None, pod_group: JSON | None
    ) -> list[tuple[Any, Callable[[], None]]]:
        """The NetworkPolicy, the store-key Secret and the PodGroup: made before any pod."""
        namespace = key[0]
        first: list[tuple[Any, Callable[[], None]]] = []
        if policy is not None:
            first.append(
                (
                    self.kube.create_network_policy(namespace, policy),
                    lambda: self._policies.add(key),
                )
            )
        if secret is not None:
            first.append(
                (self.kube.create_secret(namespace, secret), lambda: self._store_keys.add(key))
            )
        if pod_group is not None:
            size = int(pod_group["spec"]["schedulingPolicy"]["gang"]["minCount"])
            first.append(
                (
                    self.kube.ensure_pod_group(namespace, pod_group),
                    lambda: self._pod_groups.__setitem__(key, gang.Posted(size, time.monotonic())),
                )
            )
        return first

    async def _execute(
        self,
        key: Key,
        job: api.DDPJob,
        actions: Iterable[Action],
        records: Mapping[str, PodRecord],
        expected: Expectations,
        policy: JSON | None = None,
        secret: JSON | None = None,
        pod_group: JSON | None = None,
        workloads: Iterable[queue.WorkloadAction] = (),
    ) -> None:
        """The Service, the NetworkPolicy, the store-key Secret and the PodGroup first; then
        deletes and finalizer removals; then creations; then the job.

        Deletes and finalizer removals run even when the Service, the NetworkPolicy, the
        Secret or the PodGroup could not be made (they only let go of pods). Pods are created
        only when everything before succeeded: a pod must never start without its DNS name,
        the policy the job asked for, or the Secret its env reads (it would wait in
        CreateContainerConfigError), and a pod of a gang would never be scheduled without its
        group.
        """
        namespace = key[0]
        job_uid = job.metadata.uid or ""
        limit = asyncio.Semaphore(CONCURRENCY)

        async def bounded(call: Any, remember: Callable[[], None]) -> None:
            async with limit:
                await call
            remember()

        def nothing() -> None:
            pass

        # An expectation counts from when the API server answered: a 1,024-pod pass takes
        # longer than EXPECTATION_SECONDS, and stamped at its start the last pods' expectations
        # lapsed before kopf's watch showed them (the next pass made them again: 409s).
        def done(kind: str, uid: str) -> Callable[[], None]:
            return lambda: expected.done.__setitem__((kind, uid), time.monotonic())

        def created(name: str) -> Callable[[], None]:
            return lambda: expected.created.__setitem__(name, time.monotonic())

        groups: list[list[tuple[Any, Callable[[], None]]]] = [
            self._prerequisites(key, policy, secret, pod_group),
            [],
            [],
            [],
        ]
        # Workload writes go last, and always: each was decided on what the pod actions do not
        # change (an eviction's reservation is cleared once no pod holds resources, a count is
        # lowered once the surplus pods are gone), and a failed one (Kueue's webhook down) must
        # not hold back a replacement pod.
        groups.append([(self._workload_call(namespace, change), nothing) for change in workloads])
        for action in actions:
            if isinstance(action, CreateService):
                groups[0].append((self.kube.create_service(namespace, action.service), nothing))
            elif isinstance(action, DeletePod):
                kind = "force" if action.force else "delete"
                if (kind, action.uid) in expected.done:
                    continue
                call = self.kube.delete_pod(namespace, action.name, action.uid, force=action.force)
                groups[1].append((call, done(kind, action.uid)))
            elif isinstance(action, RemoveFinalizer):
                if ("release", action.uid) in expected.done:
                    continue
                record = records.get(action.name)
                finalizers = record.finalizers if record is not None else (api.POD_FINALIZER,)
                call = self.kube.remove_finalizer(
                    namespace, action.name, action.uid, finalizers, api.POD_FINALIZER
                )
                groups[1].append((call, done("release", action.uid)))
            elif isinstance(action, CreatePod):
                groups[2].append(
                    (self.kube.create_pod(namespace, action.pod), created(action.name))
                )
            elif isinstance(action, DeleteJob):
                groups[3].append((self.kube.delete_job(*key, uid=job_uid), nothing))
        errors: list[BaseException] = []
        for index, group in enumerate(groups):
            if not group:
                continue
            if errors and index in (2, 3):
                for call, _ in group:
                    call.close()  # never awaited: no creation after a failure
                continue
            if index == 2:
                # Pod creations start slowly: a quota or a webhook that refuses every pod
                # costs a few requests, not one per pod.
                refused, unstarted = await slowstart.slow_start(
                    group, CONCURRENCY, SLOW_START_FIRST
                )
                if unstarted:
                    logger.info("%d pod creations put off after a refusal", unstarted)
                errors += refused
                continue
            results = await asyncio.gather(
                *(bounded(call, remember) for call, remember in group), return_exceptions=True
            )
            errors += [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise ActionsFailedError(errors)

    def _workload_call(self, namespace: str, change: queue.WorkloadAction) -> Any:
        if isinstance(change, queue.CreateWorkload):
            return self.kube.create_workload(namespace, change.body)
        if isinstance(change, queue.PatchWorkload):
            return self.kube.patch_workload(
                namespace, change.name, change.patch, status=change.status
            )
        return self.kube.release_workload(namespace, change.name, change.uid, change.finalizers)

    async def pass_over(self, key: Key, timeout: float = STUCK_PASS_SECONDS) -> bool:
        """Wait until the job's running pass, if any, has ended; False after ``timeout``.

        For a deleted job: kopf has told its loop to stop before the delete handler runs (and
        gives it ``cancellation_backoff`` to end its pass before cancelling it), but a pass
        already under way may still create a pod or a Workload after the handler listed them
        to release. A pod is released by its own event; a Workload is not watched."""
        running = self._in_flight.get(key)
        if running is None:
            return True
        try:
            await asyncio.wait_for(running.ended.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def release_workloads(
        self,
        namespace: str,
        job_uid: str,
        reason: str = "OwnerNotFound",
        message: str = queue.OWNER_GONE,
    ) -> int:
        """A deleted job's Workloads (or, with another reason, one that left Kueue): Finished
        and without Kueue's finalizer, which nobody else removes while they keep their owner
        reference."""
        if not job_uid or not await self._serves_workloads():
            return 0
        released = 0
        now = dt.datetime.now(dt.UTC)
        try:
            listed = await self.kube.list_workloads(namespace, job_uid)
        except ApiError as exc:
            if exc.status != 403:
                raise
            return 0  # without the grant, the operator made none
        for raw in listed:
            if controller_uid(raw) != job_uid:
                continue
            wl = queue.Slice.of(raw)
            if not wl.finished and not wl.deleting:
                change = queue.finish(wl, reason, message, now)
                await self.kube.patch_workload(namespace, wl.name, change.patch, status=True)
                found = await self.kube.get_workload(namespace, wl.name)
                if found is None:
                    continue  # gone meanwhile
                wl = queue.Slice.of(found)
                if not wl.finished and not wl.deleting:
                    # The patch was stale (Kueue wrote in between): released unfinished, it
                    # would keep its quota with nobody left to finish it. Tried again.
                    raise ApiError(
                        409, "Conflict", f"Workload {namespace}/{wl.name} changed while finished"
                    )
            if queue.FINALIZER in wl.finalizers:
                await self.kube.release_workload(namespace, wl.name, wl.uid, wl.finalizers)
                released += 1
        return released

    async def release_pods(self, namespace: str, job_name: str) -> int:
        """Remove our finalizer from every pod of a job that is going away."""
        released = 0
        for pod in await self.kube.list_pods(namespace, api.job_selector(job_name)):
            released += await self.release_pod(namespace, pod.get("metadata") or {})
        return released

    async def release_pod(self, namespace: str, meta: Mapping[str, Any]) -> bool:
        """Remove our finalizer from one pod (by its metadata); False if it has none."""
        finalizers = list(meta.get("finalizers") or [])
        if api.POD_FINALIZER not in finalizers:
            return False
        await self.kube.remove_finalizer(
            namespace, meta["name"], meta["uid"], finalizers, api.POD_FINALIZER
        )
        return True


def _index_of(pod_name: str) -> int:
    return int(pod_name.rsplit("-", 1)[-1])


def _plain(body: Mapping[str, Any]) -> JSON:
    """A deep plain-dict copy of a kopf body (a live view that changes under us)."""
    out: JSON = {}
    for key, value in body.items():
        out[key] = _plain(value) if isinstance(value, Mapping) else _copy(value)
    return out


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return [_plain(v) if isinstance(v, Mapping) else _copy(v) for v in value]
    return value


def _log_decision(
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger], decision: Decision
) -> None:
    if not decision.actions and not decision.events:
        return
    actions = ", ".join(_describe(a) for a in decision.actions)
    logger.info(
        "phase %s; actions: %s; events: %s",
        decision.status.phase.value,
        actions or "none",
        ", ".join(e.reason for e in decision.events) or "none",
    )


def _describe_workload(change: queue.WorkloadAction) -> str:
    if isinstance(change, queue.CreateWorkload):
        spec = change.body["spec"]
        return f"create Workload {change.body['metadata']['name']} in {spec['queueName']}"
    if isinstance(change, queue.PatchWorkload):
        what = "status" if change.status else "spec"
        return f"patch Workload {change.name} ({what}): {_brief(change.patch)}"
    return f"remove the finalizer of Workload {change.name}"


def _brief(patch: JSON) -> str:
    body = {k: v for k, v in patch.items() if k != "metadata"}
    if "status" in body:
        conditions = body["status"].get("conditions") or []
        return ", ".join(f"{c['type']}={c['status']}/{c['reason']}" for c in conditions[-3:])
    return str(body)[:200]


def _describe(action: Action) -> str:
    if isinstance(action, CreatePod):
        return f"create {action.name}"
    if isinstance(action, DeletePod):
        return f"delete {action.name} ({action.why.value}{', force' if action.force else ''})"
    if isinstance(action, RemoveFinalizer):
        return f"release {action.name}"
    if isinstance(action, CreateService):
        return "create service"
    return "delete job"


async def _wait(wake: asyncio.Event, stopped: Any, timeout: float | None) -> None:
    """Until an event wakes the job, kopf stops its daemon, or ``timeout`` seconds pass."""
    waiters = {
        asyncio.ensure_future(wake.wait()),
        asyncio.ensure_future(stopped.wait(timeout)),
    }
    _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()


__all__ = ["Controller", "OperatorConfig", "PodRecord", "pod_record"]
