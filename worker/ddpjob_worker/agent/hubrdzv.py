"""torch's rendezvous interface over the hub: the store's host decides every round.

In a DDPJob pod (store failover on) the agent's rendezvous handler is a
:class:`HubRendezvousHandler` instead of torch's c10d ``DynamicRendezvousHandler``. Each agent holds
two connections to the store's host for its life: a c10d ``TCPStore`` client (the round's store:
torch's bootstrap keys, the worker ranks, the exit barrier, our failure reports) and a member of its
hub (:mod:`ddpjob_worker.membership.hub`, :mod:`ddpjob_worker.membership.member`), which forms the
rounds, watches the members and cuts the lost ones. Nothing rewrites a state of every member,
nothing is polled: a join is one message, a round is one message to each member, and the monitor
loop reads the member's view without a network call.

torch's agent uses it as any rendezvous handler (``next_rendezvous``, ``num_nodes_waiting``,
``is_closed``, ``shutdown``); the agent and its store link use the rest (:class:`RoundControl`
in :mod:`ddpjob_worker.membership.watch`): the round's end, leaving, what a failover needs to know.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.utils.distributed import get_free_port

from ddpjob_worker import progress
from ddpjob_worker.agent import signals
from ddpjob_worker.contract import DDPJOB_SNAPSHOT_DIR, EXIT_STOPPED_BY_SIGNAL
from ddpjob_worker.errors import AgentError
from ddpjob_worker.membership.hub import Hub
from ddpjob_worker.membership.keys import RunKeys
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.member import History, Member, MemberView, RoundInfo
from ddpjob_worker.membership.nodes import INCARNATION_SHIFT, NodeIdent, NodeRepr, ident
from ddpjob_worker.membership.seal import Seal
from ddpjob_worker.membership.watch import Look, RoundView, RoundWatch
from ddpjob_worker.membership.wire import Wire, run_on_loop

logger = logging.getLogger("ddpjob_worker.agent.hubrdzv")

BACKEND = "ddpjob"
HUB_KEY = "hub"
"""The run's key under which the store's host names where its hub listens."""
HOSTED_WAIT_SECONDS = 5.0
WAIT_POLL_SECONDS = 0.1
HOST_CONNECT = timedelta(seconds=30)
"""How long the store's host gives its own client to connect: above a resolver's stall
(glibc: 2 tries of 5 s), after which torch stops naming addresses for the process."""


def node_repr(addr: str, incarnation: int) -> NodeRepr:
    """This agent as a node (:mod:`ddpjob_worker.membership.nodes`): ``<addr>_<pid>_<incarnation <<
    20>``, whose :func:`~ddpjob_worker.membership.nodes.ident` is ``<addr>_<pid>_<incarnation>``."""
    return NodeRepr(f"{addr}_{os.getpid()}_{incarnation << INCARNATION_SHIFT}")


class HubRendezvousHandler(RendezvousHandler):
    """A rendezvous handler whose rounds the hub of the store's host decides."""

    def __init__(
        self,
        params: RendezvousParameters,
        *,
        store: Any,
        member: Member,
        keys: RunKeys,
        address: str,
        hub: Hub | None = None,
    ) -> None:
        self._params = params
        self._store = store
        self._member = member
        self.keys = keys
        self._address = address
        self.hub = hub
        self._join_timeout = float(params.config.get("join_timeout", 600))
        self._closed = False
        self._info: RoundInfo | None = None
        self.port = int(getattr(store, "port", 0) or 0)
        """The store's port (a new host's may be one the kernel picked)."""
        self.while_waiting: Callable[[], None] | None = None
        self.departed: bool | None = None
        """Whether a member of our last round is missing from the one just joined (None
        before a second round): the refund rule's evidence, without every member's name."""

    # -- torch's interface ----------------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False

    def get_run_id(self) -> str:
        return self._params.run_id

    @property
    def gen(self) -> int:
        """The generation of the store this handler reached (its hub's word)."""
        return self._member.view.gen

    def next_rendezvous(self) -> RendezvousInfo:
        previous = self._member.view.round
        # Where our rank 0 worker would serve the workers' store, chosen now, so that the
        # round's rank 0 can tell everyone through the hub instead of through the store.
        self._member.join(boot=(self._address, get_free_port()))  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + self._join_timeout
        asked = time.monotonic()
        while True:
            signals.check()
            view = self._member.wait(
                lambda v: (
                    v.round is not previous or v.hub_lost is not None or v.closed or v.replaced
                ),
                WAIT_POLL_SECONDS * 10,
            )
            if view.replaced:
                raise ReplacedError(
                    "a pod of this index replaced this one in the job (it was cut off, and its "
                    "pod object deleted): stopping"
                )
            if view.closed:
                raise RendezvousClosedError
            if view.round is not previous and view.round is not None:
                break
            if view.hub_lost is not None:
                raise RendezvousConnectionError(f"the hub is {view.hub_lost.value}")
            now = time.monotonic()
            if now > deadline:
                raise RendezvousTimeoutError(
                    f"no round within the join timeout ({self._join_timeout:g}s)"
                )
            if self.while_waiting is not None and now - asked >= 1.0:
                asked = now
                self.while_waiting()  # may raise: a newer store carries the job on
        info = view.round
        assert info is not None
        self._info = info
        self.departed = info.departed(previous)
        store = dist.PrefixStore(  # type: ignore[attr-defined]
            f"ddpjob.{self._params.run_id}.r{info.gen}.{info.round}/", self._store
        )
        return RendezvousInfo(store, info.rank, info.world, self._bootstrap(info, store))

    def _bootstrap(self, info: RoundInfo, store: Any) -> RendezvousStoreInfo:
        """Where the workers' store is: rank 0's ``boot``, which the round message carries to
        every member (no store request but rank 0's two writes, kept for an agent that reads
        them from the store, as ``RendezvousStoreInfo.build`` does); without it (a hub that
        does not say), torch's exchange through the store: 2 writes and 2N reads."""
        if info.boot is None:
            return RendezvousStoreInfo.build(info.rank, store, local_addr=self._address)
        addr, port = info.boot
        if info.rank == 0:
            store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, addr.encode())
            store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(port).encode())
        return RendezvousStoreInfo(master_addr=addr, master_port=port)

    def is_closed(self) -> bool:
        return self._closed or self._member.view.closed

    def set_closed(self) -> None:
        self._closed = True
        self._member.close_rendezvous()

    def num_nodes_waiting(self) -> int:
        return self._member.view.waiting

    def shutdown(self) -> bool:
        self.set_closed()
        return True

    # -- the agent's interface (watch.RoundControl) ----------------------------------------------

    @property
    def address(self) -> str:
        return self._address

    @property
    def me(self) -> NodeRepr:
        return self.keys.me

    @property
    def members(self) -> frozenset[NodeRepr]:
        return frozenset()

    def publish(self, liveness: str | None, *, hosting: bool, index: int | None) -> None:
        """The hub learns our liveness address from our hello: nothing to publish."""

    def look(self, watch: RoundWatch, *, hosting: bool, limit: float) -> Look:
        """One tick's look, from what the member knows: no network call."""
        view = self._member.view
        if view.hub_lost is not None and not hosting:
            return Look(host=view.hub_lost, ends=view.ends)
        ends, waiting = view.ends, view.waiting
        if ends:
            waiting = max(waiting, 1)
            cut = sorted(str(node) for node in view.cut)
            logger.info(
                "our round announced its end (%s): re-forming%s",
                ", ".join(sorted(ends)),
                f" without {', '.join(cut)}" if cut else "",
            )
        return Look(
            waiting=waiting,
            ends=ends,
            dropped=frozenset(map(_as_repr, view.cut)),
            hung=view.hung,
        )

    def announce_end(self, *reasons: str) -> None:
        for reason in reasons:
            self._member.end(reason)

    def joined(
        self, gen: int, *, my_address: str | None, failover: bool
    ) -> tuple[RoundView, dict[NodeRepr, str]]:
        """The round just joined, as a failover reads it; nobody to watch (the hub does)."""
        info = self._info
        if info is None:
            raise RuntimeError("no round joined")
        host = info.host
        addresses = {node: address for node, _, address in info.chain if address}
        if my_address is not None:
            addresses[ident(self.me)] = my_address
        view = RoundView(
            me=ident(self.me),
            base_id=info.base_id,
            ranks={node: rank for rank, (node, _, _) in enumerate(info.chain)},
            addresses=addresses,
            base=dict(info.base or {}),
            host=None if host is None else _as_repr(host[0]),
            host_address=None if host is None else host[1],
            world=info.world,
        )
        return view, {}

    def expect_survivors(self) -> None:
        """The hub waits for the survivors itself."""

    def member_gone(self) -> bool:
        return bool(self._member.view.cut)

    def leave(self, timeout: float, *, hosting: bool) -> None:
        """Leave the run (SIGTERM); as the store's host, hand it over: the others carry on
        around a new host at once."""
        self._member.leave(handover=hosting)
        time.sleep(min(timeout, 0.05))  # let the message go before the process ends

    def skip_join_jitter(self) -> None:
        """No jitter to skip: a join is one message."""

    def ring_on_news(self, ring: Callable[[], None]) -> bool:
        """A look reads only the member's view, which rings when it changes."""
        self._member.on_change = ring
        return True


class ReplacedError(AgentError):
    """Our pod was replaced (a pod of our index is in the job): we must not train."""

    exit_code = EXIT_STOPPED_BY_SIGNAL


def _as_repr(node: NodeIdent) -> NodeRepr:
    base, _, incarnation = node.rpartition("_")
    try:
        return NodeRepr(f"{base}_{int(incarnation) << INCARNATION_SHIFT}")
    except ValueError:
        return NodeRepr(f"{node}_0")


# -- making one -----------------------------------------------------------------------------


class HubBackend:
    """How the agent reaches or hosts a store with a hub (the factory its store link and its
    launch use)."""

    def __init__(
        self, *, seal: Seal, incarnation: int, liveness_address: str | None, index: int | None
    ) -> None:
        self._seal = seal
        self._incarnation = incarnation
        self._liveness = liveness_address
        self._index = index
        self._history = History()

    def _address(self, params: RendezvousParameters) -> str:
        return params.local_addr or socket.getfqdn()

    def _keys(self, store: Any, params: RendezvousParameters) -> RunKeys:
        return RunKeys(
            store, params.run_id, self._seal, node_repr(self._address(params), self._incarnation)
        )

    def _member(self, params: RendezvousParameters) -> Member:
        me = node_repr(self._address(params), self._incarnation)
        member = Member(
            Wire(self._seal, params.run_id),
            ident=ident(me),
            index=self._index,
            liveness_address=self._liveness,
            history=self._history,
        )
        directory = os.environ.get(DDPJOB_SNAPSHOT_DIR)
        if directory:
            # Our workers' progress records (the training-state API writes them), for the
            # hub's hang detection.
            member.progress = functools.partial(progress.node_records, Path(directory))
        return member

    def host(
        self,
        params: RendezvousParameters,
        *,
        gen: int,
        base: Mapping[NodeIdent, int | None] | None = None,
        base_id: str | None = None,
        gone: Iterable[NodeIdent] = (),
        expected: Iterable[NodeIdent] | None = None,
    ) -> HubRendezvousHandler:
        """Host the store at ``params.endpoint`` (port 0: a free one) and its hub. Raises
        ``RendezvousConnectionError`` when the port is taken."""
        host, _, port = params.endpoint.rpartition(":")
        read = timedelta(seconds=float(params.config.get("read_timeout", 60)))
        try:
            # The host's own client connects within HOST_CONNECT, then waits on reads as
            # every member does: torch names the address it connects to (getnameinfo, of its
            # v4-mapped form, which /etc/hosts' IPv4 line does not match) and a resolver that
            # does not answer holds that for 2 x 5 s before the connect begins.
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host.strip("[]"),
                int(port),
                is_master=True,
                timeout=max(read, HOST_CONNECT),
                wait_for_workers=False,
                multi_tenant=True,
                use_libuv=True,
            )
            store.set_timeout(read)
        except (RuntimeError, ValueError) as exc:
            raise RendezvousConnectionError(
                f"could not host the store at {params.endpoint}: {exc}"
            ) from exc
        actual = int(store.port)
        keys = self._keys(store, params)
        hub = Hub(
            Wire(self._seal, params.run_id),
            gen=gen,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            last_call=float(params.config.get("last_call_timeout", 30)),
            base=base,
            base_id=base_id,
            gone=gone,
            expected=expected,
            host=(ident(keys.me), self._liveness),
        )
        address = run_on_loop(hub.start(self._address(params)), timeout=10)
        keys.mark_hosted()
        keys._put(HUB_KEY, address)
        member = self._member(params)
        member.local = True
        member.connect(address)
        endpoint = f"{host}:{actual}"
        logger.info(
            "hosting the store at %s, its hub at %s (generation %d)", endpoint, address, gen
        )
        return HubRendezvousHandler(
            params, store=store, member=member, keys=keys, address=self._address(params), hub=hub
        )

    def client(self, params: RendezvousParameters) -> HubRendezvousHandler | None:
        """Reach the job's store at ``params.endpoint`` and its hub; None if the store there is
        not the job's (its host never said so with the job's key). Raises
        ``RendezvousConnectionError`` when it does not answer."""
        host, _, port = params.endpoint.rpartition(":")
        read = timedelta(seconds=float(params.config.get("read_timeout", 60)))
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host.strip("[]"), int(port), is_master=False, timeout=read, use_libuv=True
            )
            keys = self._keys(store, params)
            hub = keys._wait_read(HUB_KEY, timedelta(seconds=HOSTED_WAIT_SECONDS))
        except RuntimeError as exc:
            raise RendezvousConnectionError(f"the store at {params.endpoint}: {exc}") from exc
        if hub is None:
            return None  # not sealed with the job's key: another job's store
        member = self._member(params)
        try:
            member.connect(hub)
        except (TimeoutError, OSError) as exc:
            raise RendezvousConnectionError(f"the hub at {hub}: {exc}") from exc
        if member.wait(lambda v: v.gen > 0, HOSTED_WAIT_SECONDS).gen == 0:
            member.disconnect()
            raise RendezvousConnectionError(f"the hub at {hub} did not answer")
        return HubRendezvousHandler(
            params, store=store, member=member, keys=keys, address=self._address(params)
        )


def stop_hub(handler: RendezvousHandler) -> None:
    """Disconnect a handler we move away from (and stop its hub, if we hosted it)."""
    if isinstance(handler, HubRendezvousHandler):
        handler._member.disconnect()
        if handler.hub is not None:
            run_on_loop(handler.hub.stop(), timeout=5)


def member_view(handler: RendezvousHandler) -> MemberView | None:
    return handler._member.view if isinstance(handler, HubRendezvousHandler) else None


def round_departed(handler: RendezvousHandler) -> bool | None:
    """For a hub's handler, whether a member of our last round is missing from the one just
    joined; None for any other handler (it names the members: compare them)."""
    return handler.departed if isinstance(handler, HubRendezvousHandler) else None


def hub_lost(handler: RendezvousHandler) -> Health | None:
    view = member_view(handler)
    return None if view is None else view.hub_lost
