"""The agent's SIGTERM/SIGINT handler: one-shot, and reinstalled after every worker start.

torch's ``PContext.start`` installs its own handler (which raises ``SignalException`` on every
signal) each time workers start, replacing ours. With torch's, a second SIGTERM that arrives
while the agent is stopping its workers raises again inside the shutdown, abandoning it, and
the workers (each in its own session) outlive the agent. Ours raises once, then ignores further
SIGTERM/SIGINT so the shutdown runs to the end. The agent calls :func:`install` after every
worker start (``DdpjobAgent._start_workers``).
"""

# ruff: noqa: PLC0415

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_stopping = False


class StoppedWhileStartingError(Exception):
    """A stop signal that came while torch itself was being imported (the agent's start-up):
    torch's ``SignalException`` cannot be imported from a half-imported torch."""


def _raise_signal(signum: int, frame: FrameType | None) -> None:
    global _stopping  # noqa: PLW0603
    if _stopping:
        return
    _stopping = True
    ignore()
    sigval = signal.Signals(signum)
    try:
        from torch.distributed.elastic.multiprocessing import SignalException
    except Exception as exc:  # the signal interrupted torch's own import
        raise StoppedWhileStartingError(f"got {sigval.name} while starting") from exc
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def stopping() -> bool:
    """Whether a stop signal (SIGTERM/SIGINT) has been handled: the agent is shutting down."""
    return _stopping


def install() -> None:
    """(Re)install the one-shot handler, unless a stop signal has already been handled."""
    if threading.current_thread() is not threading.main_thread():
        return
    if _stopping:
        ignore()
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_signal)


def ignore() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
