"""Run something when the worker is told to stop (SIGTERM), even while the main thread is
blocked in a collective. Stdlib only.

A worker whose peer died or froze is blocked in the step's all-reduce: gloo waits in C++ and
Python's signal handlers, which run on the main thread between bytecodes, do not run until
it returns (after the backend's timeout: 30 minutes). Its state is still the last committed
step's (``optimizer.step`` has not run), and it is the state the restart needs: this is the
moment to write it down. The GIL is free while gloo waits, so another thread can.

:func:`install` has the interpreter write every signal's number to a pipe
(``signal.set_wakeup_fd``: its C-level handler does that on whichever thread the kernel
picked) and starts a thread that reads the pipe. On a SIGTERM the thread calls ``on_stop``
(under :func:`ddpjob_worker.saving.marked`, so ddpjob-agent waits for it, up to its grace
period), then, where SIGTERM had the default action, ends the process with exit code 143
(``128 + SIGTERM``, what a shell reports for a death by SIGTERM).

A script's own SIGTERM handler, installed before :func:`install`, still decides: it runs on
the main thread when that thread can run Python, beside the thread's ``on_stop``. One thing
changes: while ``hold()`` is true (a step is past its ``optimizer.step``: its parameters are
half-way to the next step, and only the commit makes them a state again) the handler is held
until :meth:`OnStop.release` (the commit), so that a handler that exits does not throw the
step away. A SIGTERM that is ignored (``SIG_IGN``) stays ignored: nothing is installed.
``signal.set_wakeup_fd`` is one per process: if something else (an asyncio loop) holds it,
nothing is installed, and if something takes it later, ``on_stop`` no longer runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from ddpjob_worker.saving import marked

logger = logging.getLogger("ddpjob_worker.train.onstop")

EXIT_CODE = 128 + signal.SIGTERM


def _never() -> bool:
    return False


class OnStop:
    """The installed watch (see the module doc); :func:`install` makes it."""

    def __init__(self, on_stop: Callable[[], None], previous: Any) -> None:
        self.on_stop = on_stop
        self.hold: Callable[[], bool] = _never
        """True while the script's own handler must wait for :meth:`release`."""
        self.previous = previous
        """The script's SIGTERM handler, or ``SIG_DFL``."""
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.pending: tuple[int, FrameType | None] | None = None
        """A SIGTERM held for the script's handler."""
        self.stops = 0
        """How many SIGTERMs the thread has seen."""
        self._thread = threading.Thread(target=self._run, name="ddpjob-onstop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread: closing the pipe's write end ends its read."""
        with contextlib.suppress(OSError):
            os.close(self.write_fd)
        if self._thread.ident is not None:
            self._thread.join(5)
        with contextlib.suppress(OSError):
            os.close(self.read_fd)

    def handler(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM on the main thread. Default action: the thread writes and exits (should it
        be gone, the default action now). A script's handler: now, or at the commit."""
        if not callable(self.previous):
            if not (self._thread.is_alive() and self._woken()):
                # Nobody will write and exit (an event loop took the wakeup fd since):
                # the default action, as if we were not here.
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.raise_signal(signal.SIGTERM)
            return
        if self.hold():
            self.pending = (signum, frame)
            return
        self.previous(signum, frame)

    def _woken(self) -> bool:
        """The wakeup fd is still ours (main thread: it can only be read by setting it)."""
        current = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        if current != self.write_fd:
            signal.set_wakeup_fd(current)
            return False
        return True

    def release(self) -> None:
        """Main thread, once the step is committed: run the script's handler a step held."""
        pending, self.pending = self.pending, None
        if pending is not None and callable(self.previous):
            self.previous(*pending)

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 512)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM not in data:
                continue  # another signal with a Python handler (SIGINT): not ours
            self.stops += 1
            try:
                with marked():
                    self.on_stop()
            except BaseException:  # the thread must not die silently
                logger.exception("writing the state at the stop failed")
            ours = signal.getsignal(signal.SIGTERM) == self.handler
            if ours and not callable(self.previous):
                os._exit(EXIT_CODE)
            # The script handles SIGTERM itself (or saving() holds it): it decides.


_WATCH: OnStop | None = None
"""This process's watch: one per process (the wakeup fd is)."""


def install(on_stop: Callable[[], None], hold: Callable[[], bool] = _never) -> OnStop | None:
    """Call ``on_stop`` on a thread of its own at each SIGTERM (see the module doc). Once per
    process: a second call replaces ``on_stop`` and ``hold``. None where it cannot be: not the
    main thread, SIGTERM ignored, the wakeup fd taken."""
    global _WATCH  # noqa: PLW0603 - the wakeup fd is the process's
    if _WATCH is not None:
        _WATCH.on_stop, _WATCH.hold = on_stop, hold
        return _WATCH
    if threading.current_thread() is not threading.main_thread():
        logger.info("not on the main thread: no snapshot at a stop (SIGTERM)")
        return None
    current = signal.getsignal(signal.SIGTERM)
    if current in (signal.SIG_IGN, None):
        return None
    watch = OnStop(on_stop, current)
    watch.hold = hold
    taken = signal.set_wakeup_fd(watch.write_fd, warn_on_full_buffer=False)
    if taken != -1:
        with contextlib.suppress(ValueError):  # gone or blocking now: not ours to mend
            signal.set_wakeup_fd(taken)  # someone else's: leave it theirs
        watch.stop()
        logger.info("the signal wakeup fd is taken (an event loop?): no snapshot at a stop")
        return None
    signal.signal(signal.SIGTERM, watch.handler)
    watch.start()
    _WATCH = watch
    global _FORK_HOOK  # noqa: PLW0603 - once per process
    if not _FORK_HOOK:
        os.register_at_fork(after_in_child=_in_child)
        _FORK_HOOK = True
    return watch


_FORK_HOOK = False


def _in_child() -> None:
    """A forked child (a DataLoader worker) inherits the wakeup fd, our pipe, but not our
    thread: a SIGTERM to the child would wake the parent's thread, which would write and exit
    the parent. The child forgets the watch: the wakeup fd released, SIGTERM's handler back to
    the script's (or the default)."""
    global _WATCH
    watch, _WATCH = _WATCH, None
    if watch is None:
        return
    with contextlib.suppress(ValueError):  # forked from another thread: not ours to set
        signal.set_wakeup_fd(-1)
        if signal.getsignal(signal.SIGTERM) == watch.handler:
            signal.signal(signal.SIGTERM, watch.previous)
    for fd in (watch.read_fd, watch.write_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


def uninstall() -> None:
    """Undo :func:`install` (main thread): the script's SIGTERM handler (or the default) back
    if ours is still installed, the wakeup fd released if it still is ours, the thread ended."""
    global _WATCH
    watch, _WATCH = _WATCH, None
    if watch is None:
        return
    if signal.getsignal(signal.SIGTERM) == watch.handler:
        signal.signal(signal.SIGTERM, watch.previous)
    previous = signal.set_wakeup_fd(-1)
    if previous not in (-1, watch.write_fd):
        signal.set_wakeup_fd(previous)
    watch.stop()
