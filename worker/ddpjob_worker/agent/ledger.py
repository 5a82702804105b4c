"""The restart ledger: what each restart costs the agent's budget, across rounds. Pure.

torch charges every restart after a failure to ``--max-restarts``. We charge only what was this
node's own failure:

* a failure whose cause is not known yet (the peers' reports are still coming in) restarts at
  once and is settled once the next round has formed (:meth:`RestartLedger.settle`): charged
  when this node's failure started the round's collapse (:mod:`ddpjob_worker.agent.blame`), free
  otherwise;
* a charged restart is refunded when the next round shows it was a membership change: a member
  of the last round is missing (it died, and our workers only failed with it), or the store's
  host changed (:func:`is_membership_change`);
* membership changes themselves (a node waits to join, the store's host is lost) are free.

torch derives ``TORCHELASTIC_RESTART_COUNT`` from its own counter; the ledger says what that
counter must read (:meth:`RestartLedger.torch_counter`) so that scripts see torchrun's count, and
notices when torch lowers it itself (its uninterruptible-state watchdog's way of saying "stop
restarting": :meth:`RestartLedger.check_torch`).
"""

from __future__ import annotations

import dataclasses


def is_membership_change(
    *,
    previous_nodes: int | None,
    new_nodes: int,
    store_recovered: bool,
    previous_members: frozenset[str] | None = None,
    new_members: frozenset[str] | None = None,
    departed: bool | None = None,
) -> bool:
    """The refund rule: was a provisionally charged restart really a membership change?

    When a peer node dies, our workers fail first (gloo loses a connection) and the restart is
    charged. If a node of the previous round is missing from the next one (it left, or was
    replaced by a new agent, as the operator does within seconds), the charge is refunded.
    Losing and rejoining the store host is a membership change too. When the rendezvous does
    not tell who its members are, a smaller round counts as a peer having left. A round with
    the same members means a worker really failed, and the charge stands. A hub's round does
    not name its members to each of them: it says whether one ``departed``, which decides.
    """
    if store_recovered:
        return True
    if departed is not None:
        return departed
    if previous_members is not None and new_members is not None:
        return bool(previous_members - new_members)
    return previous_nodes is not None and new_nodes < previous_nodes


@dataclasses.dataclass(frozen=True)
class Budget:
    """The restart budget: ``charged`` restarts so far, ``refunded`` of them given back."""

    max_restarts: int
    charged: int = 0
    refunded: int = 0
    free: int = 0
    free_after_failure: int = 0
    """Free restarts that followed a failure of our workers (collateral, or store lost)."""

    @property
    def restart_count(self) -> int:
        """Net restarts: charged minus refunded (the state file's ``restart_count``)."""
        return self.charged - self.refunded

    @property
    def torchrun_restart_count(self) -> int:
        """``TORCHELASTIC_RESTART_COUNT`` as torchrun counts it: every restart after our workers
        failed, charged or not (scripts resume from a checkpoint only when it is > 0). Restarts
        of healthy workers for a node that waits to join do not count, as in torchrun."""
        return self.charged + self.free_after_failure

    @property
    def remaining(self) -> int:
        return self.max_restarts - self.restart_count

    def charge(self) -> Budget:
        if self.remaining <= 0:
            raise ValueError(f"no restarts left of {self.max_restarts}")
        return dataclasses.replace(self, charged=self.charged + 1)

    def refund(self) -> Budget:
        if self.restart_count <= 0:
            raise ValueError("nothing to refund: no restart is charged")
        return dataclasses.replace(self, refunded=self.refunded + 1)

    def free_restart(self, *, after_failure: bool = False) -> Budget:
        return dataclasses.replace(
            self,
            free=self.free + 1,
            free_after_failure=self.free_after_failure + (1 if after_failure else 0),
        )

    @property
    def membership_restarts(self) -> int:
        return self.refunded + self.free


class RestartLedger:
    """One agent's :class:`Budget`, and what is owed on it until the next round has formed."""

    def __init__(self, max_restarts: int) -> None:
        self.budget = Budget(max_restarts)
        self.rounds = 0
        """Rounds joined so far."""
        self.disabled = False
        """torch stopped restarts (a worker stuck in uninterruptible sleep): failed workers are
        not restarted, whatever the budget says."""
        self._refundable = False
        self._previous: tuple[int, frozenset[str] | None] | None = None
        self._told_torch = max_restarts

    @property
    def remaining(self) -> int:
        return self.budget.remaining

    def charge(self) -> None:
        """A restart for our own failure; refunded if the next round shows a member gone."""
        self.budget = self.budget.charge()
        self._refundable = True

    def free(self, *, after_failure: bool) -> None:
        """A restart that costs nothing: ``after_failure`` when our workers had failed (it
        counts in ``TORCHELASTIC_RESTART_COUNT``, as torchrun counts it)."""
        self.budget = self.budget.free_restart(after_failure=after_failure)

    def settle(self, *, root: bool) -> None:
        """A failure restarted for before its cause was known: charged if it was the root cause
        and a restart is left, free otherwise."""
        if root and self.budget.remaining > 0:
            self.charge()
        else:
            self.free(after_failure=True)

    def disable(self) -> None:
        self.disabled = True

    def round_formed(
        self,
        nodes: int,
        members: frozenset[str] | None,
        *,
        recovered: bool,
        departed: bool | None = None,
    ) -> bool:
        """Record the round just formed (``nodes`` nodes; its ``members`` if the rendezvous
        says, or whether a member ``departed`` if it says that). Returns whether the last
        charge was refunded (it was a membership change)."""
        refunded = False
        if self._refundable and is_membership_change(
            previous_nodes=None if self._previous is None else self._previous[0],
            new_nodes=nodes,
            store_recovered=recovered,
            previous_members=None if self._previous is None else self._previous[1],
            new_members=members,
            departed=departed,
        ):
            self.budget = self.budget.refund()
            refunded = True
        self._refundable = False
        self._previous = (nodes, members)
        self.rounds += 1
        return refunded

    @property
    def previous_nodes(self) -> int | None:
        """The node count of the round before the one just formed, for messages."""
        return None if self._previous is None else self._previous[0]

    def torch_counter(self) -> int:
        """What torch's ``_remaining_restarts`` must read: torch derives
        ``TORCHELASTIC_RESTART_COUNT`` from it as ``max_restarts - counter``, and we make it
        count as torchrun counts (every restart after a failure, free or not), so it may go
        below 0. Once torch has disabled restarts, 0."""
        self._told_torch = (
            0 if self.disabled else self.budget.max_restarts - self.budget.torchrun_restart_count
        )
        return self._told_torch

    def check_torch(self, counter: int) -> None:
        """torch's counter as it reads now: lowered by torch itself is its watchdog's "stop"."""
        if counter != self._told_torch:
            self.disabled = True
