"""The hub: the store's host coordinates membership, and is the only one to decide a round.
No torch.

torch's c10d rendezvous keeps every participant in one pickled state that every member reads
and rewrites by compare-and-set on each keep-alive (about 168 KB per write at 1,024 members,
every member every second, through one store), and our peer watch asked neighbours with a new
TCP connection four times a second. Both grow with the job. Here:

* **One connection per member, for its life.** Each member says ``hello``, then a heartbeat
  every :data:`HEARTBEAT_SECONDS`, and the hub acknowledges: four small messages a second per
  member, none per other member. Nobody else is asked.
* **One writer.** The hub collects the members that ask to join the next round, and completes it
  when the expected survivors are all in (or when ``min_nodes`` are in and the last call has
  passed), and only with a strict majority of the last round's members not known to be gone
  (:func:`ddpjob_worker.membership.failover.has_quorum`). It tells each member its rank and the
  world size; the first few ranks (who would host the next generation) also get the whole round, the
  base of the next majority.
* **A cut needs a second opinion, and cuts are batched** (:mod:`ddpjob_worker.membership.hubwatch`
  keeps the cases, :mod:`ddpjob_worker.membership.suspicion` decides them): a member whose
  connection closed is probed at its liveness socket; one gone quiet is probed by other members, and
  one of them hearing it keeps it in. 64 members of a node frozen at once are one round change, not
  64.
* **A hung worker is not a lost member.** When most ranks wait in a collective that one
  member's worker never reaches (:mod:`ddpjob_worker.hang`), the round ends for everyone and
  names that member (``hung``): its agent kills the worker and charges the restart to itself,
  and, still a member, it is in the next round at once.
* **Fenced by generation.** Every message carries the hub's generation and round; a member
  of another round is not believed.
* **Judging nobody after its own stall.** A hub whose loop did not run for a while (frozen,
  starved) counts every member as just heard from.

The hub runs on the process's membership loop (:func:`ddpjob_worker.membership.wire.shared_loop`);
its members are :class:`ddpjob_worker.membership.member.Member`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from ddpjob_worker import hang
from ddpjob_worker.membership import liveness
from ddpjob_worker.membership.failover import has_quorum
from ddpjob_worker.membership.forming import Admitted, Forming
from ddpjob_worker.membership.hubwatch import TICK_SECONDS, HubWatch
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.nodes import NodeIdent
from ddpjob_worker.membership.wire import MAX_LINE, Message, Wire
from ddpjob_worker.progress import Progress

logger = logging.getLogger("ddpjob_worker.membership.hub")

HEARTBEAT_SECONDS = 0.5
"""How often a member tells the hub it is alive (and the hub answers)."""
CHAIN = 4
"""The first ranks of a round, which would host the next generation in turn: they get the
whole round (the next majority's base)."""
VETO_LOG_SECONDS = 5.0
"""How often a round fenced for lack of a majority says so."""


@dataclasses.dataclass
class _Session:
    ident: NodeIdent
    index: int | None
    liveness: str | None
    writer: asyncio.StreamWriter
    fresh: bool = False
    """It was never given a round (a new pod): the old holder of its index yields to it."""
    boot: object = None
    """Where its rank 0 worker would serve the workers' store, as its last join said."""
    left: bool = False
    closed: bool = False
    """Its connection closed."""
    progress: tuple[int, list[Progress]] | None = None
    """Its workers' progress records as its last heartbeat told them (its round, the records)."""


@dataclasses.dataclass(frozen=True)
class HubView:
    """What the hub holds, replaced whole at every change (for the tests and the benchmark)."""

    gen: int
    round: int
    forming: bool
    participants: Mapping[NodeIdent, int]
    connected: frozenset[NodeIdent]
    cuts: int
    """Round changes made for lost members, and for hung ones, so far."""


class Hub:
    """The membership coordinator of one store generation (see the module doc)."""

    def __init__(
        self,
        wire: Wire,
        *,
        gen: int,
        min_nodes: int,
        max_nodes: int,
        last_call: float,
        base: Mapping[NodeIdent, int | None] | None = None,
        base_id: str | None = None,
        gone: Iterable[NodeIdent] = (),
        expected: Iterable[NodeIdent] | None = None,
        host: tuple[NodeIdent, str | None] | None = None,
        probe: Callable[[str], Health] = liveness.probe,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``host``: the hub's own agent (ident, liveness address), named to every member."""
        self._wire = wire
        self._host = host
        self.gen = gen
        self._min = min_nodes
        self._max = max_nodes
        self._last_call = last_call
        self._base: dict[NodeIdent, int | None] = dict(base or {})
        self._base_id = base_id
        self._gone: set[NodeIdent] = set(gone)
        self._clock = clock
        self._sessions: dict[NodeIdent, _Session] = {}
        self._watch = HubWatch(
            self._sessions,
            send=self._send_to,
            cut=self._cut,
            hung=self._hung,
            probe=probe,
            clock=clock,
        )
        self._round = 0
        self._forming = True
        self._participants: dict[NodeIdent, int] = {}
        self._formation: Forming[_Session] = Forming(
            self._base, None if expected is None else frozenset(expected)
        )
        """The round being formed (:mod:`ddpjob_worker.membership.forming`)."""
        self._ack_line: bytes | None = None
        self._ack_round = -1
        self._cuts = 0
        self._closed = False
        self._vetoed = -VETO_LOG_SECONDS
        self._replaced: set[NodeIdent] = set()
        """Members whose pod a newcomer with their index replaced."""
        self._server: asyncio.AbstractServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.address: str | None = None
        self.sent = 0
        self.received = 0
        """Messages, for the benchmark."""

    # -- serving --------------------------------------------------------------------------------

    async def start(self, host: str, port: int = 0) -> str:
        """Listen at ``host:port`` (0: a free port); the address members connect to."""
        self._server = await asyncio.start_server(self._serve, host, port, limit=MAX_LINE)
        sockname = self._server.sockets[0].getsockname()
        shown = f"[{host}]" if ":" in host else host
        self.address = f"{shown}:{sockname[1]}"
        self._task = asyncio.get_running_loop().create_task(self._ticks())
        return self.address

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._server is not None:
            self._server.close()
        for session in list(self._sessions.values()):
            session.writer.close()
        self._sessions.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session: _Session | None = None
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                message = self._wire.decode(line)
                if message is None:
                    continue
                self.received += 1
                if session is None:
                    if message["t"] != "hello":
                        continue
                    session = self._hello(message, writer)
                    continue
                if session.closed or self._sessions.get(session.ident) is not session:
                    break  # cut, or replaced by a new hello: what it still had buffered is stale
                self._handle(session, message)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            if session is not None and self._sessions.get(session.ident) is session:
                self._closed_session(session)
            writer.close()

    def _send(self, session: _Session, message: Message) -> None:
        if session.closed:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            session.writer.write(self._wire.encode(message))
            self.sent += 1

    def _send_to(self, ident: NodeIdent, message: Message) -> None:
        session = self._sessions.get(ident)
        if session is not None:
            self._send(session, message)

    def _broadcast(self, message: Message, idents: Iterable[NodeIdent]) -> None:
        for ident in idents:
            session = self._sessions.get(ident)
            if session is not None:
                self._send(session, message)

    # -- messages -------------------------------------------------------------------------------

    def _hello(self, message: Message, writer: asyncio.StreamWriter) -> _Session:
        ident = NodeIdent(str(message.get("ident")))
        old = self._sessions.get(ident)
        if old is not None:
            old.closed = True
            old.writer.close()
        index = message.get("index")
        session = _Session(
            ident=ident,
            index=index if isinstance(index, int) else None,
            liveness=message.get("liveness") if isinstance(message.get("liveness"), str) else None,
            writer=writer,
            fresh=message.get("fresh") is True,
        )
        self._sessions[ident] = session
        self._watch.greeted(ident)
        self._send(session, {"t": "welcome", "gen": self.gen, "round": self._round})
        if ident in self._replaced:
            self._send(session, {"t": "replaced", "gen": self.gen})
        return session

    def _handle(self, session: _Session, message: Message) -> None:
        kind = message["t"]
        now = self._watch.heard(session.ident)  # it speaks: not lost
        if kind == "hb":
            self._ack(session)
            if "p" in message:
                session.progress = hang.heard(message["p"], now)
        elif kind == "join":
            session.boot = message.get("boot")
            self._join(session)
        elif kind == "end":
            ours = message.get("round") == self._round and session.ident in self._participants
            if ours and not self._forming:
                self._end(frozenset({str(message.get("reason", "failure"))}), cut=())
        elif kind == "leave":
            self._leave(session, handover=bool(message.get("handover")))
        elif kind == "probed":
            self._watch.probed(message)
        elif kind == "close":
            self._closed = True
            self._broadcast({"t": "closed", "gen": self.gen}, list(self._sessions))

    def _join(self, session: _Session) -> None:
        if self._closed:
            self._send(session, {"t": "closed", "gen": self.gen})
            return
        if session.ident in self._replaced:
            # Its pod was replaced (a pod of its index is in the round): it must not train.
            self._send(session, {"t": "replaced", "gen": self.gen})
            return
        if not self._forming:
            # A member of the running round that asks again (its workers stopped on their
            # own), or a newcomer (torch's "nodes waiting"): the running round is over.
            newcomer = session.ident not in self._participants
            self._end(frozenset({"join" if newcomer else "failure"}), cut=())
        if self._admit(session):
            self._maybe_complete()

    def _leave(self, session: _Session, *, handover: bool) -> None:
        session.left = True
        self._gone.add(session.ident)
        if handover:
            # Our host leaves (SIGTERM): everyone carries on around a new host at once.
            self._broadcast(
                {"t": "over", "gen": self.gen, "round": self._round, "reasons": ["handover"]},
                [ident for ident in self._sessions if ident != session.ident],
            )
            return
        if not self._forming and session.ident in self._participants:
            self._end(frozenset({"leave"}), cut=(session.ident,))
        else:
            self._formation.drop({session.ident})
            self._maybe_complete()

    def _closed_session(self, session: _Session) -> None:
        session.closed = True
        self._formation.unjoin(session.ident)  # it joins again once reconnected
        if session.left:
            del self._sessions[session.ident]
            self._watch.forget(session.ident)
            return
        self._watch.closed(session.ident, session.liveness)

    # -- rounds ----------------------------------------------------------------------------------

    def _ack(self, session: _Session) -> None:
        """Answer a heartbeat: our generation and round (the same bytes for every member until
        the round changes, sealed once)."""
        if self._ack_line is None or self._ack_round != self._round:
            self._ack_line = self._wire.encode({"t": "ack", "gen": self.gen, "round": self._round})
            self._ack_round = self._round
        if not session.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                session.writer.write(self._ack_line)
                self.sent += 1

    def _end(
        self,
        reasons: frozenset[str],
        cut: Iterable[NodeIdent],
        hung: frozenset[NodeIdent] = frozenset(),
    ) -> None:
        """The running round is over: tell its members, and form the next one, waiting for
        its survivors. ``hung``: members whose worker held the round up (they stay)."""
        cut = set(cut)
        if self._forming:
            self._formation.drop(cut)
            self._maybe_complete()
            return
        over = {
            "t": "over",
            "gen": self.gen,
            "round": self._round,
            "reasons": sorted(reasons),
            "cut": sorted(cut),
        }
        if hung:
            over["hung"] = sorted(hung)
        self._broadcast(over, [ident for ident in self._participants if ident not in cut])
        self._round += 1
        self._forming = True
        self._formation = Forming(self._base, frozenset(self._participants) - cut)
        logger.info(
            "round %d.%d is over (%s%s): forming round %d",
            self.gen,
            self._round - 1,
            ", ".join(sorted(reasons)),
            f"; without {len(cut)}" if cut else "",
            self._round,
        )

    def _maybe_complete(self) -> None:
        if not self._forming or self._closed:
            return
        now = self._clock()
        formation = self._formation
        if not formation.due(now, self._min, self._max, self._last_call):
            return
        joined = list(formation.joined.values())
        count = len(joined)
        idents = set(formation.joined)
        indexes = {s.ident: s.index for s in joined}
        if self._base and not has_quorum(idents, self._base, self._gone, indexes):
            # Fenced: a majority of the last round is not here (maybe the other side of a
            # partition has it).
            if now - self._vetoed >= VETO_LOG_SECONDS:
                self._vetoed = now
                _say_fenced(
                    f"{self.gen}.{self._round}", self._base_id, idents, self._base, self._gone
                )
            return
        self._complete(joined[: self._max] if count > self._max else joined)

    def _admit(self, session: _Session) -> bool:
        """Add ``session`` to the round being formed (:meth:`Forming.admit`: at most one agent
        per pod index); one whose index its replacement holds is told so. Whether it was
        added."""
        admitted, holder = self._formation.admit(session)
        if admitted is Admitted.REPLACED and holder is not None:
            self._drop_replaced(session, by=holder)
        return admitted is Admitted.ADDED

    def _drop_replaced(self, session: _Session, *, by: NodeIdent) -> None:
        logger.warning(
            "%s asks to join, but %s holds its pod index %s: it was replaced",
            session.ident,
            by,
            session.index,
        )
        self._formation.unjoin(session.ident)
        self._replaced.add(session.ident)
        self._send(session, {"t": "replaced", "gen": self.gen})

    def _complete(self, joined: list[_Session]) -> None:
        ordered = sorted(joined, key=lambda s: (s.index is None, s.index or 0, s.ident))
        self._participants = {s.ident: rank for rank, s in enumerate(ordered)}
        # A member of the last round whose pod index a newcomer of this one has was replaced:
        # the operator makes pod i again only once the old pod object is gone. If its agent
        # comes back (healed from a partition), it must not train beside its replacement.
        indexes = {s.index for s in ordered if s.index is not None}
        replaced = {
            ident
            for ident, index in self._base.items()
            if index in indexes and ident not in self._participants
        }
        self._replaced |= replaced
        for ident in replaced:
            session = self._sessions.get(ident)
            if session is not None:
                self._send(session, {"t": "replaced", "gen": self.gen})
        base = {s.ident: s.index for s in ordered}
        base_id = f"{self.gen}.{self._round}"
        # Whether a member of the last round is missing from this one, told to every member
        # in two fields: a failure that followed a membership change is nobody's charge.
        left = sum(1 for ident in self._base if ident not in self._participants)
        told: Message = {
            "t": "round",
            "gen": self.gen,
            "round": self._round,
            "base_id": base_id,
            "prev": self._base_id,
            "left": left,
            "host": None if self._host is None else list(self._host),
        }
        for session, message in _round_messages(ordered, told, base):
            self._send(session, message)
        world = len(ordered)
        self._base, self._base_id, self._gone = base, base_id, set()
        self._forming = False
        self._formation = Forming(base, None)
        logger.info("round %s formed with %d members", base_id, world)

    # -- liveness -------------------------------------------------------------------------------

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            try:
                self._tick()
            except Exception:  # a tick must never end the hub
                logger.exception("hub tick failed")

    def _tick(self) -> None:
        if self._forming:
            self._watch.tick(set(self._sessions), None)
        else:
            self._watch.tick(list(self._participants), (f"{self.gen}.{self._round}", self._round))
        self._maybe_complete()

    def _hung(self, stuck: frozenset[NodeIdent]) -> None:
        """The hang verdict: the round is over for everyone, the stuck members named (their
        agents charge the restart to themselves), nobody cut."""
        if self._forming:
            return
        self._cuts += 1
        self._end(frozenset({"failure", "hung"}), cut=(), hung=stuck)

    def _cut(self, lost: Mapping[NodeIdent, Health]) -> None:
        for ident, verdict in lost.items():
            self._watch.forget(ident)
            session = self._sessions.pop(ident, None)
            if session is not None:
                session.closed = True
                session.writer.close()
            if verdict is Health.GONE:
                self._gone.add(ident)
        in_round = {ident for ident in lost if ident in self._participants}
        shown = sorted(lost.items())
        logger.warning(
            "cutting %d member(s): %s%s",
            len(lost),
            ", ".join(f"{ident} ({verdict.value})" for ident, verdict in shown[:8]),
            " ..." if len(shown) > 8 else "",
        )
        if in_round and not self._forming:
            self._cuts += 1
            self._end(frozenset({"failure"}), cut=in_round)
        else:
            self._end(frozenset(), cut=set(lost))

    # -- the view ---------------------------------------------------------------------------------

    @property
    def view(self) -> HubView:
        """What the hub holds now (built on demand: the tests and the benchmark read it)."""
        return HubView(
            gen=self.gen,
            round=self._round,
            forming=self._forming,
            participants=dict(self._participants),
            connected=frozenset(s.ident for s in self._sessions.values() if not s.closed),
            cuts=self._cuts,
        )


def _round_messages(
    ordered: list[_Session], told: Message, base: Mapping[NodeIdent, int | None]
) -> Iterator[tuple[_Session, Message]]:
    """Each member's message of a round just formed: what every member is ``told``, its rank,
    the world, where rank 0 serves the workers' store, and the first ranks of the chain (which
    would host the next generation in turn: they also get the whole round, the next majority's
    base)."""
    chain = [[s.ident, s.index, s.liveness] for s in ordered[:CHAIN]]
    world = len(ordered)
    for rank, session in enumerate(ordered):
        message: Message = {
            **told,
            "rank": rank,
            "world": world,
            "boot": ordered[0].boot,
            "chain": chain,
        }
        if rank < CHAIN:
            message["base"] = base
        yield session, message


def _say_fenced(
    forming: str,
    base_id: str | None,
    joined: set[NodeIdent],
    base: Mapping[NodeIdent, int | None],
    gone: set[NodeIdent],
) -> None:
    logger.info(
        "round %s waits for a majority of the last round's members (%s): has %d of %d, %d "
        "known gone",
        forming,
        base_id,
        len(joined & set(base)),
        len(base),
        len(gone & set(base)),
    )
