"""Pure decisions of the agent: no I/O, no torch. The agent (``agent.py``) applies them.

* :func:`backoff_delays` / :func:`next_delay`: how long to wait between endpoint probes.
* :func:`decide`: what to do after one look at the workers (the monitor loop's only branch).
* :func:`resolve_settings`: read our settings from torchrun's parsed ``--rdzv-conf`` and the env.
* :func:`split_endpoint` / :func:`static_master`: torchrun's endpoint forms.
* :func:`exit_code_for_worker`: the agent's exit code after its first failed worker.

The refund rule is in :mod:`ddpjob_worker.agent.ledger`, failure blame in
:mod:`ddpjob_worker.agent.blame`, the fencing rules in :mod:`ddpjob_worker.membership.failover`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterator, Mapping

from ddpjob_worker import contract

DEFAULT_JOIN_TIMEOUT = 600.0
"""torch's c10d rendezvous default ``join_timeout`` (seconds)."""
DEFAULT_GRACE_SECONDS = 25.0
"""Below Kubernetes' default ``terminationGracePeriodSeconds`` (30 s), so we kill before it does."""
RECOVERY_PROBE_CAP_SECONDS = 0.2
"""The longest pause between probes of a lost store host's endpoint: its replacement is up within
seconds, and every pause after it is up is added to the recovery."""
HOST_LINGER_SECONDS = 5.0
"""After a failed run, how long the store host keeps the store up once it has closed the
rendezvous, so that the other agents see the job end instead of a lost host."""
DEFAULT_HEARTBEAT_SECONDS = 5.0
"""How often the agent rewrites its state file while nothing changes."""


def next_delay(
    attempt: int, *, initial: float = 0.05, factor: float = 2.0, cap: float = 0.5
) -> float:
    """Delay before probe ``attempt + 1`` (attempt counts from 0): capped exponential growth.

    The cap is low (0.5 s) on purpose: a probe is one TCP connect, and every fraction of a
    second between the store coming up and us noticing is added to start-up and recovery.
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    if initial <= 0 or factor < 1 or cap < initial:
        raise ValueError(
            f"need initial > 0, factor >= 1, cap >= initial; got {initial}, {factor}, {cap}"
        )
    if factor == 1:
        return initial
    # Past this attempt the delay is at the cap; checking first avoids overflowing factor**n.
    if attempt >= math.log(cap / initial, factor):
        return cap
    return min(initial * factor**attempt, cap)


def backoff_delays(
    total: float, *, initial: float = 0.05, factor: float = 2.0, cap: float = 0.5
) -> Iterator[float]:
    """The delays a waiter sleeps within ``total`` seconds; the last one is cut to fit."""
    spent = 0.0
    attempt = 0
    while spent < total:
        delay = min(next_delay(attempt, initial=initial, factor=factor, cap=cap), total - spent)
        yield delay
        spent += delay
        attempt += 1


class WorkerStatus(enum.StrEnum):
    """What one look at the local workers showed (torch's WorkerState, narrowed)."""

    HEALTHY = "healthy"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class Action(enum.StrEnum):
    CONTINUE = "continue"
    """Keep monitoring."""
    FINISH = "finish"
    """Workers succeeded: wait at the exit barrier, then exit 0."""
    RESTART_CHARGED = "restart_charged"
    """A worker failed: restart, charging one restart (may be refunded, see below)."""
    RESTART_FREE = "restart_free"
    """Membership changed (a node waits to join, or the store host was lost): free restart."""
    RESTART_SETTLE_LATER = "restart_settle_later"
    """A worker failed and restarts remain: restart at once; whether this node is charged is
    settled once the next round has formed (every failure report of its members is in by then)."""
    SETTLE_FIRST = "settle_first"
    """A worker failed, no restart remains, and it is not known yet whether the failure is this
    node's own: wait for the peers' failure reports, then decide again. Giving up is final, so
    it waits; a restart does not."""
    GIVE_UP = "give_up"
    """A worker failed and the budget is used up: stop and exit non-zero."""


def decide(
    status: WorkerStatus,
    *,
    remaining_restarts: int,
    nodes_waiting: int,
    store_lost: bool,
    collateral: bool | None = False,
    restarts_disabled: bool = False,
) -> Action:
    """The monitor loop's decision after one look at the workers.

    ``store_lost`` means the rendezvous store did not answer (its host is gone). That is a
    membership change, so it restarts for free even when workers failed because of it.
    ``collateral`` means our workers failed only because another node's failed first (see
    :func:`is_root_cause`): a free restart; ``None`` means not known yet (the peers' failure
    reports are still coming in). ``restarts_disabled`` is torch's own "stop restarting" decision
    (its uninterruptible-state watchdog): failed workers are not restarted, whatever the budget
    says.
    """
    if status is WorkerStatus.SUCCEEDED:
        return Action.FINISH
    if status is WorkerStatus.FAILED and restarts_disabled:
        return Action.GIVE_UP
    if store_lost:
        return Action.RESTART_FREE
    if status is WorkerStatus.FAILED:
        if collateral:
            return Action.RESTART_FREE
        if collateral is None:
            return Action.RESTART_SETTLE_LATER if remaining_restarts > 0 else Action.SETTLE_FIRST
        return Action.RESTART_CHARGED if remaining_restarts > 0 else Action.GIVE_UP
    if nodes_waiting > 0:
        return Action.RESTART_FREE
    return Action.CONTINUE


RESTART_STOP_SECONDS = 3
"""How long healthy workers get after SIGTERM when the agent restarts them to admit a waiting
node (not when the pod stops). Their group is intact, so a SIGTERM handler may still save."""
BROKEN_STOP_SECONDS = 0.25
"""The same when the round is over (a worker failed, here or on a peer, or a peer left): the
group is broken, and a worker blocked in a collective cannot even run a Python signal handler
until the collective fails, which it does only once the peer's processes are gone. torch's 30 s
default only delays the rejoin (it cost 30 s per chaos kill); 3 s cost up to a second per
graceful leave, waiting for the leaving pod's worker to exit.

A worker that is computing (not blocked) runs its SIGTERM handler at once; one that would save a
checkpoint then has 0.25 s. Such a checkpoint could only hold this rank's state of a step its
group cannot finish: the periodic checkpoint is what a restart resumes from."""

REAP_SECONDS = 30.0
"""How long stopped workers get to be gone (reaped) after their SIGKILL, before the next workers
start anyway. torch waits the stop timeout again there (:data:`BROKEN_STOP_SECONDS`), then
abandons the process; a GPU process can take seconds to release its device memory after a
SIGKILL, or hang in the driver, and the next workers would start on devices it still holds
(out of memory, "device busy"). torch's own default for the whole stop is 30 s. A CPU process is
gone in milliseconds: no cost there."""


def parse_bool(value: str) -> bool:
    """torch's rendezvous boolean syntax. Raises ValueError naming the value."""
    lowered = value.strip().lower()
    if lowered in {"1", "true", "t", "yes", "y"}:
        return True
    if lowered in {"0", "false", "f", "no", "n"}:
        return False
    raise ValueError(f"{value!r} is not a boolean (use true/false or 1/0)")


def parse_seconds(name: str, value: str) -> float:
    try:
        seconds = float(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} is not a number of seconds") from exc
    if seconds < 0:
        raise ValueError(f"{name}={value!r} must not be negative")
    return seconds


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the agent needs on top of torchrun's LaunchConfig."""

    is_host: bool | None
    """True: this agent hosts the store. None: unknown (torch's hostname heuristic decides)."""
    join_timeout: float
    grace_seconds: float
    state_file: str | None
    in_ddpjob_pod: bool = False
    """Launched by the operator (``DDPJOB_POD_INDEX`` set): an agent that spends its budget
    exits without closing the rendezvous, so its pod alone is replaced."""
    store_read_timeout: float | None = None
    """``read_timeout`` to give the c10d rendezvous when ``--rdzv-conf`` has none."""
    warm_workers: bool = True
    """Keep a spare process per local rank with torch imported for the next restart
    (``DDPJOB_WARM_WORKERS``, :mod:`ddpjob_worker.agent.warm`)."""
    pod_index: int | None = None
    """``DDPJOB_POD_INDEX``: a replacement pod has the index of the pod it replaces."""
    directory_port: int = 0
    """``DDPJOB_DIRECTORY_PORT``: where our liveness socket listens (0: a free port)."""
    peers: tuple[str, ...] = ()
    """``DDPJOB_RDZV_PEERS``: where the job's agents answer. Set: store failover is on."""
    stop_seconds: float = BROKEN_STOP_SECONDS
    """``DDPJOB_STOP_SECONDS``: SIGTERM to SIGKILL when the round is over."""
    restart_stop_seconds: float = RESTART_STOP_SECONDS
    """``DDPJOB_RESTART_STOP_SECONDS``: the same for healthy workers on a scale-up."""

    @property
    def store_read_limit(self) -> float:
        """How long the agent waits on one of its own store requests (the store's read
        timeout, 10 s by default)."""
        return self.store_read_timeout or 10.0

    @property
    def failover(self) -> bool:
        """Whether the survivors of a lost store host carry on around a new one: only where a
        newcomer can find the current store (the peers to ask), in a DDPJob pod."""
        return bool(self.peers) and self.in_ddpjob_pod


def resolve_settings(
    rdzv_conf: Mapping[str, str],
    env: Mapping[str, str],
    *,
    grace_flag: float | None = None,
    state_file_flag: str | None = None,
    shutdown_timeout_flag: float | None = None,
) -> Settings:
    """Combine ``--rdzv-conf`` and our ``DDPJOB_*`` env; flags win over env.

    ``is_host`` in the conf wins over ``DDPJOB_RDZV_HOST``; when they disagree the conf is what
    torch will act on, so it is what we act on too. The grace period is, first found:
    ``--grace-seconds``, ``DDPJOB_GRACE_SECONDS``, torchrun's ``--shutdown-timeout``, torch's
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 25 s. Fractions are kept.
    """
    is_host: bool | None = None
    if contract.DDPJOB_RDZV_HOST in env and env[contract.DDPJOB_RDZV_HOST].strip():
        is_host = parse_bool(env[contract.DDPJOB_RDZV_HOST])
    if "is_host" in rdzv_conf:
        is_host = parse_bool(rdzv_conf["is_host"])
    join_timeout = DEFAULT_JOIN_TIMEOUT
    if "join_timeout" in rdzv_conf:
        join_timeout = parse_seconds("join_timeout", rdzv_conf["join_timeout"])
    if grace_flag is not None:
        grace = grace_flag
    elif env.get(contract.DDPJOB_GRACE_SECONDS, "").strip():
        grace = parse_seconds(contract.DDPJOB_GRACE_SECONDS, env[contract.DDPJOB_GRACE_SECONDS])
    elif shutdown_timeout_flag is not None:
        grace = parse_seconds("--shutdown-timeout", str(shutdown_timeout_flag))
    elif env.get(TORCH_ELASTIC_SHUTDOWN_TIMEOUT, "").strip():
        grace = parse_seconds(TORCH_ELASTIC_SHUTDOWN_TIMEOUT, env[TORCH_ELASTIC_SHUTDOWN_TIMEOUT])
    else:
        grace = DEFAULT_GRACE_SECONDS
    state_file = state_file_flag or env.get(contract.DDPJOB_STATE_FILE) or None
    read_timeout: float | None = None
    if "read_timeout" not in rdzv_conf and env.get(contract.DDPJOB_STORE_READ_TIMEOUT, "").strip():
        read_timeout = parse_seconds(
            contract.DDPJOB_STORE_READ_TIMEOUT, env[contract.DDPJOB_STORE_READ_TIMEOUT]
        )
    warm_workers = True
    if env.get(contract.DDPJOB_WARM_WORKERS, "").strip():
        try:
            warm_workers = parse_bool(env[contract.DDPJOB_WARM_WORKERS])
        except ValueError as exc:
            raise ValueError(f"{contract.DDPJOB_WARM_WORKERS}: {exc}") from exc
    pod_index: int | None = None
    if env.get(contract.DDPJOB_POD_INDEX, "").strip():
        try:
            pod_index = int(env[contract.DDPJOB_POD_INDEX])
        except ValueError as exc:
            raise ValueError(
                f"{contract.DDPJOB_POD_INDEX}={env[contract.DDPJOB_POD_INDEX]!r} is not a number"
            ) from exc
    directory_port = 0
    if env.get(contract.DDPJOB_DIRECTORY_PORT, "").strip():
        text = env[contract.DDPJOB_DIRECTORY_PORT]
        if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
            raise ValueError(f"{contract.DDPJOB_DIRECTORY_PORT}={text!r} is not a port (0-65535)")
        directory_port = int(text)
    peers = tuple(
        item.strip() for item in env.get(contract.DDPJOB_RDZV_PEERS, "").split(",") if item.strip()
    )
    for peer in peers:
        try:
            _, peer_port = split_endpoint(peer, default_port=-1)
        except ValueError as exc:
            raise ValueError(f"{contract.DDPJOB_RDZV_PEERS}: {exc}") from exc
        if peer_port < 0:
            raise ValueError(
                f"{contract.DDPJOB_RDZV_PEERS}: {peer!r} needs a port (host:port, comma-separated)"
            )
    stops = {
        name: parse_seconds(name, env[name]) if env.get(name, "").strip() else default
        for name, default in (
            (contract.DDPJOB_STOP_SECONDS, BROKEN_STOP_SECONDS),
            (contract.DDPJOB_RESTART_STOP_SECONDS, float(RESTART_STOP_SECONDS)),
        )
    }
    return Settings(
        stop_seconds=stops[contract.DDPJOB_STOP_SECONDS],
        restart_stop_seconds=stops[contract.DDPJOB_RESTART_STOP_SECONDS],
        pod_index=pod_index,
        directory_port=directory_port,
        peers=peers,
        is_host=is_host,
        join_timeout=join_timeout,
        grace_seconds=grace,
        state_file=state_file,
        in_ddpjob_pod=bool(env.get(contract.DDPJOB_POD_INDEX, "").strip()),
        store_read_timeout=read_timeout,
        warm_workers=warm_workers,
    )


TORCH_ELASTIC_SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
"""torch's env default for ``--shutdown-timeout`` (torch.distributed.launcher.api)."""


def split_endpoint(
    endpoint: str, default_port: int = contract.DEFAULT_RDZV_PORT
) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``, or ``host``) to a pair. Raises ValueError naming it."""
    text = endpoint.strip()
    if not text:
        raise ValueError("the rendezvous endpoint is empty (set --rdzv-endpoint host:port)")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"endpoint {endpoint!r} has an unclosed '['")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not port_text:
        return host, default_port
    try:
        port = int(port_text)
    except ValueError as exc:
        raise ValueError(f"endpoint {endpoint!r} has a non-numeric port {port_text!r}") from exc
    if not 0 <= port <= 65535:
        raise ValueError(f"endpoint {endpoint!r} has port {port} outside 0-65535")
    return host, port


def static_master(endpoint: str) -> tuple[str, int]:
    """The master ``(host, port)`` of ``--rdzv-backend=static``: the port is required.

    Raises ValueError with a message naming the endpoint (torch would go on with port -1).
    """
    host, port = split_endpoint(endpoint, default_port=-1)
    if port < 0:
        raise ValueError(
            f"--rdzv-backend=static needs a port in --rdzv-endpoint (host:port), got {endpoint!r}"
        )
    return host, port


def exit_code_for_worker(exitcode: int) -> int:
    """The agent's exit code when it gives up after its first failed worker exited so.

    A worker killed by signal N (torch reports ``-N``) gives 128+N, as a shell does: an OOM
    kill (SIGKILL) gives 137, retryable under ``restartPolicy: ExitCode``. A worker's own code
    1-255 is passed on (1-127: the script failed, permanent). Anything else gives
    :data:`contract.EXIT_WORKER_FAILED`.
    """
    if exitcode < 0:
        return min(128 - exitcode, 255)
    if 1 <= exitcode <= 255:
        return exitcode
    return contract.EXIT_WORKER_FAILED
