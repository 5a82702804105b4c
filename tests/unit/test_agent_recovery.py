"""The pure rules and the liveness socket behind fast recovery (issue 13)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from ddpjob_worker.agent.blame import FailureReport, settled
from ddpjob_worker.agent.policy import Action, WorkerStatus, decide
from ddpjob_worker.membership import liveness
from ddpjob_worker.membership.failover import round_is_full
from ddpjob_worker.membership.liveness import Health
from tests.harness.agents import wait_until


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
    assert liveness.probe(listener.address) is Health.ALIVE
    listener.close()
    assert liveness.probe(listener.address) is Health.GONE


def test_the_kernel_answers_for_a_listener_that_never_accepts() -> None:
    # A busy agent (or a machine with every core loaded) still completes the handshake from
    # the listen backlog: busy is never taken for dead.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        assert all(liveness.probe(address) is Health.ALIVE for _ in range(5))


def test_the_listener_of_a_killed_process_is_dead_at_once() -> None:
    code = (
        "import sys, time; from ddpjob_worker.membership import liveness; "
        "l = liveness.Listener('127.0.0.1'); print(l.address, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        address = child.stdout.readline().strip()
        other = liveness.Listener("127.0.0.1")
        both = {"child": address, "other": other.address}
        assert liveness.probe_all(both) == {"child": Health.ALIVE, "other": Health.ALIVE}
        child.kill()
        child.wait(10)
        assert liveness.probe_all(both) == {"child": Health.GONE, "other": Health.ALIVE}
        other.close()
    finally:
        child.kill()
        child.wait(10)


@pytest.mark.parametrize("address", ["nonsense", "127.0.0.1:notaport", "[::1"])
def test_a_malformed_address_decides_nothing(address: str) -> None:
    assert liveness.probe(address, timeout=0.2) is Health.UNKNOWN


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
            assert liveness.probe(f"127.0.0.1:{port}", timeout=0.3) is Health.UNKNOWN
        finally:
            for client in held:
                client.close()


# -- a silent peer: the listener answers, a frozen process does not ----------------------------

LISTENER_CHILD = (
    "import sys, time; from ddpjob_worker.membership import liveness; "
    "l = liveness.Listener('127.0.0.1'); l.info = {'v': 1, 'who': 'child'}; "
    "print(l.address, flush=True); time.sleep(60)"
)


@contextlib.contextmanager
def listener_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A child process listening with :class:`liveness.Listener`, and its address; killed (even
    stopped: SIGKILL ends a stopped process) on the way out."""
    child = subprocess.Popen(
        [sys.executable, "-c", LISTENER_CHILD], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        address = child.stdout.readline().strip()
        assert address, "the child printed no address"
        yield child, address
    finally:
        child.kill()
        child.wait(10)


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped (the signal is delivered
    asynchronously: a thread woken by a connection may still answer it first)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = [
            (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            for task in Path(f"/proc/{pid}/task").iterdir()
        ]
        return all(state in {"T", "t"} for state in states)

    wait_until(f"pid {pid} stopped", stopped, 10, interval=0.01)


def test_asking_a_listener_gets_its_own_words() -> None:
    listener = liveness.Listener("127.0.0.1")
    try:
        assert liveness.ask(listener.address) == liveness.Answer(Health.ALIVE, {"v": 1})
        listener.info = {"v": 1, "round": 3}
        assert liveness.ask(listener.address).info == {"v": 1, "round": 3}
    finally:
        listener.close()


def test_asking_a_closed_listener_is_dead() -> None:
    listener = liveness.Listener("127.0.0.1")
    listener.close()
    assert liveness.ask(listener.address, timeout=0.5).health is Health.GONE


def test_a_listener_that_closes_without_a_word_is_alive() -> None:
    # An agent from before the answer line: accepted and closed is alive, as the probe says.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        answers: list[liveness.Answer] = []
        asking = threading.Thread(target=lambda: answers.append(liveness.ask(address, 5.0)))
        asking.start()
        conn, _ = sock.accept()
        conn.close()
        asking.join(10)
    assert answers == [liveness.Answer(Health.ALIVE)]


def test_a_frozen_process_is_silent_although_its_kernel_accepts() -> None:
    with listener_process() as (child, address):
        assert liveness.ask(address) == liveness.Answer(Health.ALIVE, {"v": 1, "who": "child"})
        stop(child.pid)
        started = time.monotonic()
        answer = liveness.ask(address, timeout=0.5)
        elapsed = time.monotonic() - started
        assert answer == liveness.Answer(Health.UNKNOWN)
        assert elapsed < 3.0, f"ask took {elapsed:.2f}s with a 0.5s timeout"
        # The point: a connect alone cannot tell, the frozen peer's kernel completes it.
        assert liveness.probe(address) is Health.ALIVE
        os.kill(child.pid, signal.SIGCONT)
        assert liveness.ask(address, timeout=5.0).health is Health.ALIVE


def test_the_watch_names_a_frozen_peer_silent_and_forgets_it_once_it_answers() -> None:
    live = liveness.Listener("127.0.0.1")
    with listener_process() as (child, address):
        watch = liveness.PeerWatch({"frozen": address, "live": live.address})
        try:
            wait_until("both peers answered", lambda: watch.answer("frozen") is not None, 5)
            assert watch.silent() == set()
            stop(child.pid)
            # The live one never: it is named alone.
            wait_until("the frozen peer named silent", lambda: watch.silent() == {"frozen"}, 10)
            assert watch.gone() == set(), "silent is not dead: its kernel still accepts"
            os.kill(child.pid, signal.SIGCONT)
            wait_until("the thawed peer un-named", lambda: not watch.silent(), 10)
            assert watch.answer("live") == {"v": 1}
            assert watch.answer("frozen") == {"v": 1, "who": "child"}
        finally:
            watch.close()
            live.close()


def test_the_watch_names_a_peer_that_refuses_at_once() -> None:
    live = liveness.Listener("127.0.0.1")
    with listener_process() as (child, address):
        watch = liveness.PeerWatch({"gone": address, "live": live.address})
        try:
            wait_until("both peers answered", lambda: watch.answer("gone") is not None, 5)
            child.kill()
            child.wait(10)
            # Refused is dead, not merely silent: nothing to wait the silence window for.
            wait_until("the killed peer named dead", lambda: watch.gone() == {"gone"}, 10)
            wait_until("the dead peer named silent", lambda: watch.silent() == {"gone"}, 10)
        finally:
            watch.close()
            live.close()


WATCHER_CHILD = """
import signal, sys, time
from ddpjob_worker.membership import liveness

watch = liveness.PeerWatch({"peer": sys.argv[1]})
def say(tag):  # one write per line: the SIGCONT handler may run between two of print's
    sys.stdout.write(f"{tag} {sorted(watch.silent())}\\n")
    sys.stdout.flush()

signal.signal(signal.SIGCONT, lambda *_: say("cont"))
while True:
    say("tick")
    time.sleep(0.05)
"""


def test_a_watch_that_was_frozen_itself_does_not_take_its_live_peers_for_silent() -> None:
    # The watching process is frozen for longer than the silence window while its peer answers
    # all along. It asked nobody meanwhile: once it runs again it must judge from then on, never
    # name the peer it could not ask (a pod waking from a stall would drop its live peers).
    peer = liveness.Listener("127.0.0.1")
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCHER_CHILD, peer.address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert watcher.stdout is not None
        lines: list[str] = []

        def read(stream: IO[str]) -> None:
            for line in stream:
                lines.append(line)

        threading.Thread(target=read, args=(watcher.stdout,), daemon=True).start()
        wait_until("the watcher asking", lambda: len(lines) >= 10, 15)
        stop(watcher.pid)
        time.sleep(liveness.SILENT_AFTER_SECONDS + 1.0)
        before = len(lines)
        os.kill(watcher.pid, signal.SIGCONT)
        wait_until("the watcher going on", lambda: len(lines) >= before + 10, 15)
        assert any("cont" in line for line in lines[before:]), lines[before:]
        named = [line for line in lines if "peer" in line]
        assert not named, f"a live peer named silent by a watcher that was frozen: {named}"
    finally:
        watcher.kill()
        watcher.wait(10)
        peer.close()


def test_an_agent_at_a_dead_members_address_and_pid_is_another_member() -> None:
    """A replacement pod that gets the deleted pod's address on the same node starts its agent
    at the same pid (the node's PID namespace starts pods in the same order): torch's node
    descriptor ``<addr>_<pid>_<local id>`` would take it for the member that left. The agent
    seeds its local ids with a random incarnation, and identities carry it."""
    from ddpjob_worker.membership.nodes import INCARNATION_SHIFT, NodeRepr, ident  # noqa: PLC0415

    old, new = (NodeRepr(f"10.0.0.2_11_{(i << INCARNATION_SHIFT) + 1}") for i in (5, 9))
    assert (ident(old), ident(new)) == ("10.0.0.2_11_5", "10.0.0.2_11_9")
    later = NodeRepr(f"10.0.0.2_11_{(5 << INCARNATION_SHIFT) + 7}")
    assert ident(later) == ident(old), "a later handler"
    plain = [ident(NodeRepr(name)) for name in ("10.0.0.2_11_0", "10.0.0.2_11_3")]
    assert plain == ["10.0.0.2_11", "10.0.0.2_11"], "plain torchrun"
    code = (
        "from torch.distributed.elastic.rendezvous.dynamic_rendezvous import "
        "DynamicRendezvousHandler as H\n"
        "from ddpjob_worker.membership.nodes import ident\n"
        "from ddpjob_worker.agent.rendezvous import seed_incarnation\n"
        "first = seed_incarnation()\n"
        "assert seed_incarnation() == first, 'seeded once'\n"
        "a, b = (H._node_desc_generator.generate('10.0.0.2') for _ in range(2))\n"
        "assert a != b and ident(repr(a)) == ident(repr(b)), (a, b)\n"
        "print(ident(repr(a)).rpartition('_')[2])\n"
    )
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        for _ in range(2)
    ]
    incarnations = [int(run.stdout) for run in runs]
    assert all(i > 0 for i in incarnations) and incarnations[0] != incarnations[1], incarnations


def test_a_starting_agent_asks_a_sample_of_the_pods_pod_0_among_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # ``ddpjob run`` (and the hollow bench) names one address per pod: every one of 256
    # agents asking all 256 made the first round of 256 take 25 s here. A sample is asked.
    import random  # noqa: PLC0415

    from ddpjob_worker.agent import launch  # noqa: PLC0415

    asked: list[set[str]] = []

    def ask_all(addresses: dict[str, str], timeout: float = 0.0) -> dict[str, liveness.Answer]:
        asked.append(set(addresses.values()))
        return {}

    monkeypatch.setattr(liveness, "ask_all", ask_all)
    peers = [f"127.0.0.1:{40000 + i}" for i in range(256)]
    launch._ask_peers(peers, rng=random.Random(1))
    launch._ask_peers(peers, rng=random.Random(2))
    assert [len(one) for one in asked] == [launch.ASK_PEERS] * 2
    assert all("127.0.0.1:40000" in one for one in asked), "pod 0 is always asked"
    assert asked[0] != asked[1], "the others are a random sample"
    asked.clear()
    launch._ask_peers(peers[:10])
    assert asked == [set(peers[:10])], "a small job asks everyone"
