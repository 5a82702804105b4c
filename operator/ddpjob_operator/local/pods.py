"""Local "pods": each is a process tree that runs the pod's trainer command with the pod's env.

This is the local executor's side-effect layer. It turns the reconciler's actions into process
starts and kills, and reports what it sees as :class:`~ddpjob_operator.observe.ObservedPod`, the
same type the Kubernetes executor reports. Only this module and the runner touch processes.

A pod's process tree is the trainer process and every descendant (torch's agent starts its
workers in sessions of their own, so a process group is not enough). The runner makes itself a
child subreaper, so orphans of a dead agent come back to it and are killed too.
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
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import psutil

from ddpjob_operator.errors import DDPJobError
from ddpjob_operator.observe import ObservedPod, PodPhase
from ddpjob_worker.state import AgentState, Phase, read_state

LOOPBACK = "127.0.0.1"
_PR_SET_CHILD_SUBREAPER = 36
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


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


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in command, args and env values."""
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def pod_env(pod: Mapping[str, Any], base: Mapping[str, str]) -> dict[str, str]:
    """The trainer container's env as the kubelet would resolve it, with the pod on 127.0.0.1."""
    container = pod["spec"]["containers"][0]
    meta = pod["metadata"]
    fields = {
        "status.podIP": LOOPBACK,
        "metadata.name": meta["name"],
        "metadata.namespace": meta.get("namespace", "default"),
        "spec.nodeName": "localhost",
    }
    env = dict(base)
    for index, item in enumerate(container.get("env") or []):
        name = item["name"]
        if "value" in item:
            env[name] = _expand(str(item["value"]), env)
            continue
        ref = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if ref in fields:
            env[name] = fields[ref]
            continue
        raise LocalPodError(
            f"spec.template.spec.containers[0].env[{index}] ({name}): the local runner cannot "
            f"resolve {item.get('valueFrom')!r}; give it a plain value for local runs"
        )
    return env


def pod_argv(pod: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The command the kubelet would run, with ``command[0]`` resolved on PATH."""
    container = pod["spec"]["containers"][0]
    command = list(container.get("command") or [])
    if not command:
        raise LocalPodError(
            "spec.template.spec.containers[0].command: the local runner needs an explicit "
            "command (an image's entrypoint is unknown here), e.g. command: [ddpjob-agent]"
        )
    argv = [_expand(part, env) for part in command + list(container.get("args") or [])]
    found = shutil.which(argv[0], path=env.get("PATH"))
    if found is None:
        raise LocalPodError(
            f"spec.template.spec.containers[0].command: {argv[0]!r} is not a command on this "
            f"machine (PATH={env.get('PATH', '')}); install it or fix the command"
        )
    return [found, *argv[1:]]


def tree(pid: int) -> list[psutil.Process]:
    """A process and all its descendants, root first. Empty if it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_all(processes: Iterable[psutil.Process], sig: signal.Signals) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.send_signal(sig)


@dataclasses.dataclass
class LocalPod:
    """One running (or finished) pod: its process, log and what we know of its agent."""

    name: str
    index: int
    uid: str
    process: subprocess.Popen[bytes]
    log_path: Path
    state_file: Path
    grace_seconds: float
    started_at: float
    log: IO[bytes]
    deleting_since: float | None = None
    deletion_timestamp: dt.datetime | None = None
    """As Kubernetes writes it: when the grace period of the deletion ends (wall clock)."""
    tracked: bool = True
    """The pod-tracking finalizer: the runner forgets a deleted pod only once it is removed."""
    disruption: str | None = None
    descendants: list[psutil.Process] = dataclasses.field(default_factory=list)
    agent_state: AgentState | None = None
    """The agent's state file as of the last :meth:`refresh_state` (None: none readable yet)."""

    @property
    def exit_code(self) -> int | None:
        code = self.process.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code  # -9 -> 137, as a container runtime reports it

    def refresh_state(self) -> None:
        """Read the agent's state file; once per tick, everyone else uses ``agent_state``."""
        try:
            self.agent_state = read_state(self.state_file)
        except (OSError, ValueError):
            self.agent_state = None

    def observe(self) -> ObservedPod:
        code = self.exit_code
        state = self.agent_state if code is None else None
        running = state is not None and state.phase is Phase.RUNNING
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
        )

    def _tree(self) -> list[psutil.Process]:
        # Once reaped, the root's pid may belong to anyone (even another pod): not ours to walk.
        return [] if self.process.returncode is not None else tree(self.process.pid)

    def remember_descendants(self) -> None:
        """Keep the tree's members, so they can be killed even after the root is gone."""
        known = {p.pid for p in self.descendants}
        self.descendants += [p for p in self._tree()[1:] if p.pid not in known]

    def all_processes(self) -> list[psutil.Process]:
        alive = []
        for process in [*self._tree(), *self.descendants]:
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
        return alive

    def terminate(self, now: float) -> None:
        """Graceful delete: SIGTERM the trainer (the agent forwards it), SIGKILL after grace."""
        if self.deleting_since is None:
            self.deleting_since = now
            self.deletion_timestamp = dt.datetime.now(dt.UTC) + dt.timedelta(
                seconds=self.grace_seconds
            )
            self.process.send_signal(signal.SIGTERM)  # a no-op once reaped: never a reused pid

    def kill(self) -> None:
        """SIGKILL the whole tree at once (chaos, second Ctrl-C, grace expired)."""
        self.remember_descendants()
        signal_all(self.all_processes(), signal.SIGKILL)

    def reap(self, now: float) -> bool:
        """Enforce the grace period; True when the whole tree is gone."""
        self.remember_descendants()
        if self.deleting_since is not None and now - self.deleting_since > self.grace_seconds:
            self.kill()
        if self.exit_code is not None:
            leftovers = self.all_processes()
            if leftovers and self.deleting_since is None:
                signal_all(leftovers, signal.SIGKILL)  # the root exited: its tree goes with it
            return not leftovers
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.log.close()


def start_pod(
    pod: Mapping[str, Any],
    index: int,
    *,
    base_env: Mapping[str, str],
    cwd: Path,
    log_dir: Path,
    attempt: int,
) -> LocalPod:
    """Start one pod's trainer as a new session, its output in ``<log_dir>/<pod>.<attempt>.log``."""
    env = pod_env(pod, base_env)
    argv = pod_argv(pod, env)
    name = pod["metadata"]["name"]
    log_path = log_dir / f"{name}.{attempt}.log"
    log = log_path.open("ab")
    state_file = Path(env.get("DDPJOB_STATE_FILE", log_dir / f"{name}.state.json"))
    with contextlib.suppress(FileNotFoundError):
        state_file.unlink()  # never read a previous incarnation's state
    process = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
    return LocalPod(
        name=name,
        index=index,
        uid=str(uuid.uuid4()),
        process=process,
        log_path=log_path,
        state_file=state_file,
        grace_seconds=grace,
        started_at=time.monotonic(),
        log=log,
    )
