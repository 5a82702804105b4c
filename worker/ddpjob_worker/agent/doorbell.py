"""The monitor loop's wait: until something it looks at may have changed. No torch.

torchrun's agent sleeps ``--monitor-interval`` (0.1 s) between two looks at its workers, ten
looks a second whatever happens. Ours waits on what can change a look instead: its workers'
processes ending (a pidfd each), its round's word (the hub's member rings the
:class:`Doorbell`), a stop signal (which interrupts the wait). When every one of them can ring,
a steady agent looks once every :data:`QUIET_SECONDS`, and sooner, at once, when one rings;
when one cannot (workers run as functions, torch's c10d handler, whose look reads the store,
spares still warming up), it looks every monitor interval, as torchrun does.

One agent in a pod does not care about ten looks a second; a thousand agents in one process
(the hollow benchmark) spend most of their CPU on them.
"""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Collection

QUIET_SECONDS = 1.0
"""The longest wait of a steady agent whose every source of news rings."""


class Doorbell:
    """Rung from any thread; :meth:`wait` returns at the first ring since the last wait (a
    ring between two waits is not lost: the pipe holds it)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def ring(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: already rung; closed
            os.write(self._write, b"!")

    def wait(self, timeout: float, fds: Collection[int] = ()) -> bool:
        """Until a ring, one of ``fds`` readable (a pidfd: its process ended), or ``timeout``
        seconds; whether something came."""
        poller = select.poll()
        poller.register(self._read, select.POLLIN)
        for fd in fds:
            poller.register(fd, select.POLLIN)
        events = poller.poll(max(0, int(timeout * 1000)))
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._read, 4096):
                pass
        return bool(events)

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


class ProcessWatch:
    """A pidfd for each of a set of processes (readable once the process has ended),
    reopened when the set changes."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}

    def fds(self, pids: Collection[int]) -> list[int] | None:
        """The pidfds of ``pids``; None when one cannot be opened (no pidfd on this kernel, or
        the process is already reaped): the caller must look by polling."""
        wanted = set(pids)
        if wanted != set(self._fds):
            self.close()
            for pid in wanted:
                try:
                    self._fds[pid] = os.pidfd_open(pid)
                except (OSError, AttributeError):
                    self.close()
                    return None
        return list(self._fds.values())

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}
