"""Who is charged for a round's failure. No torch.

When one node's worker dies, every other node's workers fail too (their collective breaks), and
torch charges every agent. Each agent instead reports its failure to the round's store (when its
first worker exited, timed to the millisecond by :mod:`ddpjob_worker.agent.exits`, and the cause its
workers' error files give, :func:`failure_cause`), restarts at once, and compares the reports
once the next round has formed (every member of the old round that is in the new one reported
before it joined): only the root cause is charged (:func:`is_root_cause`), the others restart
for free. With no restart left giving up is final, so the agent waits for the reports first
(:meth:`Blame.wait_settled`, at most :data:`FAILURE_SETTLE_SECONDS`).

Limits (docs/agent.md): without error files, clocks must agree to well within the gap between
two agents noticing the same collapse; two independent failures with no error file in one round
charge only the earliest.

The reports are one sealed list in the round's store (:data:`FAILURE_REPORTS_KEY`). When that
store does not answer and we do not host it, in a DDPJob pod, its host is gone (pod 0 spent its
budget and exited, as it does without closing the rendezvous): a lost store host, a free restart
and a rejoin, not a charge (:meth:`Blame.trouble`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ddpjob_worker.agent.exits import ExitClock
from ddpjob_worker.membership.seal import Seal
from ddpjob_worker.state import Failure

logger = logging.getLogger("ddpjob_worker.agent.blame")

FAILURE_SETTLE_SECONDS = 1.0
"""With no restart left, how long an agent whose workers failed waits at most for its peers'
failure reports before deciding whether its failure was the root cause (it stops waiting as
soon as an earlier report arrives or every node of the round has reported). Must exceed the time
between two agents noticing the same collapse (tens to hundreds of ms) plus a store round trip.
With restarts left nobody waits: the charge is settled once the next round has formed."""
FAILURE_REPORTS_KEY = "ddpjob/failures"


CAUSE_ERROR = "error"
"""A worker's own exception: its error file holds one that is no communication error."""
CAUSE_UNKNOWN = "unknown"
"""No error file (a signal, ``os._exit``, a script that records no error): only time tells."""
CAUSE_COMM = "comm"
"""A collective or the store failed under the worker: a peer went away, not this node's fault."""
_CAUSE_RANK = {CAUSE_ERROR: 0, CAUSE_UNKNOWN: 1, CAUSE_COMM: 2}
COMM_ERROR_MARKS = (
    "DistBackendError",
    "DistNetworkError",
    "DistStoreError",
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ncclRemoteError",
    "ncclSystemError",
    "Watchdog caught collective operation timeout",
)
"""What the error of a worker whose collective failed under it says (torch's c10d errors, gloo's
transport, NCCL's remote and watchdog errors)."""


def failure_cause(errors: Iterable[str | None]) -> str:
    """A node's cause (:data:`CAUSE_ERROR`, :data:`CAUSE_UNKNOWN` or :data:`CAUSE_COMM`) from
    its failed workers' error files (their text; None for a worker that wrote none): its own
    error if any worker has one, else unknown if any worker wrote nothing, else comm."""
    causes = [
        CAUSE_UNKNOWN
        if text is None
        else CAUSE_COMM
        if any(mark in text for mark in COMM_ERROR_MARKS)
        else CAUSE_ERROR
        for text in errors
    ]
    return min(causes, key=_CAUSE_RANK.__getitem__, default=CAUSE_UNKNOWN)


@dataclasses.dataclass(frozen=True, order=True)
class FailureReport:
    """One agent's report of its workers' failure in a round: when it noticed, who it is, and
    what its workers said (:func:`failure_cause`)."""

    at: float
    node: int
    cause: str = CAUSE_UNKNOWN

    @property
    def rank(self) -> tuple[int, float, int]:
        """The order of blame: an own error before no word before a communication error, then
        the earliest, then the lowest node."""
        return (_CAUSE_RANK.get(self.cause, _CAUSE_RANK[CAUSE_UNKNOWN]), self.at, self.node)


def format_report(report: FailureReport) -> str:
    if report.cause == CAUSE_UNKNOWN:
        return f"{report.at:.6f}@{report.node};"  # as agents before the cause wrote it
    return f"{report.at:.6f}@{report.node}@{report.cause};"


def parse_reports(text: str) -> list[FailureReport]:
    """Parse the round's appended reports; malformed items (a torn write) are skipped."""
    reports = []
    for item in text.split(";"):
        at, sep, rest = item.strip().partition("@")
        node, _, cause = rest.partition("@")
        if not sep:
            continue
        try:
            reports.append(
                FailureReport(at=float(at), node=int(node), cause=cause or CAUSE_UNKNOWN)
            )
        except ValueError:
            continue
    return reports


def settled(reports: list[FailureReport], node: int, nodes: int) -> bool | None:
    """Whether ``node``'s failure is collateral, if the reports already say: ``False`` at once
    for a worker's own error, ``True`` once a report that outranks ours is in
    (:attr:`FailureReport.rank`), ``False`` once all ``nodes`` of the round have reported and
    none does, ``None`` while it could still go either way. Without a report of ours there is
    nothing to compare: ``False`` (charged, as torch would)."""
    mine = [r for r in reports if r.node == node]
    if not mine:
        return False
    if min(r.rank for r in mine)[0] == _CAUSE_RANK[CAUSE_ERROR]:
        return False
    if not is_root_cause(reports, node):
        return True
    if len({r.node for r in reports}) >= nodes:
        return False
    return None


def is_root_cause(reports: list[FailureReport], node: int) -> bool:
    """Whether ``node``'s failure is charged. A worker's own error always is (a crash on every
    rank charges every node, as torchrun would); otherwise the report that ranks first
    (:attr:`FailureReport.rank`: no word before a communication error, then the earliest, ties
    broken by node rank), so that a node whose collective broke under it is never charged
    while another said nothing or failed on its own, whatever the clocks say. A node with no
    report counts as root cause (nothing to compare with: charge, as torch would)."""
    mine = [r.rank for r in reports if r.node == node]
    if not mine:
        return True
    if min(mine)[0] == _CAUSE_RANK[CAUSE_ERROR]:
        return True
    return min(r.rank for r in reports) >= min(mine)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the reports say of our failure so far."""

    collateral: bool | None
    """Our workers failed only because another node's did (a free restart); None: not known
    yet (settled once the next round has formed)."""
    store_lost: bool = False
    """The round's store stopped answering: its host is gone (a free restart and a rejoin)."""


class Blame:
    """Our failure reports in the rounds' stores, and the verdict on them."""

    def __init__(self, seal: Seal, *, in_pod: bool) -> None:
        self._seal = seal
        self._in_pod = in_pod
        self._exits = ExitClock()

    def watch(self, pids: Iterable[int]) -> None:
        """Time the exits of a new worker group's processes."""
        self._exits.watch(pids)

    def failure(self, failures: Mapping[int, Any], node: int, noticed_at: float) -> FailureReport:
        """Our failure (:func:`failure_of`), timed by our workers' exits."""
        return failure_of(failures, self._exits, node, noticed_at)

    def report(self, store: Any, failure: FailureReport, *, hosting: bool) -> Verdict:
        """Report our failure to the round's store: not known yet (collateral None) once it
        is in."""
        try:
            report = format_report(failure).rstrip(";")
            store.append(FAILURE_REPORTS_KEY, self._seal.items(FAILURE_REPORTS_KEY, [report]))
        except (RuntimeError, OSError) as exc:  # store trouble (DistError is a RuntimeError)
            return self.trouble(exc, hosting=hosting)
        return Verdict(collateral=None)

    def read(self, store: Any) -> list[FailureReport]:
        """The failure reports of a round's store that the job's agents wrote (sealed)."""
        raw = bytes(store.get(FAILURE_REPORTS_KEY)).decode(errors="replace")
        return parse_reports(";".join(self._seal.open_items(FAILURE_REPORTS_KEY, raw)))

    def trouble(self, exc: Exception, *, hosting: bool) -> Verdict:
        """The verdict when the store fails us while we report or compare (never a
        SignalException: a SIGTERM then must stop the agent)."""
        if self._in_pod and not hosting:
            # The store's host is gone (it may be the root cause itself, giving up). If the
            # store was only slow, the recovery finds it up at once and rejoins: harmless.
            logger.warning(
                "the rendezvous store stopped answering while comparing failure reports "
                "(%s): taking its host as lost; a free restart, then a rejoin",
                exc,
            )
            return Verdict(collateral=False, store_lost=True)
        logger.warning("could not compare failure reports, charging this one: %s", exc)
        return Verdict(collateral=False)

    def wait_settled(
        self,
        store: Any,
        node: int,
        nodes: int,
        *,
        hosting: bool,
        member_gone: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> Verdict:
        """With no restart left: wait (at most :data:`FAILURE_SETTLE_SECONDS`) until a report
        that outranks ours is in or every node of the round has reported, then say whether
        ours is collateral. A member that died whole (SIGKILL, OOM, a lost node) never reports:
        past the window, ``member_gone()`` true makes ours collateral, a membership change that
        is nobody's charge."""
        deadline = clock() + FAILURE_SETTLE_SECONDS
        while True:
            try:
                reports = self.read(store)
            except (RuntimeError, OSError) as exc:
                return self.trouble(exc, hosting=hosting)
            verdict = settled(reports, node, nodes)
            if verdict is None and clock() >= deadline and member_gone():
                log_reports(reports, node, collateral=True)
                logger.info("a member of the round is gone without a report: not our failure")
                return Verdict(collateral=True)
            if verdict is not None or clock() >= deadline:
                log_reports(reports, node, collateral=bool(verdict))
                return Verdict(collateral=bool(verdict))
            sleep(0.05)

    def is_root(self, store: Any, node: int, *, hosting: bool) -> bool:
        """Once the next round has formed: whether our failure in the round of ``store`` was
        the root cause (charged). Every report that matters is in by then."""
        try:
            reports = self.read(store)
        except (RuntimeError, OSError) as exc:
            verdict = self.trouble(exc, hosting=hosting)
            return not (verdict.collateral or verdict.store_lost)
        root = is_root_cause(reports, node)
        log_reports(reports, node, collateral=not root)
        return root


def log_reports(reports: list[FailureReport], node: int, *, collateral: bool) -> None:
    logger.info(
        "failure reports of this round: %s; ours (node %d) is %s",
        ", ".join(f"node {r.node} at {r.at:.3f} ({r.cause})" for r in sorted(reports)),
        node,
        "collateral (free restart)" if collateral else "the root cause",
    )


NO_ERROR_FILE = "<N/A>"
"""torch's ``ProcessFailure.error_file`` for a worker that wrote none."""


def _error_text(failure: Any) -> str | None:
    """What a failed worker (torch's ``ProcessFailure``) wrote to its error file, as text; None
    when it wrote none."""
    data = getattr(failure, "error_file_data", None)
    if not data or getattr(failure, "error_file", NO_ERROR_FILE) == NO_ERROR_FILE:
        return None  # torch's stand-in then is {"message": "<NONE>"}
    return json.dumps(data, default=str)


def cause_of(failures: Mapping[int, Any]) -> str:
    """The cause (:func:`failure_cause`) of torch's failures by rank (``ProcessFailure``s)."""
    return failure_cause(_error_text(f) for f in failures.values())


def failure_of(
    failures: Mapping[int, Any], clock: ExitClock, node: int, noticed_at: float
) -> FailureReport:
    """Our failure: when it started (the first failed worker's exit, timed by ``clock``; the
    moment we noticed it if that is unknown), who we are in the round, and its cause."""
    exited = clock.earliest(f.pid for f in failures.values())
    at = noticed_at if exited is None else min(exited, noticed_at)
    return FailureReport(at, node, cause_of(failures))


def describe_failure(failures: Mapping[int, Any]) -> Failure:
    """The state file's account of the first failed worker (torch's ``ProcessFailure``s)."""
    if not failures:
        return Failure(reason="workers unhealthy", at=time.time())
    rank, first = min(failures.items(), key=lambda item: item[1].timestamp)
    message = first.message if isinstance(first.message, str) else str(first.message)
    return Failure(
        reason=message or first.signal_name() or "worker failed",
        exit_code=first.exitcode,
        rank=rank,
        at=time.time(),
    )
