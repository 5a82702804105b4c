"""When the liveness probes may call a peer dead, and where the listener listens (review finding
10): only a refusal confirmed by a second one is dead, a lookup is bounded by the probe's
timeout, the listener binds its pod's own address, and its accept loop outlives errors."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ddpjob_worker.membership import liveness
from ddpjob_worker.membership.liveness import Health


@pytest.fixture
def closed_port() -> Iterator[tuple[socket.socket, int]]:
    """A port of 127.0.0.1 bound but not listening: connects to it are refused, and no other
    socket takes it while the test runs."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock, sock.getsockname()[1]
    sock.close()


class Connects:
    """Counts the connects of every socket made while installed; ``on_refused`` runs in the
    connecting thread after each refused one (the real connect, not a mock of it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tried: list[Any] = []
        self.refused = 0
        self.on_refused: Callable[[], None] = lambda: None
        connects = self

        class Counted(socket.socket):
            def connect(self, address: Any) -> None:
                connects.tried.append(address)
                try:
                    super().connect(address)
                except ConnectionRefusedError:
                    connects.refused += 1
                    connects.on_refused()
                    raise

        monkeypatch.setattr(socket, "socket", Counted)


def test_a_port_that_stays_closed_is_dead_after_a_second_refusal(
    closed_port: tuple[socket.socket, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, port = closed_port
    connects = Connects(monkeypatch)
    started = time.monotonic()
    assert liveness.probe(f"127.0.0.1:{port}") is Health.GONE
    assert connects.refused == 2
    assert time.monotonic() - started >= liveness.CONFIRM_AFTER_SECONDS
    assert liveness.ask(f"127.0.0.1:{port}").health is Health.GONE
    assert connects.refused == 4


def test_a_port_that_refuses_once_then_listens_is_alive(
    closed_port: tuple[socket.socket, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A REJECT rule that lasted a moment, a listener caught while it is made again: the first
    # connect is refused, the confirmation 0.1 s later is accepted.
    sock, port = closed_port
    connects = Connects(monkeypatch)

    def listen_50ms_later() -> None:
        if connects.refused == 1:
            time.sleep(0.05)
            sock.listen(8)

    connects.on_refused = listen_50ms_later
    assert liveness.probe(f"127.0.0.1:{port}") is Health.ALIVE
    assert connects.refused == 1
    assert len(connects.tried) == 2


def test_an_agent_that_refuses_once_then_answers_is_heard(
    closed_port: tuple[socket.socket, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, port = closed_port
    connects = Connects(monkeypatch)
    made: list[liveness.Listener] = []

    def answer_50ms_later() -> None:
        if connects.refused == 1:
            sock.close()  # never listened: the port is free again at once
            time.sleep(0.05)
            made.append(liveness.Listener("127.0.0.1", port))
            made[0].info = {"v": 1, "who": "back"}

    connects.on_refused = answer_50ms_later
    try:
        answer = liveness.ask(f"127.0.0.1:{port}")
        assert answer == liveness.Answer(Health.ALIVE, {"v": 1, "who": "back"})
    finally:
        for listener in made:
            listener.close()


@pytest.mark.parametrize(
    "code", [errno.EADDRNOTAVAIL, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED]
)
def test_only_a_refusal_says_the_peer_is_gone(code: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # EADDRNOTAVAIL and ENETUNREACH are the prober's own state; EHOSTUNREACH is a lapsed ARP
    # entry as well as a gone machine. None of them names anyone dead.
    attempts: list[Any] = []

    class Failing(socket.socket):
        def connect(self, address: Any) -> None:
            attempts.append(address)
            raise OSError(code, os.strerror(code))

    monkeypatch.setattr(socket, "socket", Failing)
    expected = Health.GONE if code == errno.ECONNREFUSED else Health.UNKNOWN
    assert liveness.probe("127.0.0.1:9", timeout=0.5) is expected
    assert liveness.ask("127.0.0.1:9", timeout=0.5).health is expected
    if code == errno.ECONNREFUSED:
        assert len(attempts) == 4  # each verdict confirmed once


def test_a_refusal_at_one_address_of_a_name_is_not_death(monkeypatch: pytest.MonkeyPatch) -> None:
    # A name with an IPv6 and an IPv4 address, the listener on the IPv4 one only: the IPv6
    # address refuses, the IPv4 one accepts.
    listener = liveness.Listener("127.0.0.1")
    port = int(listener.address.rpartition(":")[2])
    both = [
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
    ]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *_args, **_kwargs: both)
    try:
        assert liveness.probe(f"both.test:{port}") is Health.ALIVE
        assert liveness.ask(f"both.test:{port}").info == {"v": 1}
    finally:
        listener.close()


def test_a_lookup_that_hangs_decides_nothing_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def hanging(*_args: object, **_kwargs: object) -> list[Any]:
        time.sleep(5)
        raise socket.gaierror(socket.EAI_AGAIN, "resolver timed out")

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    verdicts: list[Callable[[], Health]] = [
        lambda: liveness.probe("slow-resolver.test:1234", timeout=0.5),
        lambda: liveness.ask("slow-resolver.test:1234", timeout=0.5).health,
    ]
    for verdict in verdicts:
        started = time.monotonic()
        assert verdict() is Health.UNKNOWN
        assert time.monotonic() - started < 1.5


def test_the_listener_binds_its_own_address_not_every_interface() -> None:
    # Pods that share a network namespace each have their own address: one's listener must not
    # answer at the other's address (or a gone pod's port is answered for by its neighbour).
    listener = liveness.Listener("127.0.0.2")
    listener.info = {"v": 1, "who": "127.0.0.2"}
    try:
        port = int(listener.address.rpartition(":")[2])
        assert listener.address == f"127.0.0.2:{port}"
        assert liveness.ask(f"127.0.0.2:{port}").info == {"v": 1, "who": "127.0.0.2"}
        assert liveness.ask(f"127.0.0.1:{port}").info != {"v": 1, "who": "127.0.0.2"}
    finally:
        listener.close()


def test_a_listener_at_a_name_binds_its_address_and_answers_there() -> None:
    listener = liveness.Listener("localhost")
    try:
        port = int(listener.address.rpartition(":")[2])
        assert listener.address == f"localhost:{port}"
        assert liveness.probe(listener.address) is Health.ALIVE
        assert liveness.ask(listener.address).info == {"v": 1}
    finally:
        listener.close()
    assert liveness.probe(listener.address) is Health.GONE


def test_an_address_not_of_this_machine_listens_everywhere_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A name that resolves to a service's virtual IP: binding it fails (EADDRNOTAVAIL), so the
    # listener takes every interface rather than none. 192.0.2.1 is TEST-NET-1, nobody's.
    with caplog.at_level(logging.WARNING, logger="ddpjob_worker.membership.liveness"):
        listener = liveness.Listener("192.0.2.1")
    try:
        port = int(listener.address.rpartition(":")[2])
        assert listener.address == f"192.0.2.1:{port}"
        assert "every interface" in caplog.text
        assert liveness.ask(f"127.0.0.1:{port}").info == {"v": 1}
        if socket.has_dualstack_ipv6():
            assert liveness.ask(f"[::1]:{port}").info == {"v": 1}
    finally:
        listener.close()
    with pytest.raises(OSError, match="not assign"):  # never every interface on a fixed port
        liveness.Listener("192.0.2.1", port)  # EADDRNOTAVAIL: Cannot assign requested address


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 here")
def test_an_ipv6_listener_is_published_in_brackets() -> None:
    try:
        listener = liveness.Listener("::1")
    except OSError:
        pytest.skip("::1 is not usable here")
    try:
        port = int(listener.address.rpartition(":")[2])
        assert listener.address == f"[::1]:{port}"
        assert liveness.ask(listener.address).info == {"v": 1}
    finally:
        listener.close()


def test_the_accept_loop_outlives_errors_from_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    # EMFILE (no descriptors left for a moment), ECONNABORTED (a peer that gave up in the
    # backlog): the listener keeps answering afterwards.
    failures = [errno.EMFILE, errno.ECONNABORTED, errno.ENOBUFS]
    failed = threading.Event()
    accept = socket.socket.accept

    def flaky(self: socket.socket) -> tuple[socket.socket, Any]:
        if threading.current_thread().name == "ddpjob-liveness" and failures:
            code = failures.pop(0)
            if not failures:
                failed.set()
            raise OSError(code, os.strerror(code))
        return accept(self)

    monkeypatch.setattr(socket.socket, "accept", flaky)
    listener = liveness.Listener("127.0.0.1")
    try:
        assert failed.wait(5)
        assert liveness.ask(listener.address, timeout=2.0).info == {"v": 1}
    finally:
        listener.close()


def test_many_unanswered_peers_cost_one_timeout() -> None:
    # Held handshakes of full backlogs (no answer, as from a dropped SYN): 40 of them, more than
    # the old cap of 32 threads, are judged within about one timeout, not two.
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        port = full.getsockname()[1]
        held = [socket.socket() for _ in range(4)]
        try:
            for client in held:
                client.setblocking(False)
                client.connect_ex(("127.0.0.1", port))
            addresses = {f"peer{i}": f"127.0.0.1:{port}" for i in range(40)}
            started = time.monotonic()
            answers = liveness.probe_all(addresses, timeout=1.0)
            took = time.monotonic() - started
        finally:
            for client in held:
                client.close()
    assert set(answers.values()) == {Health.UNKNOWN}
    assert took < 1.9


def test_the_listener_says_its_latest_info_and_encodes_it_once_per_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new store's host is asked by much of the job at once: its answer is encoded when
    the agent changes what it says, not once per question."""
    dumps = json.dumps
    encoded: list[object] = []

    def counting(obj: Any, **kwargs: Any) -> str:
        if threading.current_thread().name == "ddpjob-liveness":
            encoded.append(obj)
        return str(dumps(obj, **kwargs))

    monkeypatch.setattr(json, "dumps", counting)
    listener = liveness.Listener("127.0.0.1")
    try:
        listener.info = {"v": 1, "gen": 2}
        answers = [liveness.ask(listener.address, timeout=2.0).info for _ in range(5)]
        assert answers == [{"v": 1, "gen": 2}] * 5
        listener.info = {"v": 1, "gen": 3}
        assert liveness.ask(listener.address, timeout=2.0).info == {"v": 1, "gen": 3}
        assert encoded == [{"v": 1, "gen": 2}, {"v": 1, "gen": 3}]
    finally:
        listener.close()
