"""The agent's state file: what one ``ddpjob-agent`` tells the world about itself.

Stdlib only (no torch), so the operator, a readiness probe and tests can parse it cheaply.

Lifecycle of :class:`Phase` (one agent process)::

    waiting -> rendezvous -> running -> succeeded
                  ^             |
                  |             v
                  +-------- recovering  (worker failure, peer change, store host lost)
    any phase -> stopped (SIGTERM/SIGINT)     any phase -> failed (budget used up, error)

The file is rewritten atomically (tmp file in the same directory, then ``os.replace``), so a
reader never sees half a document.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Phase(enum.StrEnum):
    WAITING = "waiting"
    """Waiting for the rendezvous endpoint to resolve and accept connections."""
    RENDEZVOUS = "rendezvous"
    """Joining a rendezvous round."""
    RUNNING = "running"
    """Workers are running."""
    RECOVERING = "recovering"
    """Workers stopped after a failure or membership change; about to rejoin."""
    STOPPED = "stopped"
    """Stopped by SIGTERM/SIGINT (exit code 143)."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Failure:
    """The last failure the agent saw: a worker exit, or an agent-level error."""

    reason: str
    exit_code: int | None = None
    rank: int | None = None
    at: float = 0.0


@dataclasses.dataclass(frozen=True)
class AgentState:
    """One snapshot of an agent. ``group_rank_start``/``group_rank_end`` is the half-open range of
    global ranks this node's workers hold in the current round."""

    phase: Phase
    pid: int
    updated_at: float
    rdzv_round: int = 0
    """How many rendezvous rounds this agent has completed (1 after the first join)."""
    world_size: int | None = None
    node_rank: int | None = None
    num_nodes: int | None = None
    group_rank_start: int | None = None
    group_rank_end: int | None = None
    restart_count: int = 0
    """Restarts charged against ``--max-restarts`` (net of refunds)."""
    membership_restarts: int = 0
    """Restarts refunded or never charged because the membership changed."""
    store_recoveries: int = 0
    """Times the agent rebuilt its rendezvous handler after losing the store host."""
    max_restarts: int = 0
    last_failure: Failure | None = None
    store_host: bool = False
    """This agent hosts the rendezvous store its group uses (pod 0 at first; after a failover,
    the survivor that took over)."""
    store_gen: int = 0
    """The generation of the store this agent uses (0: none yet, or it is looking for one)."""
    spares_ready: int = 0
    """Idle warm workers with torch imported: a restart now starts that many workers warm
    (:mod:`ddpjob_worker.agent.warm`)."""

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["phase"] = self.phase.value
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AgentState:
        """Parse a state document. Raises ValueError naming what is wrong."""
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"agent state is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"agent state must be a JSON object, got {type(data).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"agent state has unknown fields {unknown}")
        try:
            data["phase"] = Phase(data["phase"])
        except KeyError as exc:
            raise ValueError("agent state has no 'phase'") from exc
        except ValueError as exc:
            raise ValueError(f"agent state has an unknown phase {data['phase']!r}") from exc
        failure = data.get("last_failure")
        if failure is not None:
            if not isinstance(failure, dict):
                raise ValueError("agent state 'last_failure' must be an object or null")
            data["last_failure"] = Failure(**failure)
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"agent state is incomplete: {exc}") from exc

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.updated_at


def write_state(path: str | os.PathLike[str], state: AgentState) -> None:
    """Write ``state`` to ``path`` atomically (tmp in the same directory + ``os.replace``)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(state.to_json())
            handle.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_state(path: str | os.PathLike[str]) -> AgentState:
    """Read a state file. Raises OSError if missing, ValueError if malformed."""
    return AgentState.from_json(Path(path).read_text(encoding="utf-8"))


def is_ready(state: AgentState, *, max_age: float, now: float | None = None) -> bool:
    """Readiness: workers running and the agent wrote its state within ``max_age`` seconds."""
    return state.phase is Phase.RUNNING and state.age(now) <= max_age


class StateWriter:
    """Holds the current :class:`AgentState` and rewrites the file on every update.

    With no path it only keeps the state in memory. A write error is logged once, not raised:
    the state file must never take the training down.
    """

    def __init__(self, path: str | None, *, max_restarts: int = 0, pid: int | None = None) -> None:
        self.path = path
        self.state = AgentState(
            phase=Phase.WAITING,
            pid=os.getpid() if pid is None else pid,
            updated_at=time.time(),
            max_restarts=max_restarts,
        )
        self._warned = False
        self.on_update: Callable[[AgentState], None] | None = None
        """Called with every new state (the agent's liveness answer follows it)."""

    def update(self, **changes: Any) -> AgentState:
        self.state = dataclasses.replace(self.state, updated_at=time.time(), **changes)
        if self.on_update is not None:
            self.on_update(self.state)
        if self.path:
            try:
                write_state(self.path, self.state)
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    print(
                        f"ddpjob-agent: cannot write state file {self.path}: {exc}",
                        file=sys.stderr,
                        flush=True,
                    )
        return self.state
