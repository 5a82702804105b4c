"""Judging the members of a round: who is alive, silent or gone. No torch.

Two ways, both through the members' liveness sockets (:mod:`ddpjob_worker.membership.liveness`) and
the run's keys (:mod:`ddpjob_worker.membership.keys`):

* while a round trains, each agent asks a few members a few times a second
  (:func:`watched`, :class:`ddpjob_worker.membership.liveness.PeerWatch`);
* before a round is re-formed, the agent probes the last round's members once
  (:func:`judge`), so the next round waits for the ones that come back and for no one else.

A monitor tick's findings are one :class:`Look`; the round joined is one :class:`RoundView`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol, TypeVar

from ddpjob_worker.bounded import call_bounded
from ddpjob_worker.errors import StoreSilentError, StoreUnreachableError
from ddpjob_worker.membership import liveness
from ddpjob_worker.membership.keys import END_DROPPED, END_FAILURE, END_HANDOVER, END_JOIN, RunKeys
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.nodes import NodeIdent, NodeRepr, ident

logger = logging.getLogger("ddpjob_worker.membership.watch")
_T = TypeVar("_T")

HOST_LOOK_SECONDS = 60.0
"""How long the store's host waits on a look at its own store before it takes it as broken."""

WATCH_ALL_UP_TO = 16
"""Rounds of up to this many other members: every agent asks every other one. In larger rounds
each asks its next :data:`WATCH_NEIGHBOURS` in node order (a ring, so every member is asked by
that many peers) and the store's host, which keeps the questions per agent constant."""
WATCH_NEIGHBOURS = 8


def watched(
    addresses: Mapping[NodeRepr, str], *, me: NodeRepr, host: NodeRepr | None
) -> dict[NodeRepr, str]:
    """Which of the round's other members (-> liveness address) one agent asks (see
    :data:`WATCH_ALL_UP_TO`)."""
    if len(addresses) <= WATCH_ALL_UP_TO:
        return dict(addresses)
    ring = sorted([*addresses, me])
    at = ring.index(me)
    chosen = {ring[(at + step) % len(ring)] for step in range(1, WATCH_NEIGHBOURS + 1)}
    if host is not None and host in addresses:
        chosen.add(host)
    return {node: addresses[node] for node in sorted(chosen)}


def judge(
    keys: RunKeys,
    nodes: Iterable[NodeRepr],
    *,
    silent: Iterable[NodeRepr] = (),
    timeout: float = liveness.PROBE_TIMEOUT_SECONDS,
) -> dict[NodeRepr, Health]:
    """The health of ``nodes`` (ourselves left out): GONE if they left the run or their
    address refuses; SILENT if a peer named them so in the round (``silent``); ALIVE if they
    accept; UNKNOWN if they never published an address or did not answer in time (only torch's
    heartbeats can tell then). Two store requests and one parallel probe, whatever their number.
    """
    others = {node for node in nodes if node != keys.me}
    left, named = keys.left(), set(silent)
    health = dict.fromkeys(others & left, Health.GONE)
    health.update(dict.fromkeys(others - left & named, Health.SILENT))
    rest = others - health.keys()
    addresses = keys.addresses(rest)
    health.update(dict.fromkeys(rest - addresses.keys(), Health.UNKNOWN))
    health.update(liveness.probe_all(addresses, timeout))
    return health


@dataclasses.dataclass(frozen=True)
class RoundView:
    """The round we joined, as a failover reads it after the watch has stopped: replaced whole
    when a round forms."""

    me: NodeIdent
    base_id: str
    """``<generation>.<round>``: the base a later round's majority is taken of."""
    ranks: Mapping[NodeIdent, int]
    addresses: Mapping[NodeIdent, str]
    """Every member's liveness address that we know, ours included."""
    base: Mapping[NodeIdent, int | None]
    """Every member's pod index (read only with failover on)."""
    host: NodeRepr | None
    """The node that hosts the store, as it published."""
    host_address: str | None
    """Its liveness address."""
    world: int = 0
    """How many members it had (0: not known)."""


@dataclasses.dataclass(frozen=True)
class Look:
    """One monitor tick's look at the round: what the agent acts on."""

    waiting: int = 0
    """Nodes waiting to join; at least 1 once our round is over (we re-form)."""
    host: Health | None = None
    """Not None: the store is lost, and this is what we know of its host (GONE: refused or
    handed over; SILENT: no answer for the silence window; UNKNOWN: the store failed, its host
    not judged)."""
    ends: frozenset[str] = frozenset()
    """Why our round is over, as its members said (END_FAILURE too once we dropped members)."""
    dropped: frozenset[NodeRepr] = frozenset()
    """Members found silent or gone at this tick: the round re-forms without them."""
    hung: bool = False
    """Our worker held the round up (a hang verdict): our failure, though it still runs."""

    @property
    def store_lost(self) -> bool:
        return self.host is not None

    @property
    def broken(self) -> bool:
        """A peer ended our round because its workers failed, it left, or we dropped it: not
        only a node waiting to join."""
        return bool(self.ends - {END_JOIN})


def host_lost(
    host: NodeRepr | None, silent: set[NodeRepr], gone: set[NodeRepr], *, hosting: bool
) -> Health | None:
    """What the peer watch says of the store's host, when it is lost to us (we do not host it
    and it is gone or silent); None otherwise."""
    if hosting or host is None:
        return None
    if host in gone:
        return Health.GONE
    if host in silent:
        return Health.SILENT
    return None


class RoundControl(Protocol):
    """What the agent and its store link do with the round: the rendezvous adapter of torch's
    c10d handler (:class:`ddpjob_worker.agent.rendezvous.RendezvousAdapter`) and the hub's handler
    (:class:`ddpjob_worker.agent.hubrdzv.HubRendezvousHandler`) both do it."""

    while_waiting: Callable[[], None] | None
    """Called about once a second while a join waits; may raise to abandon the store."""

    @property
    def address(self) -> str:
        """This node's rendezvous address (the pod's)."""

    @property
    def me(self) -> NodeRepr: ...

    @property
    def members(self) -> frozenset[NodeRepr]:
        """The members of the round joined last that this agent knows of."""

    def publish(self, liveness: str | None, *, hosting: bool, index: int | None) -> None:
        """Say in the store where our liveness socket answers (and, as its host, that the
        store is the job's)."""

    def look(self, watch: RoundWatch, *, hosting: bool, limit: float) -> Look:
        """One monitor tick's look at the round."""

    def announce_end(self, *reasons: str) -> None:
        """On our evidence, end our round."""

    def joined(
        self, gen: int, *, my_address: str | None, failover: bool
    ) -> tuple[RoundView, dict[NodeRepr, str]]:
        """The round just joined, and the members this agent watches (-> liveness address)."""

    def expect_survivors(self) -> None:
        """Before rejoining: the next round waits for the last one's survivors."""

    def member_gone(self) -> bool:
        """Whether a member of our round is gone or silent."""

    def leave(self, timeout: float, *, hosting: bool) -> None:
        """Leave the run (SIGTERM); as the store's host, hand it over."""

    def skip_join_jitter(self) -> None: ...

    def ring_on_news(self, ring: Callable[[], None]) -> bool:
        """Have ``ring`` called whenever the next :meth:`look` may differ from the last;
        False when it cannot (a look reads the store): the agent must look at every tick."""


class RoundWatch:
    """Asks the members of the round we joined whether they still answer, and looks at the
    round once per monitor tick (:meth:`look`). :attr:`view` outlives the asking: a failover
    reads it after the watch stopped."""

    def __init__(self) -> None:
        self.view: RoundView | None = None
        self.silent_seen: frozenset[NodeIdent] = frozenset()
        """Members found silent or gone since the round formed."""
        self._peers: liveness.PeerWatch[NodeRepr] | None = None

    def start(self, view: RoundView, peers: Mapping[NodeRepr, str]) -> None:
        """Start watching a round just joined: ``peers`` are the members this agent asks
        (:func:`watched`)."""
        self.close()
        self.view = view
        self.silent_seen = frozenset()
        self._peers = liveness.PeerWatch(peers)

    def close(self) -> None:
        """Stop asking (the view stays)."""
        if self._peers is not None:
            self._peers.close()
            self._peers = None

    def host_silent(self) -> bool:
        """Whether the store's host has been silent for the silence window."""
        peers, view = self._peers, self.view
        return peers is not None and view is not None and view.host in peers.silent()

    def bounded(self, call: Callable[[], _T], what: str, *, hosting: bool, limit: float) -> _T:
        """``call()`` (store requests) on a thread of its own (:func:`call_bounded`), given up
        after ``limit`` or once the store's host has been silent for the silence window (its
        client would wait forever on a host that stopped answering without a reset). Our own
        store, hosted in this process, answers unless it is stalled, as torch's is while it
        looks up a new client's name in a DNS that does not answer (10 s with glibc's
        defaults): it gets :data:`HOST_LOOK_SECONDS`, since giving up on it ends the pod."""
        if hosting:
            limit = max(limit, HOST_LOOK_SECONDS)
        return call_bounded(
            call, what, limit=limit, give_up=lambda: not hosting and self.host_silent()
        )

    def look(
        self,
        read: Callable[[], tuple[int, frozenset[str]]],
        drop: Callable[[frozenset[NodeRepr], frozenset[NodeRepr]], None],
        *,
        hosting: bool,
        limit: float,
    ) -> Look:
        """One look: the peers' answers, then the store (``read``: nodes waiting to join, and
        why the round is over). Members that went silent or whose address refuses are dropped
        (``drop(silent, gone)`` names them in the store, ends the round and expires them).
        ``read`` raises :class:`StoreUnreachableError` or :class:`StoreSilentError` when the
        store fails; as its host we have nothing to wait for then, and they propagate."""
        peers, view = self._peers, self.view
        gone = peers.gone() if peers is not None else set()
        silent = (peers.silent() if peers is not None else set()) - gone
        self.silent_seen |= {ident(node) for node in silent | gone}
        host = None if view is None else view.host
        lost = host_lost(host, silent, gone, hosting=hosting)
        if lost is Health.GONE:
            logger.warning("the rendezvous store's host (%s) is gone", host)
            return Look(host=lost)
        if lost is Health.SILENT:
            logger.warning(
                "the rendezvous store's host (%s) has not answered for %gs: taking it as lost",
                host,
                liveness.SILENT_AFTER_SECONDS,
            )
            return Look(host=lost)
        try:
            waiting, ends = self.bounded(
                read, "look at the rendezvous store", hosting=hosting, limit=limit
            )
        except (StoreUnreachableError, StoreSilentError) as exc:
            if hosting:
                raise  # we host the store; if it fails, nothing to wait for
            logger.warning("lost the rendezvous store: %s", exc)
            silenced = isinstance(exc, StoreSilentError) and self.host_silent()
            return Look(host=Health.SILENT if silenced else Health.UNKNOWN)
        if END_HANDOVER in ends and not hosting:
            logger.info("the store's host hands over (it stops): carrying on around a new host")
            return Look(host=Health.GONE, ends=ends)
        dropped: frozenset[NodeRepr] = frozenset()
        if silent or gone:
            dropped = frozenset(silent | gone)
            self._drop(frozenset(silent), frozenset(gone), drop, hosting=hosting, limit=limit)
            ends = ends | {END_FAILURE}
        if END_DROPPED in ends:
            logger.warning(
                "the rendezvous no longer has us in our round (our heartbeats lapsed, and a "
                "newcomer opened the next round): rejoining"
            )
            waiting = max(waiting, 1)
        elif ends:
            # A peer restarts or leaves: re-form now, not when our collective breaks.
            logger.info(
                "a member of our round announced its end (%s): re-forming", ", ".join(sorted(ends))
            )
            waiting = max(waiting, 1)
        return Look(waiting=waiting, ends=ends, dropped=dropped)

    def _drop(
        self,
        silent: frozenset[NodeRepr],
        gone: frozenset[NodeRepr],
        drop: Callable[[frozenset[NodeRepr], frozenset[NodeRepr]], None],
        *,
        hosting: bool,
        limit: float,
    ) -> None:
        """Re-form the round without members that stopped answering (``silent``) or whose
        address refuses (``gone``). Only the gone ones are out of the majority (a silent one
        may be alive behind a partition)."""
        if silent:
            logger.warning(
                "no answer from %s for %gs (a machine lost silently, a partition or a frozen "
                "pod): re-forming without %s",
                ", ".join(sorted(silent)),
                liveness.SILENT_AFTER_SECONDS,
                "it" if len(silent) == 1 else "them",
            )
        if gone:
            logger.warning("%s refused: re-forming without it", ", ".join(sorted(gone)))
        try:
            self.bounded(
                functools.partial(drop, silent, gone),
                "drop silent members",
                hosting=hosting,
                limit=limit,
            )
        except (RuntimeError, OSError, StoreUnreachableError) as exc:  # StoreSilentError too
            logger.warning("could not name the silent members in the store: %s", exc)
        self.close()


def round_view(
    keys: RunKeys, ranks: Mapping[NodeRepr, int], *, base_id: str, my_address: str | None
) -> tuple[RoundView, dict[NodeRepr, str]]:
    """The round just joined (its members' ``ranks``), read from the run's keys: the view, and
    the other members' liveness addresses. Raises the store's errors."""
    others = set(ranks) - {keys.me}
    addresses = keys.addresses(others)
    host = keys.host()
    known = {ident(node): address for node, address in addresses.items()}
    if my_address is not None:
        known[ident(keys.me)] = my_address
    view = RoundView(
        me=ident(keys.me),
        base_id=base_id,
        ranks={ident(node): rank for node, rank in ranks.items()},
        addresses=known,
        base={},
        host=host,
        host_address=None if host is None else addresses.get(host),
        world=len(ranks),
    )
    return view, addresses
