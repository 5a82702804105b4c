"""Wait until the rendezvous endpoint resolves (DNS) and accepts TCP connections.

Kubernetes publishes a pod's DNS record only after the pod is running, so a worker pod can start
before the store host's name resolves (pytorch#73682, torchx#541). torch gives up on the first
failed lookup; we retry with capped exponential backoff up to the join timeout.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable

from ddpjob_worker.agent.policy import next_delay
from ddpjob_worker.errors import EndpointUnreachableError


@dataclasses.dataclass
class Probe:
    """The outcome of one connection attempt, for the error message."""

    attempts: int = 0
    last_error: str = "no attempt made"


def try_connect(host: str, port: int, timeout: float) -> str | None:
    """One attempt: resolve ``host`` and open a TCP connection. None on success, else why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"DNS lookup of {host!r} failed: {exc.strerror or exc}"
    errors: list[str] = []
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout)
                sock.connect(address)
                return None
        except OSError as exc:
            where = address[0] if isinstance(address[0], str) else repr(address[0])
            errors.append(f"{where}:{address[1]!r}: {exc.strerror or exc}")
    return "TCP connect failed: " + "; ".join(errors)


def wait_for_endpoint(
    host: str,
    port: int,
    timeout: float,
    *,
    connect: Callable[[str, int, float], str | None] = try_connect,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[Probe], None] | None = None,
    join_timeout: float | None = None,
    cap: float = 0.5,
) -> Probe:
    """Block until ``host:port`` accepts a TCP connection, or raise after ``timeout`` seconds.

    Raises :class:`EndpointUnreachableError` naming the endpoint, the last error, the number of
    attempts and the time spent. ``join_timeout`` is the configured limit to name in the message
    when ``timeout`` is only what is left of it. ``cap`` is the longest pause between probes.
    """
    return _poll(
        lambda remaining: connect(host, port, max(0.05, min(2.0, remaining))),
        timeout,
        failure=lambda probe, spent: (
            f"rendezvous endpoint {host}:{port} is unreachable: tried {probe.attempts} "
            f"times over {spent:.1f}s (join timeout {join_timeout or timeout:g}s); "
            f"last error: {probe.last_error}. Check that the store host (pod 0) is running "
            f"and that its Service/DNS name is right."
        ),
        initial=0.05,
        cap=cap,
        clock=clock,
        sleep=sleep,
        on_retry=on_retry,
    )


def _poll(
    attempt: Callable[[float], str | None],
    timeout: float,
    *,
    failure: Callable[[Probe, float], str],
    initial: float,
    cap: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    on_retry: Callable[[Probe], None] | None,
) -> Probe:
    """Call ``attempt(seconds left)`` until it returns None (success) or ``timeout`` seconds
    have passed, pausing with a capped back-off; then raise :class:`EndpointUnreachableError`
    with ``failure(probe, seconds spent)``."""
    start = clock()
    deadline = start + timeout
    probe = Probe()
    while True:
        error = attempt(deadline - clock())
        probe.attempts += 1
        if error is None:
            return probe
        probe.last_error = error
        remaining = deadline - clock()
        if remaining <= 0:
            raise EndpointUnreachableError(failure(probe, clock() - start))
        if on_retry is not None:
            on_retry(probe)
        sleep(min(next_delay(probe.attempts - 1, initial=initial, cap=cap), remaining))


Resolver = Callable[[str, int], list[str]]


def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to (``socket.gaierror`` when it does not)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def is_local_address(address: str) -> bool:
    """Whether ``address`` belongs to this machine (network namespace): binding to it works.
    Nothing is sent."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


def not_here(
    host: str,
    port: int,
    *,
    resolver: Resolver = resolve,
    local: Callable[[str], bool] = is_local_address,
) -> str | None:
    """None when ``host`` resolves to an address of this machine; else why not.

    The store host's own client connects to the rendezvous endpoint by name (torch's c10d
    backend), and a new pod 0's name resolves only once the EndpointSlice controller has
    published it: before that it does not resolve, or still names the pod it replaces."""
    try:
        addresses = resolver(host, port)
    except OSError as exc:
        return f"DNS lookup of {host!r} failed: {getattr(exc, 'strerror', None) or exc}"
    if any(local(address) for address in addresses):
        return None
    return f"{host!r} resolves to {', '.join(sorted(set(addresses)))}, not to this pod"


def wait_resolves_here(
    host: str,
    port: int,
    timeout: float,
    *,
    resolver: Resolver = resolve,
    local: Callable[[str], bool] = is_local_address,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[Probe], None] | None = None,
    join_timeout: float | None = None,
) -> Probe:
    """Block until ``host`` resolves to this machine, or raise :class:`EndpointUnreachableError`
    after ``timeout`` seconds naming the name and what it resolved to last."""
    return _poll(
        lambda _remaining: not_here(host, port, resolver=resolver, local=local),
        timeout,
        failure=lambda probe, spent: (
            f"this agent hosts the rendezvous store at {host}:{port}, but that name did not "
            f"resolve to this pod within {spent:.1f}s (join timeout "
            f"{join_timeout or timeout:g}s); last: {probe.last_error}. The name must be pod 0's "
            "own (its hostname and subdomain under the job's headless Service)."
        ),
        initial=0.1,
        cap=1.0,
        clock=clock,
        sleep=sleep,
        on_retry=on_retry,
    )
