"""The agent's judgement after each look at its workers and its round: what to do
(:class:`Tick`), what a restart costs and why it happens (:class:`Restart`), and, once the next
round has formed, who was charged and whether the restart is refunded.

The agent (:mod:`ddpjob_worker.agent.elastic`) carries the judgement out. The rules are pure
(:func:`ddpjob_worker.agent.policy.decide`, :class:`~ddpjob_worker.agent.ledger.RestartLedger`);
this room reads what they decide on (the round's findings, the failure reports in the round's
store) and keeps the budget.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup

from ddpjob_worker.agent.blame import Blame, FailureReport, Verdict
from ddpjob_worker.agent.hubrdzv import round_departed
from ddpjob_worker.agent.ledger import RestartLedger
from ddpjob_worker.agent.policy import Action, Settings, WorkerStatus, decide
from ddpjob_worker.agent.rendezvous import round_members
from ddpjob_worker.agent.storelink import StoreLink
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.watch import Look, RoundWatch

logger = logging.getLogger("ddpjob_worker.agent.elastic")


@dataclasses.dataclass(frozen=True)
class Tick:
    """What one look at the workers and the round decided."""

    status: WorkerStatus
    action: Action
    look: Look
    verdict: Verdict


@dataclasses.dataclass(frozen=True)
class Restart:
    """Why the agent restarts its workers: torch's ``_restart_workers(group)`` template has no
    parameter for it, so the agent writes this just before, and ``_stop_workers`` and
    ``_rendezvous`` use it up."""

    stop_seconds: float
    """SIGTERM to SIGKILL for the workers: short when their group is broken."""
    lost: Health | None = None
    """Not None: the store is lost, and this is what we know of its host."""
    unsettled: tuple[Any, int] | None = None
    """(round store, our node rank) of a failure whose charge is settled once the next round
    has formed."""


class Judge:
    """The agent's restart budget and the verdicts it is spent on."""

    def __init__(
        self,
        ledger: RestartLedger,
        blame: Blame,
        link: StoreLink,
        watch: RoundWatch,
        settings: Settings,
    ) -> None:
        self.ledger = ledger
        self._blame = blame
        self._link = link
        self._watch = watch
        self._settings = settings

    def next_action(self, group: WorkerGroup, status: WorkerStatus, failure: FailureReport) -> Tick:
        """What to do after one look at the workers and at the round."""
        look = Look() if status is WorkerStatus.SUCCEEDED else self._look()
        verdict = Verdict(collateral=False, store_lost=look.store_lost)
        if look.hung:
            # The hub found our worker holding the round up while the others waited in its
            # collective: our failure (charged to us, a hang every time gives up in the end),
            # though torch still sees it run; the restart's stop kills it.
            logger.warning(
                "our worker held round up past the hang threshold (the hub's verdict): "
                "restarting it, charged to this node"
            )
            status = WorkerStatus.FAILED
        elif status is WorkerStatus.FAILED and look.dropped:
            # A member went silent: whatever our workers did, the group lost a member.
            verdict = Verdict(collateral=True, store_lost=look.store_lost)
        elif status is WorkerStatus.FAILED and not look.store_lost and not self.ledger.disabled:
            verdict = self._report_failure(group, failure)
        for _ in range(2):
            action = decide(
                status,
                remaining_restarts=self.ledger.remaining,
                nodes_waiting=look.waiting,
                store_lost=verdict.store_lost,
                collateral=verdict.collateral,
                restarts_disabled=self.ledger.disabled,
            )
            if action is not Action.SETTLE_FIRST:
                break
            # No restart left: giving up is final, so wait for the peers' reports first.
            verdict = self._settle_now(group)
        if verdict.store_lost and not look.store_lost:
            # The round's store failed us while we reported: its host is gone.
            look = dataclasses.replace(look, host=Health.UNKNOWN)
        return Tick(status, action, look, verdict)

    def _look(self) -> Look:
        """One look at the round (:meth:`ddpjob_worker.membership.watch.RoundControl.look`)."""
        rdzv = self._link.rdzv
        if rdzv is None:
            return Look()
        hosting = self._link.view.hosting
        return rdzv.look(self._watch, hosting=hosting, limit=self._settings.store_read_limit)

    def _report_failure(self, group: WorkerGroup, failure: FailureReport) -> Verdict:
        """Report our failure to the round's store (:class:`ddpjob_worker.agent.blame.Blame`)."""
        if group.store is None or group.group_rank is None:
            return Verdict(collateral=False)
        return self._blame.report(group.store, failure, hosting=self._link.view.hosting)

    def _settle_now(self, group: WorkerGroup) -> Verdict:
        """With no restart left: wait for the peers' reports before deciding (giving up is
        final)."""
        if group.store is None:
            return Verdict(collateral=False)
        return self._blame.wait_settled(
            group.store,
            group.group_rank or 0,
            group.group_world_size or 1,
            hosting=self._link.view.hosting,
            member_gone=self._link.rdzv.member_gone if self._link.rdzv else lambda: False,
        )

    def account(self, group: WorkerGroup, tick: Tick) -> Restart:
        """What a restart costs (:class:`ddpjob_worker.agent.ledger.RestartLedger`), and why it
        happens."""
        failed = tick.status is WorkerStatus.FAILED
        unsettled = None
        if tick.action is Action.RESTART_CHARGED:
            self.ledger.charge()
        elif tick.action is Action.RESTART_SETTLE_LATER:
            # Restart at once; who is charged is settled when the next round has formed.
            unsettled = (group.store, group.group_rank or 0)
        else:
            # Counted in TORCHELASTIC_RESTART_COUNT unless healthy workers only restart to admit
            # a waiting node (torchrun does not count those either). A peer's failure or leave
            # that ended our round counts too: under torchrun our workers would have failed.
            self.ledger.free(after_failure=failed or tick.look.store_lost or tick.look.broken)
        intact = not failed and not (tick.look.broken or tick.look.store_lost)
        settings = self._settings
        return Restart(
            stop_seconds=settings.restart_stop_seconds if intact else settings.stop_seconds,
            lost=tick.look.host,
            unsettled=unsettled,
        )

    def log_restart(self, role: str, tick: Tick) -> None:
        logger.info(
            "[%s] %s: restarting workers (%s; nodes waiting %d; store lost %s; "
            "collateral %s; %d/%d restarts left)",
            role,
            tick.status.value,
            tick.action.value,
            tick.look.waiting,
            tick.look.store_lost,
            tick.verdict.collateral,
            self.ledger.remaining,
            self.ledger.budget.max_restarts,
        )

    def after_round(
        self, group: WorkerGroup, recovered: bool, unsettled: tuple[Any, int] | None
    ) -> dict[str, Any]:
        """Settle charges and record the round just formed; what the state file says of it. A
        failure restarted for is charged only if it was the root cause; a store that changed
        under us is a membership change, free (the old round's reports died with its store)."""
        new_nodes = group.group_world_size
        if new_nodes is None:
            raise RuntimeError("rendezvous completed without a world size")
        if unsettled is not None:
            store, node = unsettled
            hosting = self._link.view.hosting
            self.ledger.settle(
                root=not recovered and self._blame.is_root(store, node, hosting=hosting)
            )
        previous = self.ledger.previous_nodes
        members = round_members(group.spec.rdzv_handler)
        departed = round_departed(group.spec.rdzv_handler)
        if self.ledger.round_formed(new_nodes, members, recovered=recovered, departed=departed):
            logger.info(
                "refunding the last restart: a membership change (nodes %s -> %s, store "
                "recovered %s)",
                previous,
                new_nodes,
                recovered,
            )
        local = [w.global_rank for w in group.workers]
        return {
            "rdzv_round": self.ledger.rounds,
            "num_nodes": new_nodes,
            "node_rank": group.group_rank,
            "world_size": group.workers[0].world_size if group.workers else None,
            "group_rank_start": min(local) if local else None,
            "group_rank_end": max(local) + 1 if local else None,
        }
