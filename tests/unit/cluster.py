"""A small simulated cluster for the pure core's tests: pod objects shaped as the real actors
write them, and an executor that applies decisions the way the API server does.

What it models, after the real controllers:

* the API server: uid and creationTimestamp on create, a 409 on a duplicate name, graceful
  deletion (``deletionTimestamp`` = now + grace, ``deletionGracePeriodSeconds``), delete
  preconditions on uid, finalizers that keep a deleted object until they are gone, force
  deletion (grace 0) that still waits for finalizers;
* the kubelet: ``containerStatuses`` sorted by name (a sidecar named ``istio-proxy`` comes
  first), ``state.terminated`` with exit code, reason and ``finishedAt``, phase ``Failed`` for a
  pod it killed on deletion, and confirming a deletion once its containers are gone;
* the scheduler (``DisruptionTarget`` ``PreemptionByScheduler``, ``PodScheduled`` False
  ``Unschedulable``), the Eviction API (``EvictionByEvictionAPI``), the taint manager on a lost
  node (``DeletionByTaintManager``, and no kubelet ever confirms), PodGC
  (``DeletionByPodGC`` + force delete) and ``kubectl delete`` (graceful, no condition).

It also keeps the ground truth the properties compare with: which pods failed while they were
part of the job, and which of those failures are charged.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import itertools
from typing import Any

from ddpjob_operator import api
from ddpjob_operator.core.actions import (
    CreatePod,
    CreateService,
    Decision,
    DeleteJob,
    DeletePod,
    Observed,
    RemoveFinalizer,
)
from ddpjob_operator.core.reconcile import reconcile
from ddpjob_operator.observe import observe_pod

JSON = dict[str, Any]
T0 = dt.datetime(2026, 11, 22, 12, 0, tzinfo=dt.UTC)
GRACE = 30


def stamp(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)


@dataclasses.dataclass
class Cluster:
    job: api.DDPJob
    now: dt.datetime = T0
    pods: dict[str, JSON] = dataclasses.field(default_factory=dict)
    service: bool = False
    dead_nodes: set[str] = dataclasses.field(default_factory=set)
    job_deleted: bool = False
    decisions: list[Decision] = dataclasses.field(default_factory=list)
    truth_failed: dict[str, bool] = dataclasses.field(default_factory=dict)
    """uid -> charged, for every pod that failed while it was part of the job."""
    ours: set[str] = dataclasses.field(default_factory=set)
    """uids the operator decided to delete."""
    created: int = 0
    _uids: itertools.count[int] = dataclasses.field(default_factory=itertools.count)
    _nodes: itertools.count[int] = dataclasses.field(default_factory=itertools.count)

    # ---- the operator -----------------------------------------------------------------------

    def observe(self) -> Observed:
        observed = (observe_pod(p) for p in self.pods.values())
        return Observed(tuple(p for p in observed if p is not None), self.service)

    def operator_pass(self) -> Decision:
        decision = reconcile(self.job, self.observe(), self.now)
        self.apply(decision)
        return decision

    def apply(self, decision: Decision) -> None:
        self.decisions.append(decision)
        self.job = self.job.model_copy(update={"status": decision.status})  # status first
        for action in decision.actions:
            if isinstance(action, CreateService):
                self.service = True
            elif isinstance(action, CreatePod):
                self._create(action)
            elif isinstance(action, DeletePod):
                pod = self.pods.get(action.name)
                if pod is None or pod["metadata"]["uid"] != action.uid:
                    continue  # 404, or 409 on the uid precondition
                self.ours.add(action.uid)
                self.delete(action.name, grace=0 if action.force else None)
            elif isinstance(action, RemoveFinalizer):
                pod = self.pods.get(action.name)
                if pod is None or pod["metadata"]["uid"] != action.uid:
                    continue
                finalizers = pod["metadata"].get("finalizers") or []
                pod["metadata"]["finalizers"] = [f for f in finalizers if f != api.POD_FINALIZER]
                self._maybe_remove(action.name)
            elif isinstance(action, DeleteJob):
                self.job_deleted = True

    def _create(self, action: CreatePod) -> None:
        assert action.name not in self.pods, f"{action.name} created while it exists (409)"
        pod = copy.deepcopy(action.pod)
        pod["metadata"]["uid"] = f"uid-{action.name}-{next(self._uids)}"
        pod["metadata"]["creationTimestamp"] = stamp(self.now)
        pod["status"] = {"phase": "Pending"}
        self.pods[action.name] = pod
        self.created += 1

    # ---- the API server ---------------------------------------------------------------------

    def delete(self, name: str, grace: int | None = None) -> None:
        """A DELETE as the API server (1.33 and later, ``rest.BeforeDelete``) handles it.

        A pod that is being deleted already only takes a shorter grace period: the timestamp
        moves back by the difference, but never into the past; if it would, it is now, and the
        grace period becomes 1 (or stays 0 for a force delete). The kubelet's final delete is
        such a delete, with grace 0.
        """
        pod = self.pods[name]
        meta = pod["metadata"]
        seconds = GRACE if grace is None else grace
        if "deletionTimestamp" in meta:
            current = meta["deletionGracePeriodSeconds"]
            if current and seconds < current:
                requested = _parse(meta["deletionTimestamp"]) - dt.timedelta(seconds=current)
                when = requested + dt.timedelta(seconds=seconds)
                if when < self.now:
                    when, seconds = self.now, (0 if seconds == 0 else 1)
                meta["deletionTimestamp"] = stamp(when)
                meta["deletionGracePeriodSeconds"] = seconds
            self._maybe_remove(name)
            return
        unscheduled = not pod["spec"].get("nodeName")
        if unscheduled or pod["status"].get("phase") in ("Succeeded", "Failed"):
            seconds = 0
        meta["deletionTimestamp"] = stamp(self.now + dt.timedelta(seconds=seconds))
        meta["deletionGracePeriodSeconds"] = seconds
        self._maybe_remove(name)

    def _maybe_remove(self, name: str) -> None:
        pod = self.pods.get(name)
        if pod is None:
            return
        meta = pod["metadata"]
        if "deletionTimestamp" not in meta or meta.get("finalizers"):
            return
        if meta["deletionGracePeriodSeconds"] == 0 or pod.get("_confirmed"):
            del self.pods[name]

    # ---- the kubelet, scheduler and controllers ---------------------------------------------

    def _live(self, name: str) -> bool:
        pod = self.pods.get(name)
        if pod is None or "deletionTimestamp" in pod["metadata"]:
            return False
        return pod["status"].get("phase") in ("Pending", "Running")

    def _mark_failed(self, name: str, charged: bool) -> None:
        uid = self.pods[name]["metadata"]["uid"]
        if uid not in self.ours and not self.job.status.phase.is_finished:
            self.truth_failed.setdefault(uid, charged)

    def start(self, name: str, node: str | None = None, sidecar: bool = False) -> None:
        """Schedule the pod (on a node of its own unless told) and run its containers."""
        pod = self.pods[name]
        pod["spec"]["nodeName"] = node or f"node-{next(self._nodes)}"
        statuses = [self._container("trainer", {"running": {"startedAt": stamp(self.now)}})]
        if sidecar:
            statuses.append(
                self._container("istio-proxy", {"running": {"startedAt": stamp(self.now)}})
            )
        pod["status"] = {
            "phase": "Running",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True"},
            ],
            "containerStatuses": sorted(statuses, key=lambda c: c["name"]),
        }

    def start_all(self) -> None:
        for name, pod in self.pods.items():
            if self._live(name) and pod["status"].get("phase") == "Pending":
                self.start(name)

    @staticmethod
    def _container(name: str, state: JSON) -> JSON:
        return {"name": name, "state": state, "ready": "running" in state, "restartCount": 0}

    def terminate_trainer(self, name: str, code: int, reason: str = "Error") -> None:
        """The trainer container exits; the pod ends unless a sidecar keeps it running."""
        pod = self.pods[name]
        statuses = pod["status"].setdefault("containerStatuses", [])
        terminated = {
            "terminated": {"exitCode": code, "reason": reason, "finishedAt": stamp(self.now)}
        }
        others = [c for c in statuses if c["name"] != "trainer"]
        statuses[:] = sorted(
            [*others, self._container("trainer", terminated)], key=lambda c: c["name"]
        )
        if not any("running" in c["state"] for c in others):
            pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
            for condition in pod["status"].get("conditions", []):
                if condition["type"] == "Ready":
                    condition["status"] = "False"

    def fail(self, name: str, code: int = 1) -> None:
        if self._live(name):
            self._mark_failed(name, True)
            self.terminate_trainer(name, code)

    def oom(self, name: str) -> None:
        if self._live(name):
            self._mark_failed(name, True)
            self.terminate_trainer(name, 137, "OOMKilled")

    def succeed(self, name: str) -> None:
        if self._live(name):
            self.terminate_trainer(name, 0, "Completed")

    def _disrupt(self, name: str, reason: str, grace: int | None = None) -> None:
        pod = self.pods[name]
        pod["status"].setdefault("conditions", []).append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": reason,
                "lastTransitionTime": stamp(self.now),
            }
        )
        self.delete(name, grace)

    def preempt(self, name: str) -> None:
        if self._live(name):
            self._mark_failed(name, False)
            self._disrupt(name, "PreemptionByScheduler")

    def evict(self, name: str) -> None:
        if self._live(name):
            self._mark_failed(name, False)
            self._disrupt(name, "EvictionByEvictionAPI")

    def lose_node(self, name: str) -> None:
        """The pod's node stops reporting; the taint manager deletes its pods, which then stay
        Terminating forever: no kubelet confirms."""
        if self._live(name):
            node = self.pods[name]["spec"].get("nodeName") or "node-lost"
            self.pods[name]["spec"]["nodeName"] = node
            self.dead_nodes.add(node)
            self._mark_failed(name, False)
            self._disrupt(name, "DeletionByTaintManager")

    def pod_gc(self, name: str) -> None:
        """PodGC on a node that is gone: DisruptionTarget, then a force delete."""
        if self._live(name):
            self._mark_failed(name, False)
            self._disrupt(name, "DeletionByPodGC", grace=0)

    def user_delete(self, name: str, force: bool = False) -> None:
        """``kubectl delete pod`` (``--force --grace-period=0`` with ``force``)."""
        if self._live(name):
            self._mark_failed(name, False)
            self.delete(name, grace=0 if force else None)

    def kubelet_tick(self) -> None:
        """Live kubelets stop the containers of deleted pods and confirm the deletion."""
        for name in list(self.pods):
            pod = self.pods[name]
            if "deletionTimestamp" not in pod["metadata"]:
                continue
            if pod["spec"].get("nodeName") in self.dead_nodes:
                continue
            if pod["status"].get("phase") in ("Pending", "Running"):
                self.kill_containers(name)
            self.kubelet_confirm(name)

    def kill_containers(self, name: str, code: int = 143) -> None:
        """The kubelet stops a deleted pod's containers: the trainer exits ``code``."""
        pod = self.pods[name]
        self.terminate_trainer(name, code)
        for status in pod["status"].get("containerStatuses") or []:
            if "running" in status["state"]:
                status["state"] = {"terminated": {"exitCode": 137, "reason": "Error"}}
        pod["status"]["phase"] = "Failed"

    def kubelet_confirm(self, name: str) -> None:
        """The kubelet's final delete (grace 0, which the API server clamps to now)."""
        pod = self.pods[name]
        pod["_confirmed"] = True
        self.delete(name, grace=0)
        self._maybe_remove(name)

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)

    # ---- views ----------------------------------------------------------------------------

    def live_pods(self) -> list[str]:
        return sorted(n for n in self.pods if self._live(n))

    def set_spec(self, **changes: Any) -> None:
        spec = self.job.spec.model_copy(update=changes)
        self.job = self.job.model_copy(update={"spec": spec})
