"""When each worker process exited, to the millisecond.

The agent polls its workers every monitor interval (0.1 s), so the moment it *notices* a failure
is quantised to that grid; two agents started together poll in step, and a root cause and the
collateral failure it caused a few milliseconds later are then noticed in the same tick, in
either order. The exit itself is what is ordered: the faulty worker's process ends (its sockets
close), and only then do the others' collectives break. So the agent keeps one small thread per
worker blocked in ``waitid(WEXITED | WNOWAIT)``: it wakes when the process exits, notes the
wall time and leaves the process unreaped, for torch's own ``Popen.poll`` to collect as usual.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable

# Linux and the BSDs have waitid; elsewhere the clock records nothing and callers fall back on
# the time they noticed the failure.
_WAITID = getattr(os, "waitid", None)


class ExitClock:
    """Wall-clock exit times of watched child processes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exited: dict[int, float] = {}

    def watch(self, pids: Iterable[int]) -> None:
        """Start timing these child processes (our own children only)."""
        if _WAITID is None:
            return
        for pid in pids:
            with self._lock:
                self._exited.pop(pid, None)  # a reused pid from an earlier round
            thread = threading.Thread(
                target=self._wait, args=(pid,), name=f"ddpjob-exit-{pid}", daemon=True
            )
            thread.start()

    def exited_at(self, pid: int) -> float | None:
        """When ``pid`` exited, or ``None`` if it has not (or was never watched)."""
        with self._lock:
            return self._exited.get(pid)

    def earliest(self, pids: Iterable[int]) -> float | None:
        """The earliest exit time among ``pids``, or ``None`` if none is known."""
        times = [at for at in map(self.exited_at, pids) if at is not None]
        return min(times, default=None)

    def _wait(self, pid: int) -> None:
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            # Reaped under us (torch polled first) or not our child: nothing precise to add.
            return
        except InterruptedError:  # pragma: no cover - PEP 475 retries these
            return
        at = time.time()
        with self._lock:
            self._exited[pid] = at
