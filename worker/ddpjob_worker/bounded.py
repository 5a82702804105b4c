"""Calls that may never return, waited for a bounded time. Stdlib only.

torch's TCPStore client waits for a reply forever when its server stops answering without
closing the connection (a frozen or partitioned host: no reset ever comes), whatever its timeout
says. A store request the agent makes on its main thread (the monitor loop, a leave on SIGTERM)
therefore runs on a daemon thread of its own, and the agent waits for it only so long; a call
that never returns stays blocked on its thread, with its client, and is abandoned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ddpjob_worker.errors import StoreSilentError

_T = TypeVar("_T")


def call_bounded(
    call: Callable[[], _T],
    what: str,
    *,
    limit: float,
    give_up: Callable[[], bool] = lambda: False,
) -> _T:
    """``call()`` on a daemon thread, waited for at most ``limit`` seconds, or until
    ``give_up()`` says so (asked every 0.05 s). Raises :class:`StoreSilentError` then; the
    call's own exception otherwise. A call that never returns stays blocked on its thread."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"ddpjob-{what.replace(' ', '-')}", daemon=True).start()
    deadline = time.monotonic() + limit
    while not done.wait(0.05):
        if time.monotonic() >= deadline or give_up():
            raise StoreSilentError(f"could not {what}: the store did not answer")
    if "error" in box:
        raise box["error"]
    value: _T = box["value"]
    return value
