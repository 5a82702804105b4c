"""Pod 0 hosts the job's first rendezvous store: when the scheduler leaves it waiting for
room that pods beyond ``minReplicas`` took, before any round formed, those pods make room (the
waiting ones and the bound one of highest index, once per episode) and come back once pod 0 is
placed."""

from __future__ import annotations

from collections.abc import Sequence

from ddpjob_operator import api, builders
from ddpjob_operator.api import PodWaiting
from ddpjob_operator.core.actions import DeletePod, DeleteWhy
from ddpjob_operator.observe import ObservedPod


def store_host_unplaced(active: Sequence[ObservedPod], minimum: int) -> bool:
    """Pod 0 hosts the job's first rendezvous store, and the scheduler left it waiting for room
    while pods beyond ``minReplicas`` took nodes, before any round formed: those pods wait for
    its store and nothing trains. Once a round has formed (an agent reports a world size or
    hosts the store; the caller also asks that no pod has failed yet, for agents that are not
    asked) a lost pod 0 is not needed: the survivors carry the store on."""
    first = next((p for p in active if p.index == 0), None)
    if first is None or first.node is not None or first.waiting_reason != "Unschedulable":
        return False
    if any(p.store_host or p.world_size for p in active):
        return False
    return any(p.index >= minimum and p.node is not None for p in active)


def make_room(pods: Sequence[ObservedPod], desired: int, minimum: int) -> list[DeletePod]:
    """While pod 0 waits for room: the waiting pods beyond ``minReplicas`` go (they would take
    the room first as well as pod 0), and the bound one of highest index, unless an earlier
    pass made room already (a pod beyond ``minReplicas`` is missing or being deleted)."""
    beyond = [p for p in pods if minimum <= p.index < desired]
    waiting = [p for p in beyond if p.live and p.node is None]
    deletes = [DeletePod(p.name, p.uid, p.index, DeleteWhy.STORE_HOST) for p in waiting]
    made = any(p.deleting for p in beyond) or len({p.index for p in beyond}) < desired - minimum
    bound = sorted((p for p in beyond if p.live and p.node is not None), key=lambda p: -p.index)
    if bound and not made:
        victim = bound[0]
        deletes.append(DeletePod(victim.name, victim.uid, victim.index, DeleteWhy.STORE_HOST))
    return deletes


def after_store_host(job: api.DDPJob, index: int) -> PodWaiting:
    return PodWaiting(
        pod=builders.pod_name(job.name, index),
        reason="StoreHostUnplaced",
        message=(
            "pod 0 hosts the job's first rendezvous store and waits for room: pods beyond "
            "minReplicas are created once it is placed"
        ),
    )
