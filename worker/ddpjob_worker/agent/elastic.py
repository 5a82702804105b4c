"""The elastic agent: torch's ``LocalElasticAgent``, with our recovery policy in its template.

:class:`DdpjobAgent` keeps only what must sit on torch's subclass: its template overrides
(``_invoke_run``, ``_rendezvous``, ``_start_workers``, ``_stop_workers``, ``_shutdown``, torch's own
"stop restarting" watchdog), giving up, and leaving. Each other concern is a room of its own, handed
what it needs:

* :mod:`~ddpjob_worker.agent.ledger`: the restart budget (a membership change never uses it up; a
  charge is refunded when the next round shows a member gone);
* :mod:`~ddpjob_worker.agent.blame`: who is charged for a round's failure (only the node where it
  started, from the reports every agent writes to the round's store);
* :mod:`~ddpjob_worker.membership.watch`: the peer watch (members that stop answering are dropped
  within the silence window) and each monitor tick's findings
  (:class:`~ddpjob_worker.membership.watch.Look`);
* :mod:`~ddpjob_worker.agent.storelink` and :mod:`~ddpjob_worker.membership.failover`: the store in
  use, and carrying on around a new host when it is lost, fenced by a majority of the last round;
* :mod:`~ddpjob_worker.agent.rendezvous`: our additions to torch's rendezvous (a fast poll, no last
  call once the expected survivors are in, the round's end announced, leaving without closing);
* :mod:`~ddpjob_worker.agent.workers` and :mod:`~ddpjob_worker.agent.warm`: worker processes (warm
  spares, checkpoint waits, stopped workers gone before new ones start, orphans reaped as PID 1);
* :mod:`~ddpjob_worker.agent.launch`: how the agent starts.

The decision after each look, what a restart costs and the charges settled after the next round are
:mod:`~ddpjob_worker.agent.judge`'s. torch's template cannot pass *why* it restarts the workers, so
the reason is one record (:class:`~ddpjob_worker.agent.judge.Restart`), written just before
``_restart_workers`` and used up by ``_stop_workers`` and ``_rendezvous``. Every transition is
written to the state file (:mod:`ddpjob_worker.state`). docs/concepts/failures.md has the failure
model, docs/agent.md a glossary.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
import time
from collections.abc import Sequence
from typing import Any

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.agent.server.api import (
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
from torch.distributed.launcher.api import LaunchConfig

from ddpjob_worker.agent import doorbell, signals, warm, workers
from ddpjob_worker.agent.blame import Blame, describe_failure
from ddpjob_worker.agent.hubrdzv import HubBackend
from ddpjob_worker.agent.judge import Judge, Restart, Tick
from ddpjob_worker.agent.ledger import RestartLedger
from ddpjob_worker.agent.policy import REAP_SECONDS, Action, Settings, WorkerStatus
from ddpjob_worker.agent.rendezvous import check_in
from ddpjob_worker.agent.storelink import StoreLink
from ddpjob_worker.bounded import call_bounded
from ddpjob_worker.membership import liveness, watch
from ddpjob_worker.membership.failover import StoreView, SupersededError
from ddpjob_worker.membership.keys import END_FAILURE, END_JOIN
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.seal import Seal
from ddpjob_worker.membership.watch import Look, RoundWatch
from ddpjob_worker.state import Failure, Phase, StateWriter

logger = logging.getLogger("ddpjob_worker.agent.elastic")

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
        listener: liveness.Listener | None = None,
        backend: HubBackend | None = None,
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
        self._settings = settings
        self._state = state
        self._heartbeat_seconds = heartbeat_seconds
        self._ledger = RestartLedger(spec.max_restarts)
        seal = Seal.from_env()
        self._blame = Blame(seal, in_pod=settings.in_ddpjob_pod)
        self._watch = RoundWatch()
        hosting = bool(settings.is_host) if hosting is None else hosting
        self._link = StoreLink(
            spec.rdzv_handler,
            params,
            settings=settings,
            state=state,
            seal=seal,
            view=StoreView(gen=gen, hosting=hosting, address=params.endpoint or None),
            use=self._use,
            last_round=lambda: self._watch.view,
            listener=listener,
            backend=backend,
        )
        self._judge = Judge(self._ledger, self._blame, self._link, self._watch, settings)
        self._restart = Restart(stop_seconds=settings.restart_stop_seconds)
        # (store, nodes) of each round we moved on from, for their exit barriers
        self._rounds_behind: list[tuple[Any, int | None]] = []
        self._departed = False
        self._warm = _warm_pool(spec, settings, early_spares)
        self._reaper = workers.Reaper(self._known_pids)
        self._doorbell = doorbell.Doorbell()
        self._exits = doorbell.ProcessWatch()
        self.gave_up = False

    def _use(self, handler: RendezvousHandler) -> None:
        """Join through ``handler`` from now on (the store moved)."""
        self._worker_group.spec.rdzv_handler = handler
        self._rdzv_handler = handler

    # -- the monitor loop -------------------------------------------------------------------

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        group = self._worker_group
        spec = group.spec
        self._initialize_workers(group)
        self._state.update(phase=Phase.RUNNING)
        last_write = time.monotonic()
        steady = False
        while True:
            self._pause(spec.monitor_interval, steady=steady)
            result: RunResult = self._monitor_workers(group)
            noticed_at = time.time()
            self._ledger.check_torch(self._remaining_restarts)
            group.state = result.state
            status = _STATUS.get(result.state)
            if status is None:
                raise RuntimeError(f"[{role}] worker group in unexpected state {result.state.name}")
            failure = self._blame.failure(result.failures, group.group_rank or 0, noticed_at)
            tick = self._judge.next_action(group, status, failure)
            status = tick.status  # FAILED for a worker the hub found hung, though it runs
            steady = tick.action is Action.CONTINUE and status is WorkerStatus.HEALTHY
            if tick.action is Action.CONTINUE:
                if status is WorkerStatus.HEALTHY:
                    self._tick_warm()
                self._reaper.tick()
                if time.monotonic() - last_write >= self._heartbeat_seconds:
                    self._state.update()
                    last_write = time.monotonic()
                continue
            if tick.action is Action.FINISH:
                self.close_warm()
                self._state.update(phase=Phase.SUCCEEDED)
                self._exit_barrier()  # type: ignore[no-untyped-call]
                self._check_in_to_rounds_behind()
                return result
            if tick.look.hung:
                hung = "hung: its worker held the round up past the hang threshold"
                self._state.update(last_failure=Failure(reason=hung, at=time.time()))
            elif status is WorkerStatus.FAILED:
                self._state.update(last_failure=describe_failure(result.failures))
            if tick.action is Action.GIVE_UP:
                self._give_up(role, group, tick)
                return result
            self._restart = self._judge.account(group, tick)
            self._announce_end(END_FAILURE if status is WorkerStatus.FAILED else END_JOIN, tick)
            self._judge.log_restart(role, tick)
            self._sync_budget(phase=Phase.RECOVERING)
            self._restart_workers(group)
            self._state.update(phase=Phase.RUNNING)
            last_write = time.monotonic()

    def _pause(self, interval: float, *, steady: bool) -> None:
        """Wait between two looks at the workers and the round
        (:mod:`ddpjob_worker.agent.doorbell`): until news comes, for up to
        :data:`~ddpjob_worker.agent.doorbell.QUIET_SECONDS` while the workers run healthy and every
        source of news rings, for ``interval`` otherwise. Then act on a stop signal whose raise
        was swallowed (:func:`ddpjob_worker.agent.signals.check`)."""
        signals.check()
        fds = self._news_fds() if steady else None
        if fds is None:
            time.sleep(interval)
        else:
            self._doorbell.wait(doorbell.QUIET_SECONDS, fds)
        signals.check()

    def _news_fds(self) -> list[int] | None:
        """What rings when the next look may differ: the workers' pidfds (the round's word
        rings the doorbell itself); None when something must be polled instead."""
        rdzv = self._link.rdzv
        if rdzv is None or not rdzv.ring_on_news(self._doorbell.ring):
            return None
        if self._warm is not None and not self._warm.settled:
            return None  # spares are starting up: their pool ticks
        return self._worker_fds()

    def _worker_fds(self) -> list[int] | None:
        """A pidfd for each worker process (readable when it ends); None when the workers are
        not all processes of ours (function entrypoints)."""
        procs = workers.processes(self._pcontext)
        if len(procs) != self._worker_group.spec.local_world_size:
            return None
        # One that torch has seen end (a rank done before the others) would ring forever.
        return self._exits.fds([proc.pid for proc in procs if proc.returncode is None])

    def _announce_end(self, reason: str, tick: Tick) -> None:
        """On our own evidence (not because a peer announced it, nor with the store lost), tell
        the round it is over."""
        rdzv = self._link.rdzv
        if rdzv is None or tick.look.store_lost or tick.look.ends:
            return
        try:
            rdzv.announce_end(reason)
        except (RuntimeError, OSError) as exc:  # peers notice through their collective
            logger.warning("could not announce the end of the round: %s", exc)

    def _give_up(self, role: str, group: WorkerGroup, tick: Tick) -> None:
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
        self._announce_end(END_FAILURE, dataclasses.replace(tick, look=Look(ends=tick.look.ends)))
        if self._settings.in_ddpjob_pod and not self._departed:
            # Our pod fails and is replaced by a new agent: the others re-form without us now,
            # not when our heartbeats lapse (the rendezvous stays open for the replacement).
            self._departed = True
            self._leave()
        self._restart = Restart(stop_seconds=self._settings.stop_seconds)
        self._stop_workers(group)
        group.state = WorkerState.FAILED
        self.gave_up = True
        self._state.update(phase=Phase.FAILED)
        # Peers of this round that finished wait for us in its exit barrier: we are done too.
        self._rounds_behind.append((self._store, group.group_world_size))
        self._check_in_to_rounds_behind()

    def _check_in_to_rounds_behind(self) -> None:
        """Check in to the exit barrier of every round we moved on from
        (:func:`ddpjob_worker.agent.rendezvous.check_in`)."""
        rounds, self._rounds_behind = self._rounds_behind, []
        check_in(rounds)

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
        self._blame.watch(pid for pid in ids.values() if isinstance(pid, int))
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

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop workers for a restart: SIGTERM, then SIGKILL after :attr:`Restart.stop_seconds`
        (torch waits 30 s here), or once a worker writing its committed step at the stop is done
        (up to the grace period); first let a checkpoint being written finish, after it wait
        for them to be gone. A pod's graceful stop (SIGTERM to the agent) still gets the full
        grace period: torch's ``run()`` calls ``_shutdown`` with it directly."""
        procs = workers.processes(self._pcontext)
        grace = self._settings.grace_seconds
        workers.wait_saves(procs, grace)
        workers.terminate(procs, self._restart.stop_seconds, grace)
        # torch's own close: it signals again, kills what is left, closes the logs.
        self._shutdown(timeout=0)
        workers.wait_gone(workers.processes(self._pcontext), REAP_SECONDS)

    # -- leaving ---------------------------------------------------------------------------------

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """torch's shutdown; on SIGTERM/SIGINT we first leave the rendezvous (as its host, hand
        the store over), so peers re-form without us at once (:meth:`_leave`)."""
        if signals.stopping() and not self._departed:
            self._departed = True
            self._leave()
        super()._shutdown(death_sig, timeout)

    def _leave(self) -> None:
        """Leave the run, bounded by :data:`LEAVE_BOUND_SECONDS`: peers re-form without us at
        once. The store's host cannot leave its own store (it goes with us): it hands it over,
        and the others carry on around a new host (failover only)."""
        rdzv = self._link.rdzv
        hosting = self._link.view.hosting
        if rdzv is None or (hosting and not self._settings.failover):
            return
        self._watch.close()
        what = "hand the store over" if hosting else "leave the rendezvous"
        try:
            call_bounded(
                functools.partial(rdzv.leave, LEAVE_BOUND_SECONDS, hosting=hosting),
                what,
                limit=LEAVE_BOUND_SECONDS,
            )
        except Exception as exc:  # best effort: peers fall back on our heartbeats lapsing
            logger.warning("could not %s: %s", what, exc)
        else:
            if hosting:
                logger.info("handed the rendezvous store over: the others carry on without us")
            else:
                logger.info("left the rendezvous: the others re-form without us")

    # -- rendezvous with store recovery -------------------------------------------------------

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        self._state.update(phase=Phase.RENDEZVOUS)
        restart = self._restart
        lost = restart.lost
        recovered = False
        deadline: float | None = None  # the join timeout, from the first trouble on

        def by() -> float:
            nonlocal deadline
            if deadline is None:
                deadline = time.monotonic() + self._settings.join_timeout
            return deadline

        left = (self._store, worker_group.group_world_size)  # the round we are leaving, if any
        self._watch.close()
        if lost is None and self._link.rdzv is not None:
            self._link.rdzv.expect_survivors()
        while True:
            signals.check()
            if lost is not None:
                self._link.recover(by(), lost, passed_over=self._watch.silent_seen)
                recovered, lost = True, None
                self._state.update(phase=Phase.RENDEZVOUS)
            try:
                # The store link's superseded check may raise from inside torch's join.
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
                self._link.join_newer(exc.found, by())
                recovered = True
            except (RendezvousConnectionError, DistNetworkError) as exc:
                if self._link.view.hosting:
                    raise
                logger.warning("rendezvous store unreachable while joining: %s", exc)
                lost = Health.UNKNOWN
            except DistStoreError as exc:
                # The round formed, then a peer vanished before it published its ranks (torch
                # waits for them with the store's read timeout). Join the next round instead of
                # dying: the lost peer is dropped from it after its heartbeats lapse.
                if time.monotonic() > by():
                    raise
                logger.warning("the round broke before it started, rejoining: %s", exc)
        self._sync_budget(**self._judge.after_round(worker_group, recovered, restart.unsettled))
        self._restart = Restart(stop_seconds=self._settings.restart_stop_seconds)

    def _joined(self, recovered: bool, left: tuple[Any, int | None]) -> None:
        """Note the round just joined: its members, its view, the watch on them."""
        rdzv = self._link.rdzv
        if rdzv is not None:
            host_at = None
            try:
                round_, peers = rdzv.joined(
                    self._link.view.gen,
                    my_address=None if self._link.advert is None else self._link.advert.address,
                    failover=self._settings.failover,
                )
            except (RuntimeError, OSError) as exc:  # store trouble: the next look finds out
                logger.warning("could not read the members' liveness addresses: %s", exc)
            else:
                self._watch.start(round_, watch.watched(peers, me=rdzv.me, host=round_.host))
                host_at = round_.host_address
            self._link.round_formed(host_at)
        if recovered:
            # The old rounds' barriers died with the old store (and whoever waited in them
            # with its host); their store clients could only hang or fail.
            self._rounds_behind.clear()
        elif self._ledger.rounds:
            self._rounds_behind.append(left)

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
