"""Is a peer's agent alive? A listening socket per agent, and a connect to ask.

torch's rendezvous learns that a node is gone only when its keep-alive heartbeats lapse
(``keep_alive_interval`` x ``keep_alive_max_attempt``, 5 s with DDPJob's defaults), and the next
round cannot start before that. When a whole pod dies (SIGKILL, OOM, a lost node), its peers'
collectives break at once, so their agents know *that* something died long before the
heartbeats say *who*. Each agent therefore keeps a listening TCP socket open for its whole life
and publishes its address in the rendezvous store. A peer that restarts after a failure connects
to every other member of the round it leaves:

* accepted: :attr:`Liveness.ALIVE`. The kernel completes the handshake from the listen backlog,
  so a busy agent (or a machine with every core loaded) still answers at once;
* refused, or no route to it: :attr:`Liveness.DEAD`. The address is up and nobody listens there
  any more (the agent's process is gone), or the address itself is gone;
* no answer within the timeout, or anything else: :attr:`Liveness.UNKNOWN`. The machine may be
  down, or a firewall may drop the packets while the peer is fine; only the heartbeats can
  tell, so nothing is decided on it.

Stdlib only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import errno
import logging
import socket
import threading
from collections.abc import Iterable, Mapping

logger = logging.getLogger("ddpjob_worker.liveness")

PROBE_TIMEOUT_SECONDS = 1.0
"""How long a probe waits for the handshake before it gives up (the answer is then unknown)."""
_GONE_ERRNOS = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL}


class Liveness(enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


class Listener:
    """A listening socket that accepts and closes every connection, on a daemon thread."""

    def __init__(self, host: str) -> None:
        """Listen on every address of this machine (a pod has its own), on a free port; peers
        reach it at ``host`` (the node's rendezvous address), as they reach its workers."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.bind(("", 0))
        self._socket.listen(128)
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        self.address = f"{shown}:{self._socket.getsockname()[1]}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ddpjob-liveness", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._socket.accept()
            except OSError:  # closed under us
                return
            conn.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


def listen(host: str) -> Listener | None:
    """A listener reachable at ``host`` (this node's rendezvous address), or None if it cannot
    listen (peers then fall back on torch's heartbeats for this node)."""
    try:
        return Listener(host)
    except OSError as exc:
        logger.warning("no liveness socket on %s (%s): peers will wait for heartbeats", host, exc)
        return None


def probe(address: str, timeout: float = PROBE_TIMEOUT_SECONDS) -> Liveness:
    """Whether an agent still listens at ``address`` (``host:port``); see the module doc."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return Liveness.ALIVE
    except ValueError:  # not an address we published: nothing to judge by
        return Liveness.UNKNOWN
    except OSError as exc:
        return Liveness.DEAD if exc.errno in _GONE_ERRNOS else Liveness.UNKNOWN


def probe_all(
    addresses: Mapping[str, str], timeout: float = PROBE_TIMEOUT_SECONDS
) -> dict[str, Liveness]:
    """:func:`probe` every value of ``addresses`` (node -> ``host:port``), in parallel, so that
    the whole check takes at most about ``timeout``."""
    if not addresses:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(addresses))) as pool:
        answers = pool.map(lambda address: probe(address, timeout), addresses.values())
        return dict(zip(addresses, answers, strict=True))


def parse_addresses(items: Iterable[tuple[str, bytes]]) -> dict[str, str]:
    """Decode ``(node, b"host:port")`` pairs read from the store, skipping undecodable values."""
    found = {}
    for node, raw in items:
        try:
            found[node] = raw.decode()
        except UnicodeDecodeError:
            continue
    return found
