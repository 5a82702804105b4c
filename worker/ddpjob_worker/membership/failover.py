"""Store failover and fencing: the rules, as pure decisions. No torch, no sockets.

The store's host (pod 0 at first) can be lost like any other pod. The survivors of its last
round carry on around a new host among themselves:

* **Who hosts next** (:func:`successor`): the lowest-ranked member of the last round that is not
  excluded (the old host, and members known gone or found silent). Every survivor computes the
  same from the round they shared: no vote to lose. A survivor asks the chosen one in turn
  (:class:`Succession`, :func:`next_step`, :func:`heard`): one that refuses is gone, one silent
  for the silence window is passed over, one that names a newer generation is joined.
* **A majority** (:func:`has_quorum`): a round completes only with a strict majority of the last
  round's members not known gone. A silent member still counts (it may be alive behind a
  partition), so of two sides at most one trains.
* **Which store carries the job** (:class:`StoreAnswer`, :func:`best_store`): an established
  store (a round completed on it, so a majority stood behind it) before a forming one, then the
  newest generation. A host that wakes up after the others moved on finds a better store named
  by a majority of its last round, or by that store's own host, and steps down
  (:func:`newer_store`, :class:`SupersededError`). A newcomer (a replacement pod 0, a scale-up)
  asks the job's pods which store to join (:func:`first_store`).

The agent's store link (:mod:`ddpjob_worker.agent.storelink`) carries the decisions out.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from typing import Any

from ddpjob_worker.membership.liveness import SILENT_AFTER_SECONDS, Answer, Health
from ddpjob_worker.membership.nodes import NodeIdent

logger = logging.getLogger("ddpjob_worker.membership.failover")


@dataclasses.dataclass(frozen=True)
class StoreView:
    """The store the agent uses now. Replaced whole on every change."""

    gen: int
    """Its generation: 1 for the job's first store, one more at each failover."""
    hosting: bool
    """We host it."""
    address: str | None
    """Its endpoint as we name it to others; None while it must not be named (a new host names
    it only once the base of its first round's majority is in it)."""
    rounds: int = 0
    """Rounds completed on it (one is enough for it to be established)."""
    recoveries: int = 0
    """Stores moved to so far, this one included."""
    host_at: str | None = None
    """Where its host's liveness socket answers, once a round on it has formed."""

    @property
    def established(self) -> bool:
        return self.rounds > 0


def round_is_full(
    participants: Collection[Hashable],
    expected: Collection[Hashable] | None,
    *,
    waiting: int,
    min_nodes: int,
) -> bool:
    """Whether a forming rendezvous round may complete now instead of after its last call.

    torch waits ``last_call_timeout`` once ``min_nodes`` have joined, in case more come. After a
    failure we know who comes: the members of the last round that are still alive
    (``expected``; the ones that left or died are out). Once all of them have joined, at least
    ``min_nodes`` are in and no node waits to join, waiting longer only delays training. With no
    expectation (the first round, or a rendezvous we cannot read) torch's last call applies.
    """
    if expected is None or waiting > 0:
        return False
    joined = set(participants)
    return len(joined) >= min_nodes and set(expected) <= joined


def has_quorum(
    participants: Collection[NodeIdent],
    base: Mapping[NodeIdent, int | None],
    gone: Collection[NodeIdent],
    indexes: Mapping[NodeIdent, int | None],
) -> bool:
    """Whether a forming round may complete: it holds a strict majority of the last round's
    members (``base``: node -> pod index) that are not known to be gone.

    Known gone: they left, their address refused (their process is dead), or a pod with the
    same index joins (the operator replaces pod *i* only once the old pod object is gone). A
    member that is merely silent still counts: it may be alive on the other side of a
    partition, and of two sides only one can hold a majority, so two groups never train at
    once. With no base (the job's first round) or every member gone, any round may complete.
    """
    joined = set(participants)
    replaced = {indexes.get(node) for node in joined - set(base)} - {None}
    alive = {
        node
        for node, index in base.items()
        if node not in gone and (index is None or index not in replaced or node in joined)
    }
    if not alive:
        return True
    return 2 * len(alive & joined) > len(alive)


def successor(
    ranks: Mapping[NodeIdent, int], *, excluded: Collection[NodeIdent]
) -> NodeIdent | None:
    """Who hosts the store after its host is lost: the lowest-ranked member of the last round
    that is not excluded (the old host, and the members known gone or silent). Every survivor
    computes the same from the round it shares with the others: no vote to lose."""
    left = sorted((rank, node) for node, rank in ranks.items() if node not in excluded)
    return left[0][1] if left else None


@dataclasses.dataclass(frozen=True, order=True)
class StoreAnswer:
    """A store that a peer named (from its liveness answer). Ordered: an established store (it
    completed a round, so a majority stood behind it) before a forming one, then the newest
    generation. A forming store that has no majority (a cut-off pod that tried to host on its
    own, the survivor of a 2-pod job) so yields to a live established one."""

    established: bool
    gen: int
    store: str
    host_at: str | None = dataclasses.field(default=None, compare=False)
    """Where the store's host answers (its liveness address), to check it is alive."""


def best_store(answers: Iterable[Mapping[str, object]], run_id: str) -> StoreAnswer | None:
    """The best store of run ``run_id`` that the answers name, if any (malformed or foreign
    answers are skipped)."""
    found = []
    for info in answers:
        gen, store, host_at = info.get("gen"), info.get("store"), info.get("host_at")
        if info.get("run") != run_id or not isinstance(store, str) or not store:
            continue
        if not isinstance(gen, int) or isinstance(gen, bool) or gen < 1:
            continue
        at = host_at if isinstance(host_at, str) and host_at else None
        found.append(StoreAnswer(bool(info.get("established")), gen, store, at))
    return max(found, default=None)


class SupersededError(RuntimeError):
    """Another store (:attr:`found`) carries the job on: ours must step down."""

    def __init__(self, found: StoreAnswer) -> None:
        super().__init__(f"generation {found.gen} at {found.store} carries the job on")
        self.found = found


# -- who hosts next --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Succession:
    """Where a failover stands, for one survivor: the last round's ranks, who is out, who is
    known gone (out of the next majority's count too), and since when a candidate has not
    answered."""

    ranks: Mapping[NodeIdent, int]
    me: NodeIdent
    gen: int
    """The generation of the store that was lost."""
    excluded: frozenset[NodeIdent]
    confirmed: frozenset[NodeIdent]
    unanswered: Mapping[NodeIdent, float] = dataclasses.field(default_factory=dict)

    @property
    def expected(self) -> frozenset[NodeIdent]:
        """The members the next round waits for: everyone not excluded (ourselves included)."""
        return frozenset(self.ranks) - self.excluded


@dataclasses.dataclass(frozen=True)
class Host:
    """We host the next generation: its first round needs a majority of the last round
    (:attr:`Succession.ranks`), without the members :attr:`Succession.confirmed` gone."""

    succession: Succession


@dataclasses.dataclass(frozen=True)
class Ask:
    """Ask :attr:`node` (the successor) whether it hosts a newer generation yet."""

    node: NodeIdent


@dataclasses.dataclass(frozen=True)
class Join:
    """Join the newer generation :attr:`found`; its first round waits for :attr:`expected`."""

    found: StoreAnswer
    expected: frozenset[NodeIdent]


@dataclasses.dataclass(frozen=True)
class Nobody:
    """Nobody of the last round is left to host the store."""


def begin(
    ranks: Mapping[NodeIdent, int],
    me: NodeIdent,
    gen: int,
    *,
    host: NodeIdent,
    host_health: Health,
    silent_seen: Iterable[NodeIdent] = (),
) -> Succession:
    """A failover after losing ``host``: it and the members found silent or gone during the
    round are passed over; a host known GONE (refused, handed over) is out of the majority."""
    return Succession(
        ranks=dict(ranks),
        me=me,
        gen=gen,
        excluded=frozenset({host, *silent_seen}),
        confirmed=frozenset({host}) if host_health is Health.GONE else frozenset(),
    )


def next_step(succession: Succession) -> Host | Ask | Nobody:
    """Host the next generation if we are the successor, else ask the successor."""
    chosen = successor(succession.ranks, excluded=succession.excluded)
    if chosen is None:
        return Nobody()
    if chosen == succession.me:
        return Host(succession)
    return Ask(chosen)


def heard(
    succession: Succession, node: NodeIdent, answer: Answer, now: float, run_id: str
) -> Succession | Join:
    """What the successor's answer changes: refused twice, it is gone (passed over and out of
    the majority); silent for :data:`SILENT_AFTER_SECONDS`, passed over; naming a newer
    generation, we join it; alive and still on the old one, we ask again."""
    if answer.health is Health.GONE:
        return dataclasses.replace(
            succession,
            excluded=succession.excluded | {node},
            confirmed=succession.confirmed | {node},
        )
    if answer.health is Health.ALIVE:
        found = best_store([answer.info or {}], run_id)
        if found is not None and found.gen > succession.gen:
            return Join(found, succession.expected)
        unanswered = {k: v for k, v in succession.unanswered.items() if k != node}
        return dataclasses.replace(succession, unanswered=unanswered)
    first = succession.unanswered.get(node, now)
    if now - first >= SILENT_AFTER_SECONDS:
        return dataclasses.replace(succession, excluded=succession.excluded | {node})
    return dataclasses.replace(succession, unanswered={**succession.unanswered, node: first})


def succeed(
    succession: Succession,
    *,
    addresses: Mapping[NodeIdent, str],
    ask: Callable[[str], Answer],
    host_answers: Callable[[], bool] | None,
    run_id: str,
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Host | Join | None:
    """Ask successors in turn until we host, join a newer generation, or there is nothing to
    do (None: nobody is left, the deadline passed, or the lost host answers again: a blip).
    ``host_answers`` (for a host lost silently) is asked about once a second."""
    looked = clock()
    while clock() < deadline:
        step = next_step(succession)
        if isinstance(step, Nobody):
            return None
        if isinstance(step, Host):
            return step
        outcome = heard(succession, step.node, ask(addresses.get(step.node, "")), clock(), run_id)
        if isinstance(outcome, Join):
            return outcome
        progressed = outcome.excluded != succession.excluded
        succession = outcome
        if progressed:
            continue
        if host_answers is not None and clock() - looked > 1.0:
            looked = clock()
            if host_answers():
                return None
        sleep(0.05)
    return None


LOOKS_PER_SECOND = 100.0
"""How many looks for a newer store (:func:`newer_store`) a job's waiting members make a second
at most, all together: each look asks the first ranks of the last round, so each of them answers
about this many a second however large the job. Every member looking once a second asked a new
store's host about 1,000 times a second at 1,024 members, while its hub formed their round: its
liveness socket took 42 % of what its process ran, and the hub's loop starved."""


def look_interval(world: int) -> float:
    """Seconds between one waiting member's looks for a newer store, in a job whose last round
    had ``world`` members (0: not known): once a second up to :data:`LOOKS_PER_SECOND` members,
    longer in proportion beyond (10 s at 1,000). A store superseded while a large job waits is
    found that much later: the price of not having the whole job ask the same few members."""
    return max(1.0, world / LOOKS_PER_SECOND)


class LookSchedule:
    """When a waiting member looks for a newer store (:func:`look_interval`); asked about once
    a second while a join waits, and reset when a wait ends (a round formed, another store)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()  # noqa: S311 - spreads looks over time, not a secret
        self._next: float | None = None

    def reset(self) -> None:
        self._next = None

    def due(self, now: float, world: int) -> bool:
        """Whether to look now. In a job of up to :data:`LOOKS_PER_SECOND` members: every time.
        Beyond, a wait's first look comes at a random point of the interval (the whole job
        most likely began waiting at once: a failure, a failover), then one an interval later,
        give or take a quarter."""
        interval = look_interval(world)
        if interval <= 1.0:
            return True
        if self._next is None:
            self._next = now + self._rng.uniform(0.0, interval)
        if now < self._next:
            return False
        self._next = now + interval * self._rng.uniform(0.75, 1.25)
        return True


# -- which store carries the job -------------------------------------------------------------


def newer_store(
    answers: Iterable[Mapping[str, Any]],
    *,
    run_id: str,
    mine: StoreView,
    members: int,
    confirm: Callable[[str], Mapping[str, Any] | None],
) -> StoreAnswer | None:
    """The store that supersedes ours, if the last round's members (``answers``: what each of
    the ``members`` other than us answers) name one that is better (:class:`StoreAnswer`'s
    order) and alive: named by a majority of them, or its host answers as its host (``confirm``
    asks a host's liveness address). Never a store that is lost, which a peer that has not
    noticed yet may still name alone."""
    named = [best_store([info], run_id) for info in answers if info.get("store") != mine.address]
    own = (mine.established, mine.gen)
    better = sorted(
        {found for found in named if found and (found.established, found.gen) > own},
        reverse=True,
    )
    for found in better:
        votes = sum(1 for other in named if other == found)
        if 2 * votes > members:
            return found
        hosts = {other.host_at for other in named if other == found and other.host_at}
        for host_at in sorted(hosts):
            info = confirm(host_at) or {}
            if info.get("host") and info.get("store") == found.store:
                return found
        logger.info(
            "generation %d at %s is named by %d of %d, and its host does not answer",
            found.gen,
            found.store,
            votes,
            members,
        )
    return None


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a starting agent goes: the store at :attr:`endpoint`, of generation :attr:`gen`,
    hosted by us or not."""

    endpoint: str
    gen: int
    hosting: bool
    named: bool = False
    """A pod of the job named it (else: the configured endpoint)."""


def first_store(
    answers: Iterable[Mapping[str, Any]],
    *,
    run_id: str,
    endpoint: str,
    hosting: bool,
    final: bool,
) -> Start | None:
    """Where a newcomer starts, from what the job's pods answer (``hosting``: we are told to
    host the job's first store, as pod 0 is). A store they name is joined, unless it is
    generation 1 at our own endpoint and we host: that is the pod we replace, which is gone,
    and the others are about to carry on around a new host, so we ask again (None) until
    ``final``. Nobody naming a store (the job's start) leaves the endpoint, hosted by pod 0 as
    generation 1, or one past the newest generation named."""
    answers = list(answers)
    found = best_store(answers, run_id)
    mine = found is not None and found.store == endpoint and found.gen <= 1
    if found is not None and not (hosting and mine):
        return Start(found.store, found.gen, hosting=False, named=True)
    if found is not None and not final:
        return None
    gens = [
        info["gen"]
        for info in answers
        if info.get("run") == run_id and isinstance(info.get("gen"), int)
    ]
    return Start(endpoint, max(gens) + 1 if gens and hosting else 1, hosting)
