"""Hollow agents: many agents to a process, each on a loopback address of its own, with workers
that are not processes.

As kubemark's hollow kubelet is a real kubelet that starts no containers, a hollow agent is the
real ``ddpjob-agent`` (``ddpjob_worker.agent.launch.launch`` with the same settings the operator's env
contract gives a pod: its rendezvous through the real c10d TCPStore, the peer watch, store
failover and fencing), whose workers only "step" on a clock: they never import torch, never
fork, and are healthy until the agent stops them. ``mode: torch`` runs stock torch instead
(torch's ``LocalElasticAgent`` and c10d rendezvous, the same hollow workers): the anchor.

One process hosts the agents a spec names (JSON on stdin) and reports, as JSON lines on stdout,
each agent's rounds (``{"ev": "round", "i": index, "t": wall time, "round": "<gen>.<round>",
"world": size}``) and exits. A fault is applied to a whole process (SIGKILL, SIGSTOP), so a
process is a node: one agent for a single loss, 64 for a node of 64. The driver is
``bench/bench_membership.py``; ``tests/agent/test_hollow.py`` runs a small one.

    python -m tests.harness.hollow_agents < spec.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ddpjob_worker.contract import AgentContract, agent_env

EVENTS_LOCK = threading.Lock()
HOLLOW_ENTRYPOINT = "hollow-worker"
"""What the stand-in workers 'run' (never started)."""


@dataclasses.dataclass(frozen=True)
class AgentSpec:
    index: int
    addr: str


@dataclasses.dataclass(frozen=True)
class Spec:
    """One hollow process: its agents, and the job they belong to."""

    mode: str
    """``ddpjob`` (our agent) or ``torch`` (stock torch: the anchor)."""
    run_id: str
    key: str
    endpoint: str
    min_nodes: int
    max_nodes: int
    agents: tuple[AgentSpec, ...]
    directory_port: int = 29401
    peers: tuple[str, ...] = ()
    keep_alive_interval: int = 1
    keep_alive_max_attempt: int = 5
    last_call_timeout: int = 2
    join_timeout: int = 900
    max_restarts: int = 1000
    """Membership is measured, not budgets: no agent gives up."""

    @classmethod
    def from_json(cls, text: str) -> Spec:
        raw = json.loads(text)
        raw["agents"] = tuple(AgentSpec(**agent) for agent in raw["agents"])
        raw["peers"] = tuple(raw.get("peers", ()))
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def contract(self, agent: AgentSpec) -> AgentContract:
        """The env contract the operator would give this agent's pod."""
        host, _, port = self.endpoint.rpartition(":")
        return AgentContract(
            job_name="hollow",
            run_id=self.run_id,
            pod_index=agent.index,
            endpoint_host=host,
            port=int(port),
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            nproc_per_node=1,
            max_restarts=self.max_restarts,
            join_timeout=self.join_timeout,
            last_call_timeout=self.last_call_timeout,
            close_timeout=30,
            keep_alive_interval=self.keep_alive_interval,
            keep_alive_max_attempt=self.keep_alive_max_attempt,
            grace_seconds=5,
            state_file="",
            directory_port=self.directory_port if self.peers else 0,
            peers=self.peers,
        )


def worker_port(spec: Spec) -> int:
    return int(spec.endpoint.rpartition(":")[2]) + WORKER_PORT_OFFSET


def emit(**event: Any) -> None:
    line = json.dumps({"t": time.time(), **event}, separators=(",", ":"))
    with EVENTS_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


# -- the stand-in workers ---------------------------------------------------------------------

WORKER_PORT_OFFSET = 2
"""A hollow worker listens at its agent's address on the rendezvous port + 2."""


class Collectives:
    """What a job's collectives do for failure detection, for every hollow worker of this
    process, on one selector thread: each worker of a round holds one TCP connection to the
    next rank's worker (a ring, as gloo's allreduce has), so a worker whose peer's process dies,
    or whose peer is stopped by its agent, sees the connection close and fails, and its agent
    restarts; a frozen or cut-off peer leaves it waiting, as gloo does until its timeout.

    Each connection belongs to a round (its first line names it), as gloo's belong to one
    process group: a worker that starts in a new round drops its connections of older ones, and
    a connection of an older round that closes breaks nothing. (Without that, a worker whose
    predecessor connected first closed the new connection as it started: every round broke.)"""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._failed: dict[int, bool] = {}
        self._round: dict[int, tuple[int, int]] = {}
        self._rings: dict[int, Callable[[], None] | None] = {}
        self._socks: dict[int, dict[socket.socket, tuple[int, int] | None]] = {}
        """Each worker's connections, with their round (None: an accepted one not named yet)."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", -1))
        threading.Thread(target=self._run, name="hollow-collectives", daemon=True).start()

    def listen(self, index: int, addr: str, port: int) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(64)
        sock.setblocking(False)
        with self._lock:
            self._selector.register(sock, selectors.EVENT_READ, ("listen", index))
        self._wake_w.send(b"x")

    def begin(
        self, index: int, round_: tuple[int, int], ring: Callable[[], None] | None = None
    ) -> None:
        """Worker ``index`` starts in round ``round_``: drop its connections of older rounds.
        ``ring``: called when the worker fails (its agent's doorbell, as a worker process's
        pidfd would be)."""
        with self._lock:
            self._round[index] = round_
            self._failed[index] = False
            self._rings[index] = ring
            for sock, of in list(self._socks.get(index, {}).items()):
                if of is not None and of < round_:
                    self._drop(index, sock)

    def connect(self, index: int, round_: tuple[int, int], successor: tuple[str, int]) -> None:
        """Connect worker ``index`` of round ``round_`` to the next rank's worker, as a
        collective's first call does; a worker that cannot reach it fails."""
        try:
            sock = socket.create_connection(successor, timeout=5)
            sock.sendall(f"{round_[0]}.{round_[1]}\n".encode())
        except OSError:
            self.fail(index, round_)
            return
        sock.setblocking(False)
        with self._lock:
            if self._round.get(index) != round_:  # stopped, or started again meanwhile
                sock.close()
                return
            self._socks.setdefault(index, {})[sock] = round_
            self._selector.register(sock, selectors.EVENT_READ, ("peer", index))
        self._wake_w.send(b"x")

    def fail(self, index: int, round_: tuple[int, int]) -> None:
        """Worker ``index`` fails in round ``round_`` (if it still runs in it)."""
        with self._lock:
            if self._round.get(index) != round_ or index not in self._failed:
                return
            self._failed[index] = True
            ring = self._rings.get(index)
        if ring is not None:
            ring()

    def failed(self, index: int) -> bool:
        with self._lock:
            return self._failed.get(index, False)

    def stop(self, index: int) -> None:
        """Worker ``index`` stops: its connections close (its peers' collectives break)."""
        with self._lock:
            for sock in list(self._socks.get(index, {})):
                self._drop(index, sock)
            self._failed.pop(index, None)
            self._round.pop(index, None)
            self._rings.pop(index, None)

    def _drop(self, index: int, sock: socket.socket) -> None:
        self._socks.get(index, {}).pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        sock.close()

    def _current(self, index: int, of: tuple[int, int] | None) -> bool:
        """Whether a connection of round ``of`` matters to worker ``index`` now."""
        mine = self._round.get(index)
        return mine is not None and (of is None or of >= mine)

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select():
                kind, index = key.data
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if kind == "wake":
                    sock.recv(4096)
                elif kind == "listen":
                    with contextlib.suppress(OSError):
                        conn, _ = sock.accept()
                        conn.setblocking(False)
                        with self._lock:
                            self._socks.setdefault(index, {})[conn] = None
                            self._selector.register(conn, selectors.EVENT_READ, ("peer", index))
                else:
                    try:
                        data = sock.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    ring = None
                    with self._lock:
                        of = self._socks.get(index, {}).get(sock)
                        if data and of is None:  # an accepted connection names its round
                            gen, _, number = data.decode().strip().partition(".")
                            of = (int(gen), int(number))
                            self._socks[index][sock] = of
                            mine = self._round.get(index)
                            if mine is not None and of < mine:  # a peer still in an old round
                                self._drop(index, sock)
                        elif not data:  # the peer's worker is gone
                            if self._current(index, of) and index in self._failed:
                                self._failed[index] = True
                                ring = self._rings.get(index)
                            self._drop(index, sock)
                    if ring is not None:
                        ring()


def _find_successor(store: Any, rank: int, index: int, round_: tuple[int, int]) -> None:
    """Read where rank ``rank``'s worker listens (the store's timeout: a peer that never comes
    fails the worker), then connect to it."""
    try:
        host, _, port = bytes(store.get(f"hollow/{rank}")).decode().rpartition(":")
    except Exception:  # torch's DistStoreError (a timeout), or the store is gone
        collectives().fail(index, round_)
        return
    collectives().connect(index, round_, (host, int(port)))


_COLLECTIVES: list[Collectives] = []
_ERROR_FILE: list[str] = []


def error_file() -> str:
    """A worker error file (torch's format) of a collective broken under the worker."""
    if not _ERROR_FILE:
        fd, path = tempfile.mkstemp(prefix="hollow-error-", suffix=".json")
        message = "DistNetworkError: Connection closed by peer (a hollow worker's ring broke)"
        error = {"message": {"message": message, "extraInfo": {"timestamp": "0"}}}
        with os.fdopen(fd, "w") as out:
            json.dump(error, out)
        _ERROR_FILE.append(path)
    return _ERROR_FILE[0]


def collectives() -> Collectives:
    if not _COLLECTIVES:
        _COLLECTIVES.append(Collectives())
    return _COLLECTIVES[0]


@functools.cache
def _torch_results() -> tuple[Any, Any, Any]:
    """torch's ``RunResult``, ``WorkerState`` and ``ProcessFailure``."""
    from torch.distributed.elastic.agent.server.api import (  # noqa: PLC0415
        RunResult,
        WorkerState,
    )
    from torch.distributed.elastic.multiprocessing.errors import (  # noqa: PLC0415
        ProcessFailure,
    )

    return RunResult, WorkerState, ProcessFailure


class HollowWorkers:
    """Workers that are not processes (see :class:`Collectives`): healthy from their start
    until a peer of their ring goes away or the agent stops them. Mixed into an agent class
    ahead of torch's ``LocalElasticAgent``."""

    _hollow_index = -1
    _hollow_addr = ""
    _hollow_port = 0
    _hollow_round = (0, 0)
    """The round joined last (generation, round)."""

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        store, rank, world = (
            worker_group.store,
            worker_group.group_rank,
            worker_group.group_world_size,
        )
        me = f"{self._hollow_addr}:{self._hollow_port}"
        store.set(f"hollow/{rank}", me)
        doorbell = getattr(self, "_doorbell", None)  # ours; torch's agent has none
        index, round_ = self._hollow_index, self._hollow_round
        collectives().begin(index, round_, None if doorbell is None else doorbell.ring)
        if world > 1:
            # As a gloo worker's first collective: it waits for its peer in the background, and
            # fails (its agent restarts it) if the peer never comes; the agent is not held.
            threading.Thread(
                target=_find_successor,
                args=(store, (rank + 1) % world, index, round_),
                name=f"hollow-ring-{index}",
                daemon=True,
            ).start()
        return {worker.local_rank: -1 - worker.local_rank for worker in worker_group.workers}

    def _worker_fds(self) -> list[int] | None:
        """No processes: a stand-in rings its agent's doorbell when its ring breaks."""
        return []

    def _monitor_workers(self, worker_group: Any) -> Any:
        # Looked up once: an import statement on every tick of every agent was a third of the
        # hollow process's CPU, which a pod's agent does not spend.
        RunResult, WorkerState, ProcessFailure = _torch_results()  # noqa: N806
        if collectives().failed(self._hollow_index):
            # What a gloo worker whose peer went away writes: a communication error.
            failure = ProcessFailure(local_rank=0, pid=-1, exitcode=1, error_file=error_file())
            rank = worker_group.workers[0].global_rank if worker_group.workers else 0
            return RunResult(state=WorkerState.FAILED, failures={rank: failure})
        return RunResult(state=WorkerState.HEALTHY)

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        collectives().stop(self._hollow_index)
        super()._shutdown(*args, **kwargs)  # type: ignore[misc]

    def _stop_workers(self, worker_group: Any, *args: Any) -> None:
        collectives().stop(self._hollow_index)
        super()._stop_workers(worker_group, *args)  # type: ignore[misc]

    def _rendezvous(self, worker_group: Any) -> None:
        super()._rendezvous(worker_group)  # type: ignore[misc]
        handler = worker_group.spec.rdzv_handler
        info = getattr(handler, "_info", None)  # a hub's round
        if info is not None:
            self._hollow_round = (info.gen, info.round)
        else:  # torch's c10d rendezvous (ours outside a pod, or stock torch)
            state = getattr(getattr(handler, "_state_holder", None), "state", None)
            gen = getattr(getattr(self, "_link", None), "view", None)
            self._hollow_round = (getattr(gen, "gen", 1), getattr(state, "round", -1))
        emit(
            ev="round",
            i=self._hollow_index,
            round="{}.{}".format(*self._hollow_round),
            world=worker_group.group_world_size,
        )


# -- a job of hollow processes (the driver's side) -----------------------------------------------

REPO = Path(__file__).resolve().parents[2]
PORT = 29400
NODE_SIZE = 64
"""A node's agents: one process."""


def address(index: int) -> str:
    return f"127.2.{index // 200}.{index % 200 + 10}"


class CpuShares:
    """A CPU cgroup of equal weight for each hollow process, as each pod has one.

    2 cores run a thousand agents' threads here, where a cluster gives each node its own CPUs.
    Without groups the kernel shares the box among threads: during a mass restart some 200 of
    them are runnable, and the process holding only the store host's agent got a 200th of the
    box (its loop stalled 4 to 16 s at 1,024 agents). With a group per process it gets a
    process's share, as a pod gets its request on a busy node. cgroup v1's ``cpu`` controller
    or v2's; where neither can be written (not root, a read-only cgroup fs) there are no groups
    and :attr:`on` says so."""

    V1 = Path("/sys/fs/cgroup/cpu")
    V2 = Path("/sys/fs/cgroup")

    def __init__(self, name: str) -> None:
        self.root: Path | None = None
        self._v2 = False
        for parent, v2 in ((self.V1, False), (self.V2, True)):
            if v2 and "cpu" not in _read(parent / "cgroup.controllers").split():
                continue
            if not v2 and not (parent / "cpu.shares").exists():
                continue
            try:
                if v2:
                    _enable_cpu(parent)
                (parent / name).mkdir()
                if v2:
                    _enable_cpu(parent / name)
            except OSError:
                continue
            self.root, self._v2 = parent / name, v2
            break

    @property
    def on(self) -> bool:
        return self.root is not None

    def place(self, k: int, pid: int, weight: int = 1) -> None:
        """Move process ``pid`` (its threads with it) into group ``k``, of ``weight`` times
        the default weight."""
        if self.root is None:
            return
        group = self.root / f"p{k}"
        try:
            group.mkdir(exist_ok=True)
            if weight != 1:
                knob, value = (
                    ("cpu.weight", 100 * weight) if self._v2 else ("cpu.shares", 1024 * weight)
                )
                (group / knob).write_text(f"{value}\n")
            (group / "cgroup.procs").write_text(f"{pid}\n")
        except OSError as exc:
            logging.getLogger(__name__).warning("no CPU group for pid %d: %s", pid, exc)

    def remove(self) -> None:
        """Remove the groups (their processes are gone)."""
        if self.root is None:
            return
        for group in self.root.glob("p*"):
            with contextlib.suppress(OSError):
                group.rmdir()
        with contextlib.suppress(OSError):
            self.root.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _enable_cpu(group: Path) -> None:
    """cgroup v2: let ``group``'s children have a cpu weight of their own."""
    if "cpu" not in _read(group / "cgroup.subtree_control").split():
        (group / "cgroup.subtree_control").write_text("+cpu\n")


@dataclasses.dataclass
class Proc:
    agents: list[int]
    popen: subprocess.Popen[str]
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    frozen: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid


class Job:
    """One job of hollow agents: its processes and every event they reported."""

    def __init__(
        self,
        mode: str,
        agents: int,
        *,
        per_process: int,
        singles: list[int],
        node: list[int],
        log_dir: Path,
        code: Path | None = None,
        cpu_groups: bool = True,
        host_weight: int = 1,
    ) -> None:
        """``mode``: ``ddpjob`` or ``torch``; agent 0 (the store's host) and each of
        ``singles`` get a process of their own, ``node`` one together, the rest
        ``per_process`` to a process; ``code``: a checkout whose agent runs (default: this
        one); ``cpu_groups``: each process in a CPU group of its own (:class:`CpuShares`),
        where the machine lets us; ``host_weight``: the groups of agents 0 and 1 (the store's
        host and its successor, when they have a process of their own) weigh this many times
        another's."""
        self.mode = mode
        self.n = agents
        self.log_dir = log_dir
        self.lock = threading.Lock()
        self.rounds: dict[int, list[tuple[float, str, int]]] = {i: [] for i in range(agents)}
        self.lags: list[float] = []
        self.exits: dict[int, str | None] = {}
        self.started_at: dict[int, float] = {}
        groups = [[0], *[[i] for i in singles]]
        if node:
            groups.append(node)
        placed = {i for group in groups for i in group}
        rest = [i for i in range(agents) if i not in placed]
        groups += [rest[k : k + per_process] for k in range(0, len(rest), per_process)]
        spec = Spec(
            mode=mode,
            run_id=uuid.uuid4().hex,
            key=uuid.uuid4().hex,
            endpoint=f"{address(0)}:{PORT}",
            min_nodes=max(1, agents - NODE_SIZE - 8)
            if agents > NODE_SIZE + 8
            else max(1, agents // 2),
            max_nodes=agents,
            agents=(),
            peers=tuple(f"{address(i)}:{PORT + 1}" for i in range(agents))
            if mode == "ddpjob"
            else (),
        )
        self.procs: list[Proc] = []
        self.netns = f"ddpj-hollow-{uuid.uuid4().hex[:8]}" if os.geteuid() == 0 else None
        if self.netns is not None:
            # A network of their own: the counters below are theirs alone, whatever else runs.
            subprocess.run(["ip", "netns", "add", self.netns], check=True)
            subprocess.run(["ip", "-n", self.netns, "link", "set", "lo", "up"], check=True)
        wrap = ["ip", "netns", "exec", self.netns] if self.netns is not None else []
        code = code or REPO
        paths = [str(code / "operator"), str(code / "worker"), str(REPO)]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]),
            # torch's per-agent log directories (torchelastic_*) and the stand-in error files
            # go with the job's logs, not thousands to the machine's temporary directory.
            "TMPDIR": str(log_dir),
        }
        self.shares = CpuShares(f"ddpj-hollow-{spec.run_id[:8]}") if cpu_groups else None
        self.started = time.time()
        for k, group in enumerate(groups):
            part = dataclasses.replace(spec, agents=tuple(AgentSpec(i, address(i)) for i in group))
            log = (log_dir / f"proc-{k}.log").open("w")
            popen = subprocess.Popen(
                [*wrap, sys.executable, "-m", "tests.harness.hollow_agents"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )
            if self.shares is not None:
                weight = host_weight if group in ([0], [1]) else 1
                self.shares.place(k, popen.pid, weight)  # before it reads its spec
            assert popen.stdin is not None
            popen.stdin.write(part.to_json() + "\n")
            popen.stdin.flush()
            proc = Proc(group, popen)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        self.host = self.procs[0]

    def _read(self, proc: Proc) -> None:
        assert proc.popen.stdout is not None
        for line in proc.popen.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                if event.get("ev") == "round":
                    self.rounds[event["i"]].append((event["t"], event["round"], event["world"]))
                elif event.get("ev") == "exit":
                    self.exits[event["i"]] = event.get("error")
                elif event.get("ev") == "started":
                    self.started_at[proc.pid] = event["t"]

    def logs(self) -> str:
        """The tails of every process's log (for a failing test)."""
        parts = []
        for k, _ in enumerate(self.procs):
            path = self.log_dir / f"proc-{k}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            parts.append(f"--- hollow process {k} ---\n{text[-3000:]}")
        return "\n".join(parts)

    def proc_of(self, index: int) -> Proc:
        return next(proc for proc in self.procs if index in proc.agents)

    def converged(self, members: list[int], world: int, since: float) -> tuple[float, str] | None:
        """When every one of ``members`` last reported the same round of ``world`` after
        ``since`` (the latest of their reports), or None."""
        with self.lock:
            last = [self.rounds[i][-1] if self.rounds[i] else None for i in members]
        if any(entry is None or entry[0] < since or entry[2] != world for entry in last):
            return None
        ids = {entry[1] for entry in last if entry is not None}
        if len(ids) != 1:
            return None
        return max(entry[0] for entry in last if entry is not None), ids.pop()

    def wait(
        self, members: list[int], world: int, since: float, cap: float
    ) -> tuple[float, str] | None:
        deadline = time.monotonic() + cap
        while time.monotonic() < deadline:
            found = self.converged(members, world, since)
            if found is not None:
                return found
            time.sleep(0.05)
        return None

    def rounds_after(self, members: list[int], since: float) -> set[str]:
        with self.lock:
            return {rid for i in members for (t, rid, _) in self.rounds[i] if t >= since}

    def signal(self, proc: Proc, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.frozen = sig is signal.SIGSTOP

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)
        if self.netns is not None:
            subprocess.run(["ip", "netns", "del", self.netns], check=False)
        if self.shares is not None:
            self.shares.remove()


# -- one agent ----------------------------------------------------------------------------------


def torch_argv(spec: Spec, agent: AgentSpec, env: Mapping[str, str]) -> list[str]:
    """torchrun's flags for this agent, from its pod's env contract (as the PET_* variables
    would give them)."""
    return [
        "--nnodes",
        env["PET_NNODES"],
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        env["PET_RDZV_ENDPOINT"],
        "--rdzv-id",
        env["PET_RDZV_ID"],
        "--rdzv-conf",
        env["PET_RDZV_CONF"],
        "--max-restarts",
        env["PET_MAX_RESTARTS"],
        "--monitor-interval",
        env["PET_MONITOR_INTERVAL"],
        "--local-addr",
        agent.addr,
        HOLLOW_ENTRYPOINT,
    ]


def run_ddpjob_agent(spec: Spec, agent: AgentSpec) -> None:
    from torch.distributed.run import config_from_args, get_args_parser  # noqa: PLC0415

    from ddpjob_worker.agent.elastic import DdpjobAgent  # noqa: PLC0415
    from ddpjob_worker.agent.launch import launch  # noqa: PLC0415
    from ddpjob_worker.agent.policy import resolve_settings  # noqa: PLC0415
    from ddpjob_worker.state import StateWriter  # noqa: PLC0415

    class HollowDdpjobAgent(HollowWorkers, DdpjobAgent):
        _hollow_index = agent.index
        _hollow_addr = agent.addr
        _hollow_port = worker_port(spec)

    env = agent_env(spec.contract(agent))
    env["DDPJOB_WARM_WORKERS"] = "0"
    args = get_args_parser().parse_args(torch_argv(spec, agent, env))
    config, entrypoint, cmd_args = config_from_args(args)
    settings = resolve_settings(config.rdzv_configs, env)
    launch(
        config,
        entrypoint,
        list(cmd_args),
        settings=settings,
        state=StateWriter(None),
        heartbeat_seconds=5.0,
        agent_class=HollowDdpjobAgent,
    )


def run_torch_agent(spec: Spec, agent: AgentSpec) -> None:
    """Stock torch: its agent and its c10d rendezvous, with the same hollow workers."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec  # noqa: PLC0415
    from torch.distributed.elastic.agent.server.local_elastic_agent import (  # noqa: PLC0415
        LocalElasticAgent,
    )
    from torch.distributed.elastic.rendezvous import (  # noqa: PLC0415
        RendezvousParameters,
        registry,
    )
    from torch.distributed.run import config_from_args, get_args_parser  # noqa: PLC0415

    class HollowTorchAgent(HollowWorkers, LocalElasticAgent):
        _hollow_index = agent.index
        _hollow_addr = agent.addr
        _hollow_port = worker_port(spec)

    env = agent_env(spec.contract(agent))
    args = get_args_parser().parse_args(torch_argv(spec, agent, env))
    config, entrypoint, cmd_args = config_from_args(args)
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    worker_spec = WorkerSpec(
        role=config.role,
        local_world_size=1,
        entrypoint=entrypoint,
        args=tuple(cmd_args),
        rdzv_handler=registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
    )
    assert config.logs_specs is not None
    HollowTorchAgent(worker_spec, config.logs_specs).run()


def run_agent(
    spec: Spec, agent: AgentSpec, done: Callable[[int, BaseException | None], None]
) -> None:
    try:
        if spec.mode == "torch":
            run_torch_agent(spec, agent)
        else:
            run_ddpjob_agent(spec, agent)
    except BaseException as exc:  # reported, the process goes on hosting the others
        done(agent.index, exc)
    else:
        done(agent.index, None)


def _method_name(depth: int = 2) -> str:
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


SWITCH_INTERVAL_ENV = "HOLLOW_SWITCH_INTERVAL"
"""Seconds: the interpreter's GIL switch interval in every hollow process (unset: Python's
5 ms). A pod's agent shares its GIL with its own few threads; a hollow process's membership
loop queues behind up to 64 agents' threads, each holding the GIL up to the interval."""


def serve(spec: Spec) -> None:
    os.environ["DDPJOB_STORE_KEY"] = spec.key
    interval = os.environ.get(SWITCH_INTERVAL_ENV)
    if interval:
        sys.setswitchinterval(float(interval))
    # The pod env's torch switches (contract.agent_env), which torch reads from the process.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ["TORCH_ELASTIC_WORKER_IDENTICAL"] = "1"
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic  # noqa: PLC0415

    # torch's c10d rendezvous names the caller of every operation it records with
    # inspect.stack(), twice, which reads the source of every frame: milliseconds per operation.
    # A pod's agent pays that on a core of its own; 64 agents sharing one interpreter would pay
    # it one after the other, and stock torch never formed a round of 64 here. The same name,
    # from the frame itself (the anchor's logic is untouched).
    dynamic.get_method_name = _method_name

    from ddpjob_worker.agent.rendezvous import seed_incarnation  # noqa: PLC0415

    seed_incarnation()

    def done(index: int, exc: BaseException | None) -> None:
        emit(ev="exit", i=index, error=None if exc is None else f"{type(exc).__name__}: {exc}")

    for agent in spec.agents:
        collectives().listen(agent.index, agent.addr, worker_port(spec))
    for agent in spec.agents:
        threading.Thread(
            target=run_agent, args=(spec, agent, done), name=f"hollow-{agent.index}", daemon=True
        ).start()
    emit(ev="started", agents=[agent.index for agent in spec.agents], pid=os.getpid())
    sys.stdin.read()  # the driver closes it (or kills us)
    os._exit(0)


def main() -> None:
    logging.basicConfig(
        level=os.environ.get("HOLLOW_LOGLEVEL", "WARNING"),
        format="[hollow %(asctime)s %(levelname)s %(name)s %(threadName)s] %(message)s",
        stream=sys.stderr,
    )
    spec = Spec.from_json(sys.stdin.readline())
    serve(spec)


if __name__ == "__main__":
    main()
