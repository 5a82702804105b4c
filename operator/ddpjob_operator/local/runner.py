"""``ddpjob run job.yaml``: run a DDPJob on this machine with the operator's own core.

The loop is the operator's: observe the pods, ``reconcile()``, keep the new status, carry out
the actions. Only the executor differs: a pod is a local process tree (:mod:`.pods`), the
Service and pod DNS names are 127.0.0.1, and the rendezvous port is a free one, so several jobs
can run side by side.

Scaling: edit ``spec.replicas`` in the manifest while the job runs (or run
``ddpjob scale FILE N``). The runner re-reads the file when it changes; an invalid edit is
reported and ignored.

Chaos: ``--chaos SECONDS`` injects a fault into a random pod (the master included) at about that
interval, and the job recovers through the same reconcile logic. The runner plays the cluster:

* ``--chaos-kind kill`` SIGKILLs the pod's whole process tree: a lost node, loud (connections
  are reset). The pod reads as failed with reason ``NodeLost``: replaced, backoffLimit not spent.
* ``--chaos-kind freeze`` SIGSTOPs the whole tree: a frozen node, silent (the kernel still ACKs,
  nothing answers). The pod reads as not ready at once, as the node controller marks the pods
  of a node that stopped reporting. ``--chaos-thaw`` SIGCONTs it after that many seconds (a long
  stall); a pod still frozen after ``--chaos-node-lost-after`` (default: the job's
  ``spec.nodeLostTolerationSeconds``, the not-ready toleration its pods get on a cluster, whose
  node monitor grace period is skipped here) is treated as the taint manager would: SIGKILLed
  and replaced as ``NodeLost``. A frozen pod cannot stop gracefully (SIGTERM waits until it is
  continued), so Ctrl-C and the end of the job SIGKILL it.
* ``--chaos-kind worker`` SIGKILLs one training process of the pod (not a warm spare): a trainer
  that crashed or was OOM-killed. The pod and its agent live; the agent restarts the group (its
  DataLoader's workers see their parent gone and exit).
* ``--chaos-kind mixed`` picks kill or freeze for each fault. A partition cannot be done here
  (every pod shares 127.0.0.1): :mod:`.options` refuses it.

Stopping: a signal handler only counts SIGINT/SIGTERM; the loop acts on it. Once
interrupted no pod starts (a CreatePod is skipped), every pod gets SIGTERM, including one
started in the tick the signal landed in, and a second signal SIGKILLs everything. When the job
is finished the run ends: pods that ``cleanPodPolicy`` would keep on a cluster are stopped too,
since nothing of a local run may outlive it. Every child is waited for, orphans included.

Exit codes: 0 the job succeeded, 1 it failed, 2 bad input, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from ddpjob_operator import api, builders
from ddpjob_operator.core.actions import CreatePod, DeleteJob, DeletePod, Observed, RemoveFinalizer
from ddpjob_operator.core.reconcile import reconcile
from ddpjob_operator.errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_OK, DDPJobError
from ddpjob_operator.local.pods import (
    LocalPod,
    become_subreaper,
    pod_argv,
    pod_env,
    reap_orphans,
    signal_all,
    start_pod,
)
from ddpjob_operator.local.view import View, make_view
from ddpjob_operator.manifest import load_job_file
from ddpjob_operator.observe import Reason
from ddpjob_worker.state import Phase as AgentPhase

TICK_SECONDS = 0.2
_STEP = re.compile(rb"DDPJOB step=(\d+)")


def free_port() -> int:
    """A TCP port nobody listens on now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive ports nobody listens on now: the pods' directory
    ports (pod ``i`` answers on ``base + i``; every local pod shares 127.0.0.1)."""
    for _ in range(100):
        base = free_port()
        if base + count > 65535:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


@dataclasses.dataclass
class Progress:
    """What the runner learns from the pods' logs and agents, for the view and the summary."""

    step: int | None = None
    offsets: dict[Path, int] = dataclasses.field(default_factory=dict)
    agent_restarts: dict[str, int] = dataclasses.field(default_factory=dict)
    recovery_seconds: float = 0.0
    was_whole: bool = False
    last_tick: float = 0.0
    desired: int = 0
    """The pods the job wants, as the last pass decided."""

    def scan(self, pod: LocalPod) -> None:
        offset = self.offsets.get(pod.log_path, 0)
        try:
            with pod.log_path.open("rb") as log:
                log.seek(offset)
                chunk = log.read()
        except OSError:
            return
        last_line_end = chunk.rfind(b"\n") + 1
        self.offsets[pod.log_path] = offset + last_line_end
        for match in _STEP.finditer(chunk[:last_line_end]):
            self.step = max(self.step or 0, int(match.group(1)))
        if pod.agent_state is not None:
            # Net of refunds: the latest word counts.
            self.agent_restarts[pod.uid] = pod.agent_state.restart_count


class LocalRunner:
    def __init__(self, job: api.DDPJob, manifest: Path, args: argparse.Namespace) -> None:
        self.manifest = manifest.resolve()
        self.job = job.model_copy(
            update={"metadata": job.metadata.model_copy(update={"uid": f"local-{os.getpid()}"})}
        )
        stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        default_dir = Path(".ddpjob") / "runs" / f"{job.name}-{stamp}-{os.getpid()}"
        self.run_dir = Path(args.run_dir or default_dir).resolve()
        self.network = builders.Network(
            rdzv_host="127.0.0.1",
            rdzv_port=free_port(),
            state_dir=str(self.run_dir / "state"),
            directory_base=free_port_run(job.spec.effective_max),
        )
        self.secret_values = {
            # One store key per run, which every pod of it gets (the job's store-key Secret).
            (builders.store_key_secret_name(job.name), builders.STORE_KEY_ENTRY): (
                secrets.token_urlsafe(32)
            )
        }
        self.chaos_interval: float | None = args.chaos
        self.chaos_kind: str = args.chaos_kind or "kill"
        self.chaos_thaw: float | None = args.chaos_thaw
        self.chaos_node_lost_after: float | None = args.chaos_node_lost_after
        self.chaos_left: int = args.chaos_faults
        self.random = random.Random(args.seed)  # noqa: S311 - chaos timing, not cryptography
        self.pods: dict[str, LocalPod] = {}
        self.attempts: dict[int, int] = {}
        self.progress = Progress()
        self.view: View = make_view(plain=args.plain)
        self.interrupts = 0
        self.mtime = self.manifest.stat().st_mtime
        self.started = time.monotonic()
        self.next_chaos = self._chaos_due(self.started)
        bin_dir = str(Path(sys.executable).parent)
        self.base_env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1",
            "DDPJOB_RUN_DIR": str(self.run_dir),
            "DDPJOB_CKPT_DIR": os.environ.get("DDPJOB_CKPT_DIR", str(self.run_dir / "ckpt")),
        }

    # ---- set-up and bad input ------------------------------------------------------------------

    def preflight(self) -> None:
        """Resolve pod 0's env and command now: bad input fails before anything starts."""
        pod = builders.build_pod(self.job, 0, self.network)
        pod_argv(pod, pod_env(pod, self.base_env, self.secret_values))

    def _chaos_due(self, now: float) -> float | None:
        if self.chaos_interval is None:
            return None
        return now + self.chaos_interval * self.random.uniform(0.7, 1.3)

    # ---- the loop ------------------------------------------------------------------------------

    def run(self) -> int:
        for sub in ("logs", "state", "ckpt"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        become_subreaper()
        with self._signals():
            try:
                self.view.start(self.job, self.run_dir)
                return self._loop()
            finally:
                self._kill_everything()
                self.view.stop()

    def _loop(self) -> int:
        while True:
            now = time.monotonic()
            if self.interrupts:
                return self._interrupted()
            self._reload_manifest()
            decision = reconcile(self.job, self._observe(), dt.datetime.now(dt.UTC), self.network)
            self.job = self.job.model_copy(update={"status": decision.status})  # the one write
            self.progress.desired = decision.desired
            for action in decision.actions:
                self._execute(action, now)
            for event in decision.events:
                self.view.event(event)
            if self.interrupts:
                continue  # stop the pods at once, this tick's new ones included
            self._chaos(now)
            self._frozen(now)
            self._reap(now)
            self._account_progress(now)
            self.view.update(self.job, self.pods, self.progress, now - self.started)
            if self.job.status.phase.is_finished:
                self._stop_kept_pods(now)
                self._kill_frozen("the job is finished")
                if not self.pods_alive():
                    return self._finish(now)
            time.sleep(TICK_SECONDS)

    def _observe(self) -> Observed:
        for pod in self.pods.values():
            pod.refresh_state()
        return Observed(tuple(pod.observe() for pod in self.pods.values()), service=True)

    def _execute(self, action: Any, now: float) -> None:
        if isinstance(action, CreatePod):
            if self.interrupts:
                self.view.message(f"interrupted: not starting {action.name}")
                return
            attempt = self.attempts.get(action.index, 0)
            self.attempts[action.index] = attempt + 1
            self.pods[action.name] = start_pod(
                action.pod,
                action.index,
                base_env=self.base_env,
                cwd=self.manifest.parent,
                log_dir=self.run_dir / "logs",
                attempt=attempt,
                secrets=self.secret_values,
            )
        elif isinstance(action, DeletePod):
            pod = self.pods.get(action.name)
            if pod is not None and pod.uid == action.uid:
                pod.terminate(now)
                if action.force:
                    pod.kill()
        elif isinstance(action, RemoveFinalizer):
            pod = self.pods.get(action.name)
            if pod is not None and pod.uid == action.uid:
                pod.tracked = False
        elif isinstance(action, DeleteJob):
            pass  # a local job is gone when the run ends

    def _reap(self, now: float) -> None:
        for name, pod in list(self.pods.items()):
            # As the API server: a deleted pod goes once its processes are gone (the kubelet
            # confirmed) and its tracking finalizer is removed.
            if pod.reap(now) and pod.deleting_since is not None and not pod.tracked:
                pod.close()
                del self.pods[name]
        self._reap_orphans()

    def _reap_orphans(self) -> None:
        """Wait for every exited child that is not a live pod's root (those ``poll()`` reaps)."""
        reap_orphans(keep={pod.process.pid for pod in self.pods.values()})

    def pods_alive(self) -> bool:
        return any(pod.all_processes() for pod in self.pods.values())

    def _account_progress(self, now: float) -> None:
        for pod in self.pods.values():
            self.progress.scan(pod)
        status = self.job.status
        whole = status.ready_replicas >= self.progress.desired
        completing = any(
            p.exit_code == 0
            or (p.agent_state is not None and p.agent_state.phase is AgentPhase.SUCCEEDED)
            for p in self.pods.values()
        )
        degraded = not whole and not completing and not status.phase.is_finished
        if self.progress.was_whole and degraded:
            self.progress.recovery_seconds += now - self.progress.last_tick
        self.progress.was_whole = self.progress.was_whole or whole
        self.progress.last_tick = now

    # ---- scaling by editing the manifest ------------------------------------------------

    def _reload_manifest(self) -> None:
        try:
            mtime = self.manifest.stat().st_mtime
        except OSError:
            return
        if mtime == self.mtime:
            return
        self.mtime = mtime
        try:
            edited = load_job_file(self.manifest)
        except DDPJobError as exc:
            self.view.message(f"ignoring the edit of {self.manifest}: {exc}")
            return
        old = self.job.spec
        if edited.spec.replicas != old.replicas:
            self.view.message(f"spec.replicas changed: {old.replicas} -> {edited.spec.replicas}")
        self.job = self.job.model_copy(update={"spec": edited.spec})

    # ---- chaos ---------------------------------------------------------------------------------

    def _chaos(self, now: float) -> None:
        if self.next_chaos is None or now < self.next_chaos or self.chaos_left <= 0:
            return
        self.next_chaos = self._chaos_due(now)
        if any(p.exit_code == 0 for p in self.pods.values()):
            return  # completing: nothing left to disrupt
        victims = [
            p
            for p in self.pods.values()
            if p.exit_code is None and p.deleting_since is None and p.frozen_since is None
        ]
        if not victims:
            return
        victim = self.random.choice(sorted(victims, key=lambda p: p.index))
        kind = self.chaos_kind
        if kind == "worker":
            pid = victim.kill_worker(self.random.choice)
            if pid is None:  # between two groups: try again soon
                self.next_chaos = now + 0.5
                return
            self.chaos_left -= 1
            self.view.message(
                f"chaos: SIGKILL the training process {pid} of {victim.name} (a crashed worker; "
                "the pod lives)"
            )
            return
        self.chaos_left -= 1
        if kind == "mixed":
            kind = self.random.choice(("kill", "freeze"))
        if kind == "freeze":
            count = victim.freeze(now)
            self.view.message(
                f"chaos: SIGSTOP the process tree of {victim.name} ({count} processes; a frozen "
                f"node: nothing answers), {self._freeze_outcome()}"
            )
            return
        victim.disruption = Reason.NODE_LOST.value
        self.view.message(f"chaos: SIGKILL the process tree of {victim.name} (a lost node)")
        victim.kill()

    def _node_lost_after(self) -> float:
        """How long a frozen pod's node stays "not ready" before it is lost (see the module)."""
        if self.chaos_node_lost_after is not None:
            return self.chaos_node_lost_after
        return float(self.job.spec.node_lost_toleration_seconds)

    def _freeze_outcome(self) -> str:
        lost_after = self._node_lost_after()
        if self.chaos_thaw is not None and self.chaos_thaw < lost_after:
            return f"SIGCONT in {self.chaos_thaw:g}s"
        return f"a lost node in {lost_after:g}s unless thawed"

    def _frozen(self, now: float) -> None:
        """Thaw frozen pods when due; a pod frozen past the toleration is a lost node."""
        lost_after = self._node_lost_after()
        for pod in self.pods.values():
            if pod.frozen_since is None:
                continue
            frozen_for = now - pod.frozen_since
            if self.chaos_thaw is not None and frozen_for >= self.chaos_thaw:
                pod.thaw()
                self.view.message(
                    f"chaos: SIGCONT the process tree of {pod.name} (frozen {frozen_for:.1f}s: "
                    "the node is back)"
                )
            elif frozen_for >= lost_after:
                if pod.disruption is None:
                    pod.disruption = Reason.NODE_LOST.value
                self.view.message(
                    f"chaos: {pod.name} frozen {frozen_for:.1f}s, past the node-lost toleration "
                    f"({lost_after:g}s): SIGKILL the process tree (a lost node)"
                )
                pod.kill()

    def _kill_frozen(self, why: str) -> None:
        """SIGKILL the frozen pods: SIGTERM would wait, pending, until they are continued."""
        for pod in self.pods.values():
            if pod.frozen_since is not None:
                self.view.message(
                    f"{why}: SIGKILL the process tree of {pod.name} (frozen: it cannot stop "
                    "gracefully)"
                )
                pod.kill()

    # ---- stopping --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        def interrupt(signum: int, _: FrameType | None) -> None:
            # Only count: the loop acts on it. Acting here would race with a CreatePod being
            # carried out (and printing from a handler can fail on a reentrant write).
            self.interrupts += 1

        previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _interrupted(self) -> int:
        """SIGTERM every pod and wait for them (their grace at most); a 2nd signal SIGKILLs."""
        self.view.message("stopping: SIGTERM to every pod (Ctrl-C again to kill now)")
        while True:
            now = time.monotonic()
            if self.interrupts > 1:
                self.view.message("second interrupt: SIGKILL to every process of the job")
                self._kill_everything()
                break
            for pod in self.pods.values():
                pod.terminate(now)  # once per pod: a no-op for the ones already deleting
            self._kill_frozen("stopping")
            if self._stopping(now):
                break
            time.sleep(TICK_SECONDS)
        self.view.message("interrupted: every process of the job is stopped")
        return EXIT_INTERRUPTED

    def _stopping(self, now: float) -> bool:
        for pod in self.pods.values():
            pod.reap(now)
        self._reap_orphans()
        return not self.pods_alive()

    def _stop_kept_pods(self, now: float) -> None:
        """The job is finished: stop the pods its cleanPodPolicy keeps (a cluster would not)."""
        kept = [p for p in self.pods.values() if p.exit_code is None and p.deleting_since is None]
        if not kept:
            return
        names = ", ".join(sorted(p.name for p in kept))
        self.view.message(
            f"cleanPodPolicy {self.job.spec.clean_pod_policy.value} keeps {names} on a cluster; "
            "a local run cannot outlive its runner: stopping them (SIGTERM)"
        )
        for pod in kept:
            pod.terminate(now)

    def _kill_everything(self) -> None:
        for pod in self.pods.values():
            pod.kill()
        for pod in self.pods.values():
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                pod.process.wait(timeout=5)
            pod.close()
        with contextlib.suppress(psutil.Error):
            orphans = psutil.Process().children(recursive=True)
            signal_all(orphans, signal.SIGKILL)
            psutil.wait_procs(orphans, timeout=5)
        self._reap_orphans()

    # ---- the end -------------------------------------------------------------------------------

    def _finish(self, now: float) -> int:
        status = self.job.status
        failures = status.failures
        lines = [
            f"DDPJob {self.job.name} {status.phase.value} in {now - self.started:.1f}s",
            f"  pods replaced: {status.restarts}"
            + (f" ({', '.join(f'{f.pod} {f.reason}' for f in failures)})" if failures else ""),
            f"  worker restarts inside pods: {sum(self.progress.agent_restarts.values())}",
            f"  time lost to recovery: {self.progress.recovery_seconds:.1f}s",
            f"  last step: {self.progress.step if self.progress.step is not None else 'none seen'}",
            f"  logs: {self.run_dir / 'logs'}",
        ]
        if status.phase is api.JobPhase.FAILED:
            condition = next((c for c in status.conditions if c.type == "Failed"), None)
            if condition is not None:
                lines.insert(1, f"  reason: {condition.reason}: {condition.message}")
            for failure in failures[-3:]:
                lines.append(f"  {failure.pod} failed with {failure.reason}: {failure.message}")
        self.view.summary("\n".join(lines), ok=status.phase is api.JobPhase.SUCCEEDED)
        return EXIT_OK if status.phase is api.JobPhase.SUCCEEDED else EXIT_JOB_FAILED


def run_job(args: argparse.Namespace) -> int:
    manifest = Path(args.manifest)
    job = load_job_file(manifest)
    runner = LocalRunner(job, manifest, args)
    runner.preflight()
    return runner.run()
