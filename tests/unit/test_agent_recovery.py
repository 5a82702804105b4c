"""The pure rules and the liveness socket behind fast recovery (issue 13)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ddpjob_worker import liveness
from ddpjob_worker.liveness import Liveness
from ddpjob_worker.policy import (
    Action,
    FailureReport,
    WorkerStatus,
    decide,
    round_is_full,
    settled,
)


def failed(remaining: int, collateral: bool | None) -> Action:
    return decide(
        WorkerStatus.FAILED,
        remaining_restarts=remaining,
        nodes_waiting=0,
        store_lost=False,
        collateral=collateral,
    )


def test_an_unsettled_failure_restarts_at_once_while_restarts_remain() -> None:
    assert failed(1, None) is Action.RESTART_SETTLE_LATER
    assert failed(0, None) is Action.SETTLE_FIRST  # giving up is final: settle first
    assert failed(0, True) is Action.RESTART_FREE
    assert failed(0, False) is Action.GIVE_UP
    assert failed(1, False) is Action.RESTART_CHARGED


def test_reports_settle_as_soon_as_an_earlier_one_or_all_of_them_are_in() -> None:
    ours = FailureReport(10.2, 1)
    assert settled([ours], node=1, nodes=3) is None  # could still go either way
    assert settled([ours, FailureReport(10.1, 0)], node=1, nodes=3) is True  # collateral
    everyone = [ours, FailureReport(10.3, 0), FailureReport(10.4, 2)]
    assert settled(everyone, node=1, nodes=3) is False  # ours is the root cause
    assert settled([], node=1, nodes=2) is False  # no report of ours: charge, as torch


def test_a_round_completes_early_only_when_every_expected_node_is_in() -> None:
    expected = frozenset({"a", "b"})
    assert round_is_full(["a", "b"], expected, waiting=0, min_nodes=2)
    assert round_is_full(["a", "b", "c"], expected, waiting=0, min_nodes=2)
    assert not round_is_full(["a"], expected, waiting=0, min_nodes=1)  # b is still coming
    assert not round_is_full(["a", "b"], expected, waiting=1, min_nodes=2)  # a node waits
    assert not round_is_full(["a", "b"], None, waiting=0, min_nodes=2)  # first round: torch
    assert not round_is_full(["a"], frozenset({"a"}), waiting=0, min_nodes=2)  # below min


def test_a_listening_agent_is_alive_and_a_closed_one_is_dead() -> None:
    listener = liveness.Listener("127.0.0.1")
    assert liveness.probe(listener.address) is Liveness.ALIVE
    listener.close()
    assert liveness.probe(listener.address) is Liveness.DEAD


def test_the_kernel_answers_for_a_listener_that_never_accepts() -> None:
    # A busy agent (or a machine with every core loaded) still completes the handshake from
    # the listen backlog: busy is never taken for dead.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        assert all(liveness.probe(address) is Liveness.ALIVE for _ in range(5))


def test_the_listener_of_a_killed_process_is_dead_at_once() -> None:
    code = (
        "import sys, time; from ddpjob_worker import liveness; "
        "l = liveness.Listener('127.0.0.1'); print(l.address, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        address = child.stdout.readline().strip()
        other = liveness.Listener("127.0.0.1")
        both = {"child": address, "other": other.address}
        assert liveness.probe_all(both) == {"child": Liveness.ALIVE, "other": Liveness.ALIVE}
        child.kill()
        child.wait(10)
        assert liveness.probe_all(both) == {"child": Liveness.DEAD, "other": Liveness.ALIVE}
        other.close()
    finally:
        child.kill()
        child.wait(10)


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:notaport", "[::1"])
def test_a_malformed_address_decides_nothing(address: str) -> None:
    assert liveness.probe(address, timeout=0.2) is Liveness.UNKNOWN


def test_no_answer_in_time_decides_nothing() -> None:
    # A handshake that is never answered looks like a lost machine, or like a packet filter that
    # drops the probe of a healthy peer: only the heartbeats can tell, so the probe says
    # unknown, not dead. A listener whose backlog is full drops new handshakes the same way.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(0)
        port = sock.getsockname()[1]
        held = [socket.socket() for _ in range(4)]
        try:
            for client in held:
                client.setblocking(False)
                client.connect_ex(("127.0.0.1", port))
            assert liveness.probe(f"127.0.0.1:{port}", timeout=0.3) is Liveness.UNKNOWN
        finally:
            for client in held:
                client.close()
