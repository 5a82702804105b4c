"""The membership protocol's wire format, and the process's event loop. Stdlib only.

Between a member and the hub (:mod:`ddpjob_worker.membership.hub`,
:mod:`ddpjob_worker.membership.member`) every message is one line of JSON, sealed with the job's key
(:mod:`ddpjob_worker.membership.seal`), on one TCP connection that lasts as long as the member does:
no connection per question, no state of every member rewritten. A line that is not sealed with the
job's key is dropped.

All hubs and members of a process share one asyncio loop on a daemon thread
(:func:`shared_loop`): one for a pod's agent, one for the hundreds of hollow agents a benchmark
process hosts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ddpjob_worker.membership.seal import Seal

logger = logging.getLogger("ddpjob_worker.membership.wire")
_T = TypeVar("_T")

MAX_LINE = 1 << 20
"""The longest message (a round's base for the successor chain, 1,024 members: ~60 KB)."""
Message = dict[str, Any]


class Wire:
    """Sealing and framing of the run's membership messages."""

    def __init__(self, seal: Seal, run_id: str) -> None:
        self._seal = seal
        self._name = f"ddpjob.{run_id}.hub"

    def encode(self, message: Message) -> bytes:
        text = json.dumps(message, separators=(",", ":"))
        return self._seal.value(self._name, text).encode() + b"\n"

    def decode(self, line: bytes) -> Message | None:
        """The message of one line, or None (not sealed with the job's key, or malformed)."""
        text = self._seal.open(self._name, line.decode(errors="replace").rstrip("\n"))
        if text is None:
            logger.warning("dropping a membership message not sealed with this job's key")
            return None
        try:
            message = json.loads(text)
        except ValueError:
            return None
        return message if isinstance(message, dict) and isinstance(message.get("t"), str) else None


_LOOP: list[asyncio.AbstractEventLoop] = []
_LOOP_LOCK = threading.Lock()


def shared_loop() -> asyncio.AbstractEventLoop:
    """The process's membership loop, started on first use on a daemon thread."""
    with _LOOP_LOCK:
        if not _LOOP:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=run, name="ddpjob-membership", daemon=True).start()
            ready.wait()
            _LOOP.append(loop)
        return _LOOP[0]


def run_on_loop(coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
    """Run ``coro`` on the shared loop from another thread and wait for its result."""
    future: concurrent.futures.Future[_T] = asyncio.run_coroutine_threadsafe(coro, shared_loop())
    return future.result(timeout)


def submit(coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
    """Start ``coro`` on the shared loop from another thread, without waiting."""
    return asyncio.run_coroutine_threadsafe(coro, shared_loop())
