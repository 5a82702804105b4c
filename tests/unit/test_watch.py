"""One monitor tick's look at the round (``ddpjob_worker.membership.watch``) and what an agent says of
itself (``ddpjob_worker.membership.advert``). No torch: the store's answers are what a fake ``read``
returns, the peers are real liveness sockets on 127.0.0.1."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpjob_worker.errors import StoreSilentError, StoreUnreachableError
from ddpjob_worker.membership import liveness
from ddpjob_worker.membership.advert import Advert
from ddpjob_worker.membership.failover import StoreView
from ddpjob_worker.membership.keys import (
    END_DROPPED,
    END_FAILURE,
    END_HANDOVER,
    END_JOIN,
    END_LEAVE,
)
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.nodes import NodeIdent, NodeRepr
from ddpjob_worker.membership.watch import Look, RoundView, RoundWatch, host_lost
from ddpjob_worker.state import Phase, StateWriter, read_state
from tests.harness.agents import wait_until

ME, PEER, HOST = (NodeRepr(f"10.0.0.{i}_{i}_0") for i in (1, 2, 3))


def view(host: NodeRepr | None = HOST) -> RoundView:
    return RoundView(
        me=NodeIdent("10.0.0.1_1"),
        base_id="1.1",
        ranks={},
        addresses={},
        base={},
        host=host,
        host_address=None,
    )


Drops = list[tuple[frozenset[NodeRepr], frozenset[NodeRepr]]]


def look(
    watch: RoundWatch,
    read_result: tuple[int, frozenset[str]] | Exception,
    *,
    hosting: bool = False,
    drops: Drops | None = None,
) -> Look:
    def read() -> tuple[int, frozenset[str]]:
        if isinstance(read_result, Exception):
            raise read_result
        return read_result

    def drop(silent: frozenset[NodeRepr], gone: frozenset[NodeRepr]) -> None:
        (drops if drops is not None else []).append((silent, gone))

    return watch.look(read, drop, hosting=hosting, limit=1.0)


@pytest.mark.parametrize(
    ("host", "silent", "gone", "hosting", "expected"),
    [
        (HOST, set(), {HOST}, False, Health.GONE),
        (HOST, {HOST}, set(), False, Health.SILENT),
        (HOST, {PEER}, {ME}, False, None),
        (HOST, {HOST}, {HOST}, True, None),  # our own store: we are its host
        (None, {HOST}, set(), False, None),  # the host never said which node it is
    ],
)
def test_the_store_is_lost_when_its_host_is(
    host: NodeRepr | None,
    silent: set[NodeRepr],
    gone: set[NodeRepr],
    hosting: bool,
    expected: Health | None,
) -> None:
    assert host_lost(host, silent, gone, hosting=hosting) == expected


@pytest.mark.parametrize(
    ("read", "expected"),
    [
        ((0, frozenset()), Look()),
        ((2, frozenset()), Look(waiting=2)),
        ((0, frozenset({END_JOIN})), Look(waiting=1, ends=frozenset({END_JOIN}))),
        ((0, frozenset({END_FAILURE})), Look(waiting=1, ends=frozenset({END_FAILURE}))),
        ((0, frozenset({END_DROPPED})), Look(waiting=1, ends=frozenset({END_DROPPED}))),
        (
            (0, frozenset({END_LEAVE, END_HANDOVER})),
            Look(host=Health.GONE, ends=frozenset({END_LEAVE, END_HANDOVER})),
        ),
        (StoreUnreachableError("connection reset"), Look(host=Health.UNKNOWN)),
    ],
)
def test_one_look_at_the_round(
    read: tuple[int, frozenset[str]] | Exception, expected: Look
) -> None:
    watch = RoundWatch()
    watch.view = view()
    assert look(watch, read) == expected


def test_a_peer_that_ends_the_round_breaks_it_a_joiner_does_not() -> None:
    assert Look(waiting=1, ends=frozenset({END_JOIN})).broken is False
    assert Look(waiting=1, ends=frozenset({END_JOIN, END_LEAVE})).broken is True
    assert Look(host=Health.SILENT).store_lost and not Look().store_lost


def test_as_the_stores_host_a_failed_look_ends_the_agent() -> None:
    watch = RoundWatch()
    watch.view = view(host=ME)
    with pytest.raises(StoreUnreachableError):
        look(watch, StoreUnreachableError("broken"), hosting=True)
    handover = look(watch, (0, frozenset({END_HANDOVER})), hosting=True)
    assert handover == Look(waiting=1, ends=frozenset({END_HANDOVER})), "not ours to take over"


def test_a_store_that_never_answers_is_given_up_after_the_limit() -> None:
    watch = RoundWatch()
    watch.view = view()
    stuck = threading.Event()

    def read() -> tuple[int, frozenset[str]]:
        stuck.wait(30)  # a frozen host: no reply, no reset
        return 0, frozenset()

    try:
        found = watch.look(read, lambda silent, gone: None, hosting=False, limit=0.3)
    finally:
        stuck.set()
    assert found == Look(host=Health.UNKNOWN), "not judged silent by the peer watch: unknown"
    with pytest.raises(StoreSilentError):
        watch.bounded(lambda: threading.Event().wait(30), "wait", hosting=False, limit=0.1)


@pytest.fixture
def listeners() -> Iterator[list[liveness.Listener]]:
    made: list[liveness.Listener] = []
    yield made
    for listener in made:
        listener.close()


def test_a_member_whose_agent_is_gone_is_dropped_from_the_round(
    listeners: list[liveness.Listener],
) -> None:
    listeners.extend([liveness.Listener("127.0.0.1"), liveness.Listener("127.0.0.1")])
    host, peer = listeners
    watch = RoundWatch()
    watch.start(view(), {HOST: host.address, PEER: peer.address})
    assert look(watch, (0, frozenset())) == Look()
    peer.close()  # its process is gone: refused twice
    drops: Drops = []
    found: list[Look] = []

    def dropped() -> bool:
        found.append(look(watch, (0, frozenset()), drops=drops))
        return bool(found[-1].dropped)

    wait_until("the gone member dropped", dropped, 10)
    assert found[-1] == Look(waiting=1, ends=frozenset({END_FAILURE}), dropped=frozenset({PEER}))
    assert drops == [(frozenset(), frozenset({PEER}))]
    assert watch.silent_seen == {NodeIdent("10.0.0.2_2")}
    watch.close()


def test_the_stores_host_gone_is_a_lost_store_without_asking_the_store(
    listeners: list[liveness.Listener],
) -> None:
    listeners.append(liveness.Listener("127.0.0.1"))
    watch = RoundWatch()
    watch.start(view(), {HOST: listeners[0].address})
    listeners[0].close()
    reads: list[int] = []

    def read() -> tuple[int, frozenset[str]]:
        reads.append(1)
        return 0, frozenset()

    found: list[Look] = []

    def lost() -> bool:
        found.append(watch.look(read, lambda silent, gone: None, hosting=False, limit=1.0))
        return found[-1].store_lost

    wait_until("the host found gone", lost, 10)
    assert found[-1] == Look(host=Health.GONE)
    assert len(reads) == len(found) - 1, "the store was not asked once its host was gone"
    watch.close()


def test_the_advert_says_which_store_we_use_and_where_we_are(
    tmp_path: Path, listeners: list[liveness.Listener]
) -> None:
    listeners.append(liveness.Listener("127.0.0.1"))
    state = StateWriter(str(tmp_path / "state.json"))
    advert = Advert(listeners[0], run_id="r", index=3, state=state)
    store = StoreView(gen=2, hosting=False, address="10.0.0.5:29400", rounds=1, host_at="h:9")
    advert.say(store)
    state.update(phase=Phase.RUNNING, world_size=4, rdzv_round=7)
    info = liveness.ask(listeners[0].address).info
    assert info == {
        "v": 1,
        "run": "r",
        "index": 3,
        "gen": 2,
        "store": "10.0.0.5:29400",
        "established": True,
        "host": False,
        "host_at": "h:9",
        "phase": "running",
        "world": 4,
        "round": 7,
    }
    advert.say(store, orphan=True)  # looking for a store: name none
    info = liveness.ask(listeners[0].address).info
    assert info is not None
    assert (info["store"], info["established"], info["host_at"]) == (None, False, None)
    assert read_state(tmp_path / "state.json").store_gen == 0
    advert.say(StoreView(gen=3, hosting=True, address="10.0.0.1:29400"))
    info = liveness.ask(listeners[0].address).info
    assert info is not None
    assert (info["host"], info["host_at"], info["established"]) == (True, advert.address, False)
    assert read_state(tmp_path / "state.json").store_host is True
