"""What an agent says of itself on its liveness socket. No torch.

Every connection to the socket (:class:`ddpjob_worker.membership.liveness.Listener`) gets one JSON
line:

* the store it uses: ``run``, ``gen`` (its generation), ``store`` (its endpoint; null while the
  agent looks for one, or while a new host has not yet recorded its first round's base),
  ``established`` (a round completed on it), ``host`` (we host it), ``host_at`` (where its host
  answers);
* where the agent is: ``index`` (its pod index), ``phase``, ``world`` (the world it trains in,
  0 when it does not), ``round``.

Peers read it to find the current store and to fence a host that woke up after the others moved on
(:mod:`ddpjob_worker.membership.failover`); newcomers ask the job's pods through it which store to
join; the operator reads the phase and the world. The state file says whether we host the store and
its generation too.
"""

from __future__ import annotations

from typing import Any

from ddpjob_worker.membership.failover import StoreView
from ddpjob_worker.membership.liveness import Listener
from ddpjob_worker.state import AgentState, Phase, StateWriter


class Advert:
    """Our liveness socket's answer, kept current: :meth:`say` when the store changes, and
    every state write (the phase, the world)."""

    def __init__(
        self, listener: Listener | None, *, run_id: str, index: int | None, state: StateWriter
    ) -> None:
        self._listener = listener
        self._run_id = run_id
        self._index = index
        self._state = state
        self._said: dict[str, Any] = {"v": 1}
        state.on_update = self._answer

    @property
    def address(self) -> str | None:
        """Where our liveness socket answers (None: we have none; peers use heartbeats)."""
        return None if self._listener is None else self._listener.address

    def say(self, store: StoreView, *, orphan: bool = False) -> None:
        """Say which store we use (``orphan``: none, we look for one)."""
        hosting = store.hosting and not orphan
        gen = 0 if orphan else store.gen
        host_at = self.address if store.hosting else store.host_at
        self._said = {
            "v": 1,
            "run": self._run_id,
            "index": self._index,
            "gen": store.gen,
            "store": None if orphan else store.address,
            "established": store.established and not orphan,
            "host": hosting,
            "host_at": None if orphan else host_at,
        }
        state = self._state.state
        if (state.store_host, state.store_gen) != (hosting, gen):
            self._state.update(store_host=hosting, store_gen=gen)  # answers through _answer
        else:
            self._answer(state)

    def _answer(self, state: AgentState) -> None:
        if self._listener is None:
            return
        training = state.phase is Phase.RUNNING
        self._listener.info = {
            **self._said,
            "phase": state.phase.value,
            "world": (state.world_size or 0) if training else 0,
            "round": state.rdzv_round,
        }
