"""The env contract between whoever starts a DDPJob pod and the ``ddpjob-agent`` inside it.

Both sides import this module: the operator's pod builder (and the local runner) write the
environment with :func:`agent_env`, and ``ddpjob-agent`` reads it back. It is stdlib only, so
the operator never pulls in torch and the worker never pulls in the operator's dependencies
(an import-linter contract enforces this).

Every rendezvous setting is carried in torchrun's own ``PET_*`` variables, so a pod whose
container runs plain ``torchrun`` gets the same rendezvous as one that runs ``ddpjob-agent``.
Settings that torchrun has no flag for go into ``PET_RDZV_CONF`` (which torch's c10d
rendezvous reads: ``is_host``, ``join_timeout``, ``last_call_timeout``, ``keep_alive_*``) or
into ``DDPJOB_*`` variables that only our agent reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

# torchrun's flags, as environment variables (torch/distributed/run.py, ``action=env``).
PET_NNODES = "PET_NNODES"
PET_NPROC_PER_NODE = "PET_NPROC_PER_NODE"
PET_RDZV_BACKEND = "PET_RDZV_BACKEND"
PET_RDZV_ENDPOINT = "PET_RDZV_ENDPOINT"
PET_RDZV_ID = "PET_RDZV_ID"
PET_RDZV_CONF = "PET_RDZV_CONF"
PET_MAX_RESTARTS = "PET_MAX_RESTARTS"
PET_MONITOR_INTERVAL = "PET_MONITOR_INTERVAL"
PET_LOCAL_ADDR = "PET_LOCAL_ADDR"

# Settings only ddpjob-agent reads.
DDPJOB_JOB_NAME = "DDPJOB_JOB_NAME"
DDPJOB_POD_INDEX = "DDPJOB_POD_INDEX"
DDPJOB_RDZV_HOST = "DDPJOB_RDZV_HOST"
"""``1`` on pod 0, the pod that hosts the c10d store; ``0`` elsewhere."""
DDPJOB_STATE_FILE = "DDPJOB_STATE_FILE"
"""Where the agent keeps its JSON state (round, world size, restarts, last failure)."""
DDPJOB_GRACE_SECONDS = "DDPJOB_GRACE_SECONDS"
"""How long the agent waits for its workers after forwarding SIGTERM before it kills them."""
DDPJOB_STOP_SECONDS = "DDPJOB_STOP_SECONDS"
"""How long workers get after SIGTERM when their round is over (a worker failed, here or on a
peer, or a peer left) before their SIGKILL: 0.25 s by default. A checkpoint being written
(``ddpjob_worker.saving()``) gets the grace period first."""
DDPJOB_RESTART_STOP_SECONDS = "DDPJOB_RESTART_STOP_SECONDS"
"""The same for healthy workers restarted to admit a new node (a scale-up): 3 s by default."""
DDPJOB_SAVING_DIR = "DDPJOB_SAVING_DIR"
"""Set by ddpjob-agent for its workers: where ``ddpjob_worker.saving()`` says a checkpoint is
being written (a file named by the worker's pid), so that the agent lets it finish before it
stops the worker."""
DDPJOB_SNAPSHOT_DIR = "DDPJOB_SNAPSHOT_DIR"
"""Set by ddpjob-agent for its workers: the run's directory for in-memory snapshots
(``/dev/shm/ddpjob-<run id>-<agent pid>``, :mod:`ddpjob_worker.snapdir`), kept across worker
restarts and removed when the agent exits. ``ddpjob_worker.train`` keeps each local rank's
snapshot file there (``rank<local rank>.snap``)."""
DDPJOB_WARM_WORKERS = "DDPJOB_WARM_WORKERS"
"""``0`` turns off ddpjob-agent's warm workers (a spare process per local rank with torch
imported, handed the next restart's worker: :mod:`ddpjob_worker.agent.warm`). On by default."""
DDPJOB_DIRECTORY_PORT = "DDPJOB_DIRECTORY_PORT"
"""The port of the agent's liveness socket, which answers who hosts the job's rendezvous store now
(:mod:`ddpjob_worker.membership.liveness`), bound to the pod's own address. Unset or 0: a free
port."""
DDPJOB_RDZV_PEERS = "DDPJOB_RDZV_PEERS"
"""Where the job's agents answer (``host:port``, comma-separated; a name may resolve to every
pod, as a headless Service's does). A starting agent asks them for the current store before it
uses ``PET_RDZV_ENDPOINT``; with it set, the survivors of a lost store host carry on around a
new host (store failover, docs/concepts/store-failover.md)."""
DDPJOB_STORE_READ_TIMEOUT = "DDPJOB_STORE_READ_TIMEOUT"
"""Our short rendezvous-store read timeout (seconds). Only ddpjob-agent applies it (as the c10d
``read_timeout``). It is *not* put in ``PET_RDZV_CONF``: torch also uses ``read_timeout`` as the
TCPStore *connect* timeout, so plain torchrun on pod 1 would give up after that long when pod 0
starts late. ddpjob-agent waits for the endpoint itself before it connects."""

# Reliability setting for torch's elastic agent: do not let the workers' process group reuse
# the rendezvous TCP store. With sharing on, a restart hangs in gloo init 5 times in 12 and a
# scale-up never completes (TORCHRUN-BASELINE.md). Set only if the user has not set it.
TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# Every pod of a DDPJob runs ``nprocPerNode`` workers of one role, so torch's agent may compute
# each worker's global rank from its node's rank (``group_rank * nproc``) instead of a store
# exchange: every agent writing its role, the round's rank 0 reading all N, writing N answers,
# every agent reading its own (2N + 2 store requests a round, and a barrier on the slowest
# agent, which broke rounds of 1,024 hollow agents on this machine). torch's own switch; the
# ranks are the same. Set only if the user has not set it.
TORCH_ELASTIC_WORKER_IDENTICAL = "TORCH_ELASTIC_WORKER_IDENTICAL"

# Exit codes of ddpjob-agent, following the Kubeflow convention that ``restartPolicy: ExitCode``
# relies on: 1-127 is permanent (the user's script failed), 128-255 is retryable.
EXIT_OK = 0
EXIT_USAGE = 2
"""Bad flags or env, or an untested torch, found before the run starts (argparse's code).
Permanent: a replacement pod would fail the same way."""
EXIT_WORKER_FAILED = 1
"""The restart budget is used up and the first failed worker's exit code is not usable (the
agent otherwise exits with that worker's own code 1-127, or 128+N when it died of signal N)."""
EXIT_RETRYABLE_MIN = 128
"""Codes from here up are retryable under ``restartPolicy: ExitCode``."""
EXIT_INFRA = 200
"""Infrastructure trouble, retryable: the rendezvous store was unreachable (or never came up
within the join timeout), the rendezvous broke, torch's watchdog found a worker stuck in the
kernel, or the agent hit an unexpected error during the run.

Why 200: 128+N is what a shell (and our agent) reports for a process killed by signal N, and
Linux signals go up to 64 (SIGRTMAX), so 129-192 can all mean "killed by a signal" (137 is the
OOM killer's SIGKILL, 143 a SIGTERM). 200 is above every signal code, so it never passes for
one, and it is not 255 (what ``exit(-1)`` becomes)."""
EXIT_STOPPED_BY_SIGNAL = 143
"""The agent's exit code after a graceful stop on SIGTERM/SIGINT: 128 + SIGTERM.

Under ``restartPolicy: ExitCode`` it falls in the retryable range (128-255), and the operator
classifies a pod that ends with it as ``Preempted`` rather than failed.
"""


def is_retryable_exit(code: int) -> bool:
    """Whether ``restartPolicy: ExitCode`` retries a pod that exited with ``code``."""
    return code >= EXIT_RETRYABLE_MIN


DEFAULT_RDZV_PORT = 29400
STORE_READ_TIMEOUT = 10
"""Seconds a blocking read of the rendezvous store may take (torch: 60). A peer that dies just
after a round forms leaves the others blocked this long before they rejoin. Carried in
``DDPJOB_STORE_READ_TIMEOUT`` (see there), not in ``PET_RDZV_CONF``."""
DEFAULT_STATE_DIR = "/var/run/ddpjob"
DEFAULT_STATE_FILE = f"{DEFAULT_STATE_DIR}/state.json"


@dataclasses.dataclass(frozen=True)
class AgentContract:
    """Everything one pod's agent needs to know, as plain values.

    ``endpoint_host:port`` is where pod 0's agent hosts the c10d store. ``is_host`` is true only
    for pod 0: the store's host is decided by this contract, never by hostname matching.
    """

    job_name: str
    run_id: str
    pod_index: int
    endpoint_host: str
    port: int
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    join_timeout: int
    last_call_timeout: int
    close_timeout: int
    keep_alive_interval: int
    keep_alive_max_attempt: int
    grace_seconds: int
    state_file: str = DEFAULT_STATE_FILE
    monitor_interval: float = 0.1
    directory_port: int = 0
    """This pod's :data:`DDPJOB_DIRECTORY_PORT` (0: a free one, and no failover)."""
    peers: tuple[str, ...] = ()
    """:data:`DDPJOB_RDZV_PEERS`: where the job's agents answer."""

    @property
    def is_host(self) -> bool:
        return self.pod_index == 0

    @property
    def endpoint(self) -> str:
        return f"{self.endpoint_host}:{self.port}"

    def rdzv_conf(self) -> dict[str, str]:
        return {
            "is_host": "true" if self.is_host else "false",
            "join_timeout": str(self.join_timeout),
            "last_call_timeout": str(self.last_call_timeout),
            "close_timeout": str(self.close_timeout),
            "keep_alive_interval": str(self.keep_alive_interval),
            "keep_alive_max_attempt": str(self.keep_alive_max_attempt),
        }


def format_rdzv_conf(conf: Mapping[str, str]) -> str:
    """Format ``{"a": "1"}`` the way torchrun's ``--rdzv-conf`` takes it: ``a=1,b=2``."""
    return ",".join(f"{key}={value}" for key, value in conf.items())


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """Parse torchrun's ``--rdzv-conf`` syntax. Raises ValueError naming the bad item."""
    conf: dict[str, str] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"rdzv conf item {item!r} is not of the form key=value")
        conf[key.strip()] = value.strip()
    return conf


def agent_env(contract: AgentContract) -> dict[str, str]:
    """The environment that makes ``ddpjob-agent`` (or plain ``torchrun``) join the job."""
    env = {
        PET_NNODES: f"{contract.min_nodes}:{contract.max_nodes}",
        PET_NPROC_PER_NODE: str(contract.nproc_per_node),
        PET_RDZV_BACKEND: "c10d",
        PET_RDZV_ENDPOINT: contract.endpoint,
        PET_RDZV_ID: contract.run_id,
        PET_RDZV_CONF: format_rdzv_conf(contract.rdzv_conf()),
        PET_MAX_RESTARTS: str(contract.max_restarts),
        PET_MONITOR_INTERVAL: str(contract.monitor_interval),
        DDPJOB_JOB_NAME: contract.job_name,
        DDPJOB_POD_INDEX: str(contract.pod_index),
        DDPJOB_RDZV_HOST: "1" if contract.is_host else "0",
        DDPJOB_STATE_FILE: contract.state_file,
        DDPJOB_GRACE_SECONDS: str(contract.grace_seconds),
        DDPJOB_STORE_READ_TIMEOUT: str(STORE_READ_TIMEOUT),
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE: "1",
        TORCH_ELASTIC_WORKER_IDENTICAL: "1",
    }
    if contract.directory_port:
        env[DDPJOB_DIRECTORY_PORT] = str(contract.directory_port)
    if contract.peers:
        env[DDPJOB_RDZV_PEERS] = ",".join(contract.peers)
    return env
