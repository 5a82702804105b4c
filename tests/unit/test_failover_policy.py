"""The pure rules of store failover: who hosts next, which store is newest, and the majority a
round needs (``ddpjob_worker.membership.failover``); and where the operator tells pods to find each other."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpjob_worker import contract
from ddpjob_worker.agent.policy import resolve_settings
from ddpjob_worker.membership.failover import StoreAnswer, best_store, has_quorum, successor
from ddpjob_worker.membership.nodes import NodeIdent


def ids(names: list[str] | set[str]) -> list[NodeIdent]:
    return [NodeIdent(name) for name in names]


def by_id(table: dict[str, int]) -> dict[NodeIdent, int | None]:
    return {NodeIdent(name): value for name, value in table.items()}


BASE = {"a_1": 0, "b_2": 1, "c_3": 2}
"""The last round: three agents (``addr_pid``) with their pod indexes."""


@pytest.mark.parametrize(
    ("joined", "gone", "expected"),
    [
        (["a_1", "b_2", "c_3"], [], True),
        (["b_2", "c_3"], [], True),  # pod 0 silent: 2 of 3
        (["c_3"], [], False),  # 1 of 3: maybe the cut-off side
        (["c_3"], ["a_1"], False),  # 1 of the 2 not known gone: a tie is not a majority
        (["c_3"], ["a_1", "b_2"], True),  # the others are dead or left
        (["b_2", "c_3"], ["a_1"], True),
        ([], ["a_1", "b_2", "c_3"], True),  # nobody is left to outvote
        (["a_1", "x_9"], [], False),  # a newcomer does not count for the base
    ],
)
def test_a_round_needs_a_strict_majority_of_the_last_round_not_known_gone(
    joined: list[str], gone: list[str], expected: bool
) -> None:
    indexes = by_id({"x_9": 7})
    assert has_quorum(ids(joined), by_id(BASE), ids(gone), indexes) is expected


def test_a_pod_replaced_under_its_index_counts_the_old_one_out() -> None:
    """The operator creates pod i again only once the old pod object is gone: the replacement
    joining proves the silent one will never train again."""
    base = by_id({"a_1": 0, "b_2": 1})
    assert not has_quorum(ids(["b_2"]), base, [], {})  # one of two: a tie
    assert has_quorum(ids(["b_2", "z_5"]), base, [], by_id({"z_5": 0}))  # pod 0's replacement
    assert not has_quorum(ids(["b_2", "z_5"]), base, [], by_id({"z_5": 4}))  # not a scale-up


def test_no_base_no_gate() -> None:
    assert has_quorum(ids(["a_1"]), {}, [], {})


@given(st.lists(st.booleans(), min_size=1, max_size=9), st.integers(min_value=0, max_value=8))
def test_two_disjoint_sides_never_both_have_a_majority(sides: list[bool], dead: int) -> None:
    """Any split of the base into two sides: at most one of them may complete a round."""
    base = by_id({f"n_{i}": i for i in range(len(sides))})
    gone = ids([f"n_{i}" for i in range(min(dead, len(sides) - 1))])
    left = [node for node, side in zip(base, sides, strict=True) if side and node not in gone]
    right = [node for node, side in zip(base, sides, strict=True) if not side and node not in gone]
    assert not (has_quorum(left, base, gone, {}) and has_quorum(right, base, gone, {}))


def test_the_successor_is_the_lowest_ranked_member_left() -> None:
    ranks = {NodeIdent(name): rank for name, rank in {"a_1": 0, "b_2": 1, "c_3": 2}.items()}
    assert successor(ranks, excluded=ids(["a_1"])) == "b_2"
    assert successor(ranks, excluded=ids(["a_1", "b_2"])) == "c_3"
    assert successor(ranks, excluded=set(ranks)) is None
    # Every survivor computes the same, whatever order it sees the members in.
    for order in itertools.permutations(ranks.items()):
        assert successor(dict(order), excluded=ids(["a_1"])) == "b_2"


def test_an_established_store_wins_then_the_newest_and_torn_answers_are_skipped() -> None:
    answers: list[dict[str, object]] = [
        {"run": "r", "gen": 1, "store": "10.0.0.1:29400", "established": True, "host_at": "h:1"},
        {"run": "r", "gen": 2, "store": "10.0.0.2:29400", "established": False},
        {"run": "other", "gen": 9, "store": "10.0.0.9:29400", "established": True},
        {"run": "r", "gen": "3", "store": "10.0.0.3:29400", "established": True},
        {"run": "r", "gen": True, "store": "10.0.0.4:29400", "established": True},
        {"run": "r", "gen": 5, "store": None, "established": True},
        {},
    ]
    # A forming store of a newer generation (a cut-off pod hosting on its own, the survivor of a
    # 2-pod job) yields to an established one: a majority stood behind that.
    assert best_store(answers, "r") == StoreAnswer(True, 1, "10.0.0.1:29400", "h:1")
    assert best_store(answers[1:], "r") == StoreAnswer(False, 2, "10.0.0.2:29400")
    assert best_store(answers[2:], "r") is None
    established: list[dict[str, object]] = [
        {"run": "r", "gen": 2, "store": "10.0.0.2:29400", "established": True},
        {"run": "r", "gen": 3, "store": "10.0.0.3:29400", "established": True},
    ]
    assert best_store(established, "r") == StoreAnswer(True, 3, "10.0.0.3:29400")


def test_failover_is_on_only_in_a_ddpjob_pod_that_knows_its_peers() -> None:
    pod = {contract.DDPJOB_POD_INDEX: "1", contract.DDPJOB_RDZV_PEERS: "job.ns.svc:29401"}
    assert resolve_settings({}, pod).failover
    assert resolve_settings({}, pod).peers == ("job.ns.svc:29401",)
    assert not resolve_settings({}, {contract.DDPJOB_POD_INDEX: "1"}).failover
    assert not resolve_settings({}, {contract.DDPJOB_RDZV_PEERS: "h:1"}).failover


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({contract.DDPJOB_DIRECTORY_PORT: "http"}, "DDPJOB_DIRECTORY_PORT='http' is not a port"),
        ({contract.DDPJOB_DIRECTORY_PORT: "70000"}, "is not a port"),
        ({contract.DDPJOB_RDZV_PEERS: "host"}, "needs a port"),
        ({contract.DDPJOB_POD_INDEX: "one"}, "DDPJOB_POD_INDEX='one' is not a number"),
    ],
)
def test_bad_failover_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_settings({}, env)
