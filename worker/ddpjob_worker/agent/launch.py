"""How ``ddpjob-agent`` starts: torch's ``launch_agent`` with our agent, the search for the
store that carries the job now (a replacement or a newcomer joins the store the others moved
to), hosting the store at its endpoint (waiting while a terminating predecessor holds its port)
or waiting for it to resolve and answer, and the state file from the first moment.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.utils import (  # torch's own hostname heuristic
    _matches_machine_hostname,
)
from torch.distributed.launcher.api import LaunchConfig

from ddpjob_worker.agent import signals, warm
from ddpjob_worker.agent.elastic import DdpjobAgent
from ddpjob_worker.agent.endpoint import Probe, try_connect, wait_for_endpoint, wait_resolves_here
from ddpjob_worker.agent.hubrdzv import HubBackend, HubRendezvousHandler
from ddpjob_worker.agent.policy import (
    HOST_LINGER_SECONDS,
    Settings,
    next_delay,
    split_endpoint,
    static_master,
)
from ddpjob_worker.agent.rendezvous import (
    is_jobs_store,
    seed_incarnation,
    store_params,
)
from ddpjob_worker.agent.storelink import retire
from ddpjob_worker.agent.workers import entrypoint_name
from ddpjob_worker.errors import EndpointUnreachableError, WorkersStuckError
from ddpjob_worker.membership import liveness
from ddpjob_worker.membership.failover import first_store
from ddpjob_worker.membership.keys import HOSTED
from ddpjob_worker.membership.seal import Seal
from ddpjob_worker.state import Phase, StateWriter

logger = logging.getLogger("ddpjob_worker.agent.launch")

FIND_STORE_SECONDS = 5.0
"""How long a replacement pod 0 waits for the others to name a store other than the one of the
pod it replaces, before it hosts its endpoint itself."""


def launch(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: list[str],
    *,
    settings: Settings,
    state: StateWriter,
    heartbeat_seconds: float,
    early_spares: Sequence[warm.Spare] = (),
    agent_class: type[DdpjobAgent] = DdpjobAgent,
) -> dict[int, Any]:
    """torch's ``launch_agent``, with our agent, the endpoint wait and the state file.

    Raises ``ChildFailedError`` when the workers fail for good (torchrun's behaviour), and
    :class:`EndpointUnreachableError` when the store never comes up. ``agent_class`` is for the
    hollow agents of the scale benchmark (``tests.harness.hollow_agents``: stand-in workers, the
    same agent).
    """
    rdzv_configs = dict(config.rdzv_configs)
    if settings.is_host is not None and config.rdzv_backend == "c10d":
        rdzv_configs["is_host"] = "true" if settings.is_host else "false"
    if settings.store_read_timeout is not None and config.rdzv_backend == "c10d":
        rdzv_configs.setdefault("read_timeout", f"{settings.store_read_timeout:g}")
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **rdzv_configs,
    )
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    start = _start(params, settings, state, local_addr=config.local_addr)
    handler, params = start.handler, start.params
    signals.check()
    master_addr, master_port = None, None
    if config.rdzv_backend == "static":
        master_addr, master_port = static_master(config.rdzv_endpoint)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    agent = agent_class(
        spec,
        config=config,
        params=params,
        settings=settings,
        state=state,
        heartbeat_seconds=heartbeat_seconds,
        early_spares=early_spares,
        gen=start.gen,
        hosting=start.hosting,
        listener=start.listener,
        backend=start.backend,
    )
    shutdown_rdzv = True
    succeeded = False
    try:
        signals.check()
        result = agent.run()
        if result.is_failed() or agent.gave_up:
            if result.failures:
                raise ChildFailedError(
                    name=entrypoint_name(entrypoint, args), failures=result.failures
                )
            raise WorkersStuckError(
                "workers were unhealthy and torch disabled restarts (a worker was stuck in "
                "uninterruptible sleep)"
            )
        succeeded = True
        return dict(result.return_values)
    except SignalException:
        # As torch: a signalled agent must not close the rendezvous for the others.
        shutdown_rdzv = False
        raise
    finally:
        agent.close_warm()
        if settings.in_ddpjob_pod and not succeeded:
            # Our pod fails and the operator replaces it; the other agents carry on and re-admit
            # the replacement. Closing the rendezvous would end the job on every pod.
            shutdown_rdzv = False
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
            if settings.is_host and not succeeded:
                # Keep the store up a little after closing the rendezvous, so the other agents
                # read "closed" (the job is over: exit 1) instead of finding the store gone
                # (the host was lost: wait up to the join timeout for it to come back).
                logger.info(
                    "closed the rendezvous; keeping the store up %gs for the others",
                    HOST_LINGER_SECONDS,
                )
                time.sleep(HOST_LINGER_SECONDS)
        retire(spec.rdzv_handler)


@dataclasses.dataclass(frozen=True)
class _Start:
    """How the agent starts: its first handler, the store's parameters and generation, whether
    it hosts the store, its liveness socket, and the hub backend (store failover on)."""

    handler: RendezvousHandler
    params: RendezvousParameters
    gen: int
    hosting: bool
    listener: liveness.Listener | None
    backend: HubBackend | None


def _start(
    params: RendezvousParameters,
    settings: Settings,
    state: StateWriter,
    *,
    local_addr: str | None,
) -> _Start:
    """The first handler: in a DDPJob pod (store failover on), the hub of the store the job's
    pods name, or of pod 0's endpoint (ddpjob_worker.membership.hub); elsewhere torch's own."""
    incarnation = seed_incarnation()
    listener = None
    if params.backend == "c10d":
        listener = liveness.listen(local_addr or socket.getfqdn(), settings.directory_port)
    if not (settings.failover and params.backend == "c10d" and params.endpoint):
        hosting = bool(settings.is_host)
        handler = _first_handler(params, settings, state, hosting=hosting)
        return _Start(handler, params, 1, hosting, listener, None)
    backend = HubBackend(
        seal=Seal.from_env(),
        incarnation=incarnation,
        liveness_address=None if listener is None else listener.address,
        index=settings.pod_index,
    )
    params, gen, hosting = _find_store(params, settings)
    if hosting:
        make = functools.partial(backend.host, params, gen=gen)
        return _Start(
            _host_store(make, params.endpoint, settings, state),
            params,
            gen,
            True,
            listener,
            backend,
        )
    hub, params, gen = _join_hub(params, settings, state, backend)
    return _Start(hub, params, gen, False, listener, backend)


def _find_store(
    params: RendezvousParameters, settings: Settings
) -> tuple[RendezvousParameters, int, bool]:
    """Ask the job's agents (``DDPJOB_RDZV_PEERS``) which store carries the job now:
    ``(params, generation, we host it)`` (:func:`ddpjob_worker.membership.failover.first_store`). A
    replacement pod 0, or a pod added by a scale-up, joins the store the others moved to after
    losing pod 0; nobody answering (the job's start) leaves the configured endpoint, hosted by
    pod 0 as generation 1. A replacement pod 0 named as the host of generation 1 at its own
    endpoint asks again for :data:`FIND_STORE_SECONDS` (the pod it replaces is gone, and the
    others are about to carry on around a new host) before it hosts the endpoint itself. Under
    ``ddpjob run`` every pod's address is 127.0.0.1: a later generation at that endpoint is
    another pod's store, and is joined."""
    hosting = bool(settings.is_host)
    deadline = time.monotonic() + FIND_STORE_SECONDS
    while True:
        signals.check()
        start = first_store(
            _ask_peers(settings.peers),
            run_id=params.run_id,
            endpoint=params.endpoint,
            hosting=hosting,
            final=time.monotonic() >= deadline,
        )
        if start is not None and start.named:
            logger.info(
                "the job's pods name generation %d of its store at %s: joining it",
                start.gen,
                start.endpoint,
            )
            return store_params(params, start.endpoint, is_host=False), start.gen, False
        if start is not None:
            return params, start.gen, start.hosting
        time.sleep(0.2)


ASK_PEERS = 16
"""How many of the job's pods a starting agent asks which store carries the job: a sample, so
that a job of 1,024 pods starting at once asks 16 thousand questions, not a million. Any live
member names the current store."""


def _ask_peers(
    peers: Sequence[str], sample: int = ASK_PEERS, rng: random.Random | None = None
) -> list[dict[str, Any]]:
    """The answers of up to ``sample`` of the agents at ``peers``: a pod's peers are one name
    (the headless Service's, which resolves to every pod), ``ddpjob run``'s one address per
    pod, pod 0's first. The first address of the first name is always asked (under ``ddpjob
    run``, pod 0's), the rest are a random sample of every address the names resolve to."""
    addresses: dict[str, None] = {}
    for peer in peers:
        host, port = split_endpoint(peer, default_port=-1)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            logger.info("no address for %s yet: %s", peer, exc)
            continue
        for info in infos:
            ip = str(info[4][0])
            addresses[f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"] = None
    chosen = list(addresses)
    if len(chosen) > sample:
        head, rest = chosen[0], chosen[1:]
        picker = rng or random.Random()  # noqa: S311 - a sample of peers, not a secret
        chosen = [head, *picker.sample(rest, max(0, sample - 1))]
    answers = liveness.ask_all({address: address for address in chosen})
    return [dict(answer.info) for answer in answers.values() if answer.info is not None]


def _port_busy(exc: BaseException) -> bool:
    """Whether torch could not host the store because its port is taken (EADDRINUSE)."""
    cause: BaseException | None = exc
    while cause is not None:
        if "EADDRINUSE" in str(cause) or "address already in use" in str(cause):
            return True
        cause = cause.__cause__
    return False


def _host_store(
    make: Callable[[], RendezvousHandler], endpoint: str, settings: Settings, state: StateWriter
) -> RendezvousHandler:
    """Host the store at ``endpoint`` (``make()``). torch's own client of the store connects to that
    name, so first wait until it resolves to this pod (a new pod 0's DNS record follows it by
    a moment; CI saw a resumed job's pod 0 give up on it). Then, while the port is taken (the
    pod we replace may still hold it, terminating, on a hostNetwork node) or the store does not
    answer, try again with a back-off up to the join timeout, saying what we wait for."""
    deadline = time.monotonic() + settings.join_timeout
    host, port = split_endpoint(endpoint)

    def waiting(probe: Probe) -> None:
        if probe.attempts == 1:
            state.update(phase=Phase.WAITING)
            logger.warning("waiting for the store's name to resolve here: %s", probe.last_error)

    probe = wait_resolves_here(
        host, port, settings.join_timeout, on_retry=waiting, join_timeout=settings.join_timeout
    )
    if probe.attempts > 1:
        logger.info("%s resolves to this pod after %d tries", host, probe.attempts)
    attempt = 0
    while True:
        signals.check()
        try:
            return make()
        except RendezvousConnectionError as exc:
            busy = _port_busy(exc)
            if time.monotonic() >= deadline:
                if busy:
                    raise EndpointUnreachableError(
                        f"could not host the rendezvous store at {endpoint}: its port "
                        f"stayed in use for the join timeout ({settings.join_timeout:g}s); "
                        "something else listens there (another job's store, on the same node "
                        "with hostNetwork?)"
                    ) from exc
                raise
            if attempt == 0:
                state.update(phase=Phase.WAITING)
            delay = next_delay(attempt, initial=0.2, cap=2.0)
            logger.warning(
                "could not host the rendezvous store at %s (%s): trying again in %.1fs, until "
                "the join timeout",
                endpoint,
                "its port is in use: the pod we replace may still hold it" if busy else _cause(exc),
                delay,
            )
            attempt += 1
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))


def _cause(exc: BaseException) -> str:
    """The innermost cause's message (torch wraps the store's error in its own)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"


def _join_hub(
    params: RendezvousParameters, settings: Settings, state: StateWriter, backend: HubBackend
) -> tuple[HubRendezvousHandler, RendezvousParameters, int]:
    """Reach the job's store and its hub before the join timeout: the one the job's pods name,
    else the configured endpoint (pod 0's). Between tries the pods are asked again: a newcomer
    that arrives while the others fail over (a scale-up, a replacement) finds the store they
    move to, instead of waiting for pod 0's endpoint, whose pod is gone. ``(handler, params,
    generation)``."""
    deadline = time.monotonic() + settings.join_timeout
    state.update(phase=Phase.WAITING)
    target = params
    while True:
        signals.check()
        host, port = split_endpoint(target.endpoint)
        error = try_connect(host, port, JOIN_TRY_SECONDS)
        if error is None:
            try:
                handler = backend.client(target)
            except RendezvousConnectionError as exc:
                logger.info("the store at %s does not answer yet: %s", target.endpoint, exc)
            else:
                if handler is not None:
                    return handler, target, handler.gen
                logger.warning(
                    "the store at %s is not this job's (no sealed %r key): looking again",
                    target.endpoint,
                    HOSTED,
                )
        if time.monotonic() >= deadline:
            raise EndpointUnreachableError(
                f"rendezvous endpoint {target.endpoint} is unreachable, and no pod of the job "
                f"named another store (join timeout {settings.join_timeout:g}s); last error: "
                f"{error or 'the store did not answer'}. Check that the store host (pod 0) is "
                "running and that its Service/DNS name is right."
            )
        time.sleep(JOIN_RETRY_SECONDS)
        start = first_store(
            _ask_peers(settings.peers),
            run_id=params.run_id,
            endpoint=params.endpoint,
            hosting=False,
            final=True,
        )
        named = start is not None and start.named
        if named and start is not None and start.endpoint != target.endpoint:
            logger.info(
                "the job's pods name generation %d of its store at %s: joining it",
                start.gen,
                start.endpoint,
            )
        target = store_params(params, start.endpoint, is_host=False) if named and start else params


JOIN_TRY_SECONDS = 1.0
"""How long one try to reach a store's port may take, before the job's pods are asked again."""
JOIN_RETRY_SECONDS = 0.5


def _first_handler(
    params: RendezvousParameters, settings: Settings, state: StateWriter, *, hosting: bool
) -> RendezvousHandler:
    """Wait for the endpoint (unless we host it), then create torch's rendezvous handler."""
    if params.backend == "c10d" and hosting and params.endpoint:
        return _host_store(
            lambda: rdzv_registry.get_rendezvous_handler(params), params.endpoint, settings, state
        )
    if params.backend != "c10d" or hosting or not params.endpoint:
        return rdzv_registry.get_rendezvous_handler(params)
    host, port = split_endpoint(params.endpoint)
    if port == 0 or (settings.is_host is None and _matches_machine_hostname(host)):
        # No explicit host (plain torchrun usage, or --standalone): torch decides by hostname,
        # and we may be the one to host the store, so we must not wait for it.
        return rdzv_registry.get_rendezvous_handler(params)
    seal = Seal.from_env()

    def client() -> RendezvousHandler | None:
        handler: RendezvousHandler = rdzv_registry.get_rendezvous_handler(params)
        return handler if is_jobs_store(handler, seal) else None

    return _reach_store(params, settings, state, client)


def _reach_store(
    params: RendezvousParameters,
    settings: Settings,
    state: StateWriter,
    client: Callable[[], RendezvousHandler | None],
) -> RendezvousHandler:
    """Wait for the store at ``params.endpoint`` to resolve, accept and answer as the job's
    (``client()`` is None when it is not), within the join timeout."""
    host, port = split_endpoint(params.endpoint)
    deadline = time.monotonic() + settings.join_timeout
    state.update(phase=Phase.WAITING)
    while True:
        signals.check()
        remaining = deadline - time.monotonic()
        probe = wait_for_endpoint(
            host, port, max(0.0, remaining), join_timeout=settings.join_timeout
        )
        if probe.attempts > 1:
            logger.info(
                "rendezvous endpoint %s:%d is up after %d tries", host, port, probe.attempts
            )
        try:
            handler = client()
        except RendezvousConnectionError as exc:
            if deadline - time.monotonic() <= 0:
                raise EndpointUnreachableError(
                    f"rendezvous endpoint {host}:{port} accepts connections but its store did "
                    f"not answer within the join timeout ({settings.join_timeout:g}s): {exc}"
                ) from exc
            time.sleep(0.2)
            continue
        if handler is not None:
            return handler
        if deadline - time.monotonic() <= 0:
            raise EndpointUnreachableError(
                f"the store at {host}:{port} is not this job's (its host never said so with the "
                f"job's key) within the join timeout ({settings.join_timeout:g}s): the name "
                "resolves to another pod's address"
            )
        logger.warning(
            "the store at %s:%d is not this job's (no sealed %r key): looking again",
            host,
            port,
            HOSTED,
        )
        time.sleep(0.5)
