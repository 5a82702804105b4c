"""Our additions to torch's c10d (dynamic) rendezvous, through its own state machine.

torch's ``DynamicRendezvousHandler`` is kept whole; :class:`RendezvousAdapter` attaches to one
handler and adds:

* **A 0.1 s poll while joining.** torch's operation executor sleeps 1 s between looks at the
  rendezvous state while it waits for others to join (``_Action.SYNC``); every node that waits
  there loses up to a second after the round completes. Ours looks every 0.1 s.
* **No last call once the expected nodes are in.** torch waits ``last_call_timeout`` after
  ``min_nodes`` have joined, for more to come. After a failure the agent knows who comes (the last
  round's members, minus those gone) and says so (:meth:`RendezvousAdapter.expect`); the round
  completes as soon as they are all in (:func:`ddpjob_worker.membership.failover.round_is_full`).
* **The end of a round, announced.** An agent that restarts on its own evidence (its workers
  failed, a node waits to join) or leaves says so in the store; the others look every monitor
  tick (:meth:`RendezvousAdapter.round_over`) and restart at once, instead of when their own
  collective breaks (gloo may notice late; a worker busy computing notices only at its next
  collective).
* **Leaving, not closing.** On SIGTERM an agent names itself in the run's ``left`` key,
  announces the end of the round and removes itself from its participants
  (:meth:`RendezvousAdapter.leave`), so peers re-form without it at once instead of waiting for
  its heartbeats to lapse. torch's ``shutdown`` would close the rendezvous for everyone.
* **Members expired at once.** Members known gone or silent (the agent judges them through their
  liveness sockets, :mod:`ddpjob_worker.membership.watch`) get their heartbeat set to the epoch
  (:meth:`RendezvousAdapter.expire`), and torch's own sanitizer removes them on the next sync, as it
  would after their heartbeats lapsed.

Each is an optimisation over torch's behaviour, never a new failure: if the handler is not a dynamic
one, or its internals are not where torch 2.13 keeps them, :meth:`RendezvousAdapter.attach` returns
None and the agent runs on stock torch behaviour. This is the agent outside a DDPJob pod (plain
``ddpjob-agent`` with torchrun's flags, no store failover); in a DDPJob pod the store's host decides
the rounds (:mod:`ddpjob_worker.agent.hubrdzv`), fenced by a majority. The run's own keys are
:class:`ddpjob_worker.membership.keys.RunKeys`; this module is the torch side, and speaks of nodes
as :data:`~ddpjob_worker.membership.nodes.NodeRepr` at its interface.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.agent.server.api import (  # the exit barrier's key (wire format)
    _TERMINAL_STATE_SYNC_ID,
)
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    _Action,
    _DistributedRendezvousOpExecutor,
    _NodeDesc,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousJoinOp,
)
from torch.distributed.elastic.utils.store import (  # the barrier's check-in, torch's own
    _barrier_nonblocking,
)

from ddpjob_worker.agent import signals
from ddpjob_worker.errors import StoreUnreachableError
from ddpjob_worker.membership import watch
from ddpjob_worker.membership.failover import round_is_full
from ddpjob_worker.membership.keys import (
    END_DROPPED,
    END_FAILURE,
    END_LEAVE,
    HOSTED,
    RunKeys,
    key,
)
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.nodes import INCARNATION_SHIFT, NodeIdent, NodeRepr, ident
from ddpjob_worker.membership.seal import Seal, SealError
from ddpjob_worker.membership.watch import Look, RoundView, RoundWatch, round_view

logger = logging.getLogger("ddpjob_worker.agent.rendezvous")

JOIN_POLL_SECONDS = 0.1
"""How often a joining node looks at the rendezvous state (torch: 1 s)."""
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


def _repr(node: _NodeDesc) -> NodeRepr:
    return NodeRepr(repr(node))


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


class RendezvousAdapter:
    """The additions above, attached to one ``DynamicRendezvousHandler``."""

    def __init__(
        self,
        handler: DynamicRendezvousHandler,
        seal: Seal | None = None,
        *,
        poll: float = JOIN_POLL_SECONDS,
    ):
        self._handler = handler
        self._node: _NodeDesc = handler._this_node
        self._holder = handler._state_holder
        self._settings = handler._settings
        seal = seal if seal is not None else Seal(None)
        self.keys = RunKeys(handler._store, self._settings.run_id, seal, _repr(self._node))
        """The run's own keys in this handler's store."""
        self.expected: frozenset[NodeIdent] | None = None
        """The nodes the next round waits for before it completes (None: torch's last call)."""
        self._members: frozenset[NodeRepr] = frozenset()
        self._ranks: dict[NodeRepr, int] = {}
        self._round: int | None = None
        self.while_waiting: Callable[[], None] | None = None
        """Unused: no failover without the hub
        (:class:`ddpjob_worker.membership.watch.RoundControl`)."""
        handler._op_executor = _Executor(self, poll)
        if seal.on:  # before the first sync: every state read or written is sealed
            holder: Any = self._holder
            name = f"torch.rendezvous.{self._settings.run_id}"
            holder._backend = SealedBackend(holder._backend, seal, name)

    @classmethod
    def attach(
        cls, handler: RendezvousHandler, seal: Seal | None = None
    ) -> RendezvousAdapter | None:
        """Attach to ``handler``, or None if it is not torch 2.13's dynamic handler. With the
        job's key (``seal``), everything written to the store from now on is sealed with it,
        torch's rendezvous state included (:mod:`ddpjob_worker.membership.seal`)."""
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

    # -- who is in the round ----------------------------------------------------------------

    @property
    def me(self) -> NodeRepr:
        """This agent's node in this store."""
        return _repr(self._node)

    @property
    def address(self) -> str:
        """This node's rendezvous address (the pod's)."""
        return str(self._node.addr)

    @property
    def members(self) -> frozenset[NodeRepr]:
        """The participants of the round we joined last."""
        return self._members

    @property
    def ranks(self) -> dict[NodeRepr, int]:
        """Node -> rank in the round we joined last."""
        return dict(self._ranks)

    @property
    def round(self) -> int | None:
        return self._round

    def note_round(self) -> None:
        """Note the round just joined (call right after ``next_rendezvous``)."""
        state = self._holder.state
        self._ranks = {_repr(node): rank for node, rank in state.participants.items()}
        self._members = frozenset(self._ranks)
        self._round = state.round
        self.expected = None

    def expect(self, nodes: Iterable[NodeIdent] | None) -> None:
        """The nodes the next round waits for before it completes (None: torch's last call)."""
        self.expected = None if nodes is None else frozenset(nodes)

    def joined(
        self, gen: int, *, my_address: str | None, failover: bool
    ) -> tuple[RoundView, dict[NodeRepr, str]]:
        """Note the round just joined, and read its view and the members to watch. Raises the
        store's errors."""
        self.note_round()
        return round_view(
            self.keys, self.ranks, base_id=f"{gen}.{self._round}", my_address=my_address
        )

    def publish(self, liveness: str | None, *, hosting: bool, index: int | None) -> None:
        """Publish where our liveness socket answers (again on every store: a recovered store
        starts empty); as the store's host, that the store is the job's."""
        if hosting:
            self.keys.mark_hosted()
        if liveness is not None:
            self.keys.publish(liveness, host=hosting)

    def look(self, watch: RoundWatch, *, hosting: bool, limit: float) -> Look:
        """One tick's look (:meth:`ddpjob_worker.membership.watch.RoundWatch.look`): the store's
        waiting nodes and the round's end, and the peers' answers."""
        handler = self._handler

        def read() -> tuple[int, frozenset[str]]:
            try:
                return handler.num_nodes_waiting(), self.round_over()
            except (RendezvousConnectionError, DistNetworkError, DistStoreError) as exc:
                # torch wraps store errors in RendezvousConnectionError; our own look does not
                raise StoreUnreachableError(str(exc)) from exc

        def drop(silent: frozenset[NodeRepr], gone: frozenset[NodeRepr]) -> None:
            self.announce_silent(sorted(silent))
            self.announce_end(END_FAILURE)
            self.expire(self._members & (silent | gone))

        return watch.look(read, drop, hosting=hosting, limit=limit)

    def leave(self, timeout: float, *, hosting: bool) -> None:
        """Leave the run without closing it (the store's host cannot: its store goes with
        it)."""
        if not hosting:
            self._leave(timeout)

    # -- the round's end ----------------------------------------------------------------------

    def announce_end(self, *reasons: str) -> None:
        """Tell the round's members it is over, and why (:data:`END_FAILURE`, :data:`END_LEAVE`,
        :data:`END_JOIN`...). They restart at once instead of when their collective breaks."""
        if self._round is not None:
            self.keys.announce_end(self._round, *reasons)

    def round_over(self) -> frozenset[str]:
        """Why our round is over, as its members announced, or :data:`END_DROPPED` when the
        state (as last synced: ``num_nodes_waiting`` syncs it) no longer has us in it; empty:
        it is not over. One small store request while it is not."""
        if self._round is None:
            return frozenset()
        state = self._holder.state
        if state.round != self._round or self._node not in state.participants:
            return frozenset({END_DROPPED})
        members = {_repr(node) for node in state.participants} | self._members
        return self.keys.ends(self._round, members)

    def announce_silent(self, nodes: Iterable[NodeRepr]) -> None:
        """Name the members of our round that stopped answering (read by :meth:`silent`)."""
        if self._round is not None:
            self.keys.announce_silent(self._round, nodes)

    def silent(self) -> set[NodeRepr]:
        """The members that a peer found silent in the round we joined last."""
        return set() if self._round is None else self.keys.silent(self._round)

    def skip_join_jitter(self) -> None:
        """Skip the random 0-0.3 s sleep torch takes before a handler's first join.

        torch sleeps so that nodes started together do not hit the store at once. Agents that
        rejoin a store host's replacement were spread out by their own failure detection, and
        the sleep only delays the round. torch decides it from the cached state's round number
        (0 on a fresh handler); the first sync of the join replaces that state with the store's.
        """
        self._holder.state.round = max(self._holder.state.round, 1)

    def ring_on_news(self, ring: Callable[[], None]) -> bool:
        """A look reads the store (the round's state, its silent list): nothing rings."""
        return False

    # -- who comes back -------------------------------------------------------------------------

    def member_gone(self) -> bool:
        """Whether a member of our round left, was found silent, or no longer listens."""
        try:
            health = watch.judge(self.keys, self._members, silent=self.silent())
        except (RuntimeError, OSError):
            return False
        return any(verdict in (Health.GONE, Health.SILENT) for verdict in health.values())

    def expect_survivors(self) -> None:
        """Before rejoining: which members of the last round come back? Those gone or found
        silent are expired (torch would wait for their heartbeats to lapse), and the round
        completes once the others are in (no last call). If any member cannot be judged (no
        answer in time), torch's heartbeats and last call decide."""
        if not self._members:
            return
        try:
            health = watch.judge(self.keys, self._members, silent=self.silent())
            gone = {node for node, verdict in health.items() if verdict is Health.GONE}
            out = gone | {node for node, verdict in health.items() if verdict is Health.SILENT}
            self.expire(out)
        except (RuntimeError, OSError) as exc:  # store trouble: torch's timings apply
            logger.warning("could not check which peers are alive: %s", exc)
            self.expect(None)
            return
        if out:
            logger.info("gone since the last round: %s", ", ".join(sorted(out)))
        unsure = sorted(node for node, verdict in health.items() if verdict is Health.UNKNOWN)
        if unsure:
            # Maybe a lost machine, maybe a dropped probe: torch's heartbeats and last call.
            logger.info("no liveness answer (not taken as gone) from %s", ", ".join(unsure))
            self.expect(None)
            return
        self.expect(ident(node) for node in self._members - out)

    # -- changing the state -----------------------------------------------------------------

    def expire(self, nodes: Iterable[NodeRepr]) -> None:
        """Expire the heartbeats of ``nodes``: torch's sanitizer removes them on the next sync,
        exactly as after their heartbeats lapsed (participants, wait list, round epilogue)."""
        targets = set(nodes)
        if not targets:
            return
        with self._handler._heartbeat_lock:
            for _ in range(10):  # compare-and-set: retry when another node wrote first
                _fresh_sync(self._holder)
                state = self._holder.state
                present = [node for node in state.last_heartbeats if _repr(node) in targets]
                if not present:
                    return
                for node in present:
                    state.last_heartbeats[node] = _EPOCH
                self._holder.mark_dirty()
                if self._holder.sync():
                    logger.info(
                        "expired %s in the rendezvous (gone or silent)",
                        ", ".join(sorted(map(repr, present))),
                    )
                    return

    def _leave(self, timeout: float) -> None:
        """Leave the run without closing it: say so in the ``left`` key, then remove ourselves
        from the round's participants (torch's exit op, within ``timeout``: one
        compare-and-set, normally milliseconds). Peers re-form without us at once."""
        self.keys.add_left()
        self.announce_end(END_LEAVE)
        stop = getattr(self._handler, "_stop_heartbeats", None)
        if stop is not None:
            stop()
        deadline = time.monotonic() + timeout
        # Under the keep-alive's lock, as torch's own exit op runs: a keep-alive already in
        # flight would otherwise write our heartbeat back over the removal.
        with self._handler._heartbeat_lock:
            self._handler._op_executor.run(_RendezvousExitOp(), deadline)
        logger.info("left the rendezvous (node %s)", self.me)


def check_in(rounds: Iterable[tuple[Any, int | None]]) -> None:
    """Check in, without waiting, to the exit barrier of each round (its store, its node
    count) an agent moved on from.

    torch's exit barrier is per round: an agent whose workers succeeded waits there for every
    agent of *its* round. A peer that then restarted finishes in a later round and never checks
    in to the old one, so the first agent would wait the whole ``exit_barrier_timeout`` (300 s).
    The agent checks in to each round it moved on from when it ends (after its own round's
    barrier, so the store's host stays up until then), and when it gives up. Store trouble is
    only logged: a round's store may be long gone."""
    for store, nodes in rounds:
        if store is None or not nodes:
            continue
        try:
            _barrier_nonblocking(store, nodes, _TERMINAL_STATE_SYNC_ID)
        except (RuntimeError, OSError) as exc:  # DistError is a RuntimeError
            logger.debug("could not check in to a round we moved on from: %s", exc)


def round_members(handler: RendezvousHandler) -> frozenset[str] | None:
    """The agents of the round just joined, if the handler says (torch's dynamic rendezvous
    keeps them in its state holder; there is no public API for it, so any other handler, or a
    future torch, falls back to comparing node counts)."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    participants = getattr(state, "participants", None)
    if not isinstance(participants, dict):
        return None
    return frozenset(repr(node) for node in participants)


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
    name = key(handler._settings.run_id, HOSTED)
    try:
        store.wait([name], timedelta(seconds=timeout))
        return seal.open(name, bytes(store.get(name)).decode(errors="replace")) is not None
    except RuntimeError:  # DistStoreError: not there in time
        return False


class SealedBackend:
    """torch's rendezvous state backend, with the state sealed with the job's key: a state
    that is not (forged, or written by an agent without the key) is refused before torch
    unpickles it (:class:`ddpjob_worker.membership.seal.SealError`)."""

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

    def __init__(self, adapter: RendezvousAdapter, poll: float) -> None:
        super().__init__(adapter._node, adapter._holder, adapter._settings)
        self._adapter = adapter
        self._poll = poll

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
                if action != _Action.SYNC:
                    return action
                # torch would sleep 1 s here and sync again; we look every poll interval.
                time.sleep(self._poll)
                signals.check()
                _fresh_sync(self._state_holder)
                self._state = self._state_holder.state
                ctx = _RendezvousContext(self._node, self._state, self._settings)

        return handler

    def _full(self, state: _State) -> bool:
        if state.closed or state.complete or self._node not in state.participants:
            return False
        return round_is_full(
            {ident(_repr(node)) for node in state.participants},
            self._adapter.expected,
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
