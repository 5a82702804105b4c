"""The agent's worker processes beyond what torch does with them: starting them from warm
spares, letting a checkpoint being written finish before a stop, waiting for stopped ones to be
gone, and reaping what they orphan when the agent is PID 1.

Each is handed what it works on (the processes, the pool); none holds agent state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.distributed.elastic.multiprocessing import api as torch_mp_api
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from ddpjob_worker.agent import orphans, warm
from ddpjob_worker.saving import marker as saving_marker

logger = logging.getLogger("ddpjob_worker.agent.workers")

REAP_EVERY_SECONDS = 1.0
"""How often an agent that runs as PID 1 reaps orphaned zombies."""


class _WarmHandler(SubprocessHandler):
    """torch's handler for one worker process, started from a warm spare when one fits."""

    def __init__(self, pool: warm.WarmPool, **kwargs: Any) -> None:
        self._pool = pool
        super().__init__(**kwargs)

    def _popen(self, args: tuple[str, ...], env: dict[str, str]) -> subprocess.Popen[bytes]:
        redirected = self._stdout is not None or self._stderr is not None
        proc = self._pool.take(args, env, redirected=redirected)
        if proc is not None:
            logger.info("local rank %d: started warm (pid %d)", self.local_rank_id, proc.pid)
            return proc
        return super()._popen(args, env)


@contextlib.contextmanager
def warm_handlers(pool: warm.WarmPool | None) -> Iterator[None]:
    """While torch starts a worker group, make its process context build :class:`_WarmHandler`
    (torch looks ``get_subprocess_handler`` up in its ``api`` module at that moment)."""
    if pool is None:
        yield
        return
    original = getattr(torch_mp_api, "get_subprocess_handler")  # noqa: B009 - not re-exported

    def make(**kwargs: Any) -> SubprocessHandler:
        return _WarmHandler(pool, **kwargs)

    setattr(torch_mp_api, "get_subprocess_handler", make)  # noqa: B010 - a scoped swap
    try:
        yield
    finally:
        setattr(torch_mp_api, "get_subprocess_handler", original)  # noqa: B010


def processes(pcontext: Any) -> list[subprocess.Popen[bytes]]:
    """The worker processes of torch's process context (its ``SubprocessContext``; none for
    function entrypoints, which torch runs in a multiprocessing context)."""
    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    return [handler.proc for handler in handlers.values()]


def _saving(procs: Iterable[subprocess.Popen[bytes]]) -> list[int]:
    """The pids of ``procs`` that say they are saving (``ddpjob_worker.saving``'s marker)."""
    return [
        proc.pid
        for proc in procs
        if (path := saving_marker(proc.pid)) is not None and path.exists()
    ]


def wait_saves(procs: Iterable[subprocess.Popen[bytes]], limit: float) -> None:
    """Before stopping workers, let those writing a checkpoint (inside
    ``ddpjob_worker.saving()``) finish it, for up to ``limit`` seconds."""
    procs = list(procs)
    deadline = time.monotonic() + limit
    told = False
    while True:
        busy = _saving(proc for proc in procs if proc.poll() is None)
        if not busy:
            return
        if time.monotonic() >= deadline:
            logger.warning(
                "worker pid %s still saving a checkpoint after %gs: stopping it anyway",
                ", ".join(map(str, busy)),
                limit,
            )
            return
        if not told:
            told = True
            logger.info(
                "worker pid %s is saving a checkpoint: letting it finish (up to %gs) "
                "before stopping it",
                ", ".join(map(str, busy)),
                limit,
            )
        time.sleep(0.05)


def terminate(procs: Iterable[subprocess.Popen[bytes]], limit: float, grace: float) -> None:
    """SIGTERM the workers (their process groups, as torch does), then wait up to ``limit``
    seconds for them to exit; a worker that says it is saving (it writes its committed step
    at the stop: :mod:`ddpjob_worker.train.onstop`) is waited for up to ``grace`` seconds, and
    given ``limit`` more to exit once it is done. The caller kills what is left (torch's
    shutdown)."""
    procs = [proc for proc in procs if proc.poll() is None]
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    started = time.monotonic()
    deadline = started + limit
    told = False
    while procs:
        procs = [proc for proc in procs if proc.poll() is None]
        busy = _saving(procs)
        now = time.monotonic()
        if busy:
            deadline = max(deadline, now + limit)
        if not procs or now >= deadline:
            return
        if now - started >= grace:
            logger.warning(
                "worker pid %s still writing its state %gs after SIGTERM: stopping it anyway",
                ", ".join(map(str, busy)),
                grace,
            )
            return
        if busy and not told:
            told = True
            logger.info(
                "worker pid %s is writing its state at the stop: letting it finish (up to %gs)",
                ", ".join(map(str, busy)),
                grace,
            )
        time.sleep(0.01)


def wait_gone(procs: Iterable[subprocess.Popen[bytes]], limit: float) -> None:
    """Wait up to ``limit`` seconds for stopped workers to be gone (torch gives up on them
    after the short stop timeout, while a GPU process may still hold its device)."""
    alive = [proc for proc in procs if proc.poll() is None]
    if not alive:
        return
    logger.warning(
        "waiting up to %gs for %d stopped worker(s) to exit (pid %s) before new ones start",
        limit,
        len(alive),
        ", ".join(str(proc.pid) for proc in alive),
    )
    deadline = time.monotonic() + limit
    for proc in alive:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.error(
                "worker pid %d has not exited %gs after its SIGKILL (stuck in the kernel or "
                "a device driver?): starting the next workers anyway",
                proc.pid,
                limit,
            )


class Reaper:
    """As PID 1 (a container with no init), once a second: reap the zombies of processes the
    workers left behind (:mod:`ddpjob_worker.agent.orphans`), never a process someone waits for."""

    def __init__(self, known: Callable[[], set[int]]) -> None:
        self._known = known
        self._next = 0.0

    def tick(self) -> None:
        if os.getpid() != 1 or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + REAP_EVERY_SECONDS
        reaped = orphans.reap(self._known())
        if reaped:
            logger.debug("reaped %d orphaned process(es): %s", len(reaped), reaped)


def entrypoint_name(entrypoint: Callable[..., Any] | str, args: list[str]) -> str:
    """What the workers run, for messages: the script (``python script.py``), the program, or
    the function's name."""
    if callable(entrypoint):
        return getattr(entrypoint, "__name__", "entrypoint")
    if entrypoint == sys.executable:
        return next((arg for arg in args if not arg.startswith("-")), "")
    return entrypoint
