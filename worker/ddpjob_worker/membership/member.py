"""A member of the hub's membership (:mod:`ddpjob_worker.membership.hub`): one connection for its
life. No torch.

The member says ``hello``, sends a heartbeat every
:data:`ddpjob_worker.membership.hub.HEARTBEAT_SECONDS` and reads the hub's answers: acknowledgements
(the round, and how many newcomers wait), the round it is given (its rank and the world size), the
end of its round (why, and who was cut), and requests to probe a suspect for the hub. What it learns
is one frozen :class:`MemberView`, replaced whole, that the agent reads at every monitor tick
without a network call.

The hub is lost when it stops acknowledging for the silence window (SILENT; three windows before
it has given us a round), when its connection
closes and its port refuses (GONE), or when its host hands over (GONE). A member whose own loop
did not run for a while (frozen, starved) judges nobody for that time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ddpjob_worker.membership import liveness
from ddpjob_worker.membership.hub import HEARTBEAT_SECONDS
from ddpjob_worker.membership.hubwatch import STALL_SECONDS
from ddpjob_worker.membership.liveness import Answer, Health
from ddpjob_worker.membership.nodes import NodeIdent
from ddpjob_worker.membership.wire import MAX_LINE, Message, Wire, shared_loop, submit
from ddpjob_worker.progress import Progress

logger = logging.getLogger("ddpjob_worker.membership.member")

CONNECT_SECONDS = 2.0
FIRST_ROUND_SILENT_SECONDS = 3 * liveness.SILENT_AFTER_SECONDS
"""How long a member that has no round from its hub yet waits for an answer before it takes the
hub as lost. A hub forming its first round (a job's start, a failover's new host) is asked by
the whole job at once, and its process may be starved meanwhile: at 1,024 hollow agents the
host's hub stalled 7 s at a time while the job started, its members took it as lost after 2 s,
came back with new connections, hellos and joins, and added to its load (1 run in 27 formed no
first round). A host lost before its first round is found 4 s later."""


@dataclasses.dataclass
class History:
    """What one agent has done in the job, across its stores (shared by its members)."""

    rounds: int = 0
    """Rounds it was given. 0: a fresh pod, which a pod index's old holder yields to."""


@dataclasses.dataclass(frozen=True)
class RoundInfo:
    """The round the hub gave us."""

    gen: int
    round: int
    rank: int
    world: int
    base_id: str
    chain: tuple[tuple[NodeIdent, int | None, str | None], ...]
    """The first ranks (ident, pod index, liveness address): who hosts the next generation."""
    base: Mapping[NodeIdent, int | None] | None = None
    """Every member (-> pod index), for the first ranks: the next majority's base."""
    host: tuple[NodeIdent, str | None] | None = None
    """The hub's own agent (ident, liveness address)."""
    boot: tuple[str, int] | None = None
    """Where the round's rank 0 worker serves the workers' store (MASTER_ADDR, MASTER_PORT),
    as its agent said when it joined; None from a hub that does not say."""
    prev_id: str | None = None
    """The round before this one, as the hub saw it (None: this is its first)."""
    left: int = 0
    """Members of that round missing from this one."""

    def departed(self, mine: RoundInfo | None) -> bool | None:
        """Whether a member of ``mine`` (the round this member was last in) is missing from
        this one: the hub says how many of its previous round left; if ours was not that
        round, we were cut off ourselves, which is a change too. None for a first round."""
        if mine is None:
            return None
        return self.left > 0 or self.prev_id != mine.base_id


@dataclasses.dataclass(frozen=True)
class MemberView:
    """What the member knows now."""

    connected: bool = False
    gen: int = 0
    round: RoundInfo | None = None
    ends: frozenset[str] = frozenset()
    """Why our round is over (empty: it runs)."""
    cut: frozenset[NodeIdent] = frozenset()
    """Members cut from our round."""
    hung: bool = False
    """Our worker held our round up (the hub's hang verdict): ours to kill, and to charge."""
    waiting: int = 0
    """Newcomers waiting to join (the hub's last word)."""
    hub_lost: Health | None = None
    closed: bool = False
    replaced: bool = False
    """A pod of our index took our place (we were cut off, and the operator replaced us)."""


class Member:
    """One agent's membership (see the module doc)."""

    def __init__(
        self,
        wire: Wire,
        *,
        ident: NodeIdent,
        index: int | None,
        liveness_address: str | None,
        history: History | None = None,
        ask: Callable[[str], Answer] = liveness.ask,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``history``: the agent's, shared by the members it makes for each store."""
        self._wire = wire
        self.ident = ident
        self._index = index
        self._liveness = liveness_address
        self.history = history if history is not None else History()
        self._ask = ask
        self._clock = clock
        self.view = MemberView()
        self._changed = threading.Condition()
        self.on_change: Callable[[], None] | None = None
        """Called (on the loop's thread) when :attr:`view` changes: the agent's doorbell."""
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._probes: set[asyncio.Task[None]] = set()
        self._hub: str | None = None
        self._acked = clock()
        self._seq = 0
        self._joining = False
        self._join: Message = {"t": "join"}
        self.progress: Callable[[float], list[Progress]] | None = None
        """This node's workers' progress records written since a time (``time.monotonic()``),
        told to the hub with each heartbeat for its hang detection; None: none to tell."""
        self._round_at = 0.0
        """When our current round came (``time.monotonic()``): older records are not its."""
        self.local = False
        """Our hub runs in this process, on our loop (we are its host's member): its silence
        is our own process stalled, never its loss. A starved host whose own member took its
        hub as lost left the job, and everyone failed over again."""
        self.sent = 0
        self.received = 0

    # -- the thread side (the agent) ------------------------------------------------------------

    def connect(self, hub: str, timeout: float = CONNECT_SECONDS) -> None:
        """Connect to the hub at ``hub`` (``host:port``) and say hello. Raises ``OSError``."""
        submit(self._connect(hub)).result(timeout + 1)

    def join(self, boot: tuple[str, int] | None = None) -> None:
        """Ask to be in the hub's next round (again after a reconnection, until one comes).
        ``boot``: where this agent's rank 0 worker would serve the workers' store (address,
        free port), told to the whole round if this agent gets rank 0."""
        self._joining = True
        self._join = {"t": "join"} if boot is None else {"t": "join", "boot": list(boot)}
        self._post(self._join)

    def end(self, reason: str) -> None:
        """Our evidence ends our round (our workers failed, a node waits)."""
        info = self.view.round
        if info is not None:
            self._post({"t": "end", "round": info.round, "reason": reason})

    def leave(self, *, handover: bool = False) -> None:
        """Leave the run (SIGTERM); as the store's host, hand it over."""
        self._post({"t": "leave", "handover": handover})

    def close_rendezvous(self) -> None:
        self._post({"t": "close"})

    def disconnect(self) -> None:
        submit(self._disconnect())

    def wait(self, predicate: Callable[[MemberView], bool], timeout: float) -> MemberView:
        """Wait until ``predicate(view)`` (or ``timeout``), and return the view."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self.view):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.1))
            return self.view

    def _post(self, message: Message) -> None:
        submit(self._write(message))

    def _set(self, **changes: Any) -> None:
        with self._changed:
            old, self.view = self.view, dataclasses.replace(self.view, **changes)
            self._changed.notify_all()
        if self.view != old and self.on_change is not None:
            self.on_change()

    # -- the loop side ----------------------------------------------------------------------------

    async def _connect(self, hub: str) -> None:
        host, _, port = hub.rpartition(":")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port), limit=MAX_LINE),
            CONNECT_SECONDS,
        )
        await self._disconnect()  # only once the new connection stands
        self._hub = hub
        self._writer = writer
        self._acked = self._clock()
        self._set(connected=True, hub_lost=None)
        await self._write(
            {
                "t": "hello",
                "ident": self.ident,
                "index": self._index,
                "liveness": self._liveness,
                "fresh": self.history.rounds == 0,
            }
        )
        if self._joining:
            await self._write(self._join)  # the hub forgot we asked when our link closed
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read(reader, writer)),
            loop.create_task(self._beat(writer)),
        ]

    async def _disconnect(self) -> None:
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._tasks = []
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    async def _write(self, message: Message) -> None:
        writer = self._writer
        if writer is None:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            writer.write(self._wire.encode(message))
            self.sent += 1

    async def _beat(self, writer: asyncio.StreamWriter) -> None:
        ticked = self._clock()
        while writer is self._writer:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            now = self._clock()
            if now - ticked > HEARTBEAT_SECONDS + STALL_SECONDS:
                logger.warning(
                    "this member's loop did not run for %.1fs (its process was frozen or "
                    "starved): not judging the hub for that time",
                    now - ticked - HEARTBEAT_SECONDS,
                )
                self._acked = now  # we were stalled: no answer expected meanwhile
            ticked = now
            self._seq += 1
            await self._write(self._heartbeat())
            window = (
                liveness.SILENT_AFTER_SECONDS
                if self.view.round is not None
                else FIRST_ROUND_SILENT_SECONDS
            )
            if now - self._acked >= window and self.view.hub_lost is None and not self.local:
                logger.warning(
                    "the hub at %s has not answered for %gs: taking it as lost", self._hub, window
                )
                self._set(hub_lost=Health.SILENT)

    def _heartbeat(self) -> Message:
        """A heartbeat, with our round's progress records when we have some: ``p`` is the
        round, then ``[step, phase, seconds in it, threshold]`` of each local rank (ages, not
        times: the hub's clock is not ours)."""
        message: Message = {"t": "hb", "seq": self._seq}
        info = self.view.round
        if self.progress is None or info is None or self.view.ends:
            return message
        records = self.progress(self._round_at)
        if records:
            now = time.monotonic()
            message["p"] = [
                info.round,
                [[r.step, int(r.phase), round(now - r.since, 3), r.threshold] for r in records],
            ]
        return message

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                message = self._wire.decode(line)
                if message is not None:
                    self.received += 1
                    self._handle(message)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        if writer is not self._writer:
            return  # we moved on
        self._set(connected=False)
        if self.view.hub_lost is None:
            loop = asyncio.get_running_loop()
            task = loop.create_task(self._reconnect(writer))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _reconnect(self, writer: asyncio.StreamWriter) -> None:
        """Our connection to the hub closed: is the hub gone (its port refuses), or was it a
        blip (say hello again)? A hub we cannot reach again within the silence window is
        lost."""
        started = self._clock()
        while writer is self._writer and self.view.hub_lost is None and not self.view.connected:
            lost = await asyncio.get_running_loop().run_in_executor(None, self._hub_health)
            if lost is Health.GONE:
                logger.warning("the hub at %s is gone", self._hub)
                self._set(hub_lost=lost)
                return
            if lost is Health.ALIVE:
                try:
                    logger.info(
                        "our connection to the hub at %s closed: saying hello again", self._hub
                    )
                    await self._connect(self._hub or "")
                    return
                except (TimeoutError, OSError) as exc:
                    logger.info("could not reach the hub again: %s", exc)
            if self._clock() - started >= liveness.SILENT_AFTER_SECONDS:
                logger.warning("the hub at %s does not answer: taking it as lost", self._hub)
                self._set(hub_lost=Health.SILENT)
                return
            await asyncio.sleep(0.1)

    def _hub_health(self) -> Health:
        """Whether the hub's port still answers, after its connection closed."""
        if self._hub is None:
            return Health.GONE
        return liveness.probe(self._hub, timeout=1.0)

    def _handle(self, message: Message) -> None:
        kind = message["t"]
        now = self._clock()
        if kind in ("ack", "welcome"):
            self._acked = now
            info = self.view.round
            hub_round = message.get("round")
            moved = isinstance(hub_round, int) and info is not None and hub_round > info.round
            if kind == "ack" and moved and not self.view.ends:
                # The hub moved on without telling us (we missed its word): re-form.
                self._set(ends=frozenset({"dropped"}))
            self._set(gen=int(message.get("gen", 0)))
        elif kind == "round":
            self._acked = now
            base = message.get("base")
            info = RoundInfo(
                gen=int(message["gen"]),
                round=int(message["round"]),
                rank=int(message["rank"]),
                world=int(message["world"]),
                base_id=str(message["base_id"]),
                chain=tuple(
                    (NodeIdent(str(ident)), index, address)
                    for ident, index, address in message.get("chain", [])
                ),
                base=(
                    {NodeIdent(str(k)): v for k, v in base.items()}
                    if isinstance(base, dict)
                    else None
                ),
                host=_host(message.get("host")),
                boot=_boot(message.get("boot")),
                prev_id=None if message.get("prev") is None else str(message["prev"]),
                left=int(message.get("left", 0)),
            )
            self._joining = False
            self._round_at = time.monotonic()
            self.history.rounds += 1
            self._set(
                round=info, ends=frozenset(), cut=frozenset(), hung=False, waiting=0, gen=info.gen
            )
        elif kind == "over":
            self._acked = now
            info = self.view.round
            reasons = frozenset(str(reason) for reason in message.get("reasons", []))
            if "handover" in reasons:
                logger.info("the store's host hands over (it stops): carrying on around a new host")
                self._set(hub_lost=Health.GONE, ends=self.view.ends | reasons)
                return
            if info is not None and message.get("round") == info.round:
                cut = frozenset(NodeIdent(str(ident)) for ident in message.get("cut", []))
                hung = self.ident in {str(ident) for ident in message.get("hung", [])}
                self._set(
                    ends=self.view.ends | reasons,
                    cut=self.view.cut | cut,
                    hung=self.view.hung or hung,
                )
        elif kind == "probe":
            loop = asyncio.get_running_loop()
            target = str(message.get("target", ""))
            req = message.get("req")

            async def probe() -> None:
                answer = await loop.run_in_executor(None, self._ask, target)
                await self._write({"t": "probed", "req": req, "health": answer.health.value})

            task = loop.create_task(probe())
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)
        elif kind == "closed":
            self._set(closed=True)
        elif kind == "replaced":
            logger.warning("a pod of our index replaced us in the job: not training beside it")
            self._set(replaced=True)


def _host(raw: Any) -> tuple[NodeIdent, str | None] | None:
    if isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str):
        return NodeIdent(raw[0]), raw[1] if isinstance(raw[1], str) else None
    return None


def loop() -> asyncio.AbstractEventLoop:
    """The loop members and hubs of this process run on."""
    return shared_loop()


def _boot(raw: object) -> tuple[str, int] | None:
    """A ``[address, port]`` pair from the wire, or None."""
    if (
        isinstance(raw, list)
        and len(raw) == 2
        and isinstance(raw[0], str)
        and isinstance(raw[1], int)
        and 0 < raw[1] < 65536
    ):
        return raw[0], raw[1]
    return None
