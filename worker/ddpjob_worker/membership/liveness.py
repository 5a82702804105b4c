"""Is a peer's agent alive? A listening socket per agent, and a connect to ask.

torch's rendezvous learns that a node is gone only when its keep-alive heartbeats lapse
(``keep_alive_interval`` x ``keep_alive_max_attempt``, 5 s with DDPJob's defaults), and the next
round cannot start before that. When a whole pod dies (SIGKILL, OOM, a lost node), its peers'
collectives break at once, so their agents know *that* something died long before the
heartbeats say *who*. Each agent therefore keeps a listening TCP socket open for its whole life
and publishes its address in the rendezvous store. A peer that restarts after a failure connects
to every other member of the round it leaves:

* accepted: :attr:`Health.ALIVE`. The kernel completes the handshake from the listen backlog,
  so a busy agent (or a machine with every core loaded) still answers at once;
* refused, and refused again :data:`CONFIRM_AFTER_SECONDS` later: :attr:`Health.GONE`. The
  address is up and nobody listens there any more (the agent's process is gone). One refusal
  is not enough: a packet filter that rejects for a moment, or a listener caught while it is
  made again, refuses once and accepts the next time;
* no answer within the timeout (the name lookup included), or anything else:
  :attr:`Health.UNKNOWN`. The machine may be down, or a firewall may drop the packets while
  the peer is fine; only the heartbeats can tell, so nothing is decided on it.

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
import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

logger = logging.getLogger("ddpjob_worker.membership.liveness")

PROBE_TIMEOUT_SECONDS = 1.0
"""How long a probe waits for the name lookup and the handshake before it gives up (the answer
is then unknown)."""
CONFIRM_AFTER_SECONDS = 0.1
"""How long after a refusal the second connect goes out; only a second refusal makes a peer
dead. Long enough for a listener made again or a rule that rejected for a moment to be gone,
short enough to cost a restarting peer nothing it would notice (a refusal itself takes one
round trip). A refused question may take this much longer than its timeout."""
_GONE_ERRNOS = {errno.ECONNREFUSED}
"""Only a refusal proves the agent is gone: its machine answers and nobody listens. "No route"
comes from a partition or a flapping network as well (a host on the same segment whose ARP
entry lapsed), and a local errno (EADDRNOTAVAIL, ENETUNREACH from the prober's own routes, no
IPv6 here) says nothing of the peer: both are unknown, which the watch turns into "silent" after
its window (a silent member still counts for a majority). A packet filter that REJECTs (iptables'
default answer is port-unreachable) refuses too; the second connect of :func:`probe` keeps a
short-lived one from naming a live peer dead, a lasting one on the listener's port is the
filter's owner's to fix."""
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
LISTEN_LOOKUP_SECONDS = 2.0
"""How long :class:`Listener` waits for the lookup of a host name it should listen on before it
listens on every interface instead."""
_MAX_PARALLEL = 256
"""Questions in flight at once in :func:`probe_all`, :func:`ask_all` and :class:`PeerWatch`: as
many as there are peers up to this, so that K peers that do not answer cost one timeout, not
K / the cap timeouts (each question is a thread blocked in a connect or a read, mostly idle)."""
_MAX_ANSWER = 4096

_Resolved = list[tuple[socket.AddressFamily, tuple[Any, ...]]]
"""Address families and socket addresses (port 0) of a host."""


class Health(enum.Enum):
    """A peer's health: the agent's one vocabulary for it (docs/agent.md, "Glossary").

    One question (:func:`ask`, :func:`probe`) answers ALIVE, GONE or UNKNOWN; a peer that stays
    UNKNOWN for :data:`SILENT_AFTER_SECONDS` is SILENT (:class:`PeerWatch`). A member that is
    SILENT or GONE is out of the round; only a GONE one is out of the majority a round needs
    (a silent one may be alive behind a partition).
    """

    ALIVE = "alive"
    """Its agent answered."""
    UNKNOWN = "unknown"
    """One question went unanswered (no handshake, or no answer line in time): nothing is
    judged on it."""
    SILENT = "silent"
    """Unanswered for :data:`SILENT_AFTER_SECONDS`: frozen, partitioned, or its machine lost
    without a reset."""
    GONE = "gone"
    """Its agent is gone for good: its address refused twice (the process is dead), it left on
    SIGTERM or handed the store over, or a pod of its index replaced it."""


def _addresses_of(host: str, flags: int = 0) -> _Resolved | None:
    """``getaddrinfo`` for TCP, IPv4 and IPv6 only, each address once; None if none."""
    try:
        found = socket.getaddrinfo(host, 0, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, flags)
    except (OSError, UnicodeError):  # gaierror: no such name; a label too long to encode
        return None
    unique: _Resolved = []
    for family, _, _, _, sockaddr in found:
        usable = family in (socket.AF_INET, socket.AF_INET6)
        if usable and (family, tuple(sockaddr)) not in unique:
            unique.append((family, tuple(sockaddr)))
    return unique or None


class _Lookup:
    """One name lookup on its own daemon thread, which its askers wait for no longer than they
    want. ``addresses`` is None when the name does not resolve."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.done = threading.Event()
        self.addresses: _Resolved | None = None

    def run(self) -> None:
        try:
            self.addresses = _addresses_of(self.host)
        finally:
            with _LOOKUPS_LOCK:
                if _LOOKUPS.get(self.host) is self:
                    del _LOOKUPS[self.host]
            self.done.set()


_LOOKUPS: dict[str, _Lookup] = {}
"""Lookups under way, by name: askers of the same name wait for the same lookup, so a resolver
that hangs holds one thread per name, not one per question."""
_LOOKUPS_LOCK = threading.Lock()


def _resolve(host: str, timeout: float) -> _Resolved | None:
    """The addresses of ``host`` (a name, or an IP address literal without brackets), or None
    when it does not resolve within ``timeout``.

    ``getaddrinfo`` has no timeout of its own and a slow resolver can hold it for many seconds
    (5 s per attempt with glibc's defaults, which ``socket.create_connection``'s timeout does
    not cover), so a name is looked up on a thread of its own and waited for only as long as
    the question may take. A literal is parsed at once (its IPv6 zone, ``%eth0``, included)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return _addresses_of(host, socket.AI_NUMERICHOST)
    with _LOOKUPS_LOCK:
        lookup = _LOOKUPS.get(host)
        if lookup is None:
            lookup = _LOOKUPS[host] = _Lookup(host)
            try:
                threading.Thread(target=lookup.run, name="ddpjob-lookup", daemon=True).start()
            except RuntimeError:  # no new threads (the interpreter is shutting down)
                del _LOOKUPS[host]
                return None
    if not lookup.done.wait(max(0.0, timeout)):
        return None
    return lookup.addresses


def _with_port(sockaddr: tuple[Any, ...], port: int) -> tuple[Any, ...]:
    return (sockaddr[0], port, *sockaddr[2:])


def _bind(family: socket.AddressFamily, sockaddr: tuple[Any, ...], reuse: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_everywhere() -> socket.socket:
    """A socket bound to every interface on a free port: dual-stack (IPv6 and IPv4 both), or
    IPv4 only where this machine has no IPv6."""
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        return _bind(socket.AF_INET, ("", 0), reuse=False)
    try:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", 0))
    except OSError:
        sock.close()
        return _bind(socket.AF_INET, ("", 0), reuse=False)
    return sock


class Listener:
    """A listening socket that answers every connection with one JSON line (:attr:`info`) and
    closes it, on a daemon thread."""

    def __init__(self, host: str, port: int = 0) -> None:
        """Listen at ``host`` (the node's rendezvous address: the pod's IP address, or a name of
        it), where peers reach it as they reach its workers; on a free port unless ``port`` is
        given (the job's directory port, which newcomers ask).

        Only on ``host``'s address, not on every interface: pods that share a network namespace
        (the tests' process kubelets, a ``hostNetwork`` job) each have an address of their own,
        and a listener on every interface answers at its neighbours' addresses too (and holds
        its port on all of them). A name is looked up (for at most
        :data:`LISTEN_LOOKUP_SECONDS`) and the listener binds the first of its addresses that
        is this machine's; peers try each address of the name, so the others refusing makes no
        one dead.

        ``host`` may not be an address of this machine (a name that resolves to a service's
        virtual IP, a name that does not resolve here). On a free port the listener then
        listens on every interface (both IPv6 and IPv4 when it can), with a warning: peers still
        reach it wherever ``host`` leads to this machine. On a fixed port it raises
        :class:`OSError` instead (every interface on a port that neighbours in the same network
        namespace share would take theirs); :func:`listen` then tries a free port."""
        bare = host.strip("[]")
        reuse = bool(port)
        addresses = _resolve(bare, LISTEN_LOOKUP_SECONDS)
        sock: socket.socket | None = None
        failure: OSError = socket.gaierror(f"{bare!r} did not resolve")
        for family, sockaddr in addresses or []:
            try:
                sock = _bind(family, _with_port(sockaddr, port), reuse)
                break
            except OSError as exc:  # EADDRNOTAVAIL: not ours; EADDRINUSE on a fixed port
                failure = exc
        if sock is None:
            if port:
                raise failure
            logger.warning(
                "could not listen on %s (%s): on every interface instead; peers reach it "
                "where %s leads to this machine",
                host,
                failure,
                host,
            )
            sock = _bind_everywhere()
        self._socket = sock
        try:
            self._socket.listen(128)
        except BaseException:
            self._socket.close()
            raise
        shown = f"[{bare}]" if ":" in bare else bare
        self.address = f"{shown}:{self._socket.getsockname()[1]}"
        self.info: dict[str, Any] = {"v": 1}
        """What the agent says of itself; replaced whole (never mutated) by the agent."""
        self._said: tuple[dict[str, Any], bytes] | None = None
        """:attr:`info` and its line, encoded once per change (not once per question: a new
        store's host is asked by most of the job while a round forms)."""
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
                time.sleep(0.01)  # EMFILE, ECONNABORTED and the like: never let the thread die
                continue
            try:
                conn.settimeout(0.2)
                conn.sendall(self._line())
            except OSError:
                pass
            finally:
                conn.close()

    def _line(self) -> bytes:
        info, said = self.info, self._said
        if said is None or said[0] is not info:
            said = self._said = (info, json.dumps(info, separators=(",", ":")).encode() + b"\n")
        return said[1]

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


def _connect_any(
    addresses: _Resolved, port: int, deadline: float
) -> tuple[socket.socket | None, bool]:
    """A socket connected to the first of ``addresses`` that accepts, each tried in turn with
    an equal share of the time left; else None, and whether every one refused."""
    refused = True
    for tried, (family, sockaddr) in enumerate(addresses):
        share = (deadline - time.monotonic()) / (len(addresses) - tried)
        if share <= 0:
            return None, False
        sock: socket.socket | None = None
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.settimeout(share)
            sock.connect(_with_port(sockaddr, port))
        except OSError as exc:
            if sock is not None:
                sock.close()
            refused = refused and exc.errno in _GONE_ERRNOS
            continue
        return sock, False
    return None, refused


@dataclasses.dataclass
class _Dialled:
    """A connection to a peer's listener, or the verdict without one; and the deadline left for
    reading the answer."""

    sock: socket.socket | None
    health: Health
    deadline: float


def _dial(address: str, timeout: float) -> _Dialled:
    """Connect to ``address`` (``host:port``) within ``timeout``, the name lookup included; a
    refusal is confirmed by a second connect :data:`CONFIRM_AFTER_SECONDS` later (with the
    time that was left, and at least that delay again), and only two make the peer dead."""
    deadline = time.monotonic() + timeout
    host, _, port_text = address.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:  # not an address we published: nothing to judge by
        return _Dialled(None, Health.UNKNOWN, deadline)
    if not host or not 0 < port < 65536:
        return _Dialled(None, Health.UNKNOWN, deadline)
    addresses = _resolve(host.strip("[]"), deadline - time.monotonic())
    if not addresses:  # no such name, or no answer in time from the resolver
        return _Dialled(None, Health.UNKNOWN, deadline)
    sock, refused = _connect_any(addresses, port, deadline)
    if sock is None and refused:
        left = max(deadline - time.monotonic(), CONFIRM_AFTER_SECONDS)
        time.sleep(CONFIRM_AFTER_SECONDS)
        deadline = time.monotonic() + left
        sock, refused = _connect_any(addresses, port, deadline)
    if sock is not None:
        return _Dialled(sock, Health.ALIVE, deadline)
    return _Dialled(None, Health.GONE if refused else Health.UNKNOWN, deadline)


def probe(address: str, timeout: float = PROBE_TIMEOUT_SECONDS) -> Health:
    """Whether an agent still listens at ``address`` (``host:port``); see the module doc."""
    dialled = _dial(address, timeout)
    if dialled.sock is not None:
        dialled.sock.close()
    return dialled.health


@dataclasses.dataclass(frozen=True)
class Answer:
    """What :func:`ask` learned: the verdict, and the peer's own words when it answered."""

    health: Health
    info: Mapping[str, Any] | None = None


def ask(address: str, timeout: float = ASK_TIMEOUT_SECONDS) -> Answer:
    """Connect to a peer's listener and read its answer line, all within ``timeout`` (and the
    confirmation's delay after a refusal, see :func:`probe`).

    An answer (or a close without one, from a listener that does not answer) is
    :attr:`Health.ALIVE`; refused twice is :attr:`Health.GONE`; a handshake that
    completes with no answer in time (a frozen process, its kernel still accepting) or no
    handshake at all is :attr:`Health.UNKNOWN`: silent.
    """
    dialled = _dial(address, timeout)
    if dialled.sock is None:
        return Answer(dialled.health)
    data = b""
    with dialled.sock as sock:
        try:
            while b"\n" not in data and len(data) < _MAX_ANSWER:
                left = dialled.deadline - time.monotonic()
                if left <= 0:
                    return Answer(Health.UNKNOWN)
                sock.settimeout(left)
                chunk = sock.recv(_MAX_ANSWER)
                if not chunk:
                    break
                data += chunk
        except OSError as exc:
            if exc.errno == errno.ECONNRESET and not data:
                return Answer(Health.ALIVE)  # accepted and closed: an agent that answers not
            return Answer(Health.UNKNOWN)
    if not data:
        return Answer(Health.ALIVE)
    try:
        info = json.loads(data.partition(b"\n")[0])
    except ValueError:
        return Answer(Health.ALIVE)
    return Answer(Health.ALIVE, info if isinstance(info, dict) else None)


_K = TypeVar("_K", bound=str)


class PeerWatch(Generic[_K]):
    """Ask a fixed set of peers (node -> listener address) every :data:`ASK_INTERVAL_SECONDS`,
    on a daemon thread, and tell which have been silent or dead for a while.

    A watch that did not run itself (this process was frozen or starved, so it could not ask)
    judges nobody for that time: after a gap in its own asking, every peer counts as just heard
    from. So a pod that wakes up from a long stall never takes its live peers for dead.
    """

    def __init__(
        self,
        peers: Mapping[_K, str],
        *,
        interval: float = ASK_INTERVAL_SECONDS,
        timeout: float = ASK_TIMEOUT_SECONDS,
    ) -> None:
        self._peers = dict(peers)
        self._interval = interval
        self._timeout = timeout
        now = time.monotonic()
        self._heard = dict.fromkeys(self._peers, now)
        self._gone: set[_K] = set()
        self._answers: dict[_K, Mapping[str, Any]] = {}
        self._ticked = now
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._peers:
            self._thread = threading.Thread(target=self._run, name="ddpjob-watch", daemon=True)
            self._thread.start()

    @property
    def peers(self) -> Mapping[_K, str]:
        return self._peers

    def _run(self) -> None:
        workers = min(_MAX_PARALLEL, len(self._peers))
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
                        if answer.health is Health.ALIVE:
                            self._heard[node] = now
                            self._gone.discard(node)
                            if answer.info is not None:
                                self._answers[node] = answer.info
                        elif answer.health is Health.GONE:
                            self._gone.add(node)
                    self._ticked = now
                self._stop.wait(max(0.0, self._interval - (now - started)))

    def silent(self, window: float = SILENT_AFTER_SECONDS) -> set[_K]:
        """Peers not heard from for ``window`` seconds, as of now (a dead one too, once the
        window has passed); nobody while this watch itself has not been asking (see the class
        doc)."""
        now = time.monotonic()
        with self._lock:
            if now - self._ticked > self._interval + self._timeout + 0.5:
                return set()
            return {node for node, heard in self._heard.items() if now - heard >= window}

    def gone(self) -> set[_K]:
        """Peers whose address refused at the last question, twice (their agent is gone)."""
        with self._lock:
            return set(self._gone)

    def answer(self, node: _K) -> Mapping[str, Any] | None:
        """The last answer line ``node`` gave, if any."""
        with self._lock:
            return self._answers.get(node)

    def close(self) -> None:
        self._stop.set()


def ask_all(addresses: Mapping[_K, str], timeout: float = ASK_TIMEOUT_SECONDS) -> dict[_K, Answer]:
    """:func:`ask` every value of ``addresses`` (name -> ``host:port``) in parallel."""
    if not addresses:
        return {}
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=min(_MAX_PARALLEL, len(addresses))
    ) as pool:
        answers = pool.map(lambda address: ask(address, timeout), addresses.values())
        return dict(zip(addresses, answers, strict=True))


def probe_all(
    addresses: Mapping[_K, str], timeout: float = PROBE_TIMEOUT_SECONDS
) -> dict[_K, Health]:
    """:func:`probe` every value of ``addresses`` (node -> ``host:port``), in parallel, so that
    the whole check takes at most about ``timeout``."""
    if not addresses:
        return {}
    with concurrent.futures.ThreadPoolExecutor(
        max_workers=min(_MAX_PARALLEL, len(addresses))
    ) as pool:
        answers = pool.map(lambda address: probe(address, timeout), addresses.values())
        return dict(zip(addresses, answers, strict=True))
