"""The round being formed at the hub (:class:`ddpjob_worker.membership.forming.Forming`): one
agent per pod index, the expected survivors, the last call. Pure."""

from __future__ import annotations

import dataclasses

from ddpjob_worker.membership.forming import Admitted, Forming
from ddpjob_worker.membership.nodes import NodeIdent


@dataclasses.dataclass(frozen=True)
class Joiner:
    ident: NodeIdent
    index: int | None
    fresh: bool = False


A, B, C, D = (NodeIdent(name) for name in "abcd")
BASE = {A: 0, B: 1, C: 2}


def test_the_first_to_ask_keeps_its_index_unless_a_new_pod_asks() -> None:
    forming: Forming[Joiner] = Forming(BASE, None)
    assert forming.admit(Joiner(A, 0)) == (Admitted.ADDED, None)
    # another agent of index 0 that was in no round: a stale one, cut off earlier
    assert forming.admit(Joiner(D, 0)) == (Admitted.REPLACED, A)
    # a new pod of index 1 goes before the last round's holder, which asked first
    assert forming.admit(Joiner(B, 1)) == (Admitted.ADDED, None)
    assert forming.admit(Joiner(D, 1, fresh=True)) == (Admitted.ADDED, None)
    assert set(forming.joined) == {A, D}
    # the old holder asks again: the new pod keeps the index
    assert forming.admit(Joiner(B, 1)) == (Admitted.WAITS, None)


def test_a_round_of_the_expected_survivors_needs_no_last_call() -> None:
    forming: Forming[Joiner] = Forming(BASE, frozenset({A, B}))
    forming.admit(Joiner(A, 0))
    assert not forming.due(0.0, minimum=1, maximum=3, last_call=2.0)  # B is still missing
    forming.admit(Joiner(B, 1))
    assert forming.due(0.0, minimum=1, maximum=3, last_call=2.0)


def test_without_expected_members_the_last_call_decides() -> None:
    forming: Forming[Joiner] = Forming(BASE, None)
    forming.admit(Joiner(A, 0))
    assert not forming.due(10.0, minimum=2, maximum=3, last_call=2.0)  # below the minimum
    forming.admit(Joiner(B, 1))
    assert not forming.due(10.0, minimum=2, maximum=3, last_call=2.0)  # the call starts
    assert not forming.due(11.9, minimum=2, maximum=3, last_call=2.0)
    assert forming.due(12.0, minimum=2, maximum=3, last_call=2.0)
    forming.admit(Joiner(C, 2))
    full: Forming[Joiner] = Forming(BASE, None)
    for joiner in (Joiner(A, 0), Joiner(B, 1), Joiner(C, 2)):
        full.admit(joiner)
    assert full.due(0.0, minimum=2, maximum=3, last_call=2.0)  # full at the maximum


def test_members_dropped_from_the_round_are_no_longer_waited_for() -> None:
    forming: Forming[Joiner] = Forming(BASE, frozenset({A, B, C}))
    forming.admit(Joiner(A, 0))
    forming.admit(Joiner(B, 1))
    forming.drop({B, C})
    assert set(forming.joined) == {A}
    assert forming.expected == frozenset({A})
    assert forming.due(0.0, minimum=1, maximum=3, last_call=2.0)
    forming.unjoin(A)  # its connection closed: it asks again once back
    assert forming.joined == {}
    assert forming.admit(Joiner(A, 0)) == (Admitted.ADDED, None)
