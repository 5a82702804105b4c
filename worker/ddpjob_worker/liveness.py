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
* refused: :attr:`Liveness.DEAD`. The address is up and nobody listens there any more (the
  agent's process is gone);
* no answer within the timeout, or anything else: :attr:`Liveness.UNKNOWN`. The machine may be
  down, or a firewall may drop the packets while the peer is fine; only the heartbeats can
  tell, so nothing is decided on it.

A connect alone cannot tell a *silent* peer: a frozen process (SIGSTOP, a hung driver, a machine
whose kernel still answers while its agent does not run) is accepted from the backlog by its
kernel. So the listener also *answers*: it writes one JSON line (:attr:`Listener.info`, what the
agent says of itself) on every connection it accepts. :func:`ask` reads that line: no line in
time means nobody runs there (silent) even though the handshake completed. :class:`PeerWatch`
asks the members of the running round a few times a second and names those that have been
silent for :data:`SILENT_AFTER_SECONDS`: a silent machine loss, a partition or a frozen pod,
which no reset ever reports.

Stdlib only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import enum
import errno
import json
import logging
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

logger = logging.getLogger("ddpjob_worker.liveness")

PROBE_TIMEOUT_SECONDS = 1.0
"""How long a probe waits for the handshake before it gives up (the answer is then unknown)."""
_GONE_ERRNOS = {errno.ECONNREFUSED}
"""Only a refusal proves the agent is gone: its machine answers and nobody listens. "No route"
comes from a partition or a flapping network as well (a host on the same segment whose ARP
entry lapsed), and a local errno says nothing of the peer: both are unknown, which the watch
turns into "silent" after its window (a silent member still counts for a majority)."""
ASK_INTERVAL_SECONDS = 0.25
"""How often :class:`PeerWatch` asks each watched peer."""
ASK_TIMEOUT_SECONDS = 0.5
"""How long one question waits for the answer line (a live agent answers in well under 10 ms)."""
SILENT_AFTER_SECONDS = 2.0
"""A peer that has not answered for this long is silent: gone as far as the round is concerned.

Longer than a pause that must not restart anyone (a 1 s stall of a whole pod, a GC pause, a
loaded machine: a stalled agent answers the questions queued in its backlog the moment it runs
again, so its silence is the stall plus at most one interval); short enough that a job whose
peer died silently trains again within about 3 s instead of waiting for its collective timeout
(30 min for a default gloo ``init_process_group``)."""
_MAX_ANSWER = 4096


class Liveness(enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    UNKNOWN = "unknown"


class Listener:
    """A listening socket that answers every connection with one JSON line (:attr:`info`) and
    closes it, on a daemon thread."""

    def __init__(self, host: str, port: int = 0) -> None:
        """Listen on every address of this machine (a pod has its own), on a free port; peers
        reach it at ``host`` (the node's rendezvous address), as they reach its workers.

        With a fixed ``port`` (the job's directory port, which newcomers ask) it listens on
        ``host`` only: pods that share a network namespace (the tests' process kubelets, a
        ``hostNetwork`` job) each have an address of their own, but not a port space."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        if port:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind((host.strip("[]"), port))
        else:
            self._socket.bind(("", 0))
        self._socket.listen(128)
        shown = f"[{host}]" if family == socket.AF_INET6 else host
        self.address = f"{shown}:{self._socket.getsockname()[1]}"
        self.info: dict[str, Any] = {"v": 1}
        """What the agent says of itself; replaced whole (never mutated) by the agent."""
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ddpjob-liveness", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._socket.accept()
            except OSError:  # closed under us
                if self._closed.is_set():
                    return
                time.sleep(0.01)  # EMFILE and the like: never let the thread die
                continue
            try:
                conn.settimeout(0.2)
                conn.sendall(json.dumps(self.info, separators=(",", ":")).encode() + b"\n")
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


def listen(host: str, port: int = 0) -> Listener | None:
    """A listener reachable at ``host`` (this node's rendezvous address), or None if it cannot
    listen (peers then fall back on torch's heartbeats for this node)."""
    if port:
        try:
            return Listener(host, port)
        except OSError as exc:
            logger.warning(
                "could not listen on %s:%d (%s): on a free port instead; newcomers will not "
                "find the store through this pod",
                host,
                port,
                exc,
            )
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


@dataclasses.dataclass(frozen=True)
class Answer:
    """What :func:`ask` learned: the verdict, and the peer's own words when it answered."""

    liveness: Liveness
    info: Mapping[str, Any] | None = None


def ask(address: str, timeout: float = ASK_TIMEOUT_SECONDS) -> Answer:
    """Connect to a peer's listener and read its answer line, all within ``timeout``.

    An answer (or a close without one, from a listener that does not answer) is
    :attr:`Liveness.ALIVE`; refused is :attr:`Liveness.DEAD`; a handshake that
    completes with no answer in time (a frozen process, its kernel still accepting) or no
    handshake at all is :attr:`Liveness.UNKNOWN`: silent.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except ValueError:
        return Answer(Liveness.UNKNOWN)
    except OSError as exc:
        return Answer(Liveness.DEAD if exc.errno in _GONE_ERRNOS else Liveness.UNKNOWN)
    data = b""
    with sock:
        try:
            while b"\n" not in data and len(data) < _MAX_ANSWER:
                left = deadline - time.monotonic()
                if left <= 0:
                    return Answer(Liveness.UNKNOWN)
                sock.settimeout(left)
                chunk = sock.recv(_MAX_ANSWER)
                if not chunk:
                    break
                data += chunk
        except OSError as exc:
            if exc.errno == errno.ECONNRESET and not data:
                return Answer(Liveness.ALIVE)  # accepted and closed: an agent that answers not
            return Answer(Liveness.UNKNOWN)
    if not data:
        return Answer(Liveness.ALIVE)
    try:
        info = json.loads(data.partition(b"\n")[0])
    except ValueError:
        return Answer(Liveness.ALIVE)
    return Answer(Liveness.ALIVE, info if isinstance(info, dict) else None)


class PeerWatch:
    """Ask a fixed set of peers (node -> listener address) every :data:`ASK_INTERVAL_SECONDS`,
    on a daemon thread, and tell which have been silent or dead for a while.

    A watch that did not run itself (this process was frozen or starved, so it could not ask)
    judges nobody for that time: after a gap in its own asking, every peer counts as just heard
    from. So a pod that wakes up from a long stall never takes its live peers for dead.
    """

    def __init__(
        self,
        peers: Mapping[str, str],
        *,
        interval: float = ASK_INTERVAL_SECONDS,
        timeout: float = ASK_TIMEOUT_SECONDS,
    ) -> None:
        self._peers = dict(peers)
        self._interval = interval
        self._timeout = timeout
        now = time.monotonic()
        self._heard = dict.fromkeys(self._peers, now)
        self._dead: set[str] = set()
        self._answers: dict[str, Mapping[str, Any]] = {}
        self._ticked = now
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._peers:
            self._thread = threading.Thread(target=self._run, name="ddpjob-watch", daemon=True)
            self._thread.start()

    @property
    def peers(self) -> Mapping[str, str]:
        return self._peers

    def _run(self) -> None:
        workers = min(32, len(self._peers))
        with concurrent.futures.ThreadPoolExecutor(workers, "ddpjob-ask") as pool:
            while not self._stop.is_set():
                started = time.monotonic()
                answers = dict(
                    zip(
                        self._peers,
                        pool.map(lambda address: ask(address, self._timeout), self._peers.values()),
                        strict=True,
                    )
                )
                now = time.monotonic()
                with self._lock:
                    gap = self._interval + self._timeout + 0.5
                    if started - self._ticked > gap or now - started > gap:
                        # We did not run for a while (frozen, starved): we heard nothing because
                        # we asked nothing. Judge from now on.
                        self._heard = dict.fromkeys(self._peers, now)
                    for node, answer in answers.items():
                        if answer.liveness is Liveness.ALIVE:
                            self._heard[node] = now
                            self._dead.discard(node)
                            if answer.info is not None:
                                self._answers[node] = answer.info
                        elif answer.liveness is Liveness.DEAD:
                            self._dead.add(node)
                    self._ticked = now
                self._stop.wait(max(0.0, self._interval - (now - started)))

    def silent(self, window: float = SILENT_AFTER_SECONDS) -> set[str]:
        """Peers not heard from for ``window`` seconds, as of now (a dead one too, once the
        window has passed); nobody while this watch itself has not been asking (see the class
        doc)."""
        now = time.monotonic()
        with self._lock:
            if now - self._ticked > self._interval + self._timeout + 0.5:
                return set()
            return {node for node, heard in self._heard.items() if now - heard >= window}

    def dead(self) -> set[str]:
        """Peers whose address refused at the last question (their agent is gone)."""
        with self._lock:
            return set(self._dead)

    def answer(self, node: str) -> Mapping[str, Any] | None:
        """The last answer line ``node`` gave, if any."""
        with self._lock:
            return self._answers.get(node)

    def close(self) -> None:
        self._stop.set()


def ask_all(
    addresses: Mapping[str, str], timeout: float = ASK_TIMEOUT_SECONDS
) -> dict[str, Answer]:
    """:func:`ask` every value of ``addresses`` (name -> ``host:port``) in parallel."""
    if not addresses:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(addresses))) as pool:
        answers = pool.map(lambda address: ask(address, timeout), addresses.values())
        return dict(zip(addresses, answers, strict=True))


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
