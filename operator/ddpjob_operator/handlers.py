"""The kopf handlers: thin wiring from Kubernetes events to :class:`~.controller.Controller`.

* Pods and Services of DDPJobs are watched with a server-side label selector
  (``ddpjob.io/job-name``) and kept in kopf indexes of small records, never whole bodies.
* Every event of a job, its pods or its Service wakes that job's daemon; the daemon runs the
  reconcile loop (:meth:`Controller.run_job`). No polling.
* kopf's own bookkeeping uses our names: the ``ddpjob.io/operator`` finalizer (held while the
  job's daemon runs, so a deleted job's pods are released first), and ``ddpjob.io`` for any
  progress annotation. No diff-base annotation is written: no handler here uses diffs, and
  kopf's would copy the whole spec into the job's annotations on every spec change.
* A deleted pod is released (our finalizer removed) right here when no job will count it: its
  job is gone, is being deleted (a pod created after the job's release list, say while a
  foreground deletion waits for it), or is another job of the same name.
* Watch streams have client and server timeouts, so a stream that goes silent is re-opened
  (kopf #810).
* The liveness probe fails when a reconcile pass has been running for too long.

The :class:`Controller` comes in through kopf's ``memo`` (set up by ``ddpjob operator``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from ddpjob_operator import api
from ddpjob_operator.controller import Controller
from ddpjob_operator.executor import PodRecord, pod_record
from ddpjob_operator.kube import controller_uid

OPERATOR_FINALIZER = "ddpjob.io/operator"
ANNOTATION_PREFIX = "ddpjob.io"
WATCH_SERVER_TIMEOUT = 300
WATCH_CLIENT_TIMEOUT = 360
WATCH_CONNECT_TIMEOUT = 30
JOBS = (api.GROUP, api.VERSION, api.PLURAL)
OURS = {api.LABEL_JOB: kopf.PRESENT}


WATCHED_ONLY = frozenset({"Pod", "Service"})
"""Kinds with watching handlers and indexes only (no changing handler, no daemon)."""
QUIET_HANDLERS = frozenset(
    f"Handler {name!r} succeeded." for name in ("pod_changed", "service_changed", "job_changed")
)
"""kopf's info line after every event of a job, a pod or a Service: thousands a minute for a
large job, and nothing a reader needs (failures are still logged)."""


class NoDiffBase(kopf.DiffBaseStorage):
    """Stores no diff-base: nothing here reacts to diffs (no on.create/on.update/on.resume
    handlers), and kopf's annotation would hold a copy of the spec (up to the 256 KiB limit of
    all annotations, one more write per spec change, a `kubectl scale` included).

    Nor does it build one for a pod or a Service: kopf deep-copies every event's body to build
    it (then again to strip its own annotations) before it looks for handlers, and only
    changing handlers and daemons read it, which those kinds have none of. It was most of the
    operator's CPU with a job of 1,024 pods (every pod event copied twice, ~6 KiB each)."""

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        if body.get("kind") in WATCHED_ONLY:
            return kopf.BodyEssence()
        return super().build(body=body, extra_fields=extra_fields)

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in QUIET_HANDLERS


def configure(settings: kopf.OperatorSettings) -> None:
    """Our names and our timeouts, on kopf's settings."""
    settings.persistence.finalizer = OPERATOR_FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = NoDiffBase()
    objects = logging.getLogger("kopf.objects")
    if not any(isinstance(f, _Quiet) for f in objects.filters):
        objects.addFilter(_Quiet())
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT
    settings.watching.connect_timeout = WATCH_CONNECT_TIMEOUT
    settings.watching.label_selectors["v1", "pods"] = api.LABEL_JOB
    settings.watching.label_selectors["v1", "services"] = api.LABEL_JOB
    settings.posting.reporting_component = "ddpjob-operator"
    settings.posting.level = logging.WARNING  # kopf's own log lines as Events: warnings only
    settings.networking.error_backoffs = (1, 1, 2, 3, 5, 8, 13, 21, 34, 55)
    # Serve exactly the namespaces given, with the resources found at start-up (the CRD is
    # checked before kopf starts): no RBAC to list namespaces or CRDs is needed.
    settings.scanning.disabled = True


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    configure(settings)


@kopf.on.cleanup()
async def cleanup(memo: Any, **_: Any) -> None:
    controller: Controller = memo.controller
    await controller.kube.close()


def _key(namespace: str | None, name: str) -> tuple[str, str]:
    return (namespace or "default", name)


# Every handler is a coroutine: kopf runs a plain function in its thread pool, a round trip
# through the executor for every event (a large job's pods make thousands), for work that
# takes microseconds.
@kopf.index("pods", labels=OURS)
async def ddpjob_pods(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[tuple[str, str], PodRecord]:
    record = pod_record(body)
    return {} if record is None else {_key(namespace, labels[api.LABEL_JOB]): record}


@kopf.index("services", labels=OURS)
async def ddpjob_services(
    namespace: str | None, name: str, labels: Mapping[str, str], **_: Any
) -> dict[tuple[str, str], str]:
    return {_key(namespace, labels[api.LABEL_JOB]): name}


@dataclasses.dataclass(frozen=True)
class JobRef:
    """What the pod handler needs to know of a job: which one, and whether it is going away."""

    uid: str
    deleting: bool


@kopf.index(*JOBS)
async def ddpjobs(
    namespace: str | None, name: str, meta: kopf.Meta, **_: Any
) -> dict[tuple[str, str], JobRef]:
    return {_key(namespace, name): JobRef(str(meta.uid), meta.deletion_timestamp is not None)}


def nobody_counts(job: JobRef | None, pod: Mapping[str, Any]) -> bool:
    """No job will count this pod: its job is gone or going, or the job of that name now is
    another one (the pod's controller is not it)."""
    if job is None or job.deleting:
        return True
    owner = controller_uid(dict(pod))
    return owner is not None and owner != job.uid


@kopf.on.event("pods", labels=OURS)
async def pod_changed(
    namespace: str | None,
    labels: Mapping[str, str],
    body: kopf.Body,
    memo: Any,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    controller: Controller = memo.controller
    key = _key(namespace, labels[api.LABEL_JOB])
    controller.wake(key)
    meta = body.get("metadata") or {}
    jobs: kopf.Index[tuple[str, str], JobRef] = kwargs["ddpjobs"]
    job = next(iter(jobs.get(key, [])), None)
    # A deleted pod that no job will count: its job was deleted (while this operator was down,
    # or it is being deleted and this pod came after the release list), or the job of that name
    # is a new one. Nobody else would release it.
    if (
        meta.get("deletionTimestamp")
        and nobody_counts(job, body)
        and await controller.release_pod(key[0], meta)
    ):
        logger.info("released pod %s, which no job counts", meta["name"])


@kopf.on.event("services", labels=OURS)
async def service_changed(
    namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any
) -> None:
    memo.controller.wake(_key(namespace, labels[api.LABEL_JOB]))


@kopf.on.event(*JOBS)
async def job_changed(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    memo.controller.wake(_key(namespace, name))


# On deletion (and operator exit) the loop is told to stop and given 10 s to end the pass it is
# in before it is cancelled: a cancelled pass could still have its last POST land after the
# delete handler listed what to release (see Controller.pass_over).
@kopf.daemon(*JOBS, cancellation_backoff=10, cancellation_timeout=30)
async def job_loop(
    body: kopf.Body,
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    memo: Any,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    controller: Controller = memo.controller
    if controller.exiting:
        # kopf stops every daemon when the operator exits, but an event its workers were
        # still handling can start one again right after (kopf guards pausing against this,
        # not exiting): it would run a pass during the shutdown and hold it up 5 s.
        return
    key = _key(namespace, name)
    pods: kopf.Index[tuple[str, str], PodRecord] = kwargs["ddpjob_pods"]
    services: kopf.Index[tuple[str, str], str] = kwargs["ddpjob_services"]

    def emit(kind: str, reason: str, message: str) -> None:
        kopf.event(body, type=kind, reason=reason, message=message[:1000])

    try:
        await controller.run_job(
            body,
            stopped,
            logger,
            pods=lambda: list(pods.get(key, [])),
            service=lambda: key in services,
            emit=emit,
        )
    finally:
        if (
            stopped.reason is not None
            and stopped.reason & kopf.DaemonStoppingReason.OPERATOR_EXITING
        ):
            controller.exiting = True


@kopf.on.delete(*JOBS)
async def job_deleted(
    namespace: str | None,
    name: str,
    uid: str,
    memo: Any,
    logger: kopf.Logger,
    **_: Any,
) -> None:
    """Let go of the job's pods (our tracking finalizer) so that garbage collection can work;
    for a Kueue job, of its Workloads too (Kueue's finalizer, which only the job's controller
    removes while a Workload still has its owner reference)."""
    controller: Controller = memo.controller
    if not await controller.pass_over(_key(namespace, name)):
        logger.warning("the job's last reconcile pass is still running; releasing anyway")
    released = await controller.release_pods(*_key(namespace, name))
    if released:
        logger.info("released %d pods of the deleted job", released)
    # Whatever its labels say now: one removed while the job ran would leave its Workloads.
    finished = await controller.release_workloads(_key(namespace, name)[0], uid)
    if finished:
        logger.info("finished and released %d Workloads of the deleted job", finished)


@kopf.on.probe(id="reconcile")
async def reconcile_loop(memo: Any, **_: Any) -> str:
    """Liveness: fails (500) when a reconcile pass is stuck, not merely when a task is alive."""
    controller: Controller = memo.controller
    stuck = controller.stuck_passes()
    if stuck:
        raise kopf.PermanentError(f"reconcile passes stuck for over 120s: {', '.join(stuck)}")
    return "ok"
