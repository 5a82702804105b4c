"""Run ``ddpjob-agent`` (or stock torchrun) as local "nodes" on 127.0.0.1: tests and benchmarks.

Each node is one agent process in its own session (``start_new_session=True``), configured with
the env contract (``agent_env``) exactly as the operator configures a pod. Every process a test
starts carries a unique ``DDPJOB_TEST_TAG`` in its environment (torch copies the agent's env
into the workers), so teardown can find and kill everything, and tests can check that nothing
outlived them by scanning ``/proc``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from ddpjob_worker.contract import PET_LOCAL_ADDR, AgentContract, agent_env
from ddpjob_worker.membership.seal import KEY_ENV
from ddpjob_worker.state import AgentState, read_state
from tests.harness.netns import Fabric

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "train.py"
"""The example script, when running from a checkout (tests, bench)."""
TAG_ENV = "DDPJOB_TEST_TAG"

STEP_RE = re.compile(r"^DDPJOB step=(\d+) rank=(\d+) world=(\d+) loss=")
RESUME_RE = re.compile(r"^DDPJOB resume step=(\d+) rank=(\d+) world=(\d+) restart=(\d+)")
CKPT_RE = re.compile(r"^DDPJOB ckpt step=(\d+)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive ports that are free on 127.0.0.1 now."""
    for _ in range(100):
        base = free_port()
        if base + count > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def wait_until(
    what: str, predicate: Callable[[], bool], timeout: float, interval: float = 0.1
) -> None:
    """Poll ``predicate`` until true; fail the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    if predicate():
        return
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces and parens: split after the last ')'.
        fields = stat.rsplit(")", 1)[1].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    tree = _children_map()
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def is_idle_spare(pid: int) -> bool:
    """A warm worker (``ddpjob_worker.agent.spare``) still waiting on its stdin pipe for a worker to
    become; once handed a worker its stdin is the agent's (``/dev/null`` in these tests)."""
    try:
        if b"ddpjob_worker.agent.spare" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        return os.readlink(f"/proc/{pid}/fd/0").startswith("pipe:")
    except OSError:
        return False


def processes_with_env(name: str, value: str) -> list[tuple[int, str]]:
    """``(pid, state)`` of every process whose environment has ``name=value`` (state as in
    ``/proc/<pid>/stat``: ``R``, ``S``, ``T`` for stopped, ``Z`` for a zombie...)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        found.append((int(entry), state))
    return found


def tagged_pids(tag: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries ``DDPJOB_TEST_TAG=tag``."""
    return [pid for pid, state in processes_with_env(TAG_ENV, tag) if state != "Z"]


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _kill(pid: int) -> None:
    _signal(pid, signal.SIGKILL)


@dataclasses.dataclass
class Node:
    """One agent process (a "pod")."""

    index: int
    proc: subprocess.Popen[bytes]
    log: Path
    state_file: Path
    started: float
    frozen: list[int] = dataclasses.field(default_factory=list)
    """The pids :meth:`freeze` stopped, for :meth:`thaw` (empty when not frozen)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def lines(self) -> list[str]:
        return self.text().splitlines()

    def steps(self) -> list[tuple[int, int, int]]:
        """``(step, rank, world)`` of every step line, in order."""
        out = []
        for line in self.lines():
            match = STEP_RE.match(line)
            if match:
                out.append((int(match[1]), int(match[2]), int(match[3])))
        return out

    def resumes(self) -> list[tuple[int, int, int, int]]:
        """``(step, rank, world, restart)`` of every resume line, in order."""
        out = []
        for line in self.lines():
            match = RESUME_RE.match(line)
            if match:
                out.append((int(match[1]), int(match[2]), int(match[3]), int(match[4])))
        return out

    def state(self) -> AgentState:
        return read_state(self.state_file)

    def worker_pids(self) -> list[int]:
        """The agent's workers (and their children), not its idle warm spares."""
        return [pid for pid in descendants(self.pid) if not is_idle_spare(pid)]

    def kill_node(self) -> None:
        """SIGKILL the whole "pod": the agent's process group and every descendant.

        torch starts each worker in its own session, so killing the agent's group alone would
        leave its workers running; a Kubernetes pod kill takes them all down together.
        """
        victims = [self.pid, *descendants(self.pid)]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in victims:
            _kill(pid)
        self.proc.wait(timeout=10)

    def freeze(self) -> None:
        """SIGSTOP the whole "pod": the agent, its workers and its warm spares.

        A silent machine loss: the processes stay alive and their sockets open, but nothing
        answers, exits or sends a reset. The agent is stopped first so that it cannot start more
        processes; one more scan then stops any it started between the first scan and its stop.
        :meth:`thaw` continues them. No thaw is needed before :meth:`kill_node` or
        :meth:`Cluster.kill_all`: SIGKILL ends a stopped process.
        """
        pids = [self.pid, *descendants(self.pid)]
        for pid in pids:
            _signal(pid, signal.SIGSTOP)
        late = [pid for pid in descendants(self.pid) if pid not in pids]
        for pid in late:
            _signal(pid, signal.SIGSTOP)
        self.frozen = [*self.frozen, *pids, *late]

    def thaw(self) -> None:
        """SIGCONT the processes :meth:`freeze` stopped, the agent last."""
        for pid in reversed(self.frozen):
            _signal(pid, signal.SIGCONT)
        self.frozen = []

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"node {self.index} (pid {self.pid}) still running after {timeout:g}s; "
                f"log tail:\n{self.text()[-3000:]}"
            ) from None

    def running(self) -> bool:
        return self.proc.poll() is None


class Cluster:
    """Starts nodes for one test and cleans up everything they started."""

    failover = True
    """Give nodes directory ports and peers, as the operator and the local runner do (store
    failover on); set False before starting nodes to run without."""
    netns = False
    """Run each node in a network namespace of its own (:class:`tests.harness.netns.Fabric`), at its own
    address, as pods are: then :meth:`cut` partitions a node for real. Set before starting
    nodes."""

    def __init__(self, tmp: Path, *, min_nodes: int, max_nodes: int, **timing: int) -> None:
        self.tmp = tmp
        self.tag = uuid.uuid4().hex
        self.store_key = uuid.uuid4().hex
        """The job's store key, as a DDPJob's Secret gives every pod (``DDPJOB_STORE_KEY``)."""
        self.port = free_port()
        self.run_id = f"run-{self.tag[:8]}"
        self.ckpt_dir = tmp / "ckpt"
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        # Each node's directory (liveness) port, as the local runner gives its pods: newcomers
        # ask them for the current store, which makes store failover possible.
        self.directory_base = free_port_run(max_nodes + 2)
        self.timing = {
            "join_timeout": 60,
            "last_call_timeout": 1,
            "close_timeout": 5,
            "keep_alive_interval": 1,
            "keep_alive_max_attempt": 3,
            "grace_seconds": 5,
            "max_restarts": 3,
            **timing,
        }
        self.nodes: list[Node] = []
        self._launches = 0
        self.fabric: Fabric | None = None

    def host(self, index: int) -> str:
        """Node ``index``'s address."""
        return Fabric.address(index) if self.netns else "127.0.0.1"

    def cut(self, index: int) -> None:
        """Partition node ``index`` (needs :attr:`netns`): nothing it sends or is sent arrives."""
        if self.fabric is None:
            raise RuntimeError("a partition needs Cluster.netns = True before the nodes start")
        self.fabric.cut(index)

    def heal(self, index: int) -> None:
        if self.fabric is not None:
            self.fabric.heal(index)

    def contract(self, index: int) -> AgentContract:
        return AgentContract(
            job_name="itest",
            run_id=self.run_id,
            pod_index=index,
            endpoint_host=self.host(0),
            port=self.port,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            nproc_per_node=1,
            max_restarts=self.timing["max_restarts"],
            join_timeout=self.timing["join_timeout"],
            last_call_timeout=self.timing["last_call_timeout"],
            close_timeout=self.timing["close_timeout"],
            keep_alive_interval=self.timing["keep_alive_interval"],
            keep_alive_max_attempt=self.timing["keep_alive_max_attempt"],
            grace_seconds=self.timing["grace_seconds"],
            state_file=str(self.tmp / f"state-{index}-{self._launches}.json"),
            directory_port=self._directory_port(index) if self.failover else 0,
            peers=tuple(self.directory(i) for i in range(self.max_nodes + 2))
            if self.failover
            else (),
        )

    def directory(self, index: int) -> str:
        """Where node ``index``'s agent answers (``host:port``; from the machine's namespace
        only without :attr:`netns`)."""
        return f"{self.host(index)}:{self._directory_port(index)}"

    def _directory_port(self, index: int) -> int:
        # A port space per node in namespaces (as pods have); one shared on 127.0.0.1.
        return self.directory_base + (0 if self.netns else index)

    def start(
        self,
        index: int,
        train_args: list[str],
        *,
        stock: bool = False,
        env: Mapping[str, str | None] | None = None,
        script: Path = TRAIN,
    ) -> Node:
        """Start node ``index`` (0 hosts the store) with ``ddpjob-agent`` or stock torchrun,
        running ``script`` (the example's, unless said).

        ``env`` adds variables, or removes those set to None (e.g. ``DDPJOB_POD_INDEX``, to run
        the agent as outside a DDPJob pod).
        """
        contract = self.contract(index)
        full = {
            **os.environ,
            **agent_env(contract),
            TAG_ENV: self.tag,
            KEY_ENV: self.store_key,
            "DDPJOB_CKPT_DIR": str(self.ckpt_dir),
            "PYTHONUNBUFFERED": "1",
        }
        if self.netns:
            full[PET_LOCAL_ADDR] = self.host(index)
            full["GLOO_SOCKET_IFNAME"] = "eth0"  # not the hostname's address (127.0.1.1)
        for key, value in (env or {}).items():
            if value is None:
                full.pop(key, None)
            else:
                full[key] = value
        launcher = ["-m", "torch.distributed.run"] if stock else ["-m", "ddpjob_worker.agent.cli"]
        argv = [sys.executable, *launcher, str(script), *train_args]
        if self.netns:
            if self.fabric is None:
                self.fabric = Fabric()
            argv = self.fabric.wrap(index, argv)
        log = self.tmp / f"node-{index}-{self._launches}.log"
        self._launches += 1
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv,
                env=full,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.tmp,
            )
        node = Node(index, proc, log, Path(contract.state_file), time.monotonic())
        self.nodes.append(node)
        return node

    def leftovers(self) -> list[int]:
        return tagged_pids(self.tag)

    def assert_clean(self, timeout: float = 10.0) -> None:
        """Every process this test started has exited."""
        wait_until(f"no processes left (tag {self.tag})", lambda: not self.leftovers(), timeout)

    def kill_all(self) -> None:
        """SIGKILL every node and every tagged process, and reap the agents.

        Frozen nodes need no SIGCONT first: SIGKILL ends stopped processes, they still carry the
        tag, and ``wait`` then reaps them.
        """
        for node in self.nodes:
            if node.running():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(node.pid, signal.SIGKILL)
        for pid in self.leftovers():
            _kill(pid)
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)
        if self.fabric is not None:
            self.fabric.close()
            self.fabric = None

    def logs(self) -> str:
        return "\n".join(
            f"--- node {n.index} ({n.log.name}) ---\n{n.text()[-4000:]}" for n in self.nodes
        )
