"""Faster re-forming of torch's c10d (dynamic) rendezvous after a failure or a leave.

torch's ``DynamicRendezvousHandler`` is kept whole; this module adds four things to one handler
(:meth:`FastRendezvous.attach`), all through its own state machine and state store:

* **A 0.1 s poll while joining.** torch's operation executor sleeps 1 s between looks at the
  rendezvous state while it waits for others to join (``_Action.SYNC``); every node that waits
  there loses up to a second after the round completes. Ours looks every 0.1 s.
* **No last call once the expected nodes are in.** torch waits ``last_call_timeout`` after
  ``min_nodes`` have joined, for more to come. After a failure the agent knows who comes (the
  last round's members, minus those gone) and tells us (:meth:`expect`); the round completes
  as soon as they are all in (:func:`ddpjob_worker.policy.round_is_full`).
* **The end of a round, announced.** An agent that restarts on its own evidence (its workers
  failed, a node waits to join) or leaves says so in the store (:meth:`announce_end`); the
  others look every monitor tick (:meth:`round_over`) and restart at once, instead of when
  their own collective breaks (gloo may notice late; a worker busy computing notices only at
  its next collective).
* **Leaving, not closing.** On SIGTERM an agent writes its node to the run's ``left`` key,
  announces the end of the round and removes itself from its participants (:meth:`leave`), so
  peers re-form without it at once instead of waiting for its heartbeats to lapse. torch's
  ``shutdown`` would close the rendezvous for everyone.
* **Dead nodes named at once.** Every agent publishes the address of its liveness socket
  (:mod:`ddpjob_worker.liveness`); after a failure the others probe the old round's members
  (:meth:`gone`) and mark the dead ones (:meth:`mark_dead`): their heartbeat is set to the
  epoch, and torch's own sanitizer removes them on the next sync, as it would after the
  heartbeats lapsed. A member that does not answer in time is left to the heartbeats.

Each is an optimisation over torch's behaviour, never a new failure: if the handler is not a
dynamic one, or its internals are not where torch 2.13 keeps them, :meth:`attach` returns None
and the agent runs on stock torch behaviour. Store keys are ``ddpjob.<run id>.*``, beside
torch's ``torch.rendezvous.<run id>*``.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _Action,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousJoinOp,
    _should_keep_alive,
)

from ddpjob_worker import liveness, signals
from ddpjob_worker.policy import has_quorum, round_is_full
from ddpjob_worker.seal import Seal, SealError

logger = logging.getLogger("ddpjob_worker.rendezvous")

JOIN_POLL_SECONDS = 0.1
"""How often a joining node looks at the rendezvous state (torch: 1 s)."""
LEAVE_TIMEOUT_SECONDS = 3.0
"""How long leaving the rendezvous on SIGTERM may take (it is one compare-and-set, normally ms)."""
END_FAILURE = "failure"
"""A member's workers failed (or it gave up): the group is broken."""
END_LEAVE = "leave"
"""A member leaves on SIGTERM: the group is broken."""
END_JOIN = "join"
"""A node waits to join: the group is intact, the round only grows."""
END_DROPPED = "dropped"
"""We are no longer a participant of our round (read from the state, not announced): our
heartbeats lapsed (a store that stalled, for one, as torch's store server does while it looks
up a new client's name in a DNS that does not answer) and a newcomer's sync removed us and
opened the next round. Training on would leave that newcomer waiting alone for good."""
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_State = Any  # torch's _RendezvousState (private, untyped)
_REQUIRED = (
    "_op_executor",
    "_state_holder",
    "_this_node",
    "_settings",
    "_store",
    "_heartbeat_lock",
)


def _key(run_id: str, what: str) -> str:
    return f"ddpjob.{run_id}.{what}"


INCARNATION_SHIFT = 20
"""A node descriptor's local id is ``incarnation << 20`` plus torch's count of the agent's
handlers (:func:`seed_incarnation`)."""


def seed_incarnation() -> int:
    """Make every node descriptor this agent process makes unique to its life: torch's local
    id starts at a random ``incarnation << 20`` instead of 0.

    torch names a node ``<addr>_<pid>_<local id>``. Two agents can have the same address and
    pid: a replacement pod that gets the deleted pod's address on the same node (pods of a node
    start in the same order in a PID namespace of their own, a ``hostNetwork`` pod with a
    recycled pid). torch would then take the newcomer for the member that left: its heartbeat,
    its place in the round, our ``left`` and ``silent`` keys. Done once, before the first
    handler; returns the incarnation."""
    generator = DynamicRendezvousHandler._node_desc_generator
    with generator._lock:
        if generator._local_id >> INCARNATION_SHIFT == 0:
            generator._local_id += (secrets.randbits(31) | 1) << INCARNATION_SHIFT
        return int(generator._local_id >> INCARNATION_SHIFT)


def ident(node: _NodeDesc | str) -> str:
    """A node's identity across stores: ``<addr>_<pid>_<incarnation>`` (``<addr>_<pid>`` for
    a plain torchrun agent). torch's descriptor carries a local id that grows with every
    handler the agent builds, so it changes when the agent moves to another store; the agent
    process, its address and its incarnation (:func:`seed_incarnation`) do not."""
    text = node if isinstance(node, str) else repr(node)
    base, _, local = text.rpartition("_")
    try:
        incarnation = int(local) >> INCARNATION_SHIFT
    except ValueError:
        return base
    return f"{base}_{incarnation}" if incarnation else base


class FastRendezvous:
    """The additions above, attached to one ``DynamicRendezvousHandler``."""

    def __init__(
        self,
        handler: DynamicRendezvousHandler,
        seal: Seal | None = None,
        *,
        poll: float = JOIN_POLL_SECONDS,
    ):
        self._handler = handler
        self._seal = seal if seal is not None else Seal(None)
        self._node: _NodeDesc = handler._this_node
        self._holder = handler._state_holder
        self._settings = handler._settings
        self._store: Any = handler._store  # a torch Store (its stub lacks append)
        self._expected: frozenset[_NodeDesc] | None = None
        self._expected_idents: frozenset[str] | None = None
        self._members: frozenset[_NodeDesc] = frozenset()
        self._ranks: dict[str, int] = {}
        self._round: int | None = None
        self.fenced = False
        """Rounds complete only with a majority of the last round's members (store failover is
        on): see :func:`ddpjob_worker.policy.has_quorum`."""
        self.while_waiting: Callable[[], None] | None = None
        """Called about once a second while a fenced join waits (for more nodes, or for a
        majority); it may raise to abandon this store, as a host does that finds a newer one."""
        handler._op_executor = _Executor(self, poll)
        if self._seal.on:  # before the first sync: every state read or written is sealed
            holder: Any = self._holder
            key = f"torch.rendezvous.{self._settings.run_id}"
            holder._backend = SealedBackend(holder._backend, self._seal, key)

    @classmethod
    def attach(cls, handler: RendezvousHandler, seal: Seal | None = None) -> FastRendezvous | None:
        """Attach to ``handler``, or None if it is not torch 2.13's dynamic handler. With the
        job's key (``seal``), everything written to the store from now on is sealed with it,
        torch's rendezvous state included (:mod:`ddpjob_worker.seal`)."""
        if not isinstance(handler, DynamicRendezvousHandler) or not all(
            hasattr(handler, name) for name in _REQUIRED
        ):
            logger.info("rendezvous handler %s: torch's own timings apply", type(handler).__name__)
            return None
        if not isinstance(handler._op_executor, _DistributedRendezvousOpExecutor):
            return None
        if seal is not None and seal.on and not hasattr(handler._state_holder, "_backend"):
            return None
        return cls(handler, seal)

    # -- the run's keys, sealed with the job's key ------------------------------------------

    def _name(self, what: str) -> str:
        return _key(self._settings.run_id, what)

    def _put(self, what: str, value: str) -> None:
        name = self._name(what)
        self._store.set(name, self._seal.value(name, value))

    def _read(self, what: str) -> str | None:
        """The value of one of the run's keys; None when it is not there, or not sealed with
        the job's key (logged: nobody of the job wrote it)."""
        name = self._name(what)
        if not self._store.check([name]):
            return None
        return self._opened(name, bytes(self._store.get(name)))

    def _read_many(self, whats: Iterable[str]) -> dict[str, str]:
        """The values of those of the run's keys that are there (and sealed), in one request."""
        names = {what: self._name(what) for what in whats}
        present = {what: name for what, name in names.items() if self._store.check([name])}
        if not present:
            return {}
        values = self._store.multi_get(list(present.values()))
        found = {}
        for (what, name), raw in zip(present.items(), values, strict=True):
            value = self._opened(name, bytes(raw))
            if value is not None:
                found[what] = value
        return found

    def _opened(self, name: str, raw: bytes) -> str | None:
        value = self._seal.open(name, raw.decode(errors="replace"))
        if value is None:
            logger.warning("ignoring %s in the store: not sealed with this job's key", name)
        return value

    def _add(self, what: str, items: Iterable[str]) -> None:
        """Append ``items`` (no ``;`` in them) to one of the run's lists."""
        name = self._name(what)
        self._store.append(name, self._seal.items(name, items))

    def _items(self, what: str) -> list[str]:
        """The items of one of the run's lists that the job's agents wrote, in order."""
        name = self._name(what)
        if not self._store.check([name]):
            return []
        return self._seal.open_items(name, bytes(self._store.get(name)).decode(errors="replace"))

    def mark_hosted(self) -> None:
        """Say, as the store's host, that this store is the job's (see :func:`is_jobs_store`)."""
        self._put(HOSTED, ident(self._node))

    # -- who is in the round ----------------------------------------------------------------

    @property
    def node(self) -> _NodeDesc:
        return self._node

    @property
    def members(self) -> frozenset[_NodeDesc]:
        """The participants of the round we joined last."""
        return self._members

    @property
    def ranks(self) -> dict[str, int]:
        """Node (``repr``) -> rank in the round we joined last."""
        return dict(self._ranks)

    @property
    def round(self) -> int | None:
        return self._round

    def joined(self, gen: int = 1) -> None:
        """Note the round just joined (call right after ``next_rendezvous``); the lowest rank
        records its members in the store as the base of the next round's majority."""
        state = self._holder.state
        self._members = frozenset(state.participants)
        self._ranks = {repr(node): rank for node, rank in state.participants.items()}
        self._round = state.round
        self._expected = None
        self._expected_idents = None
        if self.fenced and self._ranks.get(repr(self._node)) == 0:
            self.record_base(f"{gen}.{state.round}", self.indexes(map(ident, self._ranks)))

    def record_base(self, base_id: str, members: dict[str, int | None]) -> None:
        """Record the members (:func:`ident` -> pod index) a later round needs a majority of."""
        self._put("base", json.dumps({"id": base_id, "members": members}))

    def base(self) -> tuple[str, dict[str, int | None]] | None:
        """``(id, members)`` recorded by :meth:`record_base`, if any."""
        raw = self._read("base")
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            members = {str(node): index for node, index in record["members"].items()}
            return str(record["id"]), members
        except (ValueError, KeyError, TypeError, AttributeError):
            logger.warning("ignoring a malformed base record in the store")
            return None

    def confirm_gone(self, nodes: Iterable[str], base_id: str | None = None) -> None:
        """Name members of the base known to be gone (dead or left), so a majority is counted
        among the others."""
        names = sorted(nodes)
        if not names:
            return
        if base_id is None:
            base = self.base()
            if base is None:
                return
            base_id = base[0]
        self._add(f"gone.{base_id}", names)

    def confirmed_gone(self, base_id: str) -> set[str]:
        """The members (:func:`ident`) known gone: named for this base, or left the run."""
        return {ident(node) for node in self.left()} | set(self._items(f"gone.{base_id}"))

    def indexes(self, nodes: Iterable[str]) -> dict[str, int | None]:
        """The pod index each node (:func:`ident`) published (None: none)."""
        names = list(nodes)
        out: dict[str, int | None] = dict.fromkeys(names)
        found = self._read_many(f"index.{node}" for node in names)
        for node in names:
            try:
                out[node] = int(found[f"index.{node}"])
            except (KeyError, ValueError):
                continue
        return out

    def quorum(self, participants: Iterable[_NodeDesc]) -> bool:
        """Whether ``participants`` hold a majority of the base (see :meth:`record_base`)."""
        base = self.base()
        if base is None:
            return True
        base_id, members = base
        names = [ident(node) for node in participants]
        gone = self.confirmed_gone(base_id)
        if has_quorum(names, members, gone, self.indexes(n for n in names)):
            return True
        logger.debug("no majority of base %s %s (gone %s) in %s", base_id, members, gone, names)
        return False

    def expect(self, nodes: frozenset[_NodeDesc] | None) -> None:
        """The nodes the next round waits for before it completes (None: torch's last call)."""
        self._expected = nodes

    def expected(self) -> frozenset[_NodeDesc] | None:
        return self._expected

    def expect_idents(self, idents: frozenset[str] | None) -> None:
        """As :meth:`expect`, by :func:`ident` (the nodes of another store)."""
        self._expected_idents = idents

    def expected_idents(self) -> frozenset[str] | None:
        return self._expected_idents

    def announce_end(self, *reasons: str) -> None:
        """Tell the round's members it is over, and why (:data:`END_FAILURE`, :data:`END_LEAVE`,
        :data:`END_JOIN`). They restart at once instead of when their collective breaks, which
        gloo notices late or, for a worker busy computing, only at its next collective."""
        if self._round is not None:
            self._add(self._over(), [f"{reason}@{self._node!r}" for reason in reasons])

    def round_over(self) -> frozenset[str]:
        """Why our round is over, as its members announced, or :data:`END_DROPPED` when the
        state (as last synced: ``num_nodes_waiting`` syncs it) no longer has us in it; empty:
        it is not over. One small store request while it is not."""
        if self._round is None:
            return frozenset()
        state = self._holder.state
        if state.round != self._round or self._node not in state.participants:
            return frozenset({END_DROPPED})
        members = {repr(node) for node in state.participants} | {repr(n) for n in self._members}
        reasons = set()
        for item in self._items(self._over()):
            reason, _, author = item.partition("@")
            if author in members:  # a round's end is its members' to say
                reasons.add(reason)
        return frozenset(reasons)

    def _over(self) -> str:
        return f"round.{self._round}.over"

    # -- the run's own keys -----------------------------------------------------------------

    def publish(self, address: str, *, host: bool = False, index: int | None = None) -> None:
        """Publish where our liveness socket listens and our pod index (again on every store:
        a recovered store starts empty), and, from the store's host, which node it is."""
        self._add("alive", [f"{self._node!r}={address}"])
        if index is not None:
            self._put(f"index.{ident(self._node)}", str(index))
        if host:
            self._put("host", repr(self._node))

    def set_gen(self, gen: int) -> None:
        """Record this store's generation (1: the job's first store; each failover adds 1)."""
        self._put("gen", str(gen))

    def gen(self) -> int:
        try:
            return int(self._read("gen") or 1)
        except ValueError:
            return 1

    def host(self) -> str | None:
        """The node (``repr``) of the agent that hosts this store, if it said so."""
        return self._read("host")

    def addresses(self, nodes: Iterable[_NodeDesc]) -> dict[str, str]:
        """The liveness addresses (node ``repr`` -> ``host:port``) that ``nodes`` published;
        those that published none are left out. One request, whatever the number of nodes:
        every agent publishes in the run's one ``alive`` list."""
        wanted = {repr(node) for node in nodes}
        found = {}
        for item in self._items("alive"):
            node, _, address = item.rpartition("=")
            if node in wanted and address:
                found[node] = address
        return found

    def announce_silent(self, nodes: Iterable[str]) -> None:
        """Name the members of our round that stopped answering (read by :meth:`silent`)."""
        if self._round is not None:
            self._add(f"round.{self._round}.silent", nodes)

    def silent(self) -> set[str]:
        """The members (``repr``) that a peer found silent in the round we joined last."""
        if self._round is None:
            return set()
        return set(self._items(f"round.{self._round}.silent"))

    def left(self) -> set[str]:
        """The nodes (``repr``) that left the run on SIGTERM."""
        return set(self._items("left"))

    def gone(
        self, nodes: Iterable[_NodeDesc], timeout: float = liveness.PROBE_TIMEOUT_SECONDS
    ) -> tuple[set[_NodeDesc], set[_NodeDesc]]:
        """``(gone, unsure)`` among ``nodes``: gone ones left, were found silent in our round,
        or nobody listens at their liveness address any more; unsure ones never published
        one, or did not answer in time (only torch's heartbeats can tell)."""
        others = {node for node in nodes if node != self._node}
        left = self.left() | self.silent()
        gone = {node for node in others if repr(node) in left}
        addresses = self.addresses(others - gone)
        unsure = {node for node in others - gone if repr(node) not in addresses}
        answers = liveness.probe_all(addresses, timeout)
        for node in others - gone - unsure:
            answer = answers[repr(node)]
            if answer is liveness.Liveness.DEAD:
                gone.add(node)
            elif answer is liveness.Liveness.UNKNOWN:
                unsure.add(node)
        return gone, unsure

    def skip_join_jitter(self) -> None:
        """Skip the random 0-0.3 s sleep torch takes before a handler's first join.

        torch sleeps so that nodes started together do not hit the store at once. Agents that
        rejoin a store host's replacement were spread out by their own failure detection, and
        the sleep only delays the round. torch decides it from the cached state's round number
        (0 on a fresh handler); the first sync of the join replaces that state with the store's.
        """
        self._holder.state.round = max(self._holder.state.round, 1)

    # -- changing the state -----------------------------------------------------------------

    def mark_dead(self, nodes: Iterable[_NodeDesc]) -> None:
        """Expire the heartbeats of ``nodes``: torch's sanitizer removes them on the next sync,
        exactly as after their heartbeats lapsed (participants, wait list, round epilogue)."""
        targets = set(nodes)
        if not targets:
            return
        with self._handler._heartbeat_lock:
            for _ in range(10):  # compare-and-set: retry when another node wrote first
                _fresh_sync(self._holder)
                state = self._holder.state
                present = targets & set(state.last_heartbeats)
                if not present:
                    return
                for node in present:
                    state.last_heartbeats[node] = _EPOCH
                self._holder.mark_dirty()
                if self._holder.sync():
                    logger.info(
                        "marked %s as gone in the rendezvous (no liveness answer)",
                        ", ".join(sorted(map(repr, present))),
                    )
                    return

    def leave(self) -> None:
        """Leave the run without closing it: say so in the ``left`` key, then remove ourselves
        from the round's participants. Peers re-form without us at once."""
        self._add("left", [repr(self._node)])
        self.announce_end(END_LEAVE)
        stop = getattr(self._handler, "_stop_heartbeats", None)
        if stop is not None:
            stop()
        deadline = time.monotonic() + LEAVE_TIMEOUT_SECONDS
        # Under the keep-alive's lock, as torch's own exit op runs: a keep-alive already in
        # flight would otherwise write our heartbeat back over the removal.
        with self._handler._heartbeat_lock:
            self._handler._op_executor.run(_RendezvousExitOp(), deadline)
        logger.info("left the rendezvous (node %r)", self._node)


HOSTED = "hosted"
"""The run's key that a store's host writes as soon as it hosts the store (sealed)."""
HOSTED_WAIT_SECONDS = 5.0
"""How long an agent that reached a store waits for its host's ``hosted`` key (it is written
milliseconds after the store starts) before taking the store for another job's."""


def is_jobs_store(
    handler: RendezvousHandler, seal: Seal, timeout: float = HOSTED_WAIT_SECONDS
) -> bool:
    """Whether the store ``handler`` reached is the job's: its host wrote the run's ``hosted``
    key, sealed with the job's key. A name may resolve to an address that is now another pod's
    (a cached DNS answer, a reused IP, a ``hostNetwork`` pod of another job on the same node
    and port): its store takes any run id and would host a rendezvous of ours. Without the
    job's key there is nothing to tell by, and any store is taken (True)."""
    if not seal.on or not isinstance(handler, DynamicRendezvousHandler):
        return True
    store: Any = handler._store
    name = _key(handler._settings.run_id, HOSTED)
    try:
        store.wait([name], timedelta(seconds=timeout))
        return seal.open(name, bytes(store.get(name)).decode(errors="replace")) is not None
    except RuntimeError:  # DistStoreError: not there in time
        return False


class SealedBackend:
    """torch's rendezvous state backend, with the state sealed with the job's key: a state
    that is not (forged, or written by an agent without the key) is refused before torch
    unpickles it (:class:`ddpjob_worker.seal.SealError`)."""

    def __init__(self, backend: Any, seal: Seal, key: str) -> None:
        self._backend = backend
        self._seal = seal
        self._key = key

    @property
    def name(self) -> str:
        return str(self._backend.name)

    def get_state(self) -> tuple[bytes, Any] | None:
        got = self._backend.get_state()
        if got is None:
            return None
        state, token = got
        return self._open(state), token

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        got = self._backend.set_state(self._seal.seal_bytes(self._key, state), token)
        if got is None:
            return None
        stored, token, done = got
        return self._open(stored), token, done

    def _open(self, state: bytes) -> bytes:
        try:
            return self._seal.open_bytes(self._key, state)
        except SealError as exc:
            logger.error("%s", exc)
            raise


def _fresh_sync(holder: Any) -> None:
    """Sync the state holder from the store now, past its 1 s cache."""
    holder._last_sync_time = -1
    holder.sync()


class _Executor(_DistributedRendezvousOpExecutor):
    """torch's executor; joins poll faster and complete once the expected nodes are in."""

    def __init__(self, fast: FastRendezvous, poll: float) -> None:
        super().__init__(fast._node, fast._holder, fast._settings)
        self._fast = fast
        self._poll = poll
        self._vetoed_at = 0.0
        self._asked_at = time.monotonic()

    def run(
        self,
        state_handler: Callable[[_RendezvousContext, float], _Action],
        deadline: float,
        update_deadline: Callable[[timedelta], float] | None = None,
    ) -> None:
        if isinstance(state_handler, _RendezvousJoinOp):
            state_handler = self._join(state_handler)
        super().run(state_handler, deadline, update_deadline)

    def _join(
        self, join: Callable[[_RendezvousContext, float], _Action]
    ) -> Callable[[_RendezvousContext, float], _Action]:
        def handler(ctx: _RendezvousContext, deadline: float) -> _Action:
            while True:
                action = join(ctx, deadline)
                if action == _Action.SYNC and self._full(ctx.state):
                    action = _Action.MARK_RENDEZVOUS_COMPLETE
                if action == _Action.MARK_RENDEZVOUS_COMPLETE and not self._may_complete(ctx):
                    if _should_keep_alive(ctx):
                        return _Action.KEEP_ALIVE
                    action = _Action.SYNC
                if action != _Action.SYNC:
                    return action
                fast = self._fast
                now = time.monotonic()
                if fast.fenced and fast.while_waiting is not None and now - self._asked_at >= 1:
                    self._asked_at = now
                    fast.while_waiting()
                # torch would sleep 1 s here and sync again; we look every poll interval.
                time.sleep(self._poll)
                signals.check()
                _fresh_sync(self._state_holder)
                self._state = self._state_holder.state
                ctx = _RendezvousContext(self._node, self._state, self._settings)

        return handler

    def _may_complete(self, ctx: _RendezvousContext) -> bool:
        """The majority rule (:meth:`FastRendezvous.quorum`), when the rendezvous is fenced."""
        fast = self._fast
        if not fast.fenced:
            return True
        if fast.quorum(ctx.state.participants):
            return True
        now = time.monotonic()
        if now - self._vetoed_at >= 5.0:
            self._vetoed_at = now
            logger.info(
                "round %d waits for a majority of the last round's members (has %s)",
                ctx.state.round,
                ", ".join(sorted(map(repr, ctx.state.participants))),
            )
        return False

    def _full(self, state: _State) -> bool:
        if state.closed or state.complete or self._node not in state.participants:
            return False
        idents = self._fast.expected_idents()
        if idents is not None:
            return round_is_full(
                {ident(node) for node in state.participants},
                idents,
                waiting=len(state.wait_list),
                min_nodes=self._settings.min_nodes,
            )
        return round_is_full(
            state.participants,
            self._fast.expected(),
            waiting=len(state.wait_list),
            min_nodes=self._settings.min_nodes,
        )


def store_params(
    params: RendezvousParameters, endpoint: str, *, is_host: bool
) -> RendezvousParameters:
    """``params`` for the store at ``endpoint``, hosted by us or not."""
    config = {key: value for key, value in params.config.items() if key != "is_host"}
    return RendezvousParameters(
        backend=params.backend,
        endpoint=endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        is_host="true" if is_host else "false",
        **config,
    )


def stop_heartbeats(handler: RendezvousHandler) -> None:
    """Stop a dead handler's keep-alive thread (torch has no public API for it), without
    waiting: torch joins that thread, which may be blocked for good on a store that stopped
    answering."""
    stop: Callable[[], None] | None = getattr(handler, "_stop_heartbeats", None)
    if stop is None:
        return

    def run() -> None:
        try:
            stop()
        except Exception:  # best effort on a handler we are discarding
            logger.debug("could not stop the old handler's heartbeats", exc_info=True)

    threading.Thread(target=run, name="ddpjob-stop-heartbeats", daemon=True).start()
