"""The agent's SIGTERM/SIGINT handler: one-shot, reinstalled after every worker start, and
never lost.

torch's ``PContext.start`` installs its own handler (which raises ``SignalException`` on every
signal) each time workers start, replacing ours. With torch's, a second SIGTERM that arrives
while the agent is stopping its workers raises again inside the shutdown, abandoning it, and
the workers (each in its own session) outlive the agent. Ours raises once, then ignores further
SIGTERM/SIGINT so the shutdown runs to the end. The agent calls :func:`install` after every
worker start (``DdpjobAgent._start_workers``).

A handler's exception is raised wherever the main thread happens to be, and code that catches
every exception swallows it: torch's own import does (``torch._load_global_deps`` wraps the CUDA
libraries' preload in ``except Exception: pass``), so a SIGTERM 0.3 s into the agent's start-up
was lost, and the agent trained to the end and exited 0. So:

* until torch is imported, a stop does not raise at all: the agent ends there and then
  (:func:`exit_early`: its early spares killed, exit 143). Nothing of torch's runs yet, so
  nothing is left to stop;
* from then on the stop raises, and is also *remembered*: the agent acts on it at its
  checkpoints (:func:`check`: in every wait of the start-up, at every monitor tick and
  rendezvous poll, after every worker start), where a raise that was swallowed is raised again.
"""

# ruff: noqa: PLC0415

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_stopping: signal.Signals | None = None
_early_exit: Callable[[signal.Signals], NoReturn] | None = None


class StoppedWhileStartingError(Exception):
    """A stop signal that came while torch itself was being imported (the agent's start-up):
    torch's ``SignalException`` cannot be imported from a half-imported torch."""


def _stop_error(sigval: signal.Signals) -> Exception:
    """torch's ``SignalException`` for ``sigval`` (what torch's agent acts on: it stops the
    workers), or :class:`StoppedWhileStartingError` while torch is not importable."""
    try:
        from torch.distributed.elastic.multiprocessing import SignalException
    except Exception:  # the signal interrupted torch's own import
        return StoppedWhileStartingError(f"got {sigval.name} while starting")
    return SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def _raise_signal(signum: int, frame: FrameType | None) -> None:
    global _stopping  # noqa: PLW0603
    if _stopping is not None:
        return
    _stopping = signal.Signals(signum)
    ignore()
    if _early_exit is not None:
        _early_exit(_stopping)
    raise _stop_error(_stopping)


def exit_early(end: Callable[[signal.Signals], NoReturn] | None) -> None:
    """Until ``None`` is given: a stop signal calls ``end(signal)`` (which exits the process)
    instead of raising. For the start-up, before torch is imported: an exception raised then
    may land inside torch's import, which swallows it."""
    global _early_exit  # noqa: PLW0603
    _early_exit = end


def stopping() -> bool:
    """Whether a stop signal (SIGTERM/SIGINT) has been handled: the agent is shutting down."""
    return _stopping is not None


def check() -> None:
    """Raise the stop again if one was handled (its first raise may have been swallowed). Only
    at the agent's checkpoints, never on the way out (its shutdown would be cut short)."""
    if _stopping is not None and threading.current_thread() is threading.main_thread():
        raise _stop_error(_stopping)


def install() -> None:
    """(Re)install the one-shot handler, unless a stop signal has already been handled."""
    if threading.current_thread() is not threading.main_thread():
        return
    if _stopping is not None:
        ignore()
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_signal)


def ignore() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
