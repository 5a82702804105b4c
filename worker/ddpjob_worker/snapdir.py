"""The agent's snapshot directory: where its workers keep their per-step snapshots. No torch.

A worker's in-memory snapshot (:mod:`ddpjob_worker.train.snapshot`) must outlive the worker, so it
cannot be the worker's own: the agent makes one directory per run when it starts, names it to
every worker in ``DDPJOB_SNAPSHOT_DIR``, keeps it across worker restarts (that is the point)
and removes it when it exits. It lives in ``/dev/shm`` (memory, as fast as the copy can be),
or the system temp dir where there is no ``/dev/shm``.

Its name, ``ddpjob-<run id>-<agent pid>``, says whose it is: an agent killed by SIGKILL (or
the OOM killer) cannot remove its directory, so the next agent of the same run removes those
whose agent is gone (:func:`stale`), before it makes its own. Directories of other runs are
never touched: two jobs may share a node's ``/dev/shm``.

The names and the sweep's decision are pure functions; :func:`make` and :func:`remove` do the
I/O.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

logger = logging.getLogger("ddpjob_worker.snapdir")

PREFIX = "ddpjob-"
SHM = Path("/dev/shm")
_UNSAFE = re.compile(r"[^A-Za-z0-9._]+")


def safe_run_id(run_id: str) -> str:
    """``run_id`` as a file-name part: anything but letters, digits, ``.`` and ``_`` becomes
    ``_`` (so the pid after the last ``-`` is never ambiguous), and an empty id ``none``."""
    return _UNSAFE.sub("_", run_id) or "none"


def dir_name(run_id: str, pid: int) -> str:
    """The directory of the agent ``pid`` of run ``run_id``."""
    return f"{PREFIX}{safe_run_id(run_id)}-{pid}"


def parse_dir_name(name: str) -> tuple[str, int] | None:
    """``(safe run id, pid)`` of a directory :func:`dir_name` made, None for any other name."""
    if not name.startswith(PREFIX):
        return None
    run, sep, pid = name[len(PREFIX) :].rpartition("-")
    if not sep or not run or not pid.isdigit():
        return None
    return run, int(pid)


def stale(names: Iterable[str], run_id: str, *, me: int, alive: Callable[[int], bool]) -> list[str]:
    """Which of ``names`` (a base directory's entries) are snapshot directories of run
    ``run_id`` left by an agent that is gone: its pid is not ``alive``, or is our own ``me``
    (we have not made ours yet; an agent that is PID 1 in its container has the pid of the
    previous container's agent). Other runs' directories are never named."""
    run = safe_run_id(run_id)
    found = []
    for name in names:
        parsed = parse_dir_name(name)
        if parsed is None or parsed[0] != run:
            continue
        if parsed[1] == me or not alive(parsed[1]):
            found.append(name)
    return sorted(found)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts: it is not ours to
    judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def base_dir(shm: Path = SHM) -> Path:
    """``/dev/shm`` if it is a writable directory, else the system temp dir (slower: a disk,
    but the snapshots still outlive the workers)."""
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return Path(tempfile.gettempdir())


def make(run_id: str, *, base: Path | None = None, pid: int | None = None) -> Path:
    """Sweep ``base`` of this run's stale directories, then make ours (mode 0700, replacing a
    leftover of the same name); raises OSError if it cannot be made."""
    base = base_dir() if base is None else base
    pid = os.getpid() if pid is None else pid
    try:
        names = os.listdir(base)
    except OSError as exc:
        logger.warning("could not list %s for stale snapshot directories: %s", base, exc)
        names = []
    for name in stale(names, run_id, me=pid, alive=pid_alive):
        logger.info("removing the snapshot directory %s: its agent is gone", base / name)
        remove(base / name)
    path = base / dir_name(run_id, pid)
    path.mkdir(mode=0o700)
    return path


def remove(path: Path) -> None:
    """Remove a snapshot directory and what is in it (best effort: logged, never raised)."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not remove the snapshot directory %s: %s", path, exc)
