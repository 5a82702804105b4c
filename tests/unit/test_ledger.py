"""The restart ledger (``ddpjob_worker.agent.ledger``): the refund rule, the budget, and what the
agent owes across rounds, as the monitor loop drives it. Pure: no torch, no store."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpjob_worker.agent.ledger import Budget, RestartLedger, is_membership_change


@pytest.mark.parametrize(
    ("previous", "new", "recovered", "refund"),
    [
        (None, 2, False, False),  # the first round: nothing to compare with
        (3, 2, False, True),  # a peer left: our failure was its doing
        (2, 2, False, False),  # same size: a worker really failed
        (2, 3, False, False),  # grew: not a loss
        (2, 2, True, True),  # the store host came back: a membership change
        (None, 2, True, True),
    ],
)
def test_refund_rule(previous: int | None, new: int, recovered: bool, refund: bool) -> None:
    assert (
        is_membership_change(previous_nodes=previous, new_nodes=new, store_recovered=recovered)
        is refund
    )


A, B, B2, C = "10.0.0.1_100_0", "10.0.0.2_200_0", "10.0.0.2_201_0", "10.0.0.3_300_0"


@pytest.mark.parametrize(
    ("previous", "new", "refund"),
    [
        ({A, B}, {A, B}, False),  # the same agents rejoined: a worker really failed
        ({A, B}, {A, B2}, True),  # B was replaced by a new agent within seconds: a peer was lost
        ({A, B}, {A}, True),  # B left
        ({A, B}, {A, B, C}, False),  # C joined, nobody left: the charge stands
        ({A, B, C}, {A, B2}, True),
    ],
)
def test_refund_rule_by_members(previous: set[str], new: set[str], refund: bool) -> None:
    # Members decide when both rounds are known, whatever the node counts say.
    assert (
        is_membership_change(
            previous_nodes=len(previous),
            new_nodes=len(new),
            store_recovered=False,
            previous_members=frozenset(previous),
            new_members=frozenset(new),
        )
        is refund
    )


def test_unknown_members_fall_back_to_counts() -> None:
    assert is_membership_change(
        previous_nodes=2, new_nodes=1, store_recovered=False, previous_members=frozenset({A, B})
    )
    assert not is_membership_change(
        previous_nodes=2, new_nodes=2, store_recovered=False, new_members=frozenset({A, B2})
    )


def test_budget_charge_refund_and_free() -> None:
    budget = Budget(max_restarts=2)
    budget = budget.charge().charge()
    assert (budget.restart_count, budget.remaining) == (2, 0)
    with pytest.raises(ValueError, match="no restarts left of 2"):
        budget.charge()
    budget = budget.refund().free_restart()
    assert (budget.restart_count, budget.remaining, budget.membership_restarts) == (1, 1, 2)
    with pytest.raises(ValueError, match="nothing to refund"):
        Budget(max_restarts=1).refund()


@given(st.lists(st.sampled_from(["charge", "refund", "free"]), max_size=40))
def test_budget_never_goes_negative(ops: list[str]) -> None:
    budget = Budget(max_restarts=3)
    for op in ops:
        if op == "charge" and budget.remaining > 0:
            budget = budget.charge()
        elif op == "refund" and budget.restart_count > 0:
            budget = budget.refund()
        elif op == "free":
            budget = budget.free_restart()
        assert 0 <= budget.restart_count <= 3
        assert budget.remaining == 3 - budget.restart_count


def test_restart_count_counts_refunded_and_free_restarts_after_failures() -> None:
    budget = Budget(max_restarts=1).charge().refund().free_restart(after_failure=True)
    assert budget.restart_count == 0
    assert budget.remaining == 1
    assert budget.torchrun_restart_count == 2
    assert Budget(1).free_restart().torchrun_restart_count == 0  # scale-up: torchrun neither


M1 = frozenset({A, B, C})
M2 = frozenset({A, B})


def test_a_charge_is_refunded_when_the_next_round_misses_a_member() -> None:
    ledger = RestartLedger(3)
    assert not ledger.round_formed(3, M1, recovered=False)  # the first round
    ledger.charge()
    assert ledger.remaining == 2
    assert ledger.round_formed(2, M2, recovered=False)  # C died: our failure was its doing
    assert (ledger.remaining, ledger.budget.membership_restarts, ledger.rounds) == (3, 1, 2)


def test_a_charge_stands_when_the_same_members_come_back() -> None:
    ledger = RestartLedger(3)
    ledger.round_formed(2, M2, recovered=False)
    ledger.charge()
    assert not ledger.round_formed(2, M2, recovered=False)
    assert ledger.remaining == 2
    # Only the last charge is refundable: a later round without C refunds nothing more.
    assert not ledger.round_formed(1, frozenset({A}), recovered=False)
    assert ledger.remaining == 2


def test_a_hubs_word_on_departures_decides_over_node_counts() -> None:
    # A hub's round says whether a member departed, not who the members are: a pod killed and
    # replaced at once gives a round of the same size, which is still a membership change.
    ledger = RestartLedger(3)
    ledger.round_formed(2, None, recovered=False)
    ledger.charge()
    assert ledger.round_formed(2, None, recovered=False, departed=True)
    assert ledger.remaining == 3
    ledger.charge()
    assert not ledger.round_formed(2, None, recovered=False, departed=False)
    assert ledger.remaining == 2


def test_a_store_recovery_refunds_the_charge() -> None:
    ledger = RestartLedger(1)
    ledger.round_formed(2, M2, recovered=False)
    ledger.charge()
    assert ledger.remaining == 0
    assert ledger.round_formed(2, M2, recovered=True)
    assert ledger.remaining == 1


@pytest.mark.parametrize(
    ("root", "remaining", "expected"),
    [
        (True, 2, (1, 1, 0)),  # our failure: charged
        (False, 2, (2, 0, 1)),  # collateral: free, but counted as torchrun counts
        (True, 0, (0, 0, 1)),  # root cause with nothing left: free (we already restarted)
    ],
)
def test_a_deferred_failure_is_settled_once_the_next_round_formed(
    root: bool, remaining: int, expected: tuple[int, int, int]
) -> None:
    ledger = RestartLedger(2)
    for _ in range(2 - remaining):
        ledger.charge()
    ledger.round_formed(2, M2, recovered=False)  # the charges above stand
    before = ledger.budget
    ledger.settle(root=root)
    after = ledger.budget
    assert (
        after.remaining,
        after.charged - before.charged,
        after.free_after_failure - before.free_after_failure,
    ) == expected


def test_a_settled_charge_is_still_refunded_by_the_round_it_is_settled_in() -> None:
    """The agent settles a deferred failure right before it records the new round: a member
    missing from that round refunds it."""
    ledger = RestartLedger(2)
    ledger.round_formed(3, M1, recovered=False)
    ledger.settle(root=True)
    assert ledger.remaining == 1
    assert ledger.round_formed(2, M2, recovered=False)
    assert ledger.remaining == 2


def test_torchs_counter_reads_as_torchrun_counts_and_its_own_lowering_disables_restarts() -> None:
    ledger = RestartLedger(3)
    assert ledger.torch_counter() == 3
    ledger.check_torch(3)
    assert not ledger.disabled
    ledger.free(after_failure=True)  # collateral: TORCHELASTIC_RESTART_COUNT counts it
    ledger.free(after_failure=False)  # a node joined: it does not
    assert ledger.torch_counter() == 2
    ledger.check_torch(2)
    assert not ledger.disabled
    ledger.check_torch(1)  # torch's watchdog lowered it itself
    assert ledger.disabled
    assert ledger.torch_counter() == 0


def test_the_counter_may_go_below_zero_as_restarts_pile_up() -> None:
    ledger = RestartLedger(1)
    for _ in range(3):
        ledger.free(after_failure=True)
    assert ledger.torch_counter() == -2
    assert ledger.remaining == 1
