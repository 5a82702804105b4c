"""Local "pods": each is a process tree that runs the pod's trainer command with the pod's env.

This is the local executor's side-effect layer. It turns the reconciler's actions into process
starts and kills, and reports what it sees as :class:`~ddpjob_operator.observe.ObservedPod`, the
same type the Kubernetes executor reports. Only this module and the runner touch processes.

A pod's process tree is the trainer process and every descendant (torch's agent starts its
workers in sessions of their own, so a process group is not enough). The runner makes itself a
child subreaper, so orphans of a dead agent come back to it and are killed too.

A tree can be frozen (SIGSTOP to every member: a machine that stops, whose kernel still ACKs
while nothing answers) and thawed (SIGCONT). A stopped process keeps SIGTERM pending until it is
continued, but SIGKILL ends it at once, so :meth:`ContainerProcess.kill` needs no thaw first.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime as dt
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import psutil

from ddpjob_operator.errors import DDPJobError
from ddpjob_operator.observe import ObservedPod, PodPhase
from ddpjob_worker.state import AgentState, Phase, read_state

LOOPBACK = "127.0.0.1"
_PR_SET_CHILD_SUBREAPER = 36
_VAR_REF = re.compile(r"\$\$|\$\(([^)]*)\)")
_STOPPED = frozenset({psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP})
_FREEZE_PASSES = 100
_FREEZE_PASS_SECONDS = 0.01
LOCAL_TRAINER = "spec.template.spec.containers[0]"


class LocalPodError(DDPJobError):
    """A pod cannot be run on this machine as written (bad command, unsupported env source)."""


def become_subreaper() -> None:
    """Adopt orphaned descendants (Linux), so that no process of ours outlives the run."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def reap_orphans(keep: set[int]) -> None:
    """Wait for our exited children except ``keep`` (live pods' roots, their ``Popen`` reaps).

    As a subreaper the runner inherits the orphans of every dead agent; unwaited, each would stay
    a <defunct> entry until the runner exits.
    """
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return
    for child in children:
        if child.pid not in keep:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child.pid, os.WNOHANG)


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command, args and env values.

    ``$(NAME)`` becomes NAME's value when it is defined, and stays as written when it is not;
    ``$$`` is an escaped ``$`` (so ``$$(NAME)`` stays ``$(NAME)``); any other ``$`` is literal.
    """

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REF.sub(one, text)


EnvSource = Callable[[str, Mapping[str, Any]], "str | Mapping[str, str] | None"]
"""Resolves what the local runner cannot: ``(kind, reference) -> value``. ``kind`` is a
``valueFrom`` key other than ``fieldRef`` (``configMapKeyRef``, ``secretKeyRef``,
``resourceFieldRef``: a string, or None for an optional one that is absent) or an ``envFrom``
key (``configMapRef``, ``secretRef``: a mapping). Raises :class:`LocalPodError` when it cannot."""

SecretValues = Mapping[tuple[str, str], str]
"""Values a ``secretKeyRef`` resolves to without a source: ``(Secret name, key) -> value``
(``ddpjob run`` knows exactly one, the job's store key)."""


def container_env(
    container: Mapping[str, Any],
    *,
    base: Mapping[str, str],
    fields: Mapping[str, str],
    where: str,
    source: EnvSource | None = None,
    secrets: SecretValues | None = None,
) -> dict[str, str]:
    """A container's env as the kubelet resolves it: ``base`` (the image's env), then
    ``envFrom``, then ``env`` in order, each value ``$(VAR)``-expanded against what came before.

    ``fields`` maps the ``fieldRef`` paths that can be resolved (``metadata.name``,
    ``status.podIP``, ``metadata.labels['x']``...) to their values; ``where`` is the
    container's field path, for errors (``spec.containers[0]``). A ``secretKeyRef`` found in
    ``secrets`` takes its value from there (never expanded); any other goes to ``source``.
    """
    env = dict(base)
    for index, item in enumerate(container.get("envFrom") or []):
        for kind in ("configMapRef", "secretRef"):
            if kind in item:
                data = _resolve(source, kind, item[kind], f"{where}.envFrom[{index}]")
                prefix = str(item.get("prefix") or "")
                if isinstance(data, Mapping):
                    env.update({prefix + k: v for k, v in data.items()})
    for index, item in enumerate(container.get("env") or []):
        name = str(item["name"])
        if "valueFrom" not in item:
            env[name] = expand(str(item.get("value") or ""), env)
            continue
        value_from = item.get("valueFrom") or {}
        field = (value_from.get("fieldRef") or {}).get("fieldPath")
        if field is not None:
            if field not in fields:
                raise LocalPodError(
                    f"{where}.env[{index}] ({name}): fieldRef {field!r} cannot be resolved "
                    f"here; supported: {', '.join(sorted(fields))}"
                )
            env[name] = fields[field]
            continue
        kind = next(iter(value_from), "")
        ref = value_from.get(kind) or {}
        known = (str(ref.get("name", "")), str(ref.get("key", "")))
        if kind == "secretKeyRef" and secrets is not None and known in secrets:
            env[name] = secrets[known]
            continue
        value = _resolve(source, kind, ref, f"{where}.env[{index}] ({name})")
        if isinstance(value, str):
            env[name] = value
    return env


def _resolve(
    source: EnvSource | None, kind: str, ref: Mapping[str, Any], where: str
) -> str | Mapping[str, str] | None:
    if source is None:
        raise LocalPodError(
            f"{where}: the local runner cannot resolve {kind} {dict(ref)!r}; give it a plain "
            "value for local runs"
        )
    return source(kind, ref)


def container_argv(
    container: Mapping[str, Any],
    env: Mapping[str, str],
    *,
    where: str,
    entrypoint: Sequence[str] | None = None,
    cmd: Sequence[str] = (),
) -> list[str]:
    """The command the runtime would run, with ``argv[0]`` resolved on the env's PATH.

    As Kubernetes: ``command`` replaces the image's ``entrypoint`` and ``args`` its ``cmd``
    (a ``command`` without ``args`` drops the image's ``cmd``). ``entrypoint`` None means the
    image is unknown (the local runner): then ``command`` is required.
    """
    command = list(container.get("command") or [])
    args = container.get("args")
    if command:
        argv = command + list(args or [])
    elif entrypoint is not None:
        argv = [*entrypoint, *(args if args is not None else cmd)]
    else:
        raise LocalPodError(
            f"{where}.command: the local runner needs an explicit command (an image's "
            "entrypoint is unknown here), e.g. command: [ddpjob-agent]"
        )
    if not argv:
        raise LocalPodError(f"{where}: no command: neither the container nor its image has one")
    argv = [expand(str(part), env) for part in argv]
    found = shutil.which(argv[0], path=env.get("PATH"))
    if found is None:
        raise LocalPodError(
            f"{where}.command: {argv[0]!r} is not a command on this machine "
            f"(PATH={env.get('PATH', '')}); install it or fix the command"
        )
    return [found, *argv[1:]]


def pod_env(
    pod: Mapping[str, Any], base: Mapping[str, str], secrets: SecretValues | None = None
) -> dict[str, str]:
    """The trainer container's env for the local runner, with the pod on 127.0.0.1.

    ``secrets``: the Secret values the run provides (the job's store key); any other
    ``valueFrom`` but a ``fieldRef`` is refused, naming the variable."""
    meta = pod["metadata"]
    fields = {
        "status.podIP": LOOPBACK,
        "metadata.name": meta["name"],
        "metadata.namespace": meta.get("namespace", "default"),
        "spec.nodeName": "localhost",
    }
    container = pod["spec"]["containers"][0]
    return container_env(container, base=base, fields=fields, where=LOCAL_TRAINER, secrets=secrets)


def pod_argv(pod: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The trainer's command for the local runner (which knows no image entrypoints)."""
    return container_argv(pod["spec"]["containers"][0], env, where=LOCAL_TRAINER)


def tree(pid: int) -> list[psutil.Process]:
    """A process and all its descendants, root first. Empty if it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _idle_spare(process: psutil.Process) -> bool:
    """A warm spare of the agent (``ddpjob_worker.agent.spare``) that no worker has become yet:
    it waits on a pipe for its worker, and once handed one its stdin is the agent's."""
    try:
        if not any("ddpjob_worker.agent.spare" in part for part in process.cmdline()):
            return False
        return os.readlink(f"/proc/{process.pid}/fd/0").startswith("pipe:")
    except (OSError, psutil.Error):
        return False


def signal_all(processes: Iterable[psutil.Process], sig: signal.Signals) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.send_signal(sig)


@dataclasses.dataclass
class ContainerProcess:
    """One container as a process tree: its root process, every descendant, its log.

    This is the process layer that ``ddpjob run`` (one per local pod) and the test suite's
    process kubelet (one per container) share. Stopping follows a container runtime: SIGTERM to
    the root, SIGKILL to the whole tree once the grace period is over; when the root exits (on
    its own or stopped), what is left of its tree is killed at once, as a PID namespace is. The
    exit code is a runtime's: a death by signal N reads as 128 + N.
    """

    process: subprocess.Popen[bytes]
    log: IO[bytes]
    log_path: Path
    started_at: float
    """``time.monotonic()`` at the start."""
    stopping_since: float | None = None
    grace_seconds: float = 0.0
    descendants: list[psutil.Process] = dataclasses.field(default_factory=list)
    members: Path | None = None
    """A cgroup's ``cgroup.procs`` that holds every process of the container (the process
    kubelet's): then membership is read from it, exactly and cheaply, instead of walking the
    process tree (which loses orphans whose parent died)."""
    frozen_since: float | None = None
    """``time.monotonic()`` when the tree was frozen (SIGSTOP); None when it is not frozen."""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exit_code(self) -> int | None:
        code = self.process.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code  # -9 -> 137, as a container runtime reports it

    def _tree(self) -> list[psutil.Process]:
        # Once reaped, the root's pid may belong to anyone (even another pod): not ours to walk.
        return [] if self.process.returncode is not None else tree(self.process.pid)

    def remember_descendants(self) -> None:
        """Keep the tree's members, so they can be killed even after the root is gone."""
        if self.members is not None:
            return  # the cgroup remembers them
        known = {p.pid for p in self.descendants}
        self.descendants += [p for p in self._tree()[1:] if p.pid not in known]

    def _cgroup(self) -> list[psutil.Process]:
        assert self.members is not None
        try:
            pids = [int(line) for line in self.members.read_text().split()]
        except (OSError, ValueError):
            return []
        found = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                found.append(psutil.Process(pid))
        return found

    def all_processes(self) -> list[psutil.Process]:
        alive = []
        listed = self._cgroup() if self.members is not None else [*self._tree(), *self.descendants]
        for process in listed:
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
        return alive

    def stop(self, now: float, grace_seconds: float) -> None:
        """SIGTERM the root once (it forwards it, as the agent does); SIGKILL after grace."""
        if self.stopping_since is None:
            self.stopping_since = now
            self.grace_seconds = grace_seconds
            self.process.send_signal(signal.SIGTERM)  # a no-op once reaped: never a reused pid

    def kill(self) -> None:
        """SIGKILL the whole tree at once (a frozen one too: SIGKILL ends a stopped process)."""
        self.remember_descendants()
        signal_all(self.all_processes(), signal.SIGKILL)
        self.frozen_since = None

    def kill_worker(self, choose: Callable[[list[psutil.Process]], psutil.Process]) -> int | None:
        """SIGKILL one training process of the tree (``choose`` picks it), as an OOM kill or a
        crash would end it: the root (the agent) lives, and a worker's own children (its
        DataLoader's workers) see their parent gone. The pid killed; None when there is none
        (the agent is between two groups)."""
        workers = [p for p in self._children() if not _idle_spare(p)]
        if not workers:
            return None
        victim = choose(sorted(workers, key=lambda p: p.pid))
        signal_all([victim], signal.SIGKILL)
        return victim.pid

    def _children(self) -> list[psutil.Process]:
        if self.process.returncode is not None:
            return []
        try:
            return psutil.Process(self.process.pid).children()
        except psutil.NoSuchProcess:
            return []

    def freeze(self, now: float) -> int:
        """SIGSTOP every process of the tree; the number of processes stopped.

        The walk is repeated until every member is seen stopped (bounded), so a child forked
        while the first walk ran is stopped too: a stopped process forks no more.
        """
        self.remember_descendants()
        self.frozen_since = now
        members: set[int] = set()
        for _ in range(_FREEZE_PASSES):
            running = []
            for process in self.all_processes():
                members.add(process.pid)
                with contextlib.suppress(psutil.NoSuchProcess):
                    if process.status() not in _STOPPED:
                        running.append(process)
            if not running:
                break
            signal_all(running, signal.SIGSTOP)
            time.sleep(_FREEZE_PASS_SECONDS)
        return len(members)

    def thaw(self) -> None:
        """SIGCONT every process of the tree (a SIGTERM sent meanwhile is handled now)."""
        self.remember_descendants()
        signal_all(self.all_processes(), signal.SIGCONT)
        self.frozen_since = None

    def reap(self, now: float) -> bool:
        """Enforce the grace period; True when the whole tree is gone."""
        self.remember_descendants()
        if self.stopping_since is not None and now - self.stopping_since > self.grace_seconds:
            self.kill()
        if self.exit_code is not None:
            leftovers = self.all_processes()
            if leftovers:
                # The root exited: its tree goes with it, stopping or not, as a container's
                # processes do when its PID 1 exits (the kernel kills its PID namespace).
                signal_all(leftovers, signal.SIGKILL)
            return not leftovers
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.log.close()


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path | str,
    log_path: Path,
    wrapper: Sequence[str] = (),
    members: Path | None = None,
) -> ContainerProcess:
    """Start ``argv`` in a session of its own, stdout and stderr appended to ``log_path``.

    ``wrapper`` goes in front (the process kubelet's namespace set-up, which ends in an
    ``exec`` of ``argv``, so the root process is the container's own); ``members``: see
    :attr:`ContainerProcess.members`.
    """
    log = log_path.open("ab")
    try:
        process = subprocess.Popen(
            [*wrapper, *argv], env=dict(env), cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    except OSError:
        log.close()
        raise
    return ContainerProcess(
        process=process, log=log, log_path=log_path, started_at=time.monotonic(), members=members
    )


@dataclasses.dataclass
class LocalPod:
    """One pod of ``ddpjob run``: its trainer's process tree and what we know of its agent."""

    name: str
    index: int
    uid: str
    container: ContainerProcess
    state_file: Path
    grace_seconds: float
    deletion_timestamp: dt.datetime | None = None
    """As Kubernetes writes it: when the grace period of the deletion ends (wall clock)."""
    tracked: bool = True
    """The pod-tracking finalizer: the runner forgets a deleted pod only once it is removed."""
    disruption: str | None = None
    agent_state: AgentState | None = None
    """The agent's state file as of the last :meth:`refresh_state` (None: none readable yet)."""
    started_at: dt.datetime = dataclasses.field(default_factory=lambda: dt.datetime.now(dt.UTC))
    """When the trainer started (wall clock), as a kubelet writes ``startedAt``."""
    finished_at: dt.datetime | None = None
    """When the trainer was first seen exited (wall clock): a kubelet's ``finishedAt``."""

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.container.process

    @property
    def log_path(self) -> Path:
        return self.container.log_path

    @property
    def deleting_since(self) -> float | None:
        return self.container.stopping_since

    @property
    def exit_code(self) -> int | None:
        return self.container.exit_code

    def refresh_state(self) -> None:
        """Read the agent's state file; once per tick, everyone else uses ``agent_state``."""
        try:
            self.agent_state = read_state(self.state_file)
        except (OSError, ValueError):
            self.agent_state = None

    @property
    def frozen_since(self) -> float | None:
        """``time.monotonic()`` when chaos froze the pod (None: not frozen, or it has exited:
        killed by someone else meanwhile)."""
        if self.container.frozen_since is None or self.exit_code is not None:
            return None
        return self.container.frozen_since

    def observe(self) -> ObservedPod:
        code = self.exit_code
        if code is not None and self.finished_at is None:
            self.finished_at = dt.datetime.now(dt.UTC)
        state = self.agent_state if code is None else None
        # A frozen pod is not ready, as the node controller marks the pods of a node that stopped
        # reporting (here at once): its agent's state file is as stale as its node.
        running = state is not None and state.phase is Phase.RUNNING and self.frozen_since is None
        if code is None:
            phase = PodPhase.RUNNING
        else:
            phase = PodPhase.SUCCEEDED if code == 0 else PodPhase.FAILED
        return ObservedPod(
            name=self.name,
            index=self.index,
            uid=self.uid,
            phase=phase,
            ready=running,
            deleting=self.deleting_since is not None,
            deletion_timestamp=self.deletion_timestamp,
            deletion_grace_seconds=self.grace_seconds if self.deleting_since is not None else None,
            tracked=self.tracked,
            exit_code=code,
            disruption=self.disruption,
            message=f"logs: {self.log_path}" if code not in (None, 0) else "",
            node="localhost",
            world_size=state.world_size if state is not None and running else None,
            store_host=state is not None and state.store_host and self.frozen_since is None,
            store_gen=state.store_gen if state is not None else 0,
            started_at=self.started_at,
            finished_at=self.finished_at,
        )

    def all_processes(self) -> list[psutil.Process]:
        return self.container.all_processes()

    def terminate(self, now: float) -> None:
        """Graceful delete: SIGTERM the trainer (the agent forwards it), SIGKILL after grace."""
        if self.deleting_since is None:
            self.deletion_timestamp = dt.datetime.now(dt.UTC) + dt.timedelta(
                seconds=self.grace_seconds
            )
        self.container.stop(now, self.grace_seconds)

    def kill(self) -> None:
        """SIGKILL the whole tree at once (chaos, second Ctrl-C, grace expired)."""
        self.container.kill()

    def freeze(self, now: float) -> int:
        """SIGSTOP the whole tree (chaos); the number of processes stopped."""
        return self.container.freeze(now)

    def kill_worker(self, choose: Callable[[list[psutil.Process]], psutil.Process]) -> int | None:
        """SIGKILL one of the agent's training processes (chaos); its pid, or None."""
        return self.container.kill_worker(choose)

    def thaw(self) -> None:
        """SIGCONT the whole tree."""
        self.container.thaw()

    def reap(self, now: float) -> bool:
        """Enforce the grace period; True when the whole tree is gone."""
        return self.container.reap(now)

    def close(self) -> None:
        self.container.close()


def start_pod(
    pod: Mapping[str, Any],
    index: int,
    *,
    base_env: Mapping[str, str],
    cwd: Path,
    log_dir: Path,
    attempt: int,
    secrets: SecretValues | None = None,
) -> LocalPod:
    """Start one pod's trainer as a new session, its output in ``<log_dir>/<pod>.<attempt>.log``."""
    env = pod_env(pod, base_env, secrets)
    argv = pod_argv(pod, env)
    name = pod["metadata"]["name"]
    state_file = Path(env.get("DDPJOB_STATE_FILE", log_dir / f"{name}.state.json"))
    with contextlib.suppress(FileNotFoundError):
        state_file.unlink()  # never read a previous incarnation's state
    container = spawn(argv, env=env, cwd=cwd, log_path=log_dir / f"{name}.{attempt}.log")
    return LocalPod(
        name=name,
        index=index,
        uid=str(uuid.uuid4()),
        container=container,
        state_file=state_file,
        grace_seconds=float(pod["spec"].get("terminationGracePeriodSeconds", 30)),
    )
