"""Warm workers: a spare process per local rank with torch imported, ready to become a worker.

A restart's new workers spend most of their start-up in ``import torch`` (0.8 to 1 s on this
project's 2-core machine, more on a busy node), and every survivor of a failure, a leave or a
scale-up pays it again. So once a worker group has run for :data:`WARM_AFTER_SECONDS`, the agent
starts one spare per local rank: ``python -u -c <import ddpjob_worker.agent.spare ...> <script>``,
which imports torch on a thread at the ``SCHED_IDLE`` policy (on cores nothing else wants: the
workers' own start-up and training never wait for it) and waits on its stdin. A spare not done
importing is not handed a worker (that worker starts cold; the spare stays for the next restart).
When torch's ``SubprocessHandler`` is about to ``Popen`` a worker, the agent hands a spare the
worker's ``argv`` and environment instead (:meth:`WarmPool.take`); the spare sets them and runs the
script as ``__main__``, as ``python -u script`` would. Nothing is handed over unless it would behave
like a cold start:

* the command must be ``<this python> -u <script> ...`` or ``<this python> -u -m <module> ...``
  (torchrun's form); any other interpreter, flag, NUMA wrapper or ``--no-python`` starts cold;
* the worker's stdout and stderr must be inherited (no ``--redirects``/``--tee`` files);
* the environment may differ from the spare's start-up environment only in the variables torch
  sets per worker (:data:`PER_WORKER`); anything else (``PYTHONPATH``, ``LD_PRELOAD``,
  ``OMP_NUM_THREADS`` ...) changed since the spare started means a cold start.

What differs from a cold start otherwise is kept from the worker's view by the spare itself
(:mod:`ddpjob_worker.agent.spare`: ``sys.path``, stdin, CUDA).

``ddpjob-agent`` also starts spares before it imports torch itself (:func:`start_early`), for
its first workers; the agent adopts those whose environment still matches (:meth:`WarmPool.adopt`).

If the agent dies, the handover pipe closes and idle spares exit. ``DDPJOB_WARM_WORKERS=0``
turns the pool off; each spare costs about one ``import torch`` of memory (docs/agent.md has
the figures).

The handler side (torch's ``SubprocessHandler``) lives in :mod:`ddpjob_worker.agent.elastic`,
the spare's own main in :mod:`ddpjob_worker.agent.spare`; this module imports only the standard
library.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from ddpjob_worker.agent.memory import Memory, container_memory

logger = logging.getLogger(__name__)

WARM_AFTER_SECONDS = 3.0
"""How long a worker group runs before the agent starts its spares. A spare the pool starts
imports at the ``SCHED_IDLE`` policy (:func:`run`), on cores nothing else wants, so the new
workers' own start-up and their training keep the cores whenever it starts; started at the
group's start, though, it made a member's hub connection close under it about 3 s in, in
about half the runs of ``test_a_pod_killed_whole_is_found_dead_by_its_peers_at_once`` (not
found: no Python ``os.close`` of a socket; see the 2026-11-29 notes), so it waits as before."""

MODULE = "ddpjob_worker.agent.spare"

BOOT = (
    "import sys; sys.flags.safe_path or sys.path.pop(0); "
    f"from {MODULE} import run; run(sys.argv[1:])"
)
"""The spare's ``python -c`` program: ``-c`` puts the current directory first on ``sys.path``
(unless ``PYTHONSAFEPATH``); it goes before anything is imported, ``ddpjob_worker`` included."""

PER_WORKER = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "CUDA_VISIBLE_DEVICES",
    }
)
"""Variables torch's agent sets per worker (``LocalElasticAgent._start_workers``, and
``CUDA_VISIBLE_DEVICES`` with ``--virtual-local-rank``); ``TORCHELASTIC_*`` too. They are read by
the training script and by torch when it is used (the process group, CUDA), not by ``import
torch``, so a spare may take them after the import."""

PRELOAD = ("torch", "torch.distributed", "torch._dynamo")

SPARE_BYTES = 400 << 20
"""What an idle spare costs its container, about: its private memory once torch is imported (354
MiB measured with torch 2.13's CUDA wheel; the shared pages are the workers' too)."""
RESERVE_FRACTION = 0.1
"""Of the container's memory limit, what spares must leave free for the workers to grow into."""
MEMORY_LOOK_SECONDS = 30.0
"""How often a pool short of memory looks again."""


def spares_that_fit(count: int, memory: Memory | None) -> int:
    """How many of ``count`` spares the container's memory holds (:data:`SPARE_BYTES` each,
    :data:`RESERVE_FRACTION` of the limit left free); all of them with no limit."""
    if memory is None:
        return count
    room = memory.headroom - int(memory.limit * RESERVE_FRACTION)
    return max(0, min(count, room // SPARE_BYTES))


def parse_command(command: Sequence[str], python: str) -> list[str] | None:
    """The ``argv`` a spare runs for ``command``, or None if only a cold start is equivalent.

    ``[python, "-u", "train.py", "--x"]`` gives ``["train.py", "--x"]``;
    ``[python, "-u", "-m", "pkg.train", "--x"]`` gives ``["-m", "pkg.train", "--x"]``.
    """
    if len(command) < 3 or command[0] != python or command[1] != "-u":
        return None
    rest = list(command[2:])
    if rest[0] == "-m":
        return rest if len(rest) >= 2 and not rest[1].startswith("-") else None
    return None if rest[0].startswith("-") else rest


def foreign_changes(spare_env: Mapping[str, str], worker_env: Mapping[str, str]) -> list[str]:
    """Variables that differ between the spare's start and the worker, beyond :data:`PER_WORKER`."""
    changed = {
        k for k in spare_env.keys() | worker_env.keys() if spare_env.get(k) != worker_env.get(k)
    }
    return sorted(k for k in changed if k not in PER_WORKER and not k.startswith("TORCHELASTIC_"))


class Spare:
    """One idle spare process and the environment it started with.

    ``ready_fd`` is the read end of a pipe the spare writes one byte to once its imports are
    done (:attr:`ready`); None: no such pipe, the spare counts as ready at once. ``idle``: it
    imports at the ``SCHED_IDLE`` policy, and is handed a worker only once ready.
    """

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        env: dict[str, str],
        ready_fd: int | None = None,
        *,
        idle: bool = False,
    ) -> None:
        self.proc = proc
        self.env = env
        self.idle = idle
        self._ready_fd = ready_fd
        self._ready = ready_fd is None

    @property
    def ready(self) -> bool:
        """Whether the spare has imported what it preloads (never blocks)."""
        if not self._ready and self._ready_fd is not None:
            try:
                os.read(self._ready_fd, 1)  # its byte, or b"" (it exited): it imports no more
            except BlockingIOError:
                return False
            except OSError:
                pass
            self._ready = True
            self.release()
        return self._ready

    def release(self) -> None:
        """Close the agent's end of the readiness pipe (the spare is handed over or killed)."""
        fd, self._ready_fd = self._ready_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self.release()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def start_spare(
    label: str = "",
    *,
    python: str = sys.executable,
    preload: Sequence[str] = PRELOAD,
    idle: bool = False,
) -> Spare | None:
    """Start one spare with the current environment, or None (logged) if it cannot start.
    ``idle``: it imports at the ``SCHED_IDLE`` policy (:func:`run`)."""
    env = dict(os.environ)
    try:
        ready_read, ready_write = os.pipe()  # both close-on-exec: only the spare gets its end
        os.set_blocking(ready_read, False)
    except OSError as exc:
        logger.warning("could not start a warm worker (%s); workers start cold", exc)
        return None
    passed = [ready_write]
    command = [python, "-u", "-c", BOOT, "--preload", ",".join(preload)]
    command += ["--ready-fd", str(ready_write)]
    if idle:
        command += ["--idle", "1"]
    with contextlib.suppress(OSError):  # no stdin of our own: the worker's is /dev/null
        stdin_copy = os.dup(0)  # close-on-exec too; the spare's fd 0 is the handover pipe
        passed.append(stdin_copy)
        command += ["--stdin-fd", str(stdin_copy)]
    if label:
        command.append(label)  # shows in ps; the real argv comes over stdin
    try:
        proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.PIPE,
            start_new_session=True,
            pass_fds=passed,
        )
    except OSError as exc:
        os.close(ready_read)
        logger.warning("could not start a warm worker (%s); workers start cold", exc)
        return None
    finally:
        for fd in passed:
            os.close(fd)
    logger.debug("started warm worker pid %d", proc.pid)
    return Spare(proc, env, ready_read, idle=idle)


def start_early(count: int, spares: list[Spare] | None = None) -> list[Spare]:
    """``count`` spares started by ``ddpjob-agent`` before it imports torch itself, so that the
    first workers' imports overlap the agent's own start-up (a replacement pod's, above all).
    The agent adopts them (:meth:`WarmPool.adopt`) or kills them. Each is added to ``spares``
    as soon as it starts, so a signal in between loses none."""
    spares = [] if spares is None else spares
    fit = spares_that_fit(count, container_memory())
    if fit < count:
        logger.info("memory for %d of %d early warm workers", fit, count)
    for _ in range(fit):
        spare = start_spare()
        if spare is None:
            break
        spares.append(spare)
    return spares


class WarmPool:
    """Spares for one agent's local ranks. Single-threaded: the agent's monitor loop drives it."""

    def __init__(
        self,
        slots: int,
        *,
        label: str = "",
        python: str = sys.executable,
        preload: Sequence[str] = PRELOAD,
        after_seconds: float = WARM_AFTER_SECONDS,
        memory: Callable[[], Memory | None] = container_memory,
        idle: bool = True,
    ) -> None:
        self._slots = slots
        self._label = label
        self._python = python
        self._preload = tuple(preload)
        self._after_seconds = after_seconds
        self._idle = idle
        self._memory = memory
        self._memory_look = 0.0
        self._short = False
        self._spares: list[Spare] = []
        self._group_started = time.monotonic()
        self.handed_over = 0
        self.cold_starts = 0

    def group_started(self) -> None:
        """A new worker group was started: wait ``after_seconds`` before refilling."""
        self._group_started = time.monotonic()

    def tick(self) -> None:
        """Reap the spares that died idle (an OOM kill picks them first), and start the missing
        ones, once the current group has run long enough."""
        dead = [s for s in self._spares if s.proc.poll() is not None]
        for gone in dead:
            logger.info("a warm worker died idle (%s); starting another", gone.proc.returncode)
            gone.release()
        self._spares = [s for s in self._spares if s not in dead]
        if len(self._spares) >= self._slots:
            return
        if time.monotonic() - self._group_started < self._after_seconds:
            return
        if time.monotonic() < self._memory_look:
            return
        missing = self._slots - len(self._spares)
        memory = self._memory()
        fit = spares_that_fit(missing, memory)
        if fit < missing:
            self._memory_look = time.monotonic() + MEMORY_LOOK_SECONDS
            if not self._short and memory is not None:
                logger.warning(
                    "no memory for %d warm worker(s): %d MiB of the container's %d MiB are "
                    "free, each needs about %d MiB and %d%% stays free; those workers start cold",
                    missing - fit,
                    memory.headroom >> 20,
                    memory.limit >> 20,
                    SPARE_BYTES >> 20,
                    int(RESERVE_FRACTION * 100),
                )
            self._short = True
        else:
            self._short = False
        for _ in range(fit):
            started = start_spare(
                self._label, python=self._python, preload=self._preload, idle=self._idle
            )
            if started is None:
                self._slots = 0
                return
            self._spares.append(started)

    def adopt(self, spares: Sequence[Spare]) -> None:
        """Take spares started before the agent (:func:`start_early`) for the first group.

        One that has exited, is one too many, or started with an environment the workers will
        not have (torchrun sets ``OMP_NUM_THREADS`` for several local ranks, say) is killed.
        """
        for spare in spares:
            changed = foreign_changes(spare.env, os.environ)
            if spare.proc.poll() is None and len(self._spares) < self._slots and not changed:
                self._spares.append(spare)
                continue
            if changed:
                logger.debug("an early spare's environment differs (%s)", ", ".join(changed))
            spare.kill()

    def take(
        self, command: Sequence[str], env: Mapping[str, str], *, redirected: bool
    ) -> subprocess.Popen[bytes] | None:
        """Hand a spare ``command`` with ``env``, or None (start cold) with the reason logged."""
        # A spare importing at the idle policy is kept for the next restart: its imports run
        # only on cores nothing else wants, which a restart's workers do want.
        spare = next((s for s in self._spares if not s.idle or s.ready), None)
        if spare is None:
            if self._spares:
                logger.info("starting a worker cold: its spare is still importing (idle policy)")
            self.cold_starts += 1
            return None
        self._spares.remove(spare)
        argv = parse_command(command, self._python)
        reason = ""
        if redirected:
            reason = "its output is redirected to files"
        elif argv is None:
            reason = f"its command is not '{self._python} -u <script|-m module>'"
        else:
            changed = foreign_changes(spare.env, env)
            if changed:
                reason = f"the environment changed since the spare started ({', '.join(changed)})"
        if not reason and spare.proc.poll() is not None:
            reason = f"the spare exited ({spare.proc.returncode})"
        spare.release()
        if not reason and argv is not None:
            try:
                self._hand_over(spare, command, argv, env)
            except OSError as exc:  # it died between poll() and our write
                reason = f"could not hand over ({exc})"
        if reason:
            logger.info("starting a worker cold: %s", reason)
            spare.kill()
            self.cold_starts += 1
            return None
        self.handed_over += 1
        return spare.proc

    @staticmethod
    def _hand_over(
        spare: Spare, command: Sequence[str], argv: list[str], env: Mapping[str, str]
    ) -> None:
        stdin = spare.proc.stdin
        if stdin is None:
            raise OSError("the spare has no stdin pipe")
        # ``command``: what the spare execs instead when it cannot run the worker (its CUDA).
        message = {"argv": argv, "env": dict(env), "command": list(command)}
        payload = json.dumps(message).encode()
        stdin.write(payload)
        stdin.close()

    def close(self) -> None:
        """Kill every idle spare (the agent stops, or its workers stop for good)."""
        spares, self._spares = self._spares, []
        for spare in spares:
            spare.kill()

    @property
    def idle(self) -> list[int]:
        return [s.proc.pid for s in self._spares]

    @property
    def settled(self) -> bool:
        """Every slot holds a spare whose imports are done: the pool has nothing to do until
        a restart takes them (or one dies, which the monitor's next look finds)."""
        return len(self._spares) >= self._slots and all(s.ready for s in self._spares)

    @property
    def ready(self) -> int:
        """Idle spares whose imports are done: a restart now starts that many workers warm."""
        return sum(1 for s in self._spares if s.ready and s.proc.poll() is None)
