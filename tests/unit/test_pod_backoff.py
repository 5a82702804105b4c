"""Back-off per pod index (issue 23): after a charged failure, the next pod of that index comes
after ``spec.podBackoff`` (10 s, doubling, at most 360 s; reset after 600 s of running), and
the counts of one pass read in the order the failures happened.

The rules are ``ddpjob_operator.core.backoff``'s; most tests drive them through ``reconcile()``.
The state lives in ``status.podBackoff``: every test hands the last decision's status to the
next pass, as the executors do (and as an operator that restarts reads it back).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from ddpjob_operator import api
from ddpjob_operator.core import backoff
from ddpjob_operator.core.actions import CreatePod, Decision
from ddpjob_operator.core.events import Event
from ddpjob_operator.errors import SpecError
from ddpjob_operator.observe import ObservedPod, PodPhase
from ddpjob_operator.parse import parse_job

from .jobs import manifest
from .test_reconcile import T0, failed, kinds, make_job, pod, run, running_status

SMALL = {"initialDelaySeconds": 2, "maxDelaySeconds": 10, "resetAfterSeconds": 60}


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def crashed(index: int, started: float, finished: float, exit_code: int = 1) -> ObservedPod:
    """A pod of ``index`` whose trainer ran from ``started`` to ``finished`` (seconds after T0)
    and exited ``exit_code``, as the kubelet writes it."""
    return failed(index, exit_code=exit_code, started_at=at(started), finished_at=at(finished))


def step(job: api.DDPJob, decision: Decision) -> api.DDPJob:
    """The executor's one status write."""
    return job.model_copy(update={"status": decision.status})


def backoffs(decision: Decision) -> list[Event]:
    return [e for e in decision.events if e.reason == "BackOff"]


def job_with(status: api.DDPJobStatus | None = None, **spec: Any) -> api.DDPJob:
    spec.setdefault("podBackoff", SMALL)
    spec.setdefault("backoffLimit", 100)
    return make_job(status=status or running_status(), **spec)


def fail_and_wait(job: api.DDPJob, t: float, ran: float = 1.0) -> tuple[api.DDPJob, float]:
    """Pod 1 fails at ``t`` after running ``ran`` seconds; the next pass (pod 1 deleted) waits.
    Returns the job and the delay the waiting pass asks to be requeued after."""
    counted = run(job, pod(0), crashed(1, t - ran, t), now=at(t))
    assert kinds(counted) == [("delete", 1, "Replace")]
    assert len(backoffs(counted)) == 1
    job = step(job, counted)
    waiting = run(job, pod(0), now=at(t))
    assert kinds(waiting) == [] and backoffs(waiting) == []
    [entry] = [w for w in waiting.status.waiting if w.pod == "demo-worker-1"]
    assert (entry.reason, entry.index) == ("BackOff", 1)
    assert waiting.requeue_after is not None
    assert entry.retry_time == at(t + waiting.requeue_after)
    return step(job, waiting), waiting.requeue_after


def entry(index: int, failures: int, seconds: float) -> api.IndexBackoff:
    return api.IndexBackoff(index=index, failures=failures, last_failure_time=at(seconds))


def counted(
    index: int, seconds: float, ran: float, charged: bool = True
) -> tuple[api.PodFailure, float]:
    failure = api.PodFailure(
        pod=f"demo-worker-{index}", index=index, reason="X", charged=charged, time=at(seconds)
    )
    return failure, ran


@pytest.mark.parametrize(
    ("entries", "failures", "after"),
    [
        ([], [counted(1, 5, 1)], [entry(1, 1, 5)]),
        ([entry(1, 2, 0)], [counted(1, 5, 1)], [entry(1, 3, 5)]),
        ([entry(1, 2, 0)], [counted(1, 5, 60)], [entry(1, 1, 5)]),  # ran resetAfterSeconds
        ([entry(1, 2, 0)], [counted(1, 5, 60, charged=False)], []),  # a disruption after a run
        ([entry(1, 2, 0)], [counted(1, 5, 1, charged=False)], [entry(1, 2, 0)]),
        ([entry(2, 1, 0)], [counted(1, 5, 1), counted(1, 7, 1)], [entry(1, 2, 7), entry(2, 1, 0)]),
    ],
    ids=[
        "first",
        "in-a-row",
        "reset-then-one",
        "reset-by-disruption",
        "disruption",
        "two-in-a-pass",
    ],
)
def test_advance_counts_each_delaying_failure_once_per_index(
    entries: list[api.IndexBackoff],
    failures: list[tuple[api.PodFailure, float]],
    after: list[api.IndexBackoff],
) -> None:
    policy = api.PodBackoff.model_validate(SMALL)
    assert backoff.advance(policy, entries, failures) == after


def test_the_delays_of_one_index_double_from_the_start_up_to_the_cap() -> None:
    job = job_with()
    t = 0.0
    delays = []
    for _ in range(6):
        job, delay = fail_and_wait(job, t)
        delays.append(delay)
        # Not a moment before it is due, then at once.
        early = run(job, pod(0), now=at(t + delay - 0.5))
        assert kinds(early) == []
        t += delay
        assert kinds(run(job, pod(0), now=at(t))) == [("create", 1, None)]
    assert delays == [2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    [state] = job.status.pod_backoff
    assert (state.index, state.failures) == (1, 6)
    assert job.status.backoff_count == 6


def test_the_defaults_are_the_job_controllers() -> None:
    policy = parse_job(manifest()).spec.pod_backoff
    assert (policy.initial_delay_seconds, policy.max_delay_seconds) == (10, 360)
    assert policy.reset_after_seconds == 600
    assert [policy.delay(n) for n in range(1, 8)] == [10, 20, 40, 80, 160, 320, 360]
    assert policy.delay(10_000) == 360


def test_the_delay_resets_after_a_pod_that_ran_well() -> None:
    job = job_with()
    job, first = fail_and_wait(job, 0)
    job, second = fail_and_wait(job, 10)
    assert (first, second) == (2.0, 4.0)
    # The next pod ran 60 s (resetAfterSeconds) before it failed: the count starts over.
    job, third = fail_and_wait(job, 100, ran=60)
    assert third == 2.0
    assert [(e.index, e.failures) for e in job.status.pod_backoff] == [(1, 1)]


def test_a_live_pod_that_has_run_long_enough_clears_its_index() -> None:
    job = job_with()
    job, _ = fail_and_wait(job, 0)
    young = pod(1, started_at=at(10))
    assert run(job, pod(0), young, now=at(69)).status.pod_backoff == job.status.pod_backoff
    assert run(job, pod(0), young, now=at(70)).status.pod_backoff == []


@pytest.mark.parametrize(
    ("disruption", "exit_code", "deleting"),
    [
        ("PreemptionByScheduler", 137, False),
        ("EvictionByEvictionAPI", 137, False),
        ("DeletionByTaintManager", 137, False),
        (None, 143, False),  # the agent's graceful stop
        (None, 137, True),  # kubectl delete
    ],
)
def test_a_disruption_is_not_delayed(
    disruption: str | None, exit_code: int, deleting: bool
) -> None:
    job = job_with()
    job, _ = fail_and_wait(job, 0)  # a streak is pending for index 1...
    t = 100.0
    gone = failed(
        1,
        exit_code=exit_code,
        disruption=disruption,
        deleting=deleting,
        deletion_timestamp=at(t + 30) if deleting else None,
        deletion_grace_seconds=30 if deleting else None,
        started_at=at(t - 1),
        finished_at=at(t),
    )
    counted = run(job, pod(0), gone, now=at(t))
    [failure] = counted.status.failures[-1:]
    assert failure.charged is False
    assert backoffs(counted) == []
    assert counted.status.pod_backoff == job.status.pod_backoff  # ...and stays as it was
    assert kinds(run(step(job, counted), pod(0), now=at(t))) == [("create", 1, None)]


def test_the_back_off_counts_from_the_pods_finish_time() -> None:
    job = job_with()
    # It failed at 0 and is seen only at 1.5 (a watch drop, an operator restart).
    counted = run(job, pod(0), crashed(1, -1, 0), now=at(1.5))
    assert counted.status.failures[-1].time == T0
    waiting = run(step(job, counted), pod(0), now=at(1.5))
    assert waiting.requeue_after == 0.5
    # Seen after its delay: created at once, and no event announces a wait that is over.
    late = run(job, pod(0), crashed(1, -1, 0), now=at(5))
    assert backoffs(late) == []
    assert kinds(run(step(job, late), pod(0), now=at(5))) == [("create", 1, None)]


def test_a_node_clock_ahead_does_not_push_the_back_off_out() -> None:
    job = job_with()
    ahead = crashed(1, 59, 60)  # the node's clock says 60 s from now
    counted = run(job, pod(0), ahead, now=T0)
    assert counted.status.failures[-1].time == T0
    assert run(step(job, counted), pod(0), now=T0).requeue_after == 2.0


def test_a_pass_that_runs_again_charges_and_tells_each_back_off_once() -> None:
    job = job_with()
    broken = crashed(1, -1, 0)
    first = run(job, pod(0), broken, now=T0)
    # A 409 on the status write: the same pass runs again from the same status, and decides
    # the same (its events are emitted only once a write succeeds).
    again = run(job, pod(0), broken, now=at(0.1))
    assert (again.status.pod_backoff, backoffs(again)) == (
        first.status.pod_backoff,
        backoffs(first),
    )
    [event] = backoffs(first)
    assert event.type == "Warning"
    assert "demo-worker-1 is re-created in 2s" in event.message
    # Later passes see the counted pod (deleting, then gone): no new count, no new event.
    job = step(job, first)
    deleting = failed(
        1, uid=broken.uid, deleting=True, started_at=at(-1), finished_at=T0, tracked=True
    )
    for now in (0.5, 1.0, 1.5):
        later = run(job, pod(0), deleting, now=at(now))
        assert backoffs(later) == [] and later.status.pod_backoff == job.status.pod_backoff
        assert later.status.backoff_count == job.status.backoff_count
        job = step(job, later)
    [state] = job.status.pod_backoff
    assert state.failures == 1


def test_the_state_survives_an_operator_restart() -> None:
    job = job_with()
    job, _ = fail_and_wait(job, 0)
    job, _ = fail_and_wait(job, 10)
    # A new operator reads the job from the API server: the JSON round trip keeps the state.
    wire = job.model_dump(by_alias=True, mode="json")
    assert wire["status"]["podBackoff"] == [
        {"index": 1, "failures": 2, "lastFailureTime": "2026-11-22T12:00:10Z"}
    ]
    restarted = parse_job(wire)
    decision = run(restarted, pod(0), now=at(11))
    assert kinds(decision) == [] and decision.requeue_after == 3.0


def test_the_deadline_wins_over_a_pending_back_off() -> None:
    status = running_status(start_time=T0)
    job = job_with(status, activeDeadlineSeconds=5, podBackoff={"initialDelaySeconds": 60})
    counted = run(job, pod(0), crashed(1, 0, 1), now=at(1))
    job = step(job, counted)
    waiting = run(job, pod(0), now=at(1))
    assert waiting.requeue_after == 4.0  # the deadline, not the back-off's 60 s
    over = run(step(job, waiting), pod(0), now=at(5))
    assert over.status.phase is api.JobPhase.FAILED
    assert over.status.conditions[-3].reason == "DeadlineExceeded"
    assert not [a for a in over.actions if isinstance(a, CreatePod)]
    assert over.status.pod_backoff == []


def test_suspend_wins_over_a_pending_back_off() -> None:
    job = job_with()
    job, delay = fail_and_wait(job, 0)
    suspended = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
    decision = run(suspended, pod(0), now=at(delay))
    assert kinds(decision) == [("delete", 0, "Suspend")]
    assert decision.status.phase is api.JobPhase.SUSPENDED
    assert decision.status.waiting == []
    assert decision.status.pod_backoff == job.status.pod_backoff  # kept, as the budget is


def test_an_initial_delay_of_0_replaces_at_once() -> None:
    job = job_with(podBackoff={"initialDelaySeconds": 0})
    counted = run(job, pod(0), crashed(1, -1, 0), now=T0)
    assert backoffs(counted) == []
    assert kinds(run(step(job, counted), pod(0), now=T0)) == [("create", 1, None)]


def test_two_failures_of_one_pass_count_in_the_order_they_happened() -> None:
    job = job_with(make_job(replicas=3).status, replicas=3, backoffLimit=3)
    job = step(job, run(job, pod(0), pod(1), pod(2)))
    decision = run(job, pod(0), crashed(2, 0, 1), crashed(1, 0, 2), now=at(2.5))
    failed_events = [e.message for e in decision.events if e.reason == "PodFailed"]
    assert failed_events == [
        "pod demo-worker-2 failed (ExitCode(1), charged, 1/3 of backoffLimit)",
        "pod demo-worker-1 failed (ExitCode(1), charged, 2/3 of backoffLimit)",
    ]
    assert [f.pod for f in decision.status.failures] == ["demo-worker-2", "demo-worker-1"]
    assert [(e.index, e.failures) for e in decision.status.pod_backoff] == [(1, 1), (2, 1)]
    assert [e.message.split(" is ")[0] for e in backoffs(decision)] == [
        "pod demo-worker-1",
        "pod demo-worker-2",
    ]


def test_the_budget_still_fails_the_job_and_no_back_off_is_announced() -> None:
    job = job_with(backoffLimit=0)
    decision = run(job, pod(0), crashed(1, -1, 0), now=T0)
    assert decision.status.phase is api.JobPhase.FAILED
    assert backoffs(decision) == []


@pytest.mark.parametrize(
    ("backoff", "path", "words"),
    [
        (
            {"initialDelaySeconds": 30, "maxDelaySeconds": 20},
            "spec.podBackoff",
            "maxDelaySeconds (20) must be >= initialDelaySeconds (30)",
        ),
        ({"initialDelaySeconds": -1}, "spec.podBackoff.initialDelaySeconds", "greater than"),
        ({"resetAfterSeconds": "x"}, "spec.podBackoff.resetAfterSeconds", "integer"),
        ({"initialDelay": 5}, "spec.podBackoff.initialDelay", "maxDelaySeconds"),
    ],
)
def test_a_bad_pod_backoff_names_the_field_and_the_fix(
    backoff: dict[str, Any], path: str, words: str
) -> None:
    with pytest.raises(SpecError) as caught:
        parse_job(manifest(podBackoff=backoff))
    [problem] = caught.value.problems
    assert problem.path == path
    assert words in problem.message


def test_the_pods_run_time_comes_from_the_kubelets_clock() -> None:
    running = pod(0, started_at=at(0))
    assert running.ran_for(at(30)) == 30.0
    ended = failed(0, started_at=at(0), finished_at=at(12))
    assert ended.ran_for(at(1000)) == 12.0
    assert pod(0).ran_for(at(5)) == 0.0
    assert pod(0, PodPhase.PENDING).started_at is None


def test_observe_reads_the_trainers_start_and_finish() -> None:
    from ddpjob_operator import builders  # noqa: PLC0415
    from ddpjob_operator.observe import observe_pod  # noqa: PLC0415

    body = builders.build_pod(make_job(), 1)
    body["metadata"]["uid"] = "p"
    body["status"] = {
        "phase": "Failed",
        "containerStatuses": [
            {"name": "sidecar", "state": {"running": {"startedAt": "2026-11-22T11:00:00Z"}}},
            {
                "name": "trainer",
                "state": {
                    "terminated": {
                        "exitCode": 200,
                        "startedAt": "2026-11-22T12:00:00Z",
                        "finishedAt": "2026-11-22T12:00:07Z",
                    }
                },
            },
        ],
    }
    observed = observe_pod(body)
    assert observed is not None
    assert (observed.started_at, observed.finished_at) == (T0, at(7))
    assert observed.ran_for(at(100)) == 7.0
    body["status"] = {
        "phase": "Running",
        "containerStatuses": [
            {"name": "trainer", "state": {"running": {"startedAt": "2026-11-22T12:00:05Z"}}}
        ],
    }
    running = observe_pod(body)
    assert running is not None and running.started_at == at(5)
