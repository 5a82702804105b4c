"""The hub's suspicions: who probes a member gone quiet, what the answers mean, and when the
lost are cut. Pure: no sockets, no clock of its own (the hub passes ``now``). No torch.

A member is suspected two ways (:class:`Suspicion`, ``loud``):

* **loud**: its connection closed. The hub asks the member's liveness socket itself; refused
  twice means its agent's process is gone.
* **quiet**: nothing heard from it for the silence window. :data:`OBSERVERS` other members
  probe it (SWIM's indirect ping): one of them hearing it keeps it in, so one slow link is never
  a death.

Confirmed losses wait for the suspects still being probed, up to :data:`BATCH_SECONDS`, so that
64 members of one node frozen at once are one round change (:func:`judge`).
"""

from __future__ import annotations

import bisect
import dataclasses
import zlib
from collections.abc import Iterable, Mapping, Sequence

from ddpjob_worker.membership import liveness
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.nodes import NodeIdent

SILENT_AFTER_SECONDS = liveness.SILENT_AFTER_SECONDS
"""A member not heard from for this long is suspected (then probed by others)."""
PROBE_SECONDS = 0.6
"""How long the observers of a suspect get to ask it."""
OBSERVERS = 3
"""How many other members probe a suspect."""
LOUD_PROBE_SECONDS = liveness.PROBE_TIMEOUT_SECONDS + liveness.CONFIRM_AFTER_SECONDS + PROBE_SECONDS
"""How long the hub waits for its own probe of a member whose connection closed: the probe's
timeout and its confirmation, and a margin for a thread pool slow to run it."""
BATCH_SECONDS = 2.0
"""The longest a confirmed loss waits for other suspects' probes before it is cut."""


@dataclasses.dataclass
class Suspicion:
    """One suspect's case: opened at ``since``, answers gathered until ``deadline``."""

    since: float
    loud: bool
    """Its connection closed (the hub probes it itself), or it went quiet (observers do)."""
    deadline: float
    asked: set[NodeIdent] = dataclasses.field(default_factory=set)
    answers: list[Health] = dataclasses.field(default_factory=list)
    verdict: Health | None = None

    @classmethod
    def closed(cls, now: float) -> Suspicion:
        """Its connection closed: its own liveness socket is asked (refused twice: gone). The
        case waits for that probe, which its own timeout bounds: on a loaded node a refused
        connect and its confirmation can take longer than :data:`PROBE_SECONDS`, and a pod
        killed whole is then reported gone, not silent."""
        return cls(since=now, loud=True, deadline=now + LOUD_PROBE_SECONDS)

    @classmethod
    def quiet(cls, now: float) -> Suspicion:
        """Not heard from: observers probe it."""
        return cls(since=now, loud=False, deadline=now + PROBE_SECONDS)


@dataclasses.dataclass(frozen=True)
class Judgement:
    cleared: frozenset[NodeIdent]
    """Suspects heard from after all: keep them (count them as just heard)."""
    cut: Mapping[NodeIdent, Health]
    """The lost, to cut now (empty while confirmed losses wait for other probes)."""


def observers(target: NodeIdent, candidates: Iterable[NodeIdent]) -> list[NodeIdent]:
    """Up to :data:`OBSERVERS` of ``candidates`` (members heard from lately, the target not
    among them), spread over the sorted members from a start that depends on the target only:
    a node's members are not all asked about by its own neighbours."""
    return observers_among(target, sorted(set(candidates)))


def observers_among(target: NodeIdent, ordered: Sequence[NodeIdent]) -> list[NodeIdent]:
    """:func:`observers` from ``ordered``: the candidates sorted, without repeats, the target
    among them or not. The hub sorts its members once per tick, however many it suspects in it
    (a sort per suspect made a tick that suspected half of 1,024 members take 150 ms)."""
    at = bisect.bisect_left(ordered, target)
    skip = at < len(ordered) and ordered[at] == target
    size = len(ordered) - skip
    if size <= 0:
        return []

    def nth(k: int) -> NodeIdent:
        return ordered[k + 1 if skip and k >= at else k]

    start = zlib.crc32(target.encode()) % size
    step = max(1, size // OBSERVERS)
    return sorted({nth((start + k * step) % size) for k in range(OBSERVERS)})


def verdict(suspicion: Suspicion, now: float) -> Health | None:
    """ALIVE (keep it), GONE or SILENT (cut it), or None (not yet)."""
    answers = suspicion.answers
    if Health.GONE in answers:
        return Health.GONE  # refused twice: its agent's process is gone
    if suspicion.loud:
        if Health.ALIVE in answers:
            # Its agent lives but its connection closed: a hello clears this; one that does
            # not come back within the silence window is silent.
            return Health.SILENT if now - suspicion.since >= SILENT_AFTER_SECONDS else None
        if answers:
            return Health.SILENT  # its own socket did not answer within the probe's timeout
        return Health.SILENT if now >= suspicion.deadline else None
    if Health.ALIVE in answers:
        return Health.ALIVE  # someone hears it: a slow link is no death
    everyone = suspicion.asked and len(answers) >= len(suspicion.asked)
    return Health.SILENT if everyone or now >= suspicion.deadline else None


def judge(suspects: Mapping[NodeIdent, Suspicion], now: float) -> Judgement:
    """Settle the suspicions whose answers are in (or ran out of time), recording each verdict
    once; the lost are cut together, once nobody is still being probed or the oldest case has
    waited :data:`BATCH_SECONDS`."""
    cleared: set[NodeIdent] = set()
    for ident, suspicion in suspects.items():
        if suspicion.verdict is None:
            found = verdict(suspicion, now)
            if found is Health.ALIVE:
                cleared.add(ident)
            else:
                suspicion.verdict = found
    open_ = {ident: s for ident, s in suspects.items() if ident not in cleared}
    lost = {ident: s.verdict for ident, s in open_.items() if s.verdict is not None}
    if not lost:
        return Judgement(frozenset(cleared), {})
    pending = any(s.verdict is None for s in open_.values())
    oldest = min(s.since for s in open_.values())
    if pending and now - oldest < BATCH_SECONDS:
        return Judgement(frozenset(cleared), {})
    return Judgement(frozenset(cleared), lost)


def after_stall(
    suspects: Mapping[NodeIdent, Suspicion], stalled: float
) -> dict[NodeIdent, Suspicion]:
    """The cases left once the hub's own loop did not run for ``stalled`` seconds (frozen,
    starved). Every member then counts as just heard, so a quiet case still open is dropped:
    the heartbeats and the observers' answers it waited for may sit unread in our sockets, and
    its deadline passed while nobody listened. A loud case keeps its evidence (the connection
    did close), its clock moved on by the stall. Cases already decided stand."""
    kept: dict[NodeIdent, Suspicion] = {}
    for ident, case in suspects.items():
        if case.verdict is None and not case.loud:
            continue
        if case.verdict is None:
            case.since += stalled
            case.deadline += stalled
        kept[ident] = case
    return kept
