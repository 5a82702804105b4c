"""Kueue's side of the API, beside :mod:`~ddpjob_operator.kube`: what the operator reads of a
job's Workloads (and the ResourceFlavors and priority they need) for the pure core to decide
on (:func:`ddpjob_operator.core.queue.admit`), and the Workload writes it decides.

Reads are kept for a while where they change seldom (whether the cluster serves Workloads at
all; a flavor's node labels). A 403 on the Workloads is an answer, not an error: the operator
was not granted them (the chart's ``kueue.enabled: false``), and the core says so on the job.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Awaitable
from typing import Any

from ddpjob_operator import api
from ddpjob_operator.core import queue, workload
from ddpjob_operator.kube import ApiError, Kept, KubeApi, controller_uid

JSON = dict[str, Any]
logger = logging.getLogger(__name__)

SERVED_CHECK_SECONDS = 300.0
"""How long the answer to "does the cluster serve Kueue's Workloads?" is kept."""
FLAVOR_SECONDS = 60.0
"""How long a ResourceFlavor read is kept."""


class Kueue:
    """The operator's reads and writes of Kueue's objects, on the operator's API client."""

    def __init__(self, kube: KubeApi) -> None:
        self.kube = kube
        self._served: Kept[bool] = Kept(SERVED_CHECK_SECONDS)
        self._flavors: Kept[JSON | None] = Kept(FLAVOR_SECONDS)

    async def served(self) -> bool:
        """The cluster serves Kueue's Workloads (discovery, kept a while)."""
        return await self._served.get("workloads", self.kube.workloads_served)

    async def observe(
        self, namespace: str, job: api.DDPJob, priority: workload.Priority | None
    ) -> queue.Observation:
        """The job's Workloads and the flavors they were admitted to, as far as this operator
        may read them; ``priority``: the job's, if it is known already."""
        if not await self.served():
            return queue.Observation(served=False)
        uid = job.metadata.uid or ""
        try:
            listed = await self.kube.list_workloads(namespace, uid)
        except ApiError as exc:
            if exc.status != 403:
                raise
            return queue.Observation(served=True, forbidden=str(exc))
        slices = tuple(workload.Slice.of(w) for w in listed if controller_uid(w) == uid)
        flavors: dict[str, JSON] = {}
        for flavor in queue.flavors_to_read(slices):
            try:
                found = await self._flavors.get(
                    flavor, functools.partial(self.kube.get_resource_flavor, flavor)
                )
            except ApiError as exc:  # only new pods wait for it: nothing else depends on it
                logger.warning("cannot read ResourceFlavor %s: %s", flavor, exc)
                found = None
            if found is not None:
                flavors[flavor] = found
        return queue.Observation(True, slices, None, flavors, priority)

    async def priority(self, job: api.DDPJob) -> workload.Priority | str:
        """The Workload's priority (:func:`workload.priority_class`); a class that does not exist:
        why, as a message."""
        named = workload.priority_class(job)
        value = 0 if named is None else await self.kube.priority_value(named.kueue, named.name)
        return workload.priority(named, value)

    def write(self, namespace: str, change: workload.WorkloadAction) -> Awaitable[Any]:
        """The API call that carries out one of the core's Workload writes."""
        if isinstance(change, workload.CreateWorkload):
            return self.kube.create_workload(namespace, change.body)
        if isinstance(change, workload.PatchWorkload):
            return self.kube.patch_workload(
                namespace, change.name, change.patch, status=change.status
            )
        return self.kube.release_workload(namespace, change.name, change.uid, change.finalizers)

    async def release(
        self,
        namespace: str,
        job_uid: str,
        reason: str = "OwnerNotFound",
        message: str = workload.OWNER_GONE,
    ) -> int:
        """A deleted job's Workloads (or, with another reason, one that left Kueue): Finished
        and without Kueue's finalizer, which nobody else removes while they keep their owner
        reference. How many were released."""
        if not job_uid or not await self.served():
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
            wl = workload.Slice.of(raw)
            if not wl.finished and not wl.deleting:
                change = workload.finish(wl, reason, message, now)
                await self.kube.patch_workload(namespace, wl.name, change.patch, status=True)
                found = await self.kube.get_workload(namespace, wl.name)
                if found is None:
                    continue  # gone meanwhile
                wl = workload.Slice.of(found)
                if not wl.finished and not wl.deleting:
                    # The patch was stale (Kueue wrote in between): released unfinished, it
                    # would keep its quota with nobody left to finish it. Tried again.
                    raise ApiError(
                        409, "Conflict", f"Workload {namespace}/{wl.name} changed while finished"
                    )
            if workload.FINALIZER in wl.finalizers:
                await self.kube.release_workload(namespace, wl.name, wl.uid, wl.finalizers)
                released += 1
        return released


def describe(change: workload.WorkloadAction) -> str:
    """One line for the log."""
    if isinstance(change, workload.CreateWorkload):
        spec = change.body["spec"]
        return f"create Workload {change.body['metadata']['name']} in {spec['queueName']}"
    if isinstance(change, workload.PatchWorkload):
        what = "status" if change.status else "spec"
        return f"patch Workload {change.name} ({what}): {_brief(change.patch)}"
    return f"remove the finalizer of Workload {change.name}"


def _brief(patch: JSON) -> str:
    body = {k: v for k, v in patch.items() if k != "metadata"}
    if "status" in body:
        conditions = body["status"].get("conditions") or []
        return ", ".join(f"{c['type']}={c['status']}/{c['reason']}" for c in conditions[-3:])
    return str(body)[:200]
