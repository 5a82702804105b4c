"""Who is charged for a round's failure (``ddpjob_worker.agent.blame``), against a store in memory:
the reports each agent writes, the wait with no restart left, a store whose host is gone.
No torch."""

from __future__ import annotations

import pytest

from ddpjob_worker.agent.blame import (
    CAUSE_COMM,
    CAUSE_ERROR,
    FAILURE_REPORTS_KEY,
    FAILURE_SETTLE_SECONDS,
    Blame,
    FailureReport,
    Verdict,
)
from ddpjob_worker.membership.seal import Seal
from tests.unit.memstore import MemStore

SEAL = Seal(b"the job's key")


class Clock:
    """A clock the wait reads and its sleeps move on."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += seconds


def blame(*, in_pod: bool = True) -> Blame:
    return Blame(SEAL, in_pod=in_pod)


def test_reports_are_read_back_sealed_and_anything_else_is_dropped() -> None:
    store = MemStore()
    assert blame().report(store, FailureReport(10.2, 1), hosting=False) == Verdict(None)
    assert blame().report(store, FailureReport(10.1, 0, CAUSE_COMM), hosting=True) == Verdict(None)
    store.append(FAILURE_REPORTS_KEY, "9.0@2@error;")  # not sealed: anyone who reaches the port
    assert blame().read(store) == [FailureReport(10.2, 1), FailureReport(10.1, 0, CAUSE_COMM)]
    assert Blame(Seal(b"another job"), in_pod=True).read(store) == []


@pytest.mark.parametrize(
    ("in_pod", "hosting", "expected"),
    [
        (True, False, Verdict(collateral=False, store_lost=True)),  # its host is gone: free
        (True, True, Verdict(collateral=False)),  # our own store failed: charged
        (False, False, Verdict(collateral=False)),  # plain torchrun: the giver-up closes it
    ],
)
def test_a_store_that_fails_while_we_report(in_pod: bool, hosting: bool, expected: Verdict) -> None:
    store = MemStore()
    store.down = True
    assert blame(in_pod=in_pod).report(store, FailureReport(1.0, 0), hosting=hosting) == expected


def wait(store: MemStore, node: int, nodes: int, *, gone: bool = False) -> tuple[Verdict, float]:
    clock = Clock()
    verdict = blame().wait_settled(
        store,
        node,
        nodes,
        hosting=False,
        member_gone=lambda: gone,
        clock=clock,
        sleep=clock.sleep,
    )
    return verdict, clock.slept


def reported(*reports: FailureReport) -> MemStore:
    store = MemStore()
    for report in reports:
        blame().report(store, report, hosting=False)
    return store


def test_with_no_restart_left_an_earlier_report_makes_ours_collateral_at_once() -> None:
    store = reported(FailureReport(10.2, 1), FailureReport(10.1, 0))
    assert wait(store, node=1, nodes=3) == (Verdict(collateral=True), 0.0)


def test_ours_is_the_root_cause_once_every_node_has_reported() -> None:
    store = reported(FailureReport(10.1, 1), FailureReport(10.2, 0), FailureReport(10.3, 2))
    assert wait(store, node=1, nodes=3) == (Verdict(collateral=False), 0.0)


def test_a_workers_own_error_is_charged_without_waiting() -> None:
    store = reported(FailureReport(10.5, 1, CAUSE_ERROR))
    assert wait(store, node=1, nodes=3) == (Verdict(collateral=False), 0.0)


def test_a_member_that_died_whole_never_reports_and_nobody_is_charged() -> None:
    store = reported(FailureReport(10.1, 1))
    verdict, slept = wait(store, node=1, nodes=2, gone=True)
    assert verdict == Verdict(collateral=True)
    assert FAILURE_SETTLE_SECONDS <= slept < FAILURE_SETTLE_SECONDS + 0.06  # one window


def test_the_window_ends_with_a_charge_when_nobody_is_gone() -> None:
    store = reported(FailureReport(10.1, 1))
    verdict, slept = wait(store, node=1, nodes=2, gone=False)
    assert verdict == Verdict(collateral=False)
    assert FAILURE_SETTLE_SECONDS <= slept < FAILURE_SETTLE_SECONDS + 0.06  # one window


def test_after_the_restart_only_the_root_cause_is_charged() -> None:
    store = reported(FailureReport(10.3, 0, CAUSE_COMM), FailureReport(10.4, 1))
    assert blame().is_root(store, 1, hosting=False)  # no word outranks a comm error
    assert not blame().is_root(store, 0, hosting=False)
    store.down = True
    assert not blame().is_root(store, 1, hosting=False), "its host is gone: a membership change"
    assert blame(in_pod=False).is_root(store, 1, hosting=False), "charged, as torch would"
