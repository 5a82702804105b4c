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
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ddpjob_operator import agents, api, builders, kueue
from ddpjob_operator.core import workload
from ddpjob_operator.core.actions import (
    Action,
    CreatePod,
    CreateService,
    Decision,
    DeletePod,
    RemoveFinalizer,
)
from ddpjob_operator.core.plan import (
    Defaults,
    PassPlan,
    Remembered,
    Seen,
    invalid_message,
    invalid_status,
    plan,
)
from ddpjob_operator.errors import SpecError
from ddpjob_operator.executor import ActionsFailedError, Executor, Expectations, PodRecord
from ddpjob_operator.kube import ApiError, ConflictError, Kept, KubeApi
from ddpjob_operator.metrics import Metrics
from ddpjob_operator.observe import ObservedPod
from ddpjob_operator.parse import parse_job_lenient

JSON = dict[str, Any]
Key = tuple[str, str]
logger = logging.getLogger(__name__)
MAX_CONFLICT_RETRIES = 5
ERROR_BACKOFF = (1.0, 2.0, 5.0, 10.0, 30.0)
SERVED_CHECK_SECONDS = 300.0
"""How long the answer to "does the cluster serve PodGroups?" is kept (asked only for jobs that
want a gang)."""
STUCK_PASS_SECONDS = 120.0
"""A pass running longer than this makes the liveness probe fail."""
MAX_FAILED_ACTION_EVENTS = 10
"""ActionFailed events a pass emits (one per distinct error); the rest go to the log only."""


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    """Operator-wide defaults for jobs, from ``ddpjob operator``'s flags."""

    network_policy: bool = False
    ask_agents: bool = False
    """Ask the pods' agents what they do (:mod:`~ddpjob_operator.agents`): the operator must
    reach the pods' addresses."""
    security_profile: api.SecurityProfile = api.SecurityProfile.BASELINE


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


@dataclasses.dataclass
class _Job:
    """What the controller keeps of one job while its loop runs (all of it goes with the
    loop): how to wake it, its pass under way, its last status write, what the watch has not
    shown of our own writes yet, what its agents said, and what the core is to remember."""

    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    running: _Pass | None = None
    written: _Written | None = None
    remembered: Remembered = dataclasses.field(default_factory=Remembered)
    expected: Expectations = dataclasses.field(default_factory=Expectations)
    survey: agents.Survey = dataclasses.field(default_factory=agents.Survey)
    phase: api.JobPhase | None = None
    priority: workload.Priority | None = None
    """The Workload's priority, kept once found (:meth:`kueue.Kueue.priority`)."""
    ignored: list[str] | None = None
    """The unknown fields last warned about."""

    def remember(self, **change: Any) -> None:
        """What an action made, for the core's next pass (:class:`Remembered`'s fields)."""
        self.remembered = dataclasses.replace(self.remembered, **change)


class Controller:
    """The operator's per-job loops, sharing one API client and one set of metrics."""

    def __init__(self, kube: KubeApi, metrics: Metrics, config: OperatorConfig) -> None:
        self.kube = kube
        self.kueue = kueue.Kueue(kube)
        self.executor = Executor(kube, self.kueue)
        self.metrics = metrics
        self.config = config
        self.defaults = Defaults(config.network_policy, config.security_profile)
        self.exiting = False
        """The operator is exiting: a job loop that kopf starts now must not run a pass."""
        self._jobs: dict[Key, _Job] = {}
        self._pod_groups_served: Kept[bool] = Kept(SERVED_CHECK_SECONDS)
        self._asks = agents.Budget(now=time.monotonic())
        """How many agents the operator may ask now, for every job together."""

    # ---- wiring from the handlers ---------------------------------------------------------

    def wake(self, key: Key) -> None:
        job = self._jobs.get(key)
        if job is not None:
            job.wake.set()

    def stuck_passes(self, now: float | None = None) -> list[str]:
        """Jobs whose pass has run longer than :data:`STUCK_PASS_SECONDS` (for liveness)."""
        now = time.monotonic() if now is None else now
        return [
            f"{ns}/{name}"
            for (ns, name), job in self._jobs.items()
            if job.running is not None and now - job.running.started > STUCK_PASS_SECONDS
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
        job = self._jobs.setdefault(key, _Job())
        failures = 0
        try:
            while not stopped:
                job.wake.clear()
                try:
                    delay = await self.run_pass(key, body, logger, pods, service, emit)
                    failures = 0
                except Exception as exc:
                    delay = ERROR_BACKOFF[min(failures, len(ERROR_BACKOFF) - 1)]
                    failures += 1
                    logger.warning("reconcile failed (%s); retrying in %.0fs", exc, delay)
                await _wait(job.wake, stopped, delay)
        finally:
            self._jobs.pop(key, None)
            self._set_phases()

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
        job = self._jobs.setdefault(key, _Job())
        running = job.running = _Pass(time.monotonic())
        started = time.perf_counter()
        try:
            raw = self._freshest(job, body)
            for _ in range(MAX_CONFLICT_RETRIES):
                try:
                    return await self._pass(key, job, raw, logger, pods, service, emit)
                except ConflictError:
                    self.metrics.status_conflicts.inc()
                    logger.debug("status write was stale: reading the job again")
                    raw = await self.kube.get_job(*key)
            raise ApiError(
                409, "Conflict", f"status still stale after {MAX_CONFLICT_RETRIES} reads"
            )
        finally:
            if job.running is running:
                job.running = None
            running.ended.set()
            self.metrics.reconcile_seconds.observe(time.perf_counter() - started)

    def _freshest(self, job: _Job, body: Mapping[str, Any]) -> JSON:
        """kopf's copy, unless it is still the version our last status write replaced."""
        current = _plain(body)
        version = current.get("metadata", {}).get("resourceVersion")
        if job.written is not None and version == job.written.replaced:
            return job.written.job
        return current

    # ---- the pass: observe, decide, write, act, emit ----------------------------------------

    async def _pass(
        self,
        key: Key,
        job: _Job,
        raw: JSON,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        pods: Callable[[], Iterable[PodRecord]],
        service: Callable[[], bool],
        emit: Emit,
    ) -> float | None:
        try:
            ddpjob, ignored = parse_job_lenient(raw, source=f"DDPJob {key[0]}/{key[1]}")
        except SpecError as exc:
            await self._invalid(key, job, raw, exc, logger, emit)
            return None
        if ignored and job.ignored != ignored:
            logger.warning(
                "ignoring fields this operator does not know (is the CRD newer than the "
                "operator?): %s",
                ", ".join(ignored),
            )
        job.ignored = ignored
        records = {r.observed.name: r for r in pods()}
        planned = await self._observe_and_plan(key, job, ddpjob, records, service())
        decision = planned.decision
        job.remembered = planned.remembered
        if planned.write:
            await self._write_status(
                key, job, raw, decision.status.model_dump(by_alias=True, mode="json")
            )
            self._account_metrics(ddpjob, decision)
        job.phase = decision.status.phase
        self._set_phases()
        if planned.leave_kueue:
            await self._leave_kueue(key, job, ddpjob)
        try:
            await self.executor.execute(
                key, ddpjob.metadata.uid or "", planned, records, job.expected, job.remember
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
        for change in planned.kueue.actions if planned.kueue is not None else ():
            logger.info("Kueue: %s", kueue.describe(change))
        return planned.requeue_after

    async def _observe_and_plan(
        self,
        key: Key,
        job: _Job,
        ddpjob: api.DDPJob,
        records: Mapping[str, PodRecord],
        service: bool,
    ) -> PassPlan:
        """What the job's world looks like (its pods as kopf's index has them, our writes the
        watch has not shown yet, its agents' answers, PodGroups served, Kueue's objects), and
        the core's plan for it; the job's priority is read only when the plan asks for it."""
        job.expected.prune(time.monotonic(), (r.observed for r in records.values()))
        observed = job.expected.deleted(r.observed for r in records.values())
        if self.config.ask_agents:
            observed = await self._ask_agents(job, ddpjob, observed)
        everyone = observed + job.expected.pending_pods(_index_of)
        watched = None
        if workload.queue_name(ddpjob) is not None:
            watched = await self.kueue.observe(key[0], ddpjob, job.priority)
        seen = Seen(
            pods=everyone,
            service=service,
            pod_groups=await self._serves_pod_groups(ddpjob),
            kueue=watched,
            ask_every=agents.ASK_EVERY_SECONDS if self.config.ask_agents else None,
        )
        planned = self._plan(ddpjob, seen, job)
        if planned.wants_priority and watched is not None:
            found = await self.kueue.priority(ddpjob)
            if isinstance(found, workload.Priority):
                job.priority = found
            seen = dataclasses.replace(seen, kueue=dataclasses.replace(watched, priority=found))
            planned = self._plan(ddpjob, seen, job)
        return planned

    def _plan(self, ddpjob: api.DDPJob, seen: Seen, job: _Job) -> PassPlan:
        return plan(
            ddpjob,
            seen,
            dt.datetime.now(dt.UTC),
            time.monotonic(),
            job.remembered,
            self.defaults,
            secrets.token_urlsafe(32),
        )

    async def _ask_agents(
        self, job: _Job, ddpjob: api.DDPJob, seen: tuple[ObservedPod, ...]
    ) -> tuple[ObservedPod, ...]:
        """``seen`` as the agents describe it: some asked now, as the operator-wide budget
        allows, the others as they answered before (:mod:`~ddpjob_operator.agents`)."""
        now = time.monotonic()
        asked = job.survey.pick(seen, self._asks, now)
        if asked:
            port = builders.CLUSTER.directory_port(ddpjob, 0)
            job.survey.record(await agents.ask_pods(asked, port), asked, time.monotonic())
        return agents.apply(seen, job.survey.answers(seen, time.monotonic()))

    async def _write_status(self, key: Key, job: _Job, raw: JSON, status: JSON) -> None:
        version = str(raw.get("metadata", {}).get("resourceVersion", ""))
        written = await self.kube.write_status(*key, version, status)
        job.written = _Written(replaced=version, job=written)

    def _account_metrics(self, ddpjob: api.DDPJob, decision: Decision) -> None:
        new = decision.status.restarts - ddpjob.status.restarts
        if new > 0:
            self.metrics.replaced(f.reason for f in decision.status.failures[-new:])

    def _set_phases(self) -> None:
        self.metrics.set_phases(
            {key: job.phase for key, job in self._jobs.items() if job.phase is not None}
        )

    async def _invalid(
        self,
        key: Key,
        job: _Job,
        raw: JSON,
        error: SpecError,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        emit: Emit,
    ) -> None:
        """A spec that slipped past the CRD schema: an InvalidSpec condition naming the fields
        (:func:`~ddpjob_operator.core.plan.invalid_status`), written once; the job's pods are
        left alone."""
        status = invalid_status(raw, error, dt.datetime.now(dt.UTC))
        if status is None:
            return
        await self._write_status(key, job, raw, status)
        message = invalid_message(error)
        logger.error("invalid DDPJob: %s", message)
        emit("Warning", "InvalidSpec", message)

    async def _serves_pod_groups(self, ddpjob: api.DDPJob) -> bool | None:
        """Whether the cluster serves PodGroups, for a job that wants a gang (else None)."""
        if ddpjob.spec.gang_scheduling is not api.GangScheduling.NATIVE:
            return None
        return await self._pod_groups_served.get("podgroups", self.kube.pod_groups_served)

    async def _leave_kueue(self, key: Key, job: _Job, ddpjob: api.DDPJob) -> None:
        """A job without the queue label whose own Workloads may still be open: its label was
        removed (while this operator watched, or before it started: the job's status still has
        the ``Admitted`` condition, which only a Kueue job gets). They are finished and
        released, so an admitted one gives its quota back and a waiting one is never admitted
        for a job that no longer asks; the job runs on without Kueue. Never for other jobs: an
        operator not granted Workloads would get a 403 for each."""
        try:
            finished = await self.release_workloads(
                key[0], ddpjob.metadata.uid or "", *workload.LABEL_REMOVED
            )
        except ApiError as exc:  # the job itself runs on; tried again on the next pass
            job.remembered = dataclasses.replace(job.remembered, queued=True)
            logger.warning("cannot finish the Workloads of a job that left Kueue: %s", exc)
            return
        if finished:
            logger.warning(
                "the job no longer names a LocalQueue (%s): finished %d of its Workloads; it "
                "runs without Kueue",
                workload.QUEUE_LABEL,
                finished,
            )

    # ---- for the handlers: a job going away ---------------------------------------------------

    async def pass_over(self, key: Key, timeout: float = STUCK_PASS_SECONDS) -> bool:
        """Wait until the job's running pass, if any, has ended; False after ``timeout``.

        For a deleted job: kopf has told its loop to stop before the delete handler runs (and
        gives it ``cancellation_backoff`` to end its pass before cancelling it), but a pass
        already under way may still create a pod or a Workload after the handler listed them
        to release. A pod is released by its own event; a Workload is not watched."""
        job = self._jobs.get(key)
        running = job.running if job is not None else None
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
        message: str = workload.OWNER_GONE,
    ) -> int:
        """A deleted job's Workloads (or, with another reason, one that left Kueue): Finished
        and without Kueue's finalizer (:meth:`kueue.Kueue.release`)."""
        return await self.kueue.release(namespace, job_uid, reason, message)

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


__all__ = ["Controller", "OperatorConfig"]
