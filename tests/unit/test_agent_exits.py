"""The exit clock times real child processes without reaping them."""

from __future__ import annotations

import subprocess
import sys
import time

from ddpjob_worker.agent.exits import ExitClock


def _sleeper(seconds: float, code: int = 0) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", f"import os, time; time.sleep({seconds}); os._exit({code})"]
    )


def _held(code: int) -> subprocess.Popen[bytes]:
    """A child that exits with ``code`` when its stdin is closed: the test says when."""
    return subprocess.Popen(
        [sys.executable, "-c", f"import os, sys; sys.stdin.read(); os._exit({code})"],
        stdin=subprocess.PIPE,
    )


def _wait_for(clock: ExitClock, pid: int, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        at = clock.exited_at(pid)
        if at is not None:
            return at
        time.sleep(0.01)
    raise AssertionError(f"no exit time for {pid}")


def test_exit_times_follow_the_order_processes_exit_in_not_the_order_they_are_polled() -> None:
    # The test orders the exits (not sleeps, which a loaded machine stretches): the early one is
    # let go, and the late one 0.3 s after the clock has recorded the early exit.
    clock = ExitClock()
    late, early = _held(code=3), _held(code=1)
    assert late.stdin is not None and early.stdin is not None
    started = time.time()
    clock.watch([late.pid, early.pid])
    assert clock.exited_at(early.pid) is None
    early.stdin.close()
    early_at = _wait_for(clock, early.pid)
    time.sleep(0.3)
    assert clock.exited_at(late.pid) is None
    late.stdin.close()
    late_at = _wait_for(clock, late.pid)
    # Polled afterwards, in the other order: the times are still those of the exits.
    assert late.wait() == 3
    assert early.wait() == 1  # left unreaped for Popen: the exit code is still there
    assert started < early_at < late_at
    assert late_at - early_at > 0.25
    assert clock.earliest([late.pid, early.pid]) == early_at
    assert clock.earliest([late.pid]) == late_at


def test_unknown_or_foreign_pids_have_no_exit_time() -> None:
    clock = ExitClock()
    clock.watch([1])  # not our child: waitid refuses it, nothing is recorded
    time.sleep(0.1)
    assert clock.exited_at(1) is None
    assert clock.earliest([1, 999_999_999]) is None
    assert clock.earliest([]) is None


def test_a_pid_watched_again_forgets_its_old_exit_time() -> None:
    clock = ExitClock()
    proc = _sleeper(0.0)
    clock.watch([proc.pid])
    _wait_for(clock, proc.pid)
    proc.wait()
    clock.watch([proc.pid])  # a new round that reuses the pid number: no stale time survives
    time.sleep(0.1)
    assert clock.exited_at(proc.pid) is None


_PEER = """
import os, socket, sys, time
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
if sys.argv[2] == "root":
    conn.recv(1)          # the go signal
    os._exit(1)           # the faulty worker dies; its socket closes with it
conn.sendall(b"r")        # ready
conn.recv(1)              # blocks like a collective, until the peer's socket closes
time.sleep(0.02)          # unwinding: far less than a torch worker takes
os._exit(134)
"""


def test_a_failure_caused_by_a_peers_exit_is_timed_after_it_every_time() -> None:
    # What root-cause charging rests on: a worker that fails because its peer's socket closed
    # exits after that peer, and the clock orders them so, however the two are polled.
    import socket  # noqa: PLC0415

    for _ in range(10):
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = str(server.getsockname()[1])
            root = subprocess.Popen([sys.executable, "-c", _PEER, port, "root"])
            root_conn, _ = server.accept()
            victim = subprocess.Popen([sys.executable, "-c", _PEER, port, "victim"])
            victim_conn, _ = server.accept()
            clock = ExitClock()
            clock.watch([victim.pid, root.pid])
            assert victim_conn.recv(1) == b"r"
            # Relay the root's end to the victim: when the root exits, the victim sees EOF.
            root_conn.sendall(b"g")
            assert root_conn.recv(1) == b""
            victim_conn.close()
            root_at, victim_at = _wait_for(clock, root.pid), _wait_for(clock, victim.pid)
            assert (root.wait(), victim.wait()) == (1, 134)
            root_conn.close()
            assert root_at < victim_at
