"""Store failover and fencing as pure decisions (``ddpjob_worker.membership.failover``). No torch, no
sockets: peers' answers are what a fake ``ask`` returns. The hub applies the majority rule to
the members in its memory (``tests/unit/test_hub.py`` runs one).

The cases the agent must get right: the majority with members known gone, who hosts next, a
host that wakes after the others moved on and steps down, a newer generation found while
waiting, a newcomer choosing its store, and two sides of a partition never both completing a
round.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpjob_worker.membership import failover
from ddpjob_worker.membership.failover import (
    Ask,
    Host,
    Join,
    Nobody,
    Start,
    StoreAnswer,
    StoreView,
    begin,
    first_store,
    has_quorum,
    heard,
    newer_store,
    next_step,
    succeed,
)
from ddpjob_worker.membership.liveness import SILENT_AFTER_SECONDS, Answer, Health
from ddpjob_worker.membership.nodes import NodeIdent

RUN = "run-1"
A, B, C, D = (NodeIdent(f"10.0.0.{i}_{i}") for i in range(1, 5))
RANKS = {A: 0, B: 1, C: 2, D: 3}
"""The last round: four agents; A hosted the store."""


def quorum(
    joined: list[NodeIdent],
    base: Mapping[NodeIdent, int | None],
    gone: tuple[NodeIdent, ...] = (),
    indexes: Mapping[NodeIdent, int | None] | None = None,
) -> bool:
    """The hub's rule for completing a round (``has_quorum``), as it applies it: the joined
    members' pod indexes are what they said in their hello."""
    return has_quorum(joined, base, gone, {**{n: base.get(n) for n in joined}, **(indexes or {})})


# -- the majority ---------------------------------------------------------------------------


def test_a_round_needs_a_majority_of_the_members_not_known_gone() -> None:
    assert not quorum([B, C], RANKS), "2 of 4 is a tie: maybe the other half trains"
    assert quorum([B, C, D], RANKS)
    assert quorum([B, C], RANKS, gone=(A,)), "the old host refused: 2 of the 3 left"
    assert not quorum([C], RANKS, gone=(A,))


def test_a_pod_replaced_under_its_index_counts_its_predecessor_out() -> None:
    """The operator makes pod i again only once the old pod object is gone."""
    base = {A: 0, B: 1}
    assert not quorum([B], base), "one of two: a tie"
    newcomer = NodeIdent("10.0.0.9_9")
    assert quorum([B, newcomer], base, indexes={newcomer: 0}), "A is out: B is all that is left"
    scaled = NodeIdent("10.0.0.8_8")
    assert not quorum([B, scaled], base, indexes={scaled: 5}), "a scale-up is not"


def test_no_base_no_gate() -> None:
    assert quorum([D], {})


@st.composite
def partitions(
    draw: st.DrawFn,
) -> tuple[dict[NodeIdent, int], set[NodeIdent], set[NodeIdent], set[NodeIdent], set[NodeIdent]]:
    """A base of 1-9 members split into two live sides and the dead; each side knows some of
    the dead as gone (by a refusal, or a replacement pod with its index), never a live one."""
    size = draw(st.integers(min_value=1, max_value=9))
    base = {NodeIdent(f"n_{i}"): i for i in range(size)}
    fate = draw(st.lists(st.sampled_from("LRD"), min_size=size, max_size=size))
    left = {n for n, f in zip(base, fate, strict=True) if f == "L"}
    right = {n for n, f in zip(base, fate, strict=True) if f == "R"}
    dead = {n for n, f in zip(base, fate, strict=True) if f == "D"}
    known_left = draw(st.sets(st.sampled_from(sorted(dead)))) if dead else set()
    known_right = draw(st.sets(st.sampled_from(sorted(dead)))) if dead else set()
    return base, left, right, known_left, known_right


def side(
    base: dict[NodeIdent, int], members: set[NodeIdent], known: set[NodeIdent], replaced: bool
) -> bool:
    """Whether one side of a partition may complete a round on its own hub: the hub confirmed
    what this side knows gone; ``replaced``: the dead this side knows of were replaced by pods
    with their index, which joined this side."""
    joined = list(members)
    indexes: dict[NodeIdent, int | None] = {}
    for i, gone in enumerate(sorted(known) if replaced else []):
        newcomer = NodeIdent(f"r_{i}")
        indexes[newcomer] = base[gone]
        joined.append(newcomer)
    return quorum(joined, base, gone=() if replaced else tuple(sorted(known)), indexes=indexes)


@given(partitions(), st.booleans(), st.booleans())
def test_two_sides_of_a_partition_never_both_complete_a_round(
    split: tuple[Any, ...], replaced_left: bool, replaced_right: bool
) -> None:
    """Each side judges with its own view of who is gone (a refusal it saw, a replacement that
    joined it): asymmetric views of the dead never give both a majority. A side is the live
    members of the last round on it (a round has at least one member); a replaced member's
    process is dead (the operator makes pod i again only once the old pod object is gone), and
    the operator makes one pod per index, so a dead member's replacement joins one side."""
    base, left, right, known_left, known_right = split
    if replaced_left and replaced_right:
        known_right = known_right - known_left
    if not (left or (replaced_left and known_left)) or not (
        right or (replaced_right and known_right)
    ):
        return
    assert not (
        side(base, left, known_left, replaced_left)
        and side(base, right, known_right, replaced_right)
    )


# -- who hosts next -------------------------------------------------------------------------


def answer(health: Health, **info: Any) -> Answer:
    return Answer(health, {"v": 1, "run": RUN, **info} if info else None)


def test_the_lowest_ranked_survivor_hosts_and_the_others_ask_it() -> None:
    for me, expected in ((B, Host), (C, Ask), (D, Ask)):
        step = next_step(begin(RANKS, me, 1, host=A, host_health=Health.SILENT))
        assert isinstance(step, expected)
        if isinstance(step, Ask):
            assert step.node == B


def test_a_successor_that_refuses_is_gone_and_the_next_one_hosts() -> None:
    succession = begin(RANKS, C, 1, host=A, host_health=Health.GONE)
    assert succession.confirmed == {A}
    after = heard(succession, B, answer(Health.GONE), now=0.0, run_id=RUN)
    assert isinstance(after, failover.Succession)
    step = next_step(after)
    assert isinstance(step, Host)
    assert step.succession.confirmed == {A, B}, "both out of the next round's majority"
    assert step.succession.expected == {C, D}


def test_a_silent_successor_is_passed_over_after_the_silence_window_but_still_counts() -> None:
    succession = begin(RANKS, C, 1, host=A, host_health=Health.SILENT)
    assert succession.confirmed == frozenset(), "a silent host may be alive behind a partition"
    first = heard(succession, B, answer(Health.UNKNOWN), now=10.0, run_id=RUN)
    assert isinstance(first, failover.Succession) and first.excluded == {A}
    later = heard(first, B, answer(Health.UNKNOWN), now=10.0 + SILENT_AFTER_SECONDS, run_id=RUN)
    assert isinstance(later, failover.Succession)
    assert later.excluded == {A, B} and later.confirmed == frozenset()
    assert isinstance(next_step(later), Host)


def test_members_found_silent_during_the_round_are_passed_over() -> None:
    step = next_step(begin(RANKS, C, 1, host=A, host_health=Health.SILENT, silent_seen=[B]))
    assert isinstance(step, Host)


def test_nobody_left_to_host() -> None:
    ranks = {A: 0, B: 1}
    assert isinstance(
        next_step(begin(ranks, B, 1, host=A, host_health=Health.GONE, silent_seen=[B])), Nobody
    )


class Peers:
    """What each address answers, in turn, and a clock the waits move on."""

    def __init__(self, answers: dict[str, list[Answer]]) -> None:
        self.answers = answers
        self.now = 0.0
        self.asked: list[str] = []

    def ask(self, address: str) -> Answer:
        self.asked.append(address)
        queue = self.answers.get(address, [Answer(Health.UNKNOWN)])
        return queue.pop(0) if len(queue) > 1 else queue[0]

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def succeed(
        self, me: NodeIdent, *, host_answers: Callable[[], bool] | None = None
    ) -> Host | Join | None:
        return succeed(
            begin(RANKS, me, 1, host=A, host_health=Health.SILENT),
            addresses={n: f"{n}:1" for n in RANKS},
            ask=self.ask,
            host_answers=host_answers,
            run_id=RUN,
            deadline=60.0,
            clock=self.clock,
            sleep=self.sleep,
        )


def test_a_newer_generation_found_while_waiting_for_the_successor_is_joined() -> None:
    still_old = answer(Health.ALIVE, gen=1, store="10.0.0.1:29400", established=True)
    hosting = answer(Health.ALIVE, gen=2, store="10.0.0.2:29400", established=False)
    peers = Peers({f"{B}:1": [still_old, still_old, hosting]})
    outcome = peers.succeed(D)
    assert outcome == Join(StoreAnswer(False, 2, "10.0.0.2:29400"), frozenset({B, C, D}))
    assert peers.asked == [f"{B}:1"] * 3


def test_a_silently_lost_host_that_answers_again_was_a_blip() -> None:
    still_old = answer(Health.ALIVE, gen=1, store="10.0.0.1:29400", established=True)
    peers = Peers({f"{B}:1": [still_old]})
    assert peers.succeed(D, host_answers=lambda: True) is None
    assert peers.now == pytest.approx(1.05, abs=0.06), "the host is asked about once a second"


# -- which store carries the job ------------------------------------------------------------

OURS = StoreView(gen=1, hosting=True, address="10.0.0.1:29400", rounds=5)
"""A host that was frozen or cut off while the others moved on to generation 2."""
GEN2 = {
    "run": RUN,
    "gen": 2,
    "store": "10.0.0.2:29400",
    "established": True,
    "host_at": "10.0.0.2:7",
}


def confirmer(hosts: dict[str, Mapping[str, Any]]) -> Callable[[str], Mapping[str, Any] | None]:
    return hosts.get


def test_a_host_that_wakes_steps_down_when_a_majority_names_a_newer_store() -> None:
    answers = [GEN2, GEN2, GEN2]  # B, C and D moved on; the round had 4 members, us included
    found = newer_store(answers, run_id=RUN, mine=OURS, members=4, confirm=confirmer({}))
    assert found == StoreAnswer(True, 2, "10.0.0.2:29400")
    still = {"run": RUN, "gen": 1, "store": OURS.address}
    assert (
        newer_store([GEN2, GEN2, still], run_id=RUN, mine=OURS, members=4, confirm=confirmer({}))
        is None
    ), "2 of 4 is no majority, and its host does not confirm"


def test_one_peer_naming_a_newer_store_needs_that_stores_host_to_confirm() -> None:
    alive = confirmer({"10.0.0.2:7": {"host": True, "store": "10.0.0.2:29400"}})
    assert newer_store([GEN2], run_id=RUN, mine=OURS, members=4, confirm=alive) is not None
    lost = confirmer({"10.0.0.2:7": {"host": False, "store": None}})
    assert newer_store([GEN2], run_id=RUN, mine=OURS, members=4, confirm=lost) is None
    assert newer_store([GEN2], run_id=RUN, mine=OURS, members=4, confirm=confirmer({})) is None


def test_a_forming_store_yields_to_an_established_one_and_never_the_reverse() -> None:
    forming = {**GEN2, "gen": 3, "established": False}
    answers = [forming, forming, forming]
    assert newer_store(answers, run_id=RUN, mine=OURS, members=4, confirm=confirmer({})) is None
    mine_forming = StoreView(gen=2, hosting=True, address="10.0.0.3:29400")
    found = newer_store([GEN2] * 3, run_id=RUN, mine=mine_forming, members=4, confirm=confirmer({}))
    assert found == StoreAnswer(True, 2, "10.0.0.2:29400")


def test_another_jobs_answers_are_ignored() -> None:
    foreign = {**GEN2, "run": "another-job"}
    assert (
        newer_store([foreign] * 3, run_id=RUN, mine=OURS, members=4, confirm=confirmer({})) is None
    )


# -- a newcomer -----------------------------------------------------------------------------

ENDPOINT = "job-worker-0.job:29400"


@pytest.mark.parametrize(
    ("answers", "hosting", "final", "expected"),
    [
        ([], True, False, Start(ENDPOINT, 1, True)),  # the job's start: pod 0 hosts
        ([], False, False, Start(ENDPOINT, 1, False)),
        ([GEN2], True, False, Start("10.0.0.2:29400", 2, False, named=True)),  # join it
        ([GEN2], False, False, Start("10.0.0.2:29400", 2, False, named=True)),
        # A replacement pod 0 named as generation 1's host at its own endpoint: the pod it
        # replaces. Ask again, then host one past the newest generation named.
        ([{"run": RUN, "gen": 1, "store": ENDPOINT}], True, False, None),
        ([{"run": RUN, "gen": 1, "store": ENDPOINT}], True, True, Start(ENDPOINT, 2, True)),
        ([{"run": "other", "gen": 7, "store": "x:1"}], True, False, Start(ENDPOINT, 1, True)),
    ],
)
def test_where_a_newcomer_starts(
    answers: list[dict[str, Any]], hosting: bool, final: bool, expected: Start | None
) -> None:
    assert (
        first_store(answers, run_id=RUN, endpoint=ENDPOINT, hosting=hosting, final=final)
        == expected
    )


def test_waiting_members_look_for_a_newer_store_at_a_rate_the_job_size_does_not_raise() -> None:
    """Each look asks the last round's first ranks: every second in a job of up to 100
    members, then rarer in proportion, so that those few answer about 100 looks a second
    however large the job (at 1,024 members, every second was 1,000 questions a second to
    the new store's host while its hub formed the round)."""
    assert failover.look_interval(0) == 1.0  # not known: as before
    assert failover.look_interval(64) == 1.0
    assert failover.look_interval(100) == 1.0
    for world in (256, 1024, 4096):
        assert world / failover.look_interval(world) == pytest.approx(failover.LOOKS_PER_SECOND)


def test_a_large_jobs_looks_are_spread_and_rare_a_small_jobs_every_second() -> None:
    small = failover.LookSchedule(random.Random(1))
    assert all(small.due(float(t), 64) for t in range(30))
    # 1,024 members who all begin waiting at t=0 and are asked every second for 100 s.
    members = [failover.LookSchedule(random.Random(seed)) for seed in range(1024)]
    firsts, looks = [], 0
    for schedule in members:
        due = [t for t in range(100) if schedule.due(float(t), 1024)]
        firsts.append(due[0])
        looks += len(due)
    # The first looks spread over the interval: not the whole job in the same second.
    assert max(collections.Counter(firsts).values()) <= 3 * 1024 / 10.24
    assert looks / 100 == pytest.approx(failover.LOOKS_PER_SECOND, rel=0.2)
    # A new wait (a round formed in between) spreads its first looks again.
    schedule = members[0]
    schedule.reset()
    assert [schedule.due(200.0 + t, 1024) for t in range(11)].count(True) >= 1
