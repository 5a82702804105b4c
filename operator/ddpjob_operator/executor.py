"""Carrying out a pass's plan (:class:`~ddpjob_operator.core.plan.PassPlan`) through the API:
in order, independent calls at once (pod creations after a slow start), and remembering what
was done until the watch shows it (:class:`Expectations`)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ddpjob_operator import api, slowstart
from ddpjob_operator.core import gang
from ddpjob_operator.core.actions import (
    CreatePod,
    CreateService,
    DeleteJob,
    DeletePod,
    RemoveFinalizer,
)
from ddpjob_operator.core.plan import PassPlan
from ddpjob_operator.kube import KubeApi
from ddpjob_operator.kueue import Kueue
from ddpjob_operator.observe import ObservedPod, PodPhase, observe_pod

logger = logging.getLogger("ddpjob_operator.controller")

CONCURRENCY = 48
"""API calls in flight at once for one pass (pod creations of a large job go in parallel, after
a slow start: :mod:`~ddpjob_operator.slowstart`). At 1,024 hollow pods on the real API server
(bench/bench_operator.py --hollow), 16 created them in 11-16 s, 32 in 10.9 s, 48 in 4.1-6.9 s,
64 in 8.1 s."""
SLOW_START_FIRST = 16
"""Pod creations a pass starts at once before any has succeeded: a template the API refuses
costs at most this many requests a pass. 1 (the Job controller's) took a 64-pod job's
creations from 0.4 s to 0.6-1.1 s here (seven round trips instead of two)."""
EXPECTATION_SECONDS = 15.0
"""How long a write we made may take to show in kopf's indexes before we act again."""


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

    def deleted(self, seen: Iterable[ObservedPod]) -> tuple[ObservedPod, ...]:
        """``seen`` as our own deletions left it: a pod we deleted that the watch still shows
        whole is being deleted. Else a pass that runs before the watch catches up decides the
        delete again (the call is skipped for its uid) and tells its event again."""
        return tuple(
            dataclasses.replace(p, deleting=True)
            if not p.deleting and ("delete", p.uid) in self.done
            else p
            for p in seen
        )

    def pending_pods(self, index_of: Callable[[str], int]) -> tuple[ObservedPod, ...]:
        return tuple(
            ObservedPod(
                name=name, index=index_of(name), uid=f"expected:{name}", phase=PodPhase.PENDING
            )
            for name in sorted(self.created)
        )


class ActionsFailedError(Exception):
    """Some actions of a pass failed (the others were carried out)."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors[:3]))


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


class Remember(Protocol):
    """Record what an action made, for the core's next pass (``Remembered``'s fields)."""

    def __call__(self, **change: Any) -> None: ...


class Executor:
    """Carries out the plans of every job's passes, on the operator's API client."""

    def __init__(self, kube: KubeApi, kueue: Kueue) -> None:
        self.kube = kube
        self.kueue = kueue

    def _prerequisites(
        self, namespace: str, planned: PassPlan, remember: Remember
    ) -> list[tuple[Any, Callable[[], None]]]:
        """The NetworkPolicy, the store-key Secret and the PodGroup: made before any pod."""
        first: list[tuple[Any, Callable[[], None]]] = []

        def made(**change: Any) -> Callable[[], None]:
            return lambda: remember(**change)

        if planned.network_policy is not None:
            first.append(
                (
                    self.kube.create_network_policy(namespace, planned.network_policy),
                    made(network_policy_made=True),
                )
            )
        if planned.secret is not None:
            first.append(
                (
                    self.kube.create_secret(namespace, planned.secret),
                    made(store_key_made=True),
                )
            )
        pod_group = planned.pod_group
        if pod_group is not None:
            size = int(pod_group["spec"]["schedulingPolicy"]["gang"]["minCount"])

            def posted() -> None:
                remember(pod_group=gang.Posted(size, time.monotonic()))

            first.append((self.kube.ensure_pod_group(namespace, pod_group), posted))
        return first

    async def execute(
        self,
        key: tuple[str, str],
        job_uid: str,
        planned: PassPlan,
        records: Mapping[str, PodRecord],
        expected: Expectations,
        remember: Remember,
    ) -> None:
        """The Service, the NetworkPolicy, the store-key Secret and the PodGroup first; then
        deletes and finalizer removals; then creations; then the job; then Kueue's Workloads.

        Deletes and finalizer removals run even when the Service, the NetworkPolicy, the
        Secret or the PodGroup could not be made (they only let go of pods). Pods are created
        only when everything before succeeded: a pod must never start without its DNS name,
        the policy the job asked for, or the Secret its env reads (it would wait in
        CreateContainerConfigError), and a pod of a gang would never be scheduled without its
        group.
        """
        namespace = key[0]
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
            self._prerequisites(namespace, planned, remember),
            [],
            [],
            [],
        ]
        # Workload writes go last, and always: each was decided on what the pod actions do not
        # change (an eviction's reservation is cleared once no pod holds resources, a count is
        # lowered once the surplus pods are gone), and a failed one (Kueue's webhook down) must
        # not hold back a replacement pod.
        workloads = planned.kueue.actions if planned.kueue is not None else ()
        groups.append([(self.kueue.write(namespace, change), nothing) for change in workloads])
        for action in planned.decision.actions:
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
