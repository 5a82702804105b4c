"""The store the agent uses, and moving to another one: the torch side of store failover.

:class:`StoreLink` holds the rendezvous store in use: torch's handler for it, our adapter on that
handler (:class:`ddpjob_worker.agent.rendezvous.RendezvousAdapter`), its parameters and its
:class:`ddpjob_worker.membership.failover.StoreView`, replaced whole on every change, and says so on
our liveness socket (:class:`ddpjob_worker.membership.advert.Advert`). When the store is lost it
carries out the decisions of :mod:`ddpjob_worker.membership.failover`: host the next generation at
our own address, join the newer generation another survivor hosts, or wait for the lost host to come
back (the endpoint then leads to it, or to its replacement). While a join waits, it looks whether a
newer store has superseded ours (:meth:`StoreLink.check_superseded`): a host that wakes up after the
others moved on steps down.

The agent hands it what it needs (settings, the state file, where to put a new handler, the last
round's view); it never reaches back into the agent.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import socket
import time
from collections.abc import Callable

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from ddpjob_worker.agent.endpoint import wait_for_endpoint
from ddpjob_worker.agent.hubrdzv import HOST_CONNECT, HubBackend, HubRendezvousHandler, stop_hub
from ddpjob_worker.agent.policy import RECOVERY_PROBE_CAP_SECONDS, Settings, split_endpoint
from ddpjob_worker.agent.rendezvous import (
    RendezvousAdapter,
    is_jobs_store,
    stop_heartbeats,
    store_params,
)
from ddpjob_worker.bounded import call_bounded
from ddpjob_worker.errors import EndpointUnreachableError, StoreSilentError
from ddpjob_worker.membership import failover, liveness
from ddpjob_worker.membership.advert import Advert
from ddpjob_worker.membership.failover import StoreAnswer, StoreView, SupersededError
from ddpjob_worker.membership.keys import HOSTED
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.nodes import NodeIdent, ident
from ddpjob_worker.membership.seal import Seal
from ddpjob_worker.membership.watch import RoundControl, RoundView
from ddpjob_worker.state import Phase, StateWriter

logger = logging.getLogger("ddpjob_worker.agent.storelink")

HOST_BIND_SECONDS = HOST_CONNECT.total_seconds() + 15.0
"""How long hosting a new generation's store may take on one port (its client's connect, then
its hub's start)."""
SUPERSEDED_LOOK_SECONDS = 3.0
"""While we wait for a lost store to come back, how often we ask whether another supersedes it."""
_PendingLook = tuple["concurrent.futures.Future[StoreAnswer | None]", str | None]
"""A look for a newer store (:meth:`StoreLink._newer_store`) and the store it started from."""


class StoreLink:
    """The rendezvous store the agent uses (see the module doc)."""

    def __init__(
        self,
        handler: RendezvousHandler,
        params: RendezvousParameters,
        *,
        settings: Settings,
        state: StateWriter,
        seal: Seal,
        view: StoreView,
        use: Callable[[RendezvousHandler], None],
        last_round: Callable[[], RoundView | None],
        listener: liveness.Listener | None,
        backend: HubBackend | None = None,
    ) -> None:
        """``use(handler)`` makes torch's agent use a new handler; ``last_round()`` is the
        round we joined last (for a failover, and to look for a newer store); ``listener`` is
        our liveness socket; ``backend`` makes hub handlers (store failover on), else torch's
        c10d handlers are used."""
        self.params = params
        self._backend = backend
        self.handler = handler
        self.view = view
        self._settings = settings
        self._state = state
        self._seal = seal
        self._use = use
        self._last_round = last_round
        self._asker: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: _PendingLook | None = None
        self._looks = failover.LookSchedule()
        self.advert = Advert(listener, run_id=params.run_id, index=settings.pod_index, state=state)
        self.rdzv = self._attach(handler)

    # -- the store in use -------------------------------------------------------------------

    def _attach(self, handler: RendezvousHandler) -> RoundControl | None:
        """Our additions on ``handler`` (a hub's handler is its own), and our liveness address
        published in its store."""
        rdzv: RoundControl | None
        if isinstance(handler, HubRendezvousHandler):
            rdzv = handler
        else:
            rdzv = RendezvousAdapter.attach(handler, self._seal)
        if rdzv is None:
            return None
        rdzv.while_waiting = self.check_superseded
        try:
            rdzv.publish(
                self.advert.address, hosting=self.view.hosting, index=self._settings.pod_index
            )
        except (RuntimeError, OSError) as exc:  # store trouble: peers use heartbeats
            logger.warning("could not publish our liveness address: %s", exc)
        self.advert.say(self.view)
        return rdzv

    def _set(self, view: StoreView) -> None:
        self.view = view
        self.advert.say(view)

    def round_formed(self, host_at: str | None) -> None:
        """A round completed on this store: it is established, and its host answers at
        ``host_at`` (the liveness address it published; None if unknown)."""
        host_at = None if self.view.hosting else host_at
        self._looks.reset()
        self._set(dataclasses.replace(self.view, rounds=self.view.rounds + 1, host_at=host_at))

    def _install(self, handler: RendezvousHandler, view: StoreView) -> None:
        """Use ``handler`` (another store than before) from now on: a store recovery."""
        recoveries = self.view.recoveries + 1
        self._state.update(store_recoveries=recoveries)
        self._looks.reset()
        self.view = StoreView(
            gen=view.gen, hosting=view.hosting, address=view.address, recoveries=recoveries
        )
        retire(self.handler)
        self.handler = handler
        self._use(handler)
        self.rdzv = self._attach(handler)
        if self.rdzv is not None:
            self.rdzv.skip_join_jitter()

    # -- a lost store -----------------------------------------------------------------------

    def recover(
        self, deadline: float, host: Health, *, passed_over: frozenset[NodeIdent] = frozenset()
    ) -> None:
        """The store is lost (``host``: what we know of its host; ``passed_over``: members found
        silent or gone while the last round trained). Carry on around a new host
        (:mod:`ddpjob_worker.membership.failover`), or wait for the old one to come back, then use a
        fresh handler (the old TCPStore client is dead)."""
        self._state.update(phase=Phase.RECOVERING)
        retire(self.handler)
        self.advert.say(self.view, orphan=True)
        if self._settings.failover and self._fail_over(deadline, host, passed_over):
            return
        where, port = split_endpoint(self.params.endpoint)
        logger.warning("waiting for the rendezvous store at %s:%d to come back", where, port)
        round_ = self._last_round()
        while True:
            # Between tries, ask the last round's members whether a store supersedes ours: the
            # store we wait for may never come back (its host stepped down to an older
            # generation that formed a round with a majority, and closed it).
            look_until = min(deadline, time.monotonic() + SUPERSEDED_LOOK_SECONDS)
            try:
                handler = self.connect(
                    self.params,
                    look_until if self._settings.failover and round_ is not None else deadline,
                    retry_after=0.2,
                    # Its kernel still accepts (frozen, or its machine half alive) but nobody
                    # answers: a client would wait on it forever. Wait for it to answer, or for
                    # the endpoint to name another host (its replacement).
                    hold=self._old_host_silent,
                    gone=f"the rendezvous store at {where}:{port} did not come back",
                )
            except EndpointUnreachableError:
                if time.monotonic() >= deadline or round_ is None:
                    raise
                found = self._newer_store(round_)
                if found is not None:
                    logger.warning(
                        "generation %d at %s carries the job on: joining it", found.gen, found.store
                    )
                    self._join_newer(found, deadline)
                    return
                continue
            break
        self._install(handler, self.view)
        logger.info("rejoining with a fresh rendezvous handler (recovery %d)", self.view.recoveries)

    def _fail_over(self, deadline: float, host: Health, passed_over: frozenset[NodeIdent]) -> bool:
        """Carry on around the next host of the last round, if the old one is gone or silent.
        False: it answers (a blip), or nobody is left to carry on with; the caller then waits
        for the host at the endpoint. Safety does not rest on who thinks what: a round
        completes only with a majority of the last round's members."""
        round_ = self._last_round()
        if round_ is None or not round_.ranks or round_.host is None:
            return False
        if host not in (Health.GONE, Health.SILENT):
            host = self._ask_host(round_)
        if host is Health.ALIVE:
            return False
        old = ident(round_.host)
        logger.warning(
            "the store's host %s is %s: carrying on around the next host of our last round",
            old,
            host.value,
        )
        succession = failover.begin(
            round_.ranks,
            round_.me,
            self.view.gen,
            host=old,
            host_health=host,
            silent_seen=passed_over,
        )
        outcome = failover.succeed(
            succession,
            addresses=round_.addresses,
            ask=liveness.ask,
            host_answers=(
                (lambda: self._ask_host(round_) is Health.ALIVE) if host is Health.SILENT else None
            ),
            run_id=self.params.run_id,
            deadline=deadline,
        )
        if outcome is None:
            logger.warning("nobody of the last round is left to host the store")
            return False
        if isinstance(outcome, failover.Host):
            try:
                self._host_new_generation(outcome.succession, round_)
            except EndpointUnreachableError as exc:
                # Nothing was hosted: the job may still go on at the endpoint (the old host's
                # replacement hosts there), so wait for it rather than end the agent.
                logger.warning("%s: waiting for the store at the endpoint instead", exc)
                return False
        else:
            self._join_newer(outcome.found, deadline)
        return True

    @staticmethod
    def _ask_host(round_: RoundView) -> Health:
        """What the lost host's liveness socket says (SILENT for no answer)."""
        if round_.host_address is None:
            return Health.SILENT
        answer = liveness.ask(round_.host_address)
        return Health.SILENT if answer.health is Health.UNKNOWN else answer.health

    def _host_new_generation(self, succession: failover.Succession, round_: RoundView) -> None:
        """Host the store's next generation and its hub at our own address (on the configured
        port if it is free, else on one the kernel picks), carrying the last round's members
        over as the base of its first round's majority."""
        rdzv, backend = self.rdzv, self._backend
        if rdzv is None or backend is None:
            raise EndpointUnreachableError("no rendezvous of ours to host the store for")
        addr = rdzv.address
        _, configured = split_endpoint(self.params.endpoint)
        base = dict(round_.base) or dict.fromkeys(succession.ranks)
        gen = self.view.gen + 1
        handler: HubRendezvousHandler | None = None
        for port in dict.fromkeys((configured, 0)):
            params = store_params(self.params, f"{addr}:{port}", is_host=True)
            try:
                handler = call_bounded(
                    functools.partial(
                        backend.host,
                        params,
                        gen=gen,
                        base=base,
                        base_id=round_.base_id,
                        gone=succession.confirmed,
                        expected=frozenset(base) - succession.excluded,
                    ),
                    "host the rendezvous store",
                    limit=HOST_BIND_SECONDS,
                )
                break
            except (RendezvousConnectionError, StoreSilentError, ValueError) as exc:
                logger.info("cannot host the store on port %d: %s", port, exc)
        if handler is None:
            raise EndpointUnreachableError("could not host the rendezvous store on any port")
        endpoint = f"{addr}:{handler.port}"
        self.params = store_params(self.params, endpoint, is_host=True)
        self._install(handler, StoreView(gen=gen, hosting=True, address=endpoint))
        logger.warning("hosting the rendezvous store, generation %d, at %s", gen, endpoint)

    def join_newer(self, found: StoreAnswer, deadline: float) -> None:
        """Join a store another agent named (its generation is newer than ours), when ours is
        superseded."""
        self._join_newer(found, deadline)

    def _join_newer(self, found: StoreAnswer, deadline: float) -> None:
        """Join the newer generation another survivor hosts (its hub waits for the survivors
        itself)."""
        params = store_params(self.params, found.store, is_host=False)
        handler = self.connect(
            params,
            deadline,
            retry_after=0.05,
            gone=f"the rendezvous store at {found.store} (generation {found.gen}) did not answer",
        )
        self.params = params
        self._install(handler, StoreView(gen=found.gen, hosting=False, address=found.store))
        logger.info("joined the rendezvous store, generation %d, at %s", found.gen, found.store)

    def connect(
        self,
        params: RendezvousParameters,
        deadline: float,
        *,
        retry_after: float,
        gone: str,
        hold: Callable[[str, int], bool] | None = None,
    ) -> RendezvousHandler:
        """A client handler for the job's store at ``params.endpoint``, once it accepts
        connections and answers (each try bounded), before ``deadline``; ``hold(host, port)``
        true means "not yet, look again"."""
        host, port = split_endpoint(params.endpoint)
        join_timeout = self._settings.join_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EndpointUnreachableError(
                    f"{gone} within the join timeout ({join_timeout:g}s)"
                )
            wait_for_endpoint(
                host, port, remaining, join_timeout=join_timeout, cap=RECOVERY_PROBE_CAP_SECONDS
            )
            if hold is not None and hold(host, port):
                time.sleep(min(RECOVERY_PROBE_CAP_SECONDS, max(0.0, remaining)))
                continue
            try:
                handler = call_bounded(
                    functools.partial(self._client, params),
                    "connect to the rendezvous store",
                    limit=self._settings.store_read_limit,
                )
                if handler is not None:
                    return handler
                logger.warning(
                    "the store at %s is not this job's (no sealed %r key): its address is "
                    "another pod's now; looking again",
                    params.endpoint,
                    HOSTED,
                )
            except (RendezvousConnectionError, StoreSilentError) as exc:
                logger.warning("store at %s not ready yet: %s", params.endpoint, exc)
            time.sleep(min(retry_after, max(0.0, deadline - time.monotonic())))

    def _client(self, params: RendezvousParameters) -> RendezvousHandler | None:
        """A client handler for the store at ``params.endpoint``: a hub's, or torch's c10d
        one; None if the store there is not the job's."""
        if self._backend is not None:
            return self._backend.client(params)
        handler: RendezvousHandler = rdzv_registry.get_rendezvous_handler(params)
        return handler if is_jobs_store(handler, self._seal) else None

    def _old_host_silent(self, host: str, port: int) -> bool:
        """Whether the endpoint still leads to the store host we lost and that host is silent
        (accepts, never answers). A replacement at another address, a host that answers, or
        one whose address refuses (its agent is gone) is not."""
        round_ = self._last_round()
        address = None if round_ is None else round_.host_address
        if address is None:
            return False
        old_ip = address.rpartition(":")[0].strip("[]")
        try:
            now = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        except OSError:
            return False
        if old_ip not in now:
            return False
        if liveness.ask(address).health is Health.UNKNOWN:
            logger.info("the store's old host at %s is still silent", address)
            return True
        return False

    # -- a newer store ------------------------------------------------------------------------

    def check_superseded(self) -> None:
        """While our join waits (about once a second): act on what the last look found
        (:meth:`_newer_store`), and start the next look when it is due
        (:class:`ddpjob_worker.membership.failover.LookSchedule`: every second in a job of up to 100
        members, spread out and rarer beyond). Looks run on a helper thread, so the join's polling
        never waits on a silent member's question (0.5 s each). Raises
        :class:`ddpjob_worker.membership.failover.SupersededError` from inside torch's join: the
        agent catches it around the join and moves to the newer store."""
        pending = self._pending
        if pending is not None:
            look, store = pending
            if not look.done():
                return
            self._pending = None
            found = look.result()
            if found is not None and store == self.view.address:
                raise SupersededError(found)
        round_ = self._last_round()
        if round_ is None or not round_.addresses:
            return
        if not self._looks.due(time.monotonic(), round_.world):
            return
        if self._asker is None:
            self._asker = concurrent.futures.ThreadPoolExecutor(1, "ddpjob-superseded")
        self._pending = (self._asker.submit(self._newer_store, round_), self.view.address)

    def _newer_store(self, round_: RoundView) -> StoreAnswer | None:
        """A store that supersedes ours (:func:`ddpjob_worker.membership.failover.newer_store`),
        from what the last round's members answer."""
        try:
            peers = {
                node: address for node, address in round_.addresses.items() if node != round_.me
            }
            answers = [
                answer.info
                for answer in liveness.ask_all(peers).values()
                if answer.info is not None
            ]
            return failover.newer_store(
                answers,
                run_id=self.params.run_id,
                mine=self.view,
                members=len(round_.addresses),
                confirm=lambda address: liveness.ask(address).info,
            )
        except Exception:  # a look must never take the join down
            logger.exception("could not look for a newer store")
            return None


def retire(handler: RendezvousHandler) -> None:
    """Let go of a handler we move away from: stop its keep-alive (torch's c10d handler),
    disconnect its member and stop its hub (a hub's)."""
    if isinstance(handler, HubRendezvousHandler):
        stop_hub(handler)
    else:
        stop_heartbeats(handler)
