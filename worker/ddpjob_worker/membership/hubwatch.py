"""The hub's watch over its members: when each was last heard, the open cases against those
gone quiet or whose connection closed, the probes asked for them, the workers that hold a
round up, and the cuts. No torch.

The decisions are :mod:`ddpjob_worker.membership.suspicion`'s and :mod:`ddpjob_worker.hang`'s
(pure); this keeps their state and does the asking. It is handed what it needs by the hub
(:class:`ddpjob_worker.membership.hub.Hub`): the members' sessions, read only (:class:`Peer`), a way
to send one of them a message, and the cut, and never reaches back further.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from ddpjob_worker import hang
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.nodes import NodeIdent
from ddpjob_worker.membership.suspicion import (
    OBSERVERS,
    SILENT_AFTER_SECONDS,
    Suspicion,
    after_stall,
    judge,
    observers_among,
)
from ddpjob_worker.membership.wire import Message
from ddpjob_worker.progress import Progress

logger = logging.getLogger("ddpjob_worker.membership.hub")

STALL_SECONDS = 1.0
"""A tick this late means the hub itself was stalled: it judges nobody for that time."""
TICK_SECONDS = 0.1


class Peer(Protocol):
    """What the watch reads of a member's session."""

    @property
    def liveness(self) -> str | None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def left(self) -> bool: ...
    @property
    def progress(self) -> tuple[int, list[Progress]] | None: ...


class HubWatch:
    """Who is alive, for one hub: fed each message's arrival, asked to tick every
    :data:`TICK_SECONDS`; it calls ``cut`` with the members found lost (batched)."""

    def __init__(
        self,
        peers: Mapping[NodeIdent, Peer],
        *,
        send: Callable[[NodeIdent, Message], None],
        cut: Callable[[Mapping[NodeIdent, Health]], None],
        hung: Callable[[frozenset[NodeIdent]], None],
        probe: Callable[[str], Health],
        clock: Callable[[], float],
    ) -> None:
        self._peers = peers
        self._send = send
        self._cut = cut
        self._hung = hung
        self._probe = probe
        self._clock = clock
        self._heard: dict[NodeIdent, float] = {}
        self._suspects: dict[NodeIdent, Suspicion] = {}
        self._req = 0
        self._probes: dict[int, NodeIdent] = {}
        self._ticked = clock()

    def __contains__(self, ident: object) -> bool:
        """Whether a case is open against ``ident``."""
        return ident in self._suspects

    def greeted(self, ident: NodeIdent) -> None:
        """A (new) connection said hello: heard now, no case against it."""
        self._heard[ident] = self._clock()
        self._suspects.pop(ident, None)

    def heard(self, ident: NodeIdent) -> float:
        """A message from ``ident``: heard now, and a quiet case against it is closed (it
        speaks). When, for the caller's own use."""
        now = self._heard[ident] = self._clock()
        suspicion = self._suspects.get(ident)
        if suspicion is not None and not suspicion.loud:
            del self._suspects[ident]
        return now

    def forget(self, ident: NodeIdent) -> None:
        """``ident`` was cut or left for good."""
        self._suspects.pop(ident, None)
        self._heard.pop(ident, None)

    def closed(self, ident: NodeIdent, liveness: str | None) -> None:
        """Its connection closed: ask its liveness socket whether its agent is gone."""
        self._suspects[ident] = Suspicion.closed(self._clock())
        if liveness is not None:
            task = asyncio.get_running_loop().run_in_executor(None, self._probe, liveness)
            task.add_done_callback(lambda done: self._self_probed(ident, done))

    def _self_probed(self, ident: NodeIdent, done: asyncio.Future[Health]) -> None:
        suspicion = self._suspects.get(ident)
        if suspicion is None or done.cancelled() or done.exception() is not None:
            return
        suspicion.answers.append(done.result())

    def probed(self, message: Message) -> None:
        """An observer's answer about a suspect."""
        target = self._probes.pop(int(message.get("req", -1)), None)
        suspicion = self._suspects.get(target) if target is not None else None
        if suspicion is None:
            return
        try:
            suspicion.answers.append(Health(message.get("health")))
        except ValueError:
            return

    def tick(self, members: Iterable[NodeIdent], running: tuple[str, int] | None) -> None:
        """Suspect the ``members`` gone quiet, judge the open cases, and, while a round runs
        (``running``: its id and round number), look for hung workers, unless a cut just ended
        it."""
        now = self._clock()
        if now - self._ticked > STALL_SECONDS:
            # We did not run: we heard nothing because we listened to nothing.
            stalled = now - self._ticked - TICK_SECONDS
            logger.warning(
                "the hub's loop did not run for %.1fs (this process was frozen or starved): "
                "judging nobody for that time",
                stalled,
            )
            self._heard = dict.fromkeys(self._heard, now)
            self._suspects = after_stall(self._suspects, stalled)
        self._ticked = now
        quiet = [
            ident
            for ident in members
            if ident not in self._suspects
            and (peer := self._peers.get(ident)) is not None
            and not peer.left
            and now - self._heard.get(ident, now) >= SILENT_AFTER_SECONDS
        ]
        if quiet:
            # Who may observe: heard from lately, with no case open (sorted once per tick).
            heard = sorted(
                other
                for other, peer in self._peers.items()
                if not peer.closed
                and other not in self._suspects
                and now - self._heard.get(other, now) < SILENT_AFTER_SECONDS
            )
            for ident in quiet:
                self._suspect(ident, now, heard)
        if not self._judge(now) and running is not None:
            self._hangs(members, running, now)

    def _suspect(self, ident: NodeIdent, now: float, heard: Sequence[NodeIdent]) -> None:
        """Ask other members (of ``heard``: sorted, heard from lately) to probe a member gone
        quiet."""
        suspicion = Suspicion.quiet(now)
        self._suspects[ident] = suspicion
        target = self._peers[ident].liveness
        if target is None:
            return
        for observer in observers_among(ident, heard):
            self._req += 1
            self._probes[self._req] = ident
            suspicion.asked.add(observer)
            self._send(observer, {"t": "probe", "req": self._req, "target": target})

    def _judge(self, now: float) -> bool:
        """Whether it cut (the round then ends)."""
        judgement = judge(self._suspects, now)
        for ident in judgement.cleared:
            del self._suspects[ident]
            if ident in self._heard:
                self._heard[ident] = now
        if len(self._probes) > OBSERVERS * len(self._suspects):
            # Questions about closed cases that no observer answered (it was cut, or its
            # answer was lost): forget them, or a long job's hub keeps them all.
            self._probes = {r: i for r, i in self._probes.items() if i in self._suspects}
        if judgement.cut:
            self._cut(judgement.cut)
        return bool(judgement.cut)

    def _hangs(self, members: Iterable[NodeIdent], running: tuple[str, int], now: float) -> None:
        """End the round for the members whose worker holds it up while most wait in its
        collective (:mod:`ddpjob_worker.hang`). They stay members: their agents answer, and
        kill the stuck workers as the others stop theirs, so the next round forms once, with
        them (cut like silent members, they came back half a second later: a second restart)."""
        round_id, number = running
        reports = {
            ident: peer.progress[1]
            for ident in members
            if (peer := self._peers.get(ident)) is not None
            and peer.progress is not None
            and peer.progress[0] == number
            and ident not in self._suspects
        }
        stuck, threshold = hang.stuck_members(reports, now)
        if not stuck:
            return
        logger.warning(
            "%d member(s) hold round %s up: their workers have not reached the collective "
            "that most of the others have waited in for over %.1fs (hung): %s",
            len(stuck),
            round_id,
            threshold,
            ", ".join(sorted(stuck)[:8]),
        )
        self._hung(frozenset(stuck))
