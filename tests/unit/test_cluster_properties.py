"""Properties of the core over any sequence of cluster events and operator passes.

Events: a trainer fails or is OOM-killed, a pod is preempted, evicted, lost with its node,
garbage-collected, deleted by a user (gracefully or by force), succeeds; the job is scaled,
suspended and resumed; the kubelet confirms deletions; pods start; time passes; the operator
runs a pass. Whatever the order:

* ``status.restarts`` equals the number of distinct pods that failed while they were part of
  the job (ground truth kept by the simulator), and ``status.backoffCount`` the charged ones;
* the job never sits with fewer pods than desired with no action and no requeue;
* no pod is ever created while one of the same name exists (the simulator asserts it).
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from ddpjob_operator import api, builders
from ddpjob_operator.core.facts import desired_replicas

from .cluster import GRACE, Cluster
from .jobs import job as make_job

POD_EVENTS = (
    "fail",
    "oom",
    "preempt",
    "evict",
    "lose_node",
    "pod_gc",
    "user_delete",
    "force_delete",
    "succeed",
)
JOB_EVENTS = ("scale", "suspend", "resume", "kubelet", "start", "advance", "pass", "pass")

events = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(POD_EVENTS), st.integers(0, 4)),
        st.tuples(st.sampled_from(JOB_EVENTS), st.integers(1, 4)),
    ),
    max_size=40,
)


def _apply_event(world: Cluster, event: str, value: int) -> None:
    name = builders.pod_name("demo", value)
    if event in POD_EVENTS:
        if name not in world.pods:
            return
        if event == "force_delete":
            world.user_delete(name, force=True)
        else:
            getattr(world, event)(name)
    elif event == "scale":
        world.set_spec(replicas=value)
    elif event == "suspend":
        world.set_spec(suspend=True)
    elif event == "resume":
        world.set_spec(suspend=False)
    elif event == "kubelet":
        world.kubelet_tick()
    elif event == "start":
        world.start_all()
    elif event == "advance":
        world.advance(value * 10)
    else:
        _checked_pass(world)


def _checked_pass(world: Cluster) -> None:
    decision = world.operator_pass()
    status = decision.status
    quiet = not decision.actions and decision.requeue_after is None
    busy = (
        status.phase.is_finished
        or world.job.spec.suspend
        or status.succeeded > 0
        or world.job_deleted
    )
    if quiet and not busy:
        live = world.live_pods()
        assert len(live) >= desired_replicas(world.job.spec), (
            f"wedged: {live} live, {desired_replicas(world.job.spec)} desired, "
            "no action and no requeue"
        )


def _settle(world: Cluster) -> None:
    world.set_spec(suspend=False)
    for _ in range(8):
        _checked_pass(world)
        world.kubelet_tick()
        world.start_all()
        world.advance(GRACE + 31)
    _checked_pass(world)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events, st.sampled_from(["OnFailure", "ExitCode"]))
def test_counts_are_exact_and_the_job_never_wedges(
    sequence: list[tuple[str, int]], policy: str
) -> None:
    spec: dict[str, Any] = {
        "replicas": 3,
        "minReplicas": 1,
        "maxReplicas": 4,
        "backoffLimit": 1000,
        "restartPolicy": policy,
    }
    world = Cluster(make_job(**spec))
    for event, value in sequence:
        _apply_event(world, event, value)
        status = world.job.status
        assert status.restarts <= len(world.truth_failed)
    _settle(world)
    status = world.job.status
    assert status.restarts == len(world.truth_failed)
    assert status.backoff_count == sum(world.truth_failed.values())
    if status.phase is api.JobPhase.RUNNING and status.succeeded == 0:
        assert len(world.live_pods()) == desired_replicas(world.job.spec)
