"""``saving()``: tell ddpjob-agent that this worker is writing a checkpoint. Stdlib only.

A restart stops workers fast (SIGTERM, SIGKILL 0.25 s later when the round is over): a worker
blocked in a broken collective has nothing to lose. A worker that is writing a checkpoint has:
killed mid-write, it loses the newest checkpoint, and a save that is not atomic leaves a torn
file that every rank then fails to load. Inside ``with saving():``

* the agent waits for the block to end (up to its grace period, ``DDPJOB_GRACE_SECONDS``)
  before it stops the worker, and
* a SIGTERM (the pod stops; the agent forwards it) is held until the block ends, then
  delivered to the script's own handler (or the default action).

Outside ddpjob-agent (``DDPJOB_SAVING_DIR`` unset) only the second holds. Save atomically all
the same (write to a temporary file in the same directory, then ``os.replace``): nothing
protects a save from a SIGKILL, an OOM kill or a lost node.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from ddpjob_worker.contract import DDPJOB_SAVING_DIR


def marker(pid: int, directory: str | None = None) -> Path | None:
    """Where the worker ``pid`` says it is saving, or None outside ddpjob-agent."""
    directory = directory if directory is not None else os.environ.get(DDPJOB_SAVING_DIR)
    return Path(directory) / str(pid) if directory else None


@contextlib.contextmanager
def marked() -> Iterator[None]:
    """Only the first half of :func:`saving`: ddpjob-agent waits for the block to end (up to its
    grace period) before it stops this worker; signals are left alone, so any thread may use
    it (the snapshot a stopped worker writes: :mod:`ddpjob_worker.train.onstop`). Nests, across
    threads too: the outermost block makes and removes the marker."""
    path = marker(os.getpid())
    if path is None:
        yield
        return
    with _LOCK:
        first = _DEPTH[0] == 0
        _DEPTH[0] += 1
        if first:
            with contextlib.suppress(OSError):
                path.touch()
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                with contextlib.suppress(OSError):
                    path.unlink()


_LOCK = threading.Lock()
_DEPTH = [0]
"""How many :func:`marked` blocks are open in this process."""


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Hold off ddpjob-agent's stop and SIGTERM while the block writes a checkpoint (see the
    module doc). Nests; use it on the thread that handles signals (the main one) to hold
    SIGTERM."""
    held: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None

    def hold(signum: int, frame: FrameType | None) -> None:
        held.append(signum)

    if main:
        signal.signal(signal.SIGTERM, hold)
    try:
        with marked():
            yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
            if held:
                signal.raise_signal(signal.SIGTERM)
