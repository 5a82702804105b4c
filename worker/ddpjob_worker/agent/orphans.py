"""Reaping orphans when the agent is PID 1. Stdlib only.

In a pod the agent is usually the container's PID 1 (``command: [ddpjob-agent]``, an image with
no init). When a worker dies or is killed, its own children (DataLoader workers, compile
workers, whatever the script started) are reparented to PID 1, and nobody waits for them: every
restart leaves zombies, and with ``podPidsLimit`` forks eventually fail. So the agent, as PID 1,
reaps the zombie children it did not start itself: torch reaps its workers, and the warm pool
its spares, through their ``Popen`` objects, which must see their exit status.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path


def zombie_children(parent: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids of ``parent``'s children that have exited and wait to be reaped."""
    zombies = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after it
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 2 and fields[0] == "Z" and int(fields[1]) == parent:
            zombies.append(int(entry.name))
    return zombies


def reap(known: Iterable[int], proc: Path = Path("/proc")) -> list[int]:
    """Reap this process's zombie children but ``known`` (the ones a ``Popen`` waits for);
    return their pids."""
    skip = set(known)
    reaped = []
    for pid in zombie_children(os.getpid(), proc):
        if pid in skip:
            continue
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
            reaped.append(pid)
    return reaped
