"""Exit codes, root-cause charging, torch's stop decision, restart count, settings, torch bounds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpjob_worker import contract
from ddpjob_worker.agent import compat
from ddpjob_worker.agent.blame import (
    CAUSE_COMM,
    CAUSE_ERROR,
    CAUSE_UNKNOWN,
    FailureReport,
    failure_cause,
    format_report,
    is_root_cause,
    parse_reports,
    settled,
)
from ddpjob_worker.agent.policy import (
    Action,
    WorkerStatus,
    decide,
    exit_code_for_worker,
    resolve_settings,
    static_master,
)

# -- 11: exit codes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("worker", "agent"),
    [(-signal.SIGKILL, 137), (-signal.SIGTERM, 143), (-signal.SIGSEGV, 139), (1, 1), (3, 3)],
)
def test_the_agent_exits_with_its_first_failed_workers_code(worker: int, agent: int) -> None:
    assert exit_code_for_worker(worker) == agent


def test_a_script_failure_is_permanent_and_a_signal_death_is_retryable() -> None:
    assert not contract.is_retryable_exit(exit_code_for_worker(1))
    assert contract.is_retryable_exit(exit_code_for_worker(-signal.SIGKILL))


@given(st.integers(min_value=-64, max_value=300))
def test_worker_exit_codes_map_into_0_255_and_never_0(code: int) -> None:
    assert 1 <= exit_code_for_worker(code) <= 255


def test_the_infrastructure_code_is_retryable_and_no_signal_code() -> None:
    assert contract.is_retryable_exit(contract.EXIT_INFRA)
    assert contract.EXIT_INFRA > 128 + signal.SIGRTMAX
    assert contract.EXIT_INFRA != 255
    assert not contract.is_retryable_exit(contract.EXIT_USAGE)


# -- 12: root cause ----------------------------------------------------------------------------


def test_the_earliest_report_is_the_root_cause() -> None:
    reports = [FailureReport(10.5, 0), FailureReport(10.1, 1)]
    assert is_root_cause(reports, 1)
    assert not is_root_cause(reports, 0)


def test_reports_round_trip_and_torn_items_are_skipped() -> None:
    text = format_report(FailureReport(1.25, 3)) + format_report(FailureReport(2.5, 0)) + "9.0@"
    assert parse_reports(text) == [FailureReport(1.25, 3), FailureReport(2.5, 0)]


@given(
    st.lists(
        st.tuples(
            st.floats(0, 1e9),
            st.integers(0, 20),
            st.sampled_from([CAUSE_UNKNOWN, CAUSE_COMM]),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_exactly_one_reporting_node_is_the_root_cause(items: list[tuple[float, int, str]]) -> None:
    # Without a worker's own error: one node is charged, never one whose collective broke
    # under it while another said nothing.
    reports = [FailureReport(a, n, c) for n, (a, c) in {n: (a, c) for a, n, c in items}.items()]
    nodes = {r.node for r in reports}
    assert sum(is_root_cause(reports, n) for n in nodes) == 1
    (charged,) = [r for r in reports if is_root_cause(reports, r.node)]
    if any(r.cause == CAUSE_UNKNOWN for r in reports):
        assert charged.cause == CAUSE_UNKNOWN


def test_a_communication_error_is_charged_after_a_silent_failure_whatever_the_clocks() -> None:
    # Pod 0's collective broke under it and its worker exited first (pod 1 tore its process
    # group down, then spent a second in a CUDA teardown): pod 1 is charged, not pod 0.
    reports = [FailureReport(10.0, 0, CAUSE_COMM), FailureReport(11.0, 1, CAUSE_UNKNOWN)]
    assert not is_root_cause(reports, 0)
    assert is_root_cause(reports, 1)
    assert settled(reports[:1], node=0, nodes=2) is None  # pod 1 may still outrank it
    assert settled(reports, node=0, nodes=2) is True
    assert settled(reports, node=1, nodes=2) is False
    # Every rank that failed on its own error is charged (a bug hit on every rank), at once.
    errors = [FailureReport(10.0, 0, CAUSE_ERROR), FailureReport(10.5, 1, CAUSE_ERROR)]
    assert is_root_cause(errors, 0) and is_root_cause(errors, 1)
    assert settled(errors[1:], node=1, nodes=3) is False
    # Only communication errors: the earliest is charged, as before (the budget still ends a
    # job whose every round breaks).
    comms = [FailureReport(10.5, 0, CAUSE_COMM), FailureReport(10.1, 1, CAUSE_COMM)]
    assert [is_root_cause(comms, n) for n in (0, 1)] == [False, True]


def test_a_failures_cause_comes_from_its_workers_error_files() -> None:
    gloo = '{"message": {"message": "RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error'
    nccl = '{"message": "DistBackendError: NCCL communicator was aborted on rank 3."}'
    own = '{"message": {"message": "ValueError: bad shape"}}'
    assert failure_cause([gloo]) == CAUSE_COMM
    assert failure_cause([nccl, gloo]) == CAUSE_COMM
    assert failure_cause([None]) == CAUSE_UNKNOWN  # a signal, os._exit, no init_distributed()
    assert failure_cause([gloo, None]) == CAUSE_UNKNOWN
    assert failure_cause([gloo, own, None]) == CAUSE_ERROR
    assert failure_cause([]) == CAUSE_UNKNOWN


def test_reports_carry_their_cause_and_read_as_older_agents_wrote_them() -> None:
    reports = [
        FailureReport(1.25, 3, CAUSE_COMM),
        FailureReport(2.5, 0),
        FailureReport(3.0, 1, CAUSE_ERROR),
    ]
    text = "".join(map(format_report, reports))
    assert text == "1.250000@3@comm;2.500000@0;3.000000@1@error;"
    assert parse_reports(text) == reports
    assert parse_reports("4.0@2;") == [FailureReport(4.0, 2, CAUSE_UNKNOWN)]


def test_a_collateral_failure_restarts_for_free_even_with_no_budget() -> None:
    def action(collateral: bool) -> Action:
        return decide(
            WorkerStatus.FAILED,
            remaining_restarts=0,
            nodes_waiting=0,
            store_lost=False,
            collateral=collateral,
        )

    assert action(collateral=True) is Action.RESTART_FREE
    assert action(collateral=False) is Action.GIVE_UP


# -- 13: torch's stop decision -----------------------------------------------------------------


@pytest.mark.parametrize("store_lost", [False, True])
@pytest.mark.parametrize("collateral", [False, True])
def test_torchs_stop_decision_wins_over_the_budget(store_lost: bool, collateral: bool) -> None:
    action = decide(
        WorkerStatus.FAILED,
        remaining_restarts=3,
        nodes_waiting=1,
        store_lost=store_lost,
        collateral=collateral,
        restarts_disabled=True,
    )
    assert action is Action.GIVE_UP


# -- 15a: TORCHELASTIC_RESTART_COUNT -----------------------------------------------------------


# -- 15b/d/e: settings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "shutdown_flag", "grace"),
    [
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}, None, 7.0),
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}, 9.0, 9.0),
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7", "DDPJOB_GRACE_SECONDS": "2.5"}, 9.0, 2.5),
        ({}, None, 25.0),
    ],
)
def test_grace_period_sources(
    env: dict[str, str], shutdown_flag: float | None, grace: float
) -> None:
    settings = resolve_settings({}, env, shutdown_timeout_flag=shutdown_flag)
    assert settings.grace_seconds == grace


def test_the_store_read_timeout_is_ours_only() -> None:
    env = contract.agent_env(
        contract.AgentContract(
            job_name="j",
            run_id="r",
            pod_index=1,
            endpoint_host="j-0",
            port=29400,
            min_nodes=1,
            max_nodes=2,
            nproc_per_node=1,
            max_restarts=3,
            join_timeout=600,
            last_call_timeout=5,
            close_timeout=5,
            keep_alive_interval=1,
            keep_alive_max_attempt=3,
            grace_seconds=25,
        )
    )
    # Plain torchrun reads PET_RDZV_CONF, and uses read_timeout as its store *connect* timeout.
    assert "read_timeout" not in contract.parse_rdzv_conf(env[contract.PET_RDZV_CONF])
    settings = resolve_settings(contract.parse_rdzv_conf(env[contract.PET_RDZV_CONF]), env)
    assert settings.store_read_timeout == contract.STORE_READ_TIMEOUT
    assert settings.in_ddpjob_pod
    # The user's own read_timeout wins.
    assert resolve_settings({"read_timeout": "30"}, env).store_read_timeout is None
    assert not resolve_settings({}, {}).in_ddpjob_pod


def test_a_static_endpoint_needs_a_port() -> None:
    assert static_master("10.0.0.1:29500") == ("10.0.0.1", 29500)
    with pytest.raises(ValueError, match="static needs a port"):
        static_master("10.0.0.1")


# -- 16: torch bounds --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "tested"),
    [("2.13.0+cpu", True), ("2.13.1", True), ("2.12.1", False), ("2.14.0.dev1", False)],
)
def test_tested_torch_range(version: str, tested: bool) -> None:
    assert compat.is_tested(version) is tested
    may_run, message = compat.check_torch(version, {})
    assert may_run is tested
    if not tested:
        assert message is not None
        assert version in message
        assert compat.TESTED_TORCH in message
        assert compat.ALLOW_UNTESTED_TORCH in message


def test_an_untested_torch_may_run_when_allowed() -> None:
    may_run, message = compat.check_torch("2.99.0", {compat.ALLOW_UNTESTED_TORCH: "1"})
    assert may_run
    assert message is not None
    assert "Running anyway" in message


def _agent(args: list[str], prelude: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys\n{prelude}\nfrom ddpjob_worker.agent.cli import main\nmain(sys.argv[1:])\n"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "DDPJOB_"))}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=120,
        check=False,
    )


FAKE_TORCH = "import importlib.metadata as m\nm.version = lambda name: '2.12.0'"


def test_the_agent_refuses_an_untested_torch_with_exit_2() -> None:
    result = _agent(["--standalone", "train.py"], prelude=FAKE_TORCH)
    assert result.returncode == contract.EXIT_USAGE, result.stderr
    assert "torch 2.12.0 is installed" in result.stderr
    assert "DDPJOB_ALLOW_UNTESTED_TORCH=1" in result.stderr


def test_a_static_endpoint_without_a_port_is_a_usage_error() -> None:
    result = _agent(
        [
            "--nnodes=2",
            "--node-rank=0",
            "--rdzv-backend=static",
            "--rdzv-endpoint=127.0.0.1",
            "x.py",
        ]
    )
    assert result.returncode == contract.EXIT_USAGE, result.stderr
    assert "static needs a port" in result.stderr
