"""The elastic agent: torch's ``LocalElasticAgent`` plus our recovery policy.

What we change in torch's ``SimpleElasticAgent._invoke_run`` loop (the decisions themselves are
pure functions in :mod:`ddpjob_worker.policy`):

* A membership change never uses up the restart budget. torch already restarts for free when a
  node waits to join; we also refund a charged restart when the next round has fewer nodes (a
  peer left, and our workers only failed because of it), and restart for free when the store
  host is lost.
* Losing the store host costs a rejoin, not the job. When the c10d store stops answering, we
  stop our workers, wait for the endpoint to come back (bounded by the join timeout), build a
  fresh rendezvous handler (the old TCPStore client is dead) and join a new round. torch raises
  ``RendezvousConnectionError`` and exits.
* A failure is charged only to the node where it started. When one node's worker dies, every
  other node's workers fail too (their collective breaks); each agent reports when its first
  worker exited (timed to the millisecond, :mod:`ddpjob_worker.exits`) to the round's store,
  restarts at once, and compares the reports once the next round has formed: only the earliest
  is charged, the others restart for free (torch charges every agent).
* Recovery waits on no timer it can avoid (:mod:`ddpjob_worker.rendezvous`): the end of a round
  is announced to its members, a pod stopped by SIGTERM leaves the rendezvous, dead peers are
  named through their liveness sockets (:mod:`ddpjob_worker.liveness`), and a round completes
  once the expected survivors are in.
* torch's own "stop restarting" decision (its uninterruptible-state watchdog) is honoured.
* In a DDPJob pod, an agent that gives up does not close the rendezvous: its pod fails and is
  replaced, and the others re-admit the replacement (torch closes it, ending the job); it
  leaves the rendezvous instead, so they re-form without it at once.
* Our one-shot SIGTERM/SIGINT handler is reinstalled after every worker start (torch installs
  its own there).
* Every transition is written to the state file (:mod:`ddpjob_worker.state`).
* A restart's workers start warm: once a group has run a few seconds, a spare process per local
  rank imports torch and waits; torch's ``SubprocessHandler`` hands it the next worker's argv and
  environment instead of starting a cold ``python`` (:mod:`ddpjob_worker.warm`, where the
  conditions are; ``DDPJOB_WARM_WORKERS=0`` turns it off).

Everything else (starting workers, their env, error files, signal forwarding on shutdown) is
torch's own code.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import signal
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.agent.server.api import (  # the exit barrier's key (wire format)
    _TERMINAL_STATE_SYNC_ID,
    DEFAULT_ROLE,
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.utils.store import (  # the barrier's check-in, torch's own
    _barrier_nonblocking,
)
from torch.distributed.launcher.api import LaunchConfig

from ddpjob_worker import liveness, signals, warm, watch, workers
from ddpjob_worker.blame import Blame, FailureReport, Verdict, describe_failure, failure_of
from ddpjob_worker.bounded import call_bounded
from ddpjob_worker.endpoint import wait_for_endpoint
from ddpjob_worker.errors import EndpointUnreachableError, StoreSilentError
from ddpjob_worker.exits import ExitClock
from ddpjob_worker.keys import HOSTED
from ddpjob_worker.ledger import RestartLedger
from ddpjob_worker.liveness import Health
from ddpjob_worker.nodes import NodeIdent, NodeRepr, ident
from ddpjob_worker.policy import (
    REAP_SECONDS,
    RECOVERY_PROBE_CAP_SECONDS,
    Action,
    Settings,
    StoreAnswer,
    WorkerStatus,
    best_store,
    decide,
    split_endpoint,
    successor,
)
from ddpjob_worker.rendezvous import (
    END_DROPPED,
    END_FAILURE,
    END_HANDOVER,
    END_JOIN,
    END_LEAVE,
    RendezvousAdapter,
    is_jobs_store,
    round_members,
    stop_heartbeats,
    store_params,
)
from ddpjob_worker.seal import Seal
from ddpjob_worker.state import AgentState, Phase, StateWriter

logger = logging.getLogger("ddpjob_worker.agent")
_T = TypeVar("_T")
_Look = tuple["concurrent.futures.Future[StoreAnswer | None]", str | None]
"""A look for a newer store (:meth:`DdpjobAgent._better_store`) and the store it started from."""

HOST_LOOK_SECONDS = 60.0
"""How long the store's host waits on a look at its own store before it takes it as broken."""
LEAVE_BOUND_SECONDS = 1.5
"""How long leaving the rendezvous may hold up a SIGTERM on its way to the workers (a store
host that does not answer would otherwise hold it up forever)."""

_STATUS = {
    WorkerState.HEALTHY: WorkerStatus.HEALTHY,
    WorkerState.SUCCEEDED: WorkerStatus.SUCCEEDED,
    WorkerState.FAILED: WorkerStatus.FAILED,
    WorkerState.UNHEALTHY: WorkerStatus.FAILED,
}


class DdpjobAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that survives losing the store host and refunds membership changes."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        config: LaunchConfig,
        params: RendezvousParameters,
        settings: Settings,
        state: StateWriter,
        heartbeat_seconds: float,
        early_spares: Sequence[warm.Spare] = (),
        gen: int = 1,
        hosting: bool | None = None,
    ) -> None:
        if config.logs_specs is None:
            raise ValueError("LaunchConfig.logs_specs must be set (LaunchConfig sets a default)")
        super().__init__(
            spec=spec,
            logs_specs=config.logs_specs,
            start_method=config.start_method,
            log_line_prefix_template=config.log_line_prefix_template,
            # torch types it int, but only adds it to a deadline: a fraction is kept.
            shutdown_timeout=settings.grace_seconds,  # type: ignore[arg-type]
        )
        self._params = params
        self._settings = settings
        self._state = state
        self._heartbeat_seconds = heartbeat_seconds
        self._ledger = RestartLedger(spec.max_restarts)
        self._blame = Blame(Seal.from_env(), in_pod=settings.in_ddpjob_pod)
        self._store_lost = False
        self._store_recoveries = 0
        self._exit_clock = ExitClock()
        # (store, nodes) of each round we moved on from, for their exit barriers
        self._left_rounds: list[tuple[Any, int | None]] = []
        # (round store, our node rank) of a failure whose charge is settled in the next round
        self._unsettled: tuple[Any, int] | None = None
        self._left_run = False
        self._round_over: frozenset[str] = frozenset()  # why peers said our round is over
        self._stop_seconds: float = settings.restart_stop_seconds
        self._liveness: liveness.Listener | None = None
        self._said: dict[str, Any] = {"v": 1}  # our liveness answer's store part
        state.on_update = self._answer
        # we host the store we use now
        self._hosting = bool(settings.is_host) if hosting is None else hosting
        self._gen = gen  # that store's generation
        self._store_address: str | None = params.endpoint or None
        self._store_rounds = 0  # rounds completed on it
        self._host_gone = False  # the lost host is known gone (it handed over)
        self._host_silent = False  # the lost host stopped answering
        self._addresses: dict[NodeIdent, str] = {}  # the last round's liveness addresses
        self._base: dict[NodeIdent, int | None] = {}  # its members' pod indexes
        self._base_id: str | None = None
        self._silent_seen: set[NodeIdent] = set()  # members found silent since it formed
        self._watch: liveness.PeerWatch[NodeRepr] | None = None
        self._host_node: NodeRepr | None = None  # the store host's node, as it published
        self._host_address: str | None = None  # its liveness address
        self._dropped: frozenset[NodeRepr] = frozenset()  # silent peers dropped at this tick
        self._asker: concurrent.futures.ThreadPoolExecutor | None = None
        self._superseding: _Look | None = None
        self._rdzv = self._attach(spec.rdzv_handler)
        self._warm = _warm_pool(spec, settings, early_spares)
        self._reaper = workers.Reaper(self._known_pids)
        self.gave_up = False

    @functools.cached_property
    def _seal(self) -> Seal:
        """The job's store key (``DDPJOB_STORE_KEY``), if it has one."""
        return Seal.from_env()

    def _attach(self, handler: RendezvousHandler) -> RendezvousAdapter | None:
        """Our rendezvous additions (:mod:`ddpjob_worker.rendezvous`) on ``handler``, and our
        liveness socket's address published in its store."""
        rdzv = RendezvousAdapter.attach(handler, self._seal)
        if rdzv is None:
            return None
        rdzv.fenced = self._settings.failover
        rdzv.while_waiting = self._check_superseded
        if self._liveness is None:
            self._liveness = liveness.listen(rdzv.address, self._settings.directory_port)
        try:
            if self._hosting:
                rdzv.keys.mark_hosted()
            if self._liveness is not None:
                rdzv.keys.publish(
                    self._liveness.address, host=self._hosting, index=self._settings.pod_index
                )
        except (RuntimeError, OSError) as exc:  # store trouble: peers use heartbeats
            logger.warning("could not publish our liveness address: %s", exc)
        self._say()
        return rdzv

    def _say(self, *, orphan: bool = False) -> None:
        """What our liveness socket answers: which store we use (none while we look for
        one), its generation, and whether a round completed on it; and, in the state file
        too, whether we host it."""
        hosting, gen = self._hosting and not orphan, 0 if orphan else self._gen
        if self._liveness is not None:
            self._said = {
                "v": 1,
                "run": self._params.run_id,
                "index": self._settings.pod_index,
                "gen": self._gen,
                "store": None if orphan else self._store_address,
                "established": self._store_rounds > 0 and not orphan,
                "host": hosting,
                "host_at": None if orphan else self._host_at(),
            }
        if (self._state.state.store_host, self._state.state.store_gen) != (hosting, gen):
            self._state.update(store_host=hosting, store_gen=gen)  # answers through _answer
        else:
            self._answer(self._state.state)

    def _answer(self, state: AgentState) -> None:
        """Our liveness answer: what :meth:`_say` said, and where the agent is (its phase, and
        the world it trains in, 0 when it does not), read by peers and by the operator."""
        if self._liveness is None:
            return
        training = state.phase is Phase.RUNNING
        self._liveness.info = {
            **self._said,
            "phase": state.phase.value,
            "world": (state.world_size or 0) if training else 0,
            "round": state.rdzv_round,
        }

    def _host_at(self) -> str | None:
        """Where the host of the store we use answers."""
        if self._hosting:
            return None if self._liveness is None else self._liveness.address
        return self._host_address

    # -- the monitor loop -------------------------------------------------------------------

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        group = self._worker_group
        spec = group.spec
        self._initialize_workers(group)
        self._state.update(phase=Phase.RUNNING)
        last_write = time.monotonic()
        while True:
            _pause(spec.monitor_interval)
            result: RunResult = self._monitor_workers(group)
            noticed_at = time.time()
            self._ledger.check_torch(self._remaining_restarts)
            group.state = result.state
            status = _STATUS.get(result.state)
            if status is None:
                raise RuntimeError(f"[{role}] worker group in unexpected state {result.state.name}")
            action, nodes_waiting, store_lost, collateral = self._next_action(
                group, status, self._failure(result, noticed_at)
            )
            if action is Action.CONTINUE:
                if status is WorkerStatus.HEALTHY:
                    self._tick_warm()
                self._reaper.tick()
                if time.monotonic() - last_write >= self._heartbeat_seconds:
                    self._state.update()
                    last_write = time.monotonic()
                continue
            if action is Action.FINISH:
                self.close_warm()
                self._state.update(phase=Phase.SUCCEEDED)
                self._exit_barrier()  # type: ignore[no-untyped-call]
                self._check_in_to_left_rounds()
                return result
            if status is WorkerStatus.FAILED:
                self._state.update(last_failure=describe_failure(result.failures))
            if action is Action.GIVE_UP:
                self._give_up(role, group)
                return result
            if action is Action.RESTART_CHARGED:
                self._ledger.charge()
            elif action is Action.RESTART_SETTLE_LATER:
                # Restart at once; who is charged is settled when the next round has formed.
                self._unsettled = (group.store, group.group_rank or 0)
            else:
                # Counted in TORCHELASTIC_RESTART_COUNT unless healthy workers only restart to
                # admit a waiting node (torchrun does not count those either).
                # A peer's failure or leave that ended our round counts too: under torchrun our
                # workers would have failed with it.
                self._ledger.free(
                    after_failure=status is WorkerStatus.FAILED or store_lost or self._broken()
                )
                self._store_lost = self._store_lost or store_lost
            reason = END_FAILURE if status is WorkerStatus.FAILED else END_JOIN
            self._announce_end(reason, store_lost)
            logger.info(
                "[%s] %s: restarting workers (%s; nodes waiting %d; store lost %s; "
                "collateral %s; %d/%d restarts left)",
                role,
                status.value,
                action.value,
                nodes_waiting,
                store_lost,
                collateral,
                self._ledger.remaining,
                self._ledger.budget.max_restarts,
            )
            self._sync_budget(phase=Phase.RECOVERING)
            intact = status is WorkerStatus.HEALTHY and not (self._broken() or store_lost)
            self._stop_seconds = (
                self._settings.restart_stop_seconds if intact else self._settings.stop_seconds
            )
            self._restart_workers(group)
            self._state.update(phase=Phase.RUNNING)
            last_write = time.monotonic()

    def _next_action(
        self, group: WorkerGroup, status: WorkerStatus, failure: FailureReport
    ) -> tuple[Action, int, bool, bool | None]:
        """``(action, nodes waiting, store lost, collateral)`` after one look at the workers."""
        nodes_waiting, store_lost = 0, False
        if status is not WorkerStatus.SUCCEEDED:
            nodes_waiting, store_lost = self._poll_rendezvous()
        collateral: bool | None = False
        if status is WorkerStatus.FAILED and self._dropped:
            # A member went silent: whatever our workers did, the group lost a member.
            collateral = True
        elif status is WorkerStatus.FAILED and not store_lost and not self._ledger.disabled:
            collateral, store_lost = dataclasses.astuple(self._report_failure(group, failure))
        for _ in range(2):
            action = decide(
                status,
                remaining_restarts=self._ledger.remaining,
                nodes_waiting=nodes_waiting,
                store_lost=store_lost,
                collateral=collateral,
                restarts_disabled=self._ledger.disabled,
            )
            if action is not Action.SETTLE_FIRST:
                break
            # No restart left: giving up is final, so wait for the peers' reports first.
            collateral, store_lost = dataclasses.astuple(self._settle_now(group))
        return action, nodes_waiting, store_lost, collateral

    def _broken(self) -> bool:
        """Whether a peer ended our round because its workers failed or it left."""
        return bool(self._round_over - {END_JOIN})

    def _announce_end(self, reason: str, store_lost: bool) -> None:
        """On our own evidence (not because a peer announced it), tell the round it is over."""
        if self._rdzv is None or store_lost or self._round_over:
            return
        try:
            self._rdzv.announce_end(reason)
        except (RuntimeError, OSError) as exc:  # peers notice through their collective
            logger.warning("could not announce the end of the round: %s", exc)

    def _give_up(self, role: str, group: WorkerGroup) -> None:
        if self._ledger.disabled:
            logger.error(
                "[%s] workers failed and torch disabled restarts (a worker is stuck in "
                "uninterruptible sleep): not restarting",
                role,
            )
        else:
            logger.error(
                "[%s] workers failed and the restart budget (%d) is used up",
                role,
                self._ledger.budget.max_restarts,
            )
        self.close_warm()
        self._announce_end(END_FAILURE, store_lost=False)
        if self._settings.in_ddpjob_pod and not self._left_run:
            # Our pod fails and is replaced by a new agent: the others re-form without us now,
            # not when our heartbeats lapse (the rendezvous stays open for the replacement).
            self._left_run = True
            self._leave()
        self._stop_seconds = self._settings.stop_seconds
        self._stop_workers(group)
        group.state = WorkerState.FAILED
        self.gave_up = True
        self._state.update(phase=Phase.FAILED)
        # Peers of this round that finished wait for us in its exit barrier: we are done too.
        self._left_rounds.append((self._store, group.group_world_size))
        self._check_in_to_left_rounds()

    def _check_in_to_left_rounds(self) -> None:
        """Check in, without waiting, to the exit barrier of every round we left.

        torch's exit barrier is per round: an agent whose workers succeeded waits there (hosting
        the store, if it is pod 0) for every agent of *its* round. A peer that then restarted
        (its workers failed, say in a teardown abort after the last step) finishes in a later
        round and never checks in to the old one, so the first agent waited the whole
        ``exit_barrier_timeout`` (300 s) before exiting. We check in to each round we left when
        we end (after our own round's barrier, so the store's host stays up until then), and
        when we give up. Store trouble is only logged: the round's store may be long gone.
        """
        rounds, self._left_rounds = self._left_rounds, []
        for store, nodes in rounds:
            if store is None or not nodes:
                continue
            try:
                _barrier_nonblocking(store, nodes, _TERMINAL_STATE_SYNC_ID)
            except (RuntimeError, OSError) as exc:  # DistError is a RuntimeError
                logger.debug("could not check in to a round we left: %s", exc)

    def _failure(self, result: RunResult, noticed_at: float) -> FailureReport:
        """Our failure (:func:`ddpjob_worker.blame.failure_of`)."""
        node = self._worker_group.group_rank or 0
        return failure_of(result.failures, self._exit_clock, node, noticed_at)

    def _report_failure(self, group: WorkerGroup, failure: FailureReport) -> Verdict:
        """Report our failure to the round's store (:class:`ddpjob_worker.blame.Blame`)."""
        if group.store is None or group.group_rank is None:
            return Verdict(collateral=False)
        return self._blame.report(group.store, failure, hosting=self._hosting)

    def _settle_now(self, group: WorkerGroup) -> Verdict:
        """With no restart left: wait for the peers' reports before deciding (giving up is
        final)."""
        if group.store is None:
            return Verdict(collateral=False)
        return self._blame.wait_settled(
            group.store,
            group.group_rank or 0,
            group.group_world_size or 1,
            hosting=self._hosting,
            member_gone=self._member_gone,
        )

    def _member_gone(self) -> bool:
        """Whether a member of our round left, was found silent, or no longer listens."""
        rdzv = self._rdzv
        if rdzv is None:
            return False
        try:
            health = watch.judge(rdzv.keys, rdzv.members, silent=rdzv.silent())
        except (RuntimeError, OSError):
            return False
        return any(verdict in (Health.GONE, Health.SILENT) for verdict in health.values())

    def _settle(self, recovered: bool) -> None:
        """Charge the failure we restarted for, or not, now that the next round has formed.
        A store that changed under us is a membership change: free (the old round's reports
        died with its store)."""
        if self._unsettled is None:
            return
        store, node = self._unsettled
        self._unsettled = None
        root = not recovered and self._blame.is_root(store, node, hosting=self._hosting)
        self._ledger.settle(root=root)

    def _check_uninterruptible_state_timeout(
        self, worker_group: WorkerGroup, timeout: float
    ) -> RunResult | None:
        """torch's D-state watchdog; when it fires it also disables restarts, which we honour."""
        result: RunResult | None = super()._check_uninterruptible_state_timeout(
            worker_group, timeout
        )
        if result is not None:
            self._ledger.disable()
        return result

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        with workers.warm_handlers(self._warm):
            ids: dict[int, Any] = super()._start_workers(worker_group)
        if self._warm is not None:
            self._warm.group_started()
        signals.install()  # torch's PContext.start replaced our handler with its own
        signals.check()  # a stop while they started: torch's run() stops them
        self._exit_clock.watch(pid for pid in ids.values() if isinstance(pid, int))
        return ids

    def _known_pids(self) -> set[int]:
        """Processes someone waits for: the workers (torch), the idle spares (the pool)."""
        known = {proc.pid for proc in workers.processes(self._pcontext)}
        if self._warm is not None:
            known.update(self._warm.idle)
        return known

    def _tick_warm(self) -> None:
        """Start missing spares, and say in the state how many are ready."""
        if self._warm is not None:
            self._warm.tick()
            if self._warm.ready != self._state.state.spares_ready:
                self._state.update(spares_ready=self._warm.ready)

    def close_warm(self) -> None:
        """Kill the idle warm workers (the agent ends, or its workers will not restart)."""
        if self._warm is not None:
            if self._warm.handed_over or self._warm.cold_starts:
                logger.info(
                    "workers started warm %d times, cold %d times",
                    self._warm.handed_over,
                    self._warm.cold_starts,
                )
            self._warm.close()
            if self._state.state.spares_ready:
                self._state.update(spares_ready=0)

    def _poll_rendezvous(self) -> tuple[int, bool]:
        """``(nodes waiting to join, store lost)``, from one look at the rendezvous store and
        at the peers' answers (:class:`ddpjob_worker.liveness.PeerWatch`)."""
        self._dropped = frozenset()
        silent = self._watch.silent() if self._watch is not None else set()
        dead = self._watch.gone() if self._watch is not None else set()
        silent -= dead
        self._silent_seen |= {ident(node) for node in silent | dead}
        if self._host_node in dead and not self._hosting:
            logger.warning("the rendezvous store's host (%s) is gone", self._host_node)
            self._host_gone = True
            return 0, True
        if self._host_node in silent and not self._hosting:
            logger.warning(
                "the rendezvous store's host (%s) has not answered for %gs: taking it as lost",
                self._host_node,
                liveness.SILENT_AFTER_SECONDS,
            )
            self._host_silent = True
            return 0, True
        handler = self._worker_group.spec.rdzv_handler
        rdzv = self._rdzv

        def look() -> tuple[int, frozenset[str]]:
            return handler.num_nodes_waiting(), frozenset() if rdzv is None else rdzv.round_over()

        try:
            waiting, self._round_over = self._bounded(look, "look at the rendezvous store")
        except (RendezvousConnectionError, DistNetworkError, DistStoreError) as exc:
            # torch wraps store errors in RendezvousConnectionError; our own look does not
            if self._hosting:
                raise  # we host the store; if it fails, nothing to wait for
            logger.warning("lost the rendezvous store: %s", exc)
            return 0, True
        except StoreSilentError as exc:
            if self._hosting:
                raise
            logger.warning("lost the rendezvous store: %s", exc)
            self._host_silent = self._watch is not None and self._host_node in self._watch.silent()
            return 0, True
        if END_HANDOVER in self._round_over and not self._hosting:
            logger.info("the store's host hands over (it stops): carrying on around a new host")
            self._host_gone = True
            return 0, True
        if silent or dead:
            self._drop_silent(silent, dead)
        if END_DROPPED in self._round_over:
            logger.warning(
                "the rendezvous no longer has us in our round (our heartbeats lapsed, and a "
                "newcomer opened the next round): rejoining"
            )
            waiting = max(waiting, 1)
        elif self._round_over:
            # A peer restarts or leaves: re-form now, not when our collective breaks.
            logger.info(
                "a member of our round announced its end (%s): re-forming",
                ", ".join(sorted(self._round_over)),
            )
            waiting = max(waiting, 1)
        return waiting, False

    def _bounded(self, call: Callable[[], _T], what: str) -> _T:
        """``call()`` (store requests), given up once the store's host has been silent for
        the silence window, or after the store's read timeout.

        torch's TCPStore client waits for a reply forever when its server stops answering
        without closing the connection (a frozen or partitioned host: no reset ever comes),
        whatever its timeout says, and so would the monitor loop, SIGTERM included. The call
        runs on a daemon thread; one that never returns is abandoned with its client.
        """
        limit = self._settings.store_read_timeout or 10.0
        if self._hosting:
            # Our own store: its server runs in this process and answers unless it is stalled,
            # as torch's is while it looks up a new client's name in a DNS that does not answer
            # (10 s with glibc's defaults). Giving up on it would end the pod (exit 200).
            limit = max(limit, HOST_LOOK_SECONDS)
        return call_bounded(
            call,
            what,
            limit=limit,
            give_up=lambda: (
                self._watch is not None
                and not self._hosting
                and self._host_node in self._watch.silent()
            ),
        )

    def _drop_silent(self, silent: set[NodeRepr], dead: set[NodeRepr]) -> None:
        """Re-form the round without members that stopped answering (``silent``) or whose
        address refuses (``dead``): name them in the round (the others read it when they
        rejoin), end the round, and expire their heartbeats. Only the dead ones are known gone
        (a silent one may be alive behind a partition: it still counts for a majority)."""
        rdzv = self._rdzv
        if rdzv is None:
            return
        self._dropped = frozenset(silent | dead)
        if silent:
            logger.warning(
                "no answer from %s for %gs (a machine lost silently, a partition or a frozen "
                "pod): re-forming without %s",
                ", ".join(sorted(silent)),
                liveness.SILENT_AFTER_SECONDS,
                "it" if len(silent) == 1 else "them",
            )
        if dead:
            logger.warning("%s refused: re-forming without it", ", ".join(sorted(dead)))
        nodes = rdzv.members & (silent | dead)

        def drop() -> None:
            rdzv.announce_silent(sorted(silent))
            if rdzv.fenced:
                rdzv.keys.confirm_gone(ident(node) for node in dead)
            rdzv.announce_end(END_FAILURE)
            rdzv.expire(nodes)

        try:
            self._bounded(drop, "drop silent members")
        except (RuntimeError, OSError) as exc:  # DistError and StoreSilentError too
            logger.warning("could not name the silent members in the store: %s", exc)
        self._round_over = self._round_over | {END_FAILURE}
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def _watch_round(self) -> None:
        """Start asking the members of the round just joined whether they still answer."""
        self._close_watch()
        rdzv = self._rdzv
        if rdzv is None:
            return
        others = rdzv.members - {rdzv.me}
        try:
            addresses = rdzv.keys.addresses(others)
            self._host_node = rdzv.keys.host()
            if self._settings.failover:
                self._base = rdzv.keys.indexes(ident(node) for node in rdzv.members)
        except (RuntimeError, OSError) as exc:  # store trouble: the poll finds out
            logger.warning("could not read the members' liveness addresses: %s", exc)
            return
        self._base_id = f"{self._gen}.{rdzv.round}"
        self._silent_seen = set()
        self._addresses = {ident(node): address for node, address in addresses.items()}
        if self._liveness is not None:
            self._addresses[ident(rdzv.me)] = self._liveness.address
        self._host_address = None if self._host_node is None else addresses.get(self._host_node)
        self._watch = liveness.PeerWatch(watch.watched(addresses, me=rdzv.me, host=self._host_node))

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop workers for a restart: SIGTERM, then SIGKILL after a short wait.

        torch waits 30 s here. A pod's graceful stop (SIGTERM to the agent) still gets the full
        grace period: torch's ``run()`` calls ``_shutdown`` with it directly.
        """
        workers.wait_saves(workers.processes(self._pcontext), self._settings.grace_seconds)
        # torch types the timeout int, but only adds it to a deadline: a fraction is kept.
        self._shutdown(timeout=self._stop_seconds)  # type: ignore[arg-type]
        workers.wait_gone(workers.processes(self._pcontext), REAP_SECONDS)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """torch's shutdown; on SIGTERM/SIGINT we first leave the rendezvous (not as its host:
        the store goes with us), so peers re-form without us at once (:meth:`_leave`)."""
        if signals.stopping() and not self._left_run:
            self._left_run = True
            self._leave()
        super()._shutdown(death_sig, timeout)

    def _leave(self) -> None:
        rdzv = self._rdzv
        if rdzv is None:
            return
        if self._hosting:
            if self._settings.failover:
                self._hand_over(rdzv)
            return
        self._close_watch()
        try:
            call_bounded(
                functools.partial(rdzv.leave, LEAVE_BOUND_SECONDS),
                "leave the rendezvous",
                limit=LEAVE_BOUND_SECONDS,
            )
        except Exception as exc:  # best effort: peers fall back on our heartbeats lapsing
            logger.warning("could not leave the rendezvous: %s", exc)

    def _hand_over(self, rdzv: RendezvousAdapter) -> None:
        """As the store's host, leave: the others carry on around a new host at once (the
        store stays up until we exit, but nobody waits for it)."""
        self._close_watch()

        def hand_over() -> None:
            rdzv.keys.confirm_gone([ident(rdzv.me)])
            rdzv.announce_end(END_LEAVE, END_HANDOVER)

        try:
            call_bounded(hand_over, "hand the store over", limit=LEAVE_BOUND_SECONDS)
            logger.info("handed the rendezvous store over: the others carry on without us")
        except Exception as exc:  # best effort: they find the store gone when we exit
            logger.warning("could not hand the store over: %s", exc)

    # -- rendezvous with store recovery ----------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self._state.update(phase=Phase.RENDEZVOUS)
        recovered = False
        deadline: float | None = None
        left = (self._store, worker_group.group_world_size)  # the round we are leaving, if any
        self._close_watch()
        self._expect_survivors()
        while True:
            signals.check()
            if self._store_lost:
                if deadline is None:
                    deadline = time.monotonic() + self._settings.join_timeout
                self._recover_store(deadline)
                recovered = True
                self._store_lost = False
                self._state.update(phase=Phase.RENDEZVOUS)
            try:
                super()._rendezvous(worker_group)
                self._joined(recovered, left)
                break
            except SupersededError as exc:
                # A newer store has a majority of our last round: ours will never again.
                logger.warning(
                    "stepping down: %s; joining generation %d at %s",
                    exc,
                    exc.found.gen,
                    exc.found.store,
                )
                if deadline is None:
                    deadline = time.monotonic() + self._settings.join_timeout
                self._move_to(exc.found, deadline, expect=None)
                recovered = True
            except (RendezvousConnectionError, DistNetworkError) as exc:
                if self._hosting:
                    raise
                logger.warning("rendezvous store unreachable while joining: %s", exc)
                self._store_lost = True
            except DistStoreError as exc:
                # The round formed, then a peer vanished before it published its ranks (torch
                # waits for them with the store's read timeout). Join the next round instead of
                # dying: the lost peer is dropped from it after its heartbeats lapse.
                if deadline is None:
                    deadline = time.monotonic() + self._settings.join_timeout
                if time.monotonic() > deadline:
                    raise
                logger.warning("the round broke before it started, rejoining: %s", exc)
        self._after_round(worker_group, recovered)

    def _joined(self, recovered: bool, left: tuple[Any, int | None]) -> None:
        if self._rdzv is not None:
            self._rdzv.joined(self._gen)
            self._store_rounds += 1
            self._say()
            self._watch_round()
        if recovered:
            # The old rounds' barriers died with the old store (and whoever waited in them
            # with its host); their store clients could only hang or fail.
            self._left_rounds.clear()
        elif self._ledger.rounds:
            self._left_rounds.append(left)

    def _after_round(self, worker_group: WorkerGroup, recovered: bool) -> None:
        """Settle charges and record the round just formed."""
        new_nodes = worker_group.group_world_size
        if new_nodes is None:
            raise RuntimeError("rendezvous completed without a world size")
        members = round_members(worker_group.spec.rdzv_handler)
        self._settle(recovered)
        previous = self._ledger.previous_nodes
        if self._ledger.round_formed(new_nodes, members, recovered=recovered):
            logger.info(
                "refunding the last restart: a membership change (nodes %s -> %s, store "
                "recovered %s)",
                previous,
                new_nodes,
                recovered,
            )
        local = [w.global_rank for w in worker_group.workers]
        self._sync_budget(
            rdzv_round=self._ledger.rounds,
            num_nodes=new_nodes,
            node_rank=worker_group.group_rank,
            world_size=worker_group.workers[0].world_size if worker_group.workers else None,
            group_rank_start=min(local) if local else None,
            group_rank_end=max(local) + 1 if local else None,
        )

    def _expect_survivors(self) -> None:
        """Before rejoining: which members of the last round come back? Those that left or
        whose liveness socket is closed are marked gone (torch would wait for their heartbeats
        to lapse), and the round completes once the others are in (no last call). If any member
        cannot be judged (no answer in time), torch's heartbeats and last call decide.
        """
        rdzv = self._rdzv
        if rdzv is None or not rdzv.members or self._store_lost:
            return
        try:
            health = watch.judge(rdzv.keys, rdzv.members, silent=rdzv.silent())
            gone = {node for node, verdict in health.items() if verdict is Health.GONE}
            out = gone | {node for node, verdict in health.items() if verdict is Health.SILENT}
            rdzv.expire(out)
            if rdzv.fenced:
                # Gone, not merely silent: out of the count a majority is taken of.
                rdzv.keys.confirm_gone(ident(node) for node in gone)
        except (RuntimeError, OSError) as exc:  # store trouble: torch's timings apply
            logger.warning("could not check which peers are alive: %s", exc)
            rdzv.expect(None)
            return
        if out:
            logger.info("gone since the last round: %s", ", ".join(sorted(out)))
        unsure = sorted(node for node, verdict in health.items() if verdict is Health.UNKNOWN)
        if unsure:
            # Maybe a lost machine, maybe a dropped probe: torch's heartbeats and last call.
            logger.info("no liveness answer (not taken as gone) from %s", ", ".join(unsure))
            rdzv.expect(None)
            return
        rdzv.expect(ident(node) for node in rdzv.members - out)

    def _recover_store(self, deadline: float) -> None:
        """Carry on around a new store host (:meth:`_fail_over`), or wait for the old one to
        come back, then replace the dead rendezvous handler."""
        self._state.update(phase=Phase.RECOVERING)
        spec = self._worker_group.spec
        self._close_watch()
        stop_heartbeats(spec.rdzv_handler)
        self._say(orphan=True)
        if self._settings.failover and self._fail_over(deadline):
            return
        host, port = split_endpoint(self._params.endpoint)
        logger.warning("waiting for the rendezvous store at %s:%d to come back", host, port)
        handler = self._connect(
            self._params,
            deadline,
            retry_after=0.2,
            # Its kernel still accepts (frozen, or its machine half alive) but nobody answers:
            # a client would wait on it forever. Wait for it to answer, or for the endpoint to
            # name another host (its replacement).
            hold=self._old_host_silent,
            gone=f"the rendezvous store at {host}:{port} did not come back",
        )
        self._install(handler)
        logger.info(
            "rejoining with a fresh rendezvous handler (recovery %d)", self._store_recoveries
        )

    def _connect(
        self,
        params: RendezvousParameters,
        deadline: float,
        *,
        retry_after: float,
        gone: str,
        hold: Callable[[str, int], bool] | None = None,
    ) -> RendezvousHandler:
        """A client handler for the store at ``params.endpoint``, once it accepts connections
        and answers (each try bounded), before ``deadline``; ``hold(host, port)`` true means
        "not yet, look again"."""
        host, port = split_endpoint(params.endpoint)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EndpointUnreachableError(
                    f"{gone} within the join timeout ({self._settings.join_timeout:g}s)"
                )
            wait_for_endpoint(
                host,
                port,
                remaining,
                join_timeout=self._settings.join_timeout,
                cap=RECOVERY_PROBE_CAP_SECONDS,
            )
            if hold is not None and hold(host, port):
                time.sleep(min(RECOVERY_PROBE_CAP_SECONDS, max(0.0, remaining)))
                continue
            try:
                handler: RendezvousHandler = call_bounded(
                    functools.partial(rdzv_registry.get_rendezvous_handler, params),
                    "connect to the rendezvous store",
                    limit=self._settings.store_read_timeout or 10.0,
                )
                if is_jobs_store(handler, self._seal):
                    return handler
                logger.warning(
                    "the store at %s is not this job's (no sealed %r key): its address is "
                    "another pod's now; looking again",
                    params.endpoint,
                    HOSTED,
                )
                time.sleep(min(retry_after, max(0.0, deadline - time.monotonic())))
            except (RendezvousConnectionError, StoreSilentError) as exc:
                logger.warning("store at %s not ready yet: %s", params.endpoint, exc)
                time.sleep(min(retry_after, max(0.0, deadline - time.monotonic())))

    def _install(self, handler: RendezvousHandler) -> None:
        """Use ``handler`` (another store than before) from now on; a store recovery."""
        self._store_recoveries += 1
        self._state.update(store_recoveries=self._store_recoveries)
        spec = self._worker_group.spec
        spec.rdzv_handler = handler
        self._rdzv_handler = handler
        self._store_rounds = 0
        self._host_gone = self._host_silent = False
        self._host_node = self._host_address = None  # known again once a round has formed
        self._rdzv = self._attach(handler)
        if self._rdzv is not None:
            self._rdzv.skip_join_jitter()

    def _fail_over(self, deadline: float) -> bool:
        """Carry on around a new store host, if the old one is gone or silent: the
        lowest-ranked member of the last round that still answers hosts the next generation,
        the others join it. False: the host answers (a blip), or there is nobody to carry on
        with; the caller then waits for the host at the endpoint.

        Safety does not rest on who thinks what: a round completes only with a majority of
        the last round's members (:func:`ddpjob_worker.policy.has_quorum`), so if the old host
        is alive behind a partition, at most one side trains.
        """
        rdzv = self._rdzv
        if rdzv is None or not rdzv.ranks or self._host_node is None:
            return False
        ranks = {ident(node): rank for node, rank in rdzv.ranks.items()}
        me, host = ident(rdzv.me), ident(self._host_node)
        if self._host_gone:
            verdict = "gone"
        elif self._host_silent:
            verdict = "silent"
        else:
            verdict = self._ask_host()
        if verdict == "alive":
            return False
        logger.warning(
            "the store's host %s is %s: carrying on around the next host of our last round",
            host,
            "gone" if verdict == "gone" else "silent",
        )
        excluded = {host} | self._silent_seen
        confirmed = {host} if verdict == "gone" else set()
        unknown_since: dict[NodeIdent, float] = {}
        started = time.monotonic()
        while time.monotonic() < deadline:
            chosen = successor(ranks, excluded=excluded)
            if chosen is None:
                logger.warning("nobody of the last round is left to host the store")
                return False
            if chosen == me:
                self._host_next(ranks, confirmed, excluded)
                return True
            answer = liveness.ask(self._addresses.get(chosen, ""))
            if answer.health is liveness.Health.GONE:
                excluded.add(chosen)
                confirmed.add(chosen)
                continue
            if answer.health is liveness.Health.ALIVE:
                unknown_since.pop(chosen, None)
                found = best_store([answer.info or {}], self._params.run_id)
                if found is not None and found.gen > self._gen:
                    expect = frozenset(ranks) - excluded - {me}
                    self._move_to(found, deadline, expect=expect | {me})
                    return True
            else:
                first = unknown_since.setdefault(chosen, time.monotonic())
                if time.monotonic() - first >= liveness.SILENT_AFTER_SECONDS:
                    excluded.add(chosen)
                    continue
            if verdict == "silent" and time.monotonic() - started > 1.0:
                started = time.monotonic()
                if self._ask_host() == "alive":
                    logger.info("the store's host answers again: rejoining it")
                    return False
            time.sleep(0.05)
        return False

    def _ask_host(self) -> str:
        """``gone``, ``silent`` or ``alive``: what the lost store host's liveness socket says."""
        if self._host_address is None:
            return "silent"
        answer = liveness.ask(self._host_address)
        if answer.health is liveness.Health.GONE:
            return "gone"
        if answer.health is liveness.Health.UNKNOWN:
            return "silent"
        return "alive"

    def _host_next(
        self, ranks: dict[NodeIdent, int], confirmed: set[NodeIdent], excluded: set[NodeIdent]
    ) -> None:
        """Host the store's next generation at our own address, carrying the last round's
        members over as the base of its first round's majority."""
        rdzv = self._rdzv
        assert rdzv is not None
        addr = rdzv.address
        _, configured = split_endpoint(self._params.endpoint)
        handler: RendezvousHandler | None = None
        for port in dict.fromkeys((configured, 0)):
            params = store_params(self._params, f"{addr}:{port}", is_host=True)
            try:
                handler = call_bounded(
                    functools.partial(rdzv_registry.get_rendezvous_handler, params),
                    "host the rendezvous store",
                    limit=10.0,
                )
                break
            except (RendezvousConnectionError, StoreSilentError, ValueError) as exc:
                logger.info("cannot host the store on port %d: %s", port, exc)
        if handler is None:
            raise EndpointUnreachableError("could not host the rendezvous store on any port")
        port = int(getattr(getattr(handler, "_store", None), "port", 0) or configured)
        self._params = store_params(self._params, f"{addr}:{port}", is_host=True)
        self._hosting = True
        self._gen += 1
        self._store_address = None  # not named to anyone before the base is in it
        base_id = self._base_id or f"{self._gen - 1}.0"
        self._install(handler)
        new = self._rdzv
        if new is not None:
            new.keys.record_base(base_id, self._base or dict.fromkeys(ranks))
            new.keys.confirm_gone(confirmed, base_id)
            new.expect(frozenset(ranks) - excluded)
        self._store_address = f"{addr}:{port}"
        self._say()
        logger.warning(
            "hosting the rendezvous store, generation %d, at %s", self._gen, self._store_address
        )

    def _move_to(
        self, found: StoreAnswer, deadline: float, expect: frozenset[NodeIdent] | None
    ) -> None:
        """Join the store another agent named (its generation is newer than ours)."""
        params = store_params(self._params, found.store, is_host=False)
        handler = self._connect(
            params,
            deadline,
            retry_after=0.05,
            gone=f"the rendezvous store at {found.store} (generation {found.gen}) did not answer",
        )
        self._params = params
        self._hosting = False
        self._gen = found.gen
        self._store_address = found.store
        self._install(handler)
        if self._rdzv is not None and expect is not None:
            self._rdzv.expect(expect)
        logger.info("joined the rendezvous store, generation %d, at %s", found.gen, found.store)

    def _check_superseded(self) -> None:
        """While our join waits (about once a second): act on what the last look found
        (:meth:`_better_store`), and start the next look. Looks run on a helper thread, so the
        join's polling never waits on a silent member's question (0.5 s each)."""
        pending = self._superseding
        if pending is not None:
            look, store = pending
            if not look.done():
                return
            self._superseding = None
            found = look.result()
            if found is not None and store == self._store_address:
                raise SupersededError(found)
        if not self._addresses:
            return
        if self._asker is None:
            self._asker = concurrent.futures.ThreadPoolExecutor(1, "ddpjob-superseded")
        self._superseding = (self._asker.submit(self._better_store), self._store_address)

    def _better_store(self) -> StoreAnswer | None:
        """If the last round's members name a better store (:class:`StoreAnswer`'s order), ours
        is superseded, provided that store is alive: its host answers as its host, or a
        majority of the last round's members name it. Never a store that is lost, as a peer
        that has not noticed yet may still name it (alone)."""
        try:
            me = ident(self._rdzv.me) if self._rdzv is not None else None
            peers = {node: address for node, address in self._addresses.items() if node != me}
            answers = [
                answer.info
                for answer in liveness.ask_all(peers).values()
                if answer.info is not None and answer.info.get("store") != self._store_address
            ]
            mine = (self._store_rounds > 0, self._gen)
            named = [best_store([info], self._params.run_id) for info in answers]
            better = sorted(
                {found for found in named if found and (found.established, found.gen) > mine},
                reverse=True,
            )
            for found in better:
                votes = sum(1 for other in named if other == found)
                if 2 * votes > len(self._addresses):
                    return found
                hosts = {other.host_at for other in named if other == found and other.host_at}
                for host_at in hosts:
                    info = liveness.ask(host_at).info or {}
                    if info.get("host") and info.get("store") == found.store:
                        return found
                logger.info(
                    "generation %d at %s is named by %d of %d, and its host does not answer",
                    found.gen,
                    found.store,
                    votes,
                    len(self._addresses),
                )
        except Exception:  # a look must never take the join down
            logger.exception("could not look for a newer store")
        return None

    def _old_host_silent(self, host: str, port: int) -> bool:
        """Whether the endpoint still leads to the store host we lost and that host is silent
        (accepts, never answers). A replacement at another address, a host that answers, or
        one whose address refuses (its agent is gone) is not."""
        address = self._host_address
        if address is None:
            return False
        old_ip = address.rpartition(":")[0].strip("[]")
        try:
            now = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        except OSError:
            return False
        if old_ip not in now:
            return False
        answer = liveness.ask(address)
        if answer.health is liveness.Health.UNKNOWN:
            logger.info("the store's old host at %s is still silent", address)
            return True
        return False

    # -- helpers ---------------------------------------------------------------------------

    def _sync_budget(self, **changes: Any) -> None:
        """Mirror the budget into torch's counter (:meth:`RestartLedger.torch_counter`) and the
        state."""
        self._remaining_restarts = self._ledger.torch_counter()
        budget = self._ledger.budget
        self._state.update(
            restart_count=budget.restart_count,
            membership_restarts=budget.membership_restarts,
            **changes,
        )


class SupersededError(RuntimeError):
    """Another store (:attr:`found`) carries the job on: ours must step down."""

    def __init__(self, found: StoreAnswer) -> None:
        super().__init__(f"generation {found.gen} at {found.store} carries the job on")
        self.found = found


def _warm_pool(
    spec: WorkerSpec, settings: Settings, early_spares: Sequence[warm.Spare]
) -> warm.WarmPool | None:
    """The agent's spares (adopting the early ones), or None (off, or a function entrypoint:
    the early spares are killed)."""
    if settings.warm_workers and isinstance(spec.entrypoint, str):
        label = workers.entrypoint_name(spec.entrypoint, list(spec.args))
        pool = warm.WarmPool(spec.local_world_size, label=label)
        pool.adopt(early_spares)
        return pool
    for spare in early_spares:
        spare.kill()
    return None


def _pause(seconds: float) -> None:
    """Sleep between two looks at the workers, then act on a stop signal whose raise was
    swallowed (:func:`ddpjob_worker.signals.check`)."""
    time.sleep(seconds)
    signals.check()
