"""The operator's slow start for pod creations (ddpjob_operator.slowstart)."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from ddpjob_operator.slowstart import Call, slow_start


class Server:
    """Answers each call after ``delay`` seconds; refuses the names in ``refuse``. Records what
    was started, in order, and how many ran at once."""

    def __init__(self, delay: float = 0.001, refuse: frozenset[int] = frozenset()) -> None:
        self.delay = delay
        self.refuse = refuse
        self.started: list[int] = []
        self.in_flight = 0
        self.most = 0
        self.at_start: list[int] = []
        """How many were in flight when each call started (itself included)."""

    async def create(self, n: int) -> None:
        self.started.append(n)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        self.at_start.append(self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if n in self.refuse:
                raise RuntimeError(f"pod {n} refused")
        finally:
            self.in_flight -= 1


def calls(server: Server, count: int, done: list[int]) -> list[Call]:
    return [(server.create(n), lambda n=n: done.append(n)) for n in range(count)]  # type: ignore[misc]


def all_closed(made: list[Call]) -> bool:
    """Every coroutine ran to its end or was closed: none is left never awaited."""
    return all(inspect.getcoroutinestate(call) == inspect.CORO_CLOSED for call, _ in made)


def test_every_call_is_made_once_in_order_and_remembered() -> None:
    server, done = Server(), list[int]()
    errors, unstarted = asyncio.run(slow_start(calls(server, 300, done), limit=48))
    assert (errors, unstarted) == ([], 0)
    assert server.started == list(range(300))
    assert sorted(done) == list(range(300))


def test_the_window_starts_at_one_and_doubles_up_to_the_limit() -> None:
    server = Server(delay=0.01)
    asyncio.run(slow_start(calls(server, 400, []), limit=48))
    assert server.at_start[0] == 1
    assert server.at_start[1] == 1  # the second starts only once the first succeeded
    assert server.most == 48
    # One round trip: 1 in flight; then 2, 4, 8, ...: far fewer than 48 in the first 7 calls.
    assert max(server.at_start[:7]) <= 4


def test_a_refused_call_stops_new_ones_and_closes_those_not_started() -> None:
    server, done = Server(refuse=frozenset({0})), list[int]()
    made = calls(server, 1024, done)
    errors, unstarted = asyncio.run(slow_start(made, limit=48))
    assert [str(e) for e in errors] == ["pod 0 refused"]
    assert server.started == [0]  # a webhook that refuses every pod cost one request
    assert (unstarted, done) == (1023, [])
    assert all_closed(made)


def test_calls_in_flight_when_one_fails_still_finish() -> None:
    server, done = Server(refuse=frozenset({20})), list[int]()
    errors, unstarted = asyncio.run(slow_start(calls(server, 1024, done), limit=8))
    assert [str(e) for e in errors] == ["pod 20 refused"]
    started = set(server.started)
    assert started >= set(range(21)) and len(started) <= 21 + 8
    assert set(done) == started - {20}  # every started call but the refused one succeeded
    assert unstarted == 1024 - len(started)


def test_cancelling_the_caller_cancels_the_started_and_closes_the_rest() -> None:
    server = Server(delay=10.0)
    made = calls(server, 10, [])

    async def run() -> None:
        task = asyncio.ensure_future(slow_start(made, limit=4))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert server.started == [0] and server.in_flight == 0
    assert all_closed(made)


def test_a_first_window_of_16_takes_16_at_once_then_grows() -> None:
    server = Server(delay=0.01)
    asyncio.run(slow_start(calls(server, 400, []), limit=48, first=16))
    assert server.at_start[:16] == list(range(1, 17))
    assert max(server.at_start[:17]) == 16  # the 17th waits for a success
    assert server.most == 48


def test_a_refusal_with_a_first_window_costs_at_most_that_window() -> None:
    server = Server(refuse=frozenset(range(1024)))
    made = calls(server, 1024, [])
    errors, unstarted = asyncio.run(slow_start(made, limit=48, first=16))
    assert (len(errors), unstarted, server.started) == (16, 1008, list(range(16)))
    assert all_closed(made)


@pytest.mark.parametrize(("limit", "first"), [(0, 1), (4, 0), (4, 5)])
def test_windows_out_of_range_are_refused(limit: int, first: int) -> None:
    with pytest.raises(ValueError, match="need 1 <= first <= limit"):
        asyncio.run(slow_start([], limit=limit, first=first))
