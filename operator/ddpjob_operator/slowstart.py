"""Many creations, started slowly and then all at once: the Job and ReplicaSet controllers'
slow start, without their batches' barriers.

Kubernetes' controllers create a large number of pods in batches of 1, 2, 4, 8, ... and stop
at the first batch with a failure, so that a quota or a webhook that refuses every pod costs a
request or two rather than one per pod. :func:`slow_start` keeps that property and drops the
barrier between batches (where each batch waits for its slowest request): it starts ``first``
calls, and each call that succeeds lets one more start beside the next, so that the calls in
flight double with each round trip, up to ``limit``. Once a call fails, no new one starts;
those in flight finish, and the calls never started are closed unawaited (the caller's next
pass decides them again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

Call = tuple[Coroutine[Any, Any, Any], Callable[[], None]]
"""A coroutine to await, and what to do once it succeeded (say, record an expectation)."""


async def slow_start(
    calls: Sequence[Call], limit: int, first: int = 1
) -> tuple[list[BaseException], int]:
    """Await ``calls`` in order, at most ``limit`` at once, the window starting at ``first`` and
    growing by one with each success; stop starting new ones after the first failure.

    Returns the failures and how many calls were never started (closed)."""
    if not 1 <= first <= limit:
        raise ValueError(f"need 1 <= first <= limit, not first={first}, limit={limit}")
    errors: list[BaseException] = []
    window = first
    running: dict[asyncio.Task[Any], Callable[[], None]] = {}
    next_call = 0
    try:
        while next_call < len(calls) or running:
            while not errors and next_call < len(calls) and len(running) < window:
                call, remember = calls[next_call]
                running[asyncio.ensure_future(call)] = remember
                next_call += 1
            if not running:
                break
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                remember = running.pop(task)
                failure = task.exception()
                if failure is not None:
                    errors.append(failure)
                    continue
                remember()
                window = min(limit, window + 1)
    finally:
        for task in running:  # cancelled while awaiting: take the started ones down too
            task.cancel()
        for call, _ in calls[next_call:]:
            call.close()
    return errors, len(calls) - next_call
