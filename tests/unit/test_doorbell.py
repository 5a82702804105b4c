"""The monitor loop's wait (:mod:`ddpjob_worker.agent.doorbell`): a ring is never lost, a worker's end
wakes it, and what cannot ring says so."""

from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace

from ddpjob_worker.agent.doorbell import Doorbell, ProcessWatch


def test_a_ring_before_the_wait_is_not_lost() -> None:
    bell = Doorbell()
    try:
        bell.ring()
        bell.ring()  # two rings, one wake: the wait drains them
        assert bell.wait(10.0) is True
        assert bell.wait(0.0) is False
    finally:
        bell.close()


def test_a_ring_from_another_thread_ends_the_wait() -> None:
    bell = Doorbell()
    try:
        timer = threading.Timer(0.05, bell.ring)
        timer.start()
        assert bell.wait(30.0) is True
        timer.join()
    finally:
        bell.close()


def test_nothing_comes_and_the_wait_times_out() -> None:
    bell = Doorbell()
    try:
        assert bell.wait(0.01) is False
    finally:
        bell.close()


def test_a_worker_that_ends_wakes_the_wait_and_one_reaped_cannot_be_watched() -> None:
    bell, watch = Doorbell(), ProcessWatch()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        fds = watch.fds([proc.pid])
        assert fds is not None and len(fds) == 1
        assert watch.fds([proc.pid]) == fds  # the same set: the same pidfds
        assert bell.wait(0.01, fds) is False  # it runs
        assert proc.stdin is not None
        proc.stdin.close()  # it ends
        assert bell.wait(30.0, fds) is True
        proc.wait()
        watch.close()
        assert watch.fds([proc.pid]) is None  # reaped: no pidfd, so the caller polls
    finally:
        proc.kill()
        proc.wait()
        watch.close()
        bell.close()


def test_the_agent_waits_only_on_workers_still_running() -> None:
    """A local rank that ended first (torch has polled it) must not ring every wait: its pidfd
    stays readable, and the loop would spin until the others end."""
    from ddpjob_worker.agent.elastic import DdpjobAgent  # noqa: PLC0415 (torch)

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    agent = SimpleNamespace(
        _pcontext=SimpleNamespace(
            subprocess_handlers={0: SimpleNamespace(proc=done), 1: SimpleNamespace(proc=running)}
        ),
        _worker_group=SimpleNamespace(spec=SimpleNamespace(local_world_size=2)),
        _exits=ProcessWatch(),
    )
    bell = Doorbell()
    try:
        fds = DdpjobAgent._worker_fds(agent)  # type: ignore[arg-type]
        assert fds is not None and len(fds) == 1
        assert bell.wait(0.05, fds) is False
        running.kill()
        assert bell.wait(30.0, fds) is True
        # Workers run as functions (no processes of ours): the loop must poll.
        agent._pcontext = SimpleNamespace(subprocess_handlers={})
        assert DdpjobAgent._worker_fds(agent) is None  # type: ignore[arg-type]
    finally:
        running.kill()
        running.wait()
        agent._exits.close()
        bell.close()
