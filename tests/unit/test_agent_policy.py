"""The agent's pure decisions: backoff, the monitor-loop decision, settings."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpjob_worker.agent.policy import (
    DEFAULT_GRACE_SECONDS,
    DEFAULT_JOIN_TIMEOUT,
    Action,
    WorkerStatus,
    backoff_delays,
    decide,
    next_delay,
    resolve_settings,
    split_endpoint,
)


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(0, 0.05), (1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (50, 0.5), (10**6, 0.5)],
)
def test_next_delay_doubles_up_to_the_cap(attempt: int, expected: float) -> None:
    assert next_delay(attempt) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attempt": -1}, "attempt must be >= 0"),
        ({"attempt": 0, "initial": 0}, "need initial > 0"),
        ({"attempt": 0, "factor": 0.5}, "factor >= 1"),
        ({"attempt": 0, "initial": 3, "cap": 2}, "cap >= initial"),
        ({"attempt": 0, "initial": 3}, "cap >= initial"),
    ],
)
def test_next_delay_rejects_bad_parameters(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        next_delay(**kwargs)  # type: ignore[arg-type]


@given(
    total=st.floats(min_value=0.0, max_value=600.0),
    initial=st.floats(min_value=0.01, max_value=1.0),
    factor=st.floats(min_value=1.0, max_value=4.0),
)
def test_backoff_schedule_fits_the_budget_and_never_shrinks(
    total: float, initial: float, factor: float
) -> None:
    delays = list(backoff_delays(total, initial=initial, factor=factor, cap=2.0))
    assert sum(delays) == pytest.approx(total, abs=1e-6)
    assert all(0 < d <= 2.0 for d in delays)
    # Non-decreasing, except the last one which is cut to fit.
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(delays[:-1]))


@pytest.mark.parametrize(
    ("status", "remaining", "waiting", "store_lost", "expected"),
    [
        (WorkerStatus.HEALTHY, 3, 0, False, Action.CONTINUE),
        (WorkerStatus.HEALTHY, 3, 1, False, Action.RESTART_FREE),
        (WorkerStatus.HEALTHY, 0, 2, False, Action.RESTART_FREE),
        (WorkerStatus.HEALTHY, 3, 0, True, Action.RESTART_FREE),
        (WorkerStatus.FAILED, 3, 0, False, Action.RESTART_CHARGED),
        (WorkerStatus.FAILED, 1, 5, False, Action.RESTART_CHARGED),
        (WorkerStatus.FAILED, 0, 0, False, Action.GIVE_UP),
        (WorkerStatus.FAILED, 0, 0, True, Action.RESTART_FREE),
        (WorkerStatus.SUCCEEDED, 0, 3, True, Action.FINISH),
    ],
)
def test_decide(
    status: WorkerStatus, remaining: int, waiting: int, store_lost: bool, expected: Action
) -> None:
    assert (
        decide(status, remaining_restarts=remaining, nodes_waiting=waiting, store_lost=store_lost)
        is expected
    )


@given(
    status=st.sampled_from(WorkerStatus),
    remaining=st.integers(min_value=0, max_value=10),
    waiting=st.integers(min_value=0, max_value=10),
    store_lost=st.booleans(),
)
def test_only_a_worker_failure_is_ever_charged(
    status: WorkerStatus, remaining: int, waiting: int, store_lost: bool
) -> None:
    action = decide(
        status, remaining_restarts=remaining, nodes_waiting=waiting, store_lost=store_lost
    )
    if action in {Action.RESTART_CHARGED, Action.GIVE_UP}:
        assert status is WorkerStatus.FAILED
        assert not store_lost
    if action is Action.RESTART_CHARGED:
        assert remaining > 0


@pytest.mark.parametrize(
    ("conf", "env", "grace_flag", "expected"),
    [
        ({}, {}, None, (None, DEFAULT_JOIN_TIMEOUT, DEFAULT_GRACE_SECONDS, None)),
        ({"is_host": "true", "join_timeout": "30"}, {}, None, (True, 30.0, 25.0, None)),
        ({}, {"DDPJOB_RDZV_HOST": "1"}, None, (True, 600.0, 25.0, None)),
        ({}, {"DDPJOB_RDZV_HOST": "0"}, None, (False, 600.0, 25.0, None)),
        # The conf is what torch acts on, so it wins over our env.
        ({"is_host": "false"}, {"DDPJOB_RDZV_HOST": "1"}, None, (False, 600.0, 25.0, None)),
        (
            {},
            {"DDPJOB_GRACE_SECONDS": "7", "DDPJOB_STATE_FILE": "/s.json"},
            None,
            (None, 600.0, 7.0, "/s.json"),
        ),
        ({}, {"DDPJOB_GRACE_SECONDS": "7"}, 3.0, (None, 600.0, 3.0, None)),
    ],
)
def test_resolve_settings(
    conf: dict[str, str],
    env: dict[str, str],
    grace_flag: float | None,
    expected: tuple[bool | None, float, float, str | None],
) -> None:
    settings = resolve_settings(conf, env, grace_flag=grace_flag)
    assert (
        settings.is_host,
        settings.join_timeout,
        settings.grace_seconds,
        settings.state_file,
    ) == expected


@pytest.mark.parametrize(
    ("conf", "env", "message"),
    [
        ({"is_host": "maybe"}, {}, "'maybe' is not a boolean"),
        ({"join_timeout": "soon"}, {}, "join_timeout='soon' is not a number"),
        ({}, {"DDPJOB_GRACE_SECONDS": "-1"}, "DDPJOB_GRACE_SECONDS='-1' must not be negative"),
        ({}, {"DDPJOB_STOP_SECONDS": "fast"}, "DDPJOB_STOP_SECONDS='fast' is not a number"),
        (
            {},
            {"DDPJOB_RESTART_STOP_SECONDS": "-3"},
            "DDPJOB_RESTART_STOP_SECONDS='-3' must not be negative",
        ),
    ],
)
def test_resolve_settings_names_the_bad_value(
    conf: dict[str, str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_settings(conf, env)


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("pod-0.svc:29400", ("pod-0.svc", 29400)),
        ("127.0.0.1:1234", ("127.0.0.1", 1234)),
        ("host", ("host", 29400)),
        ("[::1]:5", ("::1", 5)),
        ("[fe80::1]", ("fe80::1", 29400)),
        (" h:0 ", ("h", 0)),
    ],
)
def test_split_endpoint(endpoint: str, expected: tuple[str, int]) -> None:
    assert split_endpoint(endpoint) == expected


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("", "endpoint is empty"),
        ("h:x", "non-numeric port 'x'"),
        ("h:70000", "outside 0-65535"),
        ("[::1", "unclosed"),
    ],
)
def test_split_endpoint_errors(endpoint: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_endpoint(endpoint)


def test_the_stop_timeouts_are_configurable() -> None:
    assert (
        resolve_settings({}, {}).stop_seconds,
        resolve_settings({}, {}).restart_stop_seconds,
    ) == (
        0.25,
        3.0,
    )
    env = {"DDPJOB_STOP_SECONDS": "1.5", "DDPJOB_RESTART_STOP_SECONDS": "20"}
    settings = resolve_settings({}, env)
    assert (settings.stop_seconds, settings.restart_stop_seconds) == (1.5, 20.0)
