"""A job's trainer logs on a cluster, and the check that every step was done once.

:class:`PodLogs` streams the trainer log of every pod of a job from each pod's start (a pod's
log is kept after the pod is gone); :func:`rank0_runs` and :func:`lineage_problems` replay
rank 0's runs in the order they began: each resumes at the newest checkpoint it could see, its
steps follow on one by one, and the final lineage is each step once.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import threading
import time
from collections.abc import Callable

from tests.harness.kubectl import Doc, Kube, wait_until

OVERLAP_SLACK = 1.0
"""Seconds by which the arrival of one run's last line may trail the next run's resume line
(each log stream has its own delivery delay; a stale rank 0 training on would trail by steps
of 0.5 s, and its steps would break the lineage anyway)."""


STEP_RE = re.compile(r"DDPJOB step=(\d+) rank=(\d+) world=(\d+)")


RESUME_RE = re.compile(r"DDPJOB resume step=(\d+) rank=(\d+) world=(\d+)")


CKPT_RE = re.compile(r"DDPJOB ckpt step=(\d+)")


DONE_RE = re.compile(r"DDPJOB done steps=(\d+)")


RECOVERY_TIMEOUT = 420


def trainer_started(pod: Doc) -> bool:
    """The trainer container runs or has run (so ``kubectl logs`` has something to stream)."""
    for status in pod.get("status", {}).get("containerStatuses") or []:
        if status["name"] == "trainer":
            state = status.get("state") or {}
            return bool(state.get("running") or state.get("terminated"))
    return False


@dataclasses.dataclass
class PodLog:
    """The trainer log of one pod (one uid), each line with the time it arrived."""

    name: str
    uid: str
    lines: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    process: subprocess.Popen[str] | None = None
    reader: threading.Thread | None = None
    errors: list[str] = dataclasses.field(default_factory=list)

    @property
    def streaming(self) -> bool:
        """Its stream is open, or its last lines are still being read."""
        return self.reader is not None and self.reader.is_alive()


class PodLogs:
    """Streams the trainer log of every pod of one job (by the job's uid), from the moment its
    trainer has started until it ends, so that pods deleted later keep their logs.

    A poll every second finds new pod uids and runs ``kubectl logs --follow`` for each: the
    whole log so far, then every new line (when a pod is replaced, its name's stream started
    before the replacement keeps reading the old container to its end). A stream that stops
    while its pod still runs is started again and skips the lines it already has.
    """

    def __init__(self, kube: Kube, job: str, job_uid: str, interval: float = 1.0) -> None:
        self.kube = kube
        self.job = job
        self.job_uid = job_uid
        self.interval = interval
        self.logs: dict[str, PodLog] = {}
        self.errors: list[str] = []
        self.stopping = threading.Event()
        self.poller = threading.Thread(target=self._run, daemon=True, name="pod-logs")

    def start(self) -> PodLogs:
        self.poller.start()
        return self

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.poll()
            except (AssertionError, subprocess.SubprocessError, ValueError) as exc:
                self.errors.append(f"poll: {exc}"[:500])  # kubectl failed once: poll again
            self.stopping.wait(self.interval)

    def poll(self) -> None:
        for pod in self.kube.items("pods", "-l", f"ddpjob.io/job-name={self.job}"):
            meta = pod["metadata"]
            owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
            if self.job_uid not in owners or not trainer_started(pod):
                continue
            log = self.logs.setdefault(meta["uid"], PodLog(meta["name"], meta["uid"]))
            if log.streaming:
                continue
            running = bool(
                next(
                    (
                        (s.get("state") or {}).get("running")
                        for s in pod["status"].get("containerStatuses") or []
                        if s["name"] == "trainer"
                    ),
                    None,
                )
            )
            if log.process is None or running:
                self._follow(log)

    def _follow(self, log: PodLog) -> None:
        if log.process is not None:
            log.errors.append(f"stream restarted after {len(log.lines)} lines")
        args = [self.kube.kubectl_bin, "--namespace", self.kube.namespace, "logs", "--follow",
                log.name, "-c", "trainer"]  # fmt: skip
        process = subprocess.Popen(
            args, env=self.kube.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        log.process = process
        log.reader = threading.Thread(
            target=self._read, args=(log, process, len(log.lines)), daemon=True
        )
        log.reader.start()

    @staticmethod
    def _read(log: PodLog, process: subprocess.Popen[str], skip: int) -> None:
        assert process.stdout is not None and process.stderr is not None
        for line in process.stdout:
            if skip:
                skip -= 1
                continue
            log.lines.append((time.monotonic(), line.rstrip("\n")))
        code = process.wait()
        error = process.stderr.read().strip()
        if code != 0 or error:
            log.errors.append(f"kubectl logs exited {code}: {error[-300:]}")

    def finish(self, timeout: float = 60.0) -> None:
        """Stop finding pods, let the streams of the pods that still exist end (their trainers
        have exited), and complete their logs from a last plain ``kubectl logs``.

        The streams of pods deleted long ago get no wait: their containers ended minutes ago,
        so they have delivered all they will (the process kubelet never ends the stream of a
        pod it forgot while streaming; a kubelet would have)."""
        self.stopping.set()
        self.poller.join(timeout=30)
        existing = {
            pod["metadata"]["uid"]: pod
            for pod in self.kube.items("pods", "-l", f"ddpjob.io/job-name={self.job}")
        }
        deadline = time.monotonic() + timeout
        for uid, log in self.logs.items():
            if log.reader is not None and uid in existing:
                log.reader.join(timeout=max(0.0, deadline - time.monotonic()))
        self.close()
        for uid in existing:
            if uid not in self.logs:
                continue
            log = self.logs[uid]
            final = self.kube.logs(log.name).splitlines()
            streamed = [line for _, line in log.lines]
            assert final[: len(streamed)] == streamed, (
                f"the stream of {log.name} ({log.uid}) is not the start of its log: the "
                f"collector mixed pods up.\nstreamed tail: {streamed[-5:]}\nlog: {final[-5:]}"
            )
            now = time.monotonic()
            log.lines += [(now, line) for line in final[len(streamed) :]]

    def close(self) -> None:
        """Stop every stream still open (at the end, or after a failure)."""
        self.stopping.set()
        for log in self.logs.values():
            if log.process is not None and log.process.poll() is None:
                log.errors.append("stream still open at the end: closed")
                log.process.kill()
                log.process.wait(timeout=30)

    def newest(self, pattern: re.Pattern[str]) -> int:
        """The highest step in the lines matching ``pattern`` (its first group) so far, or -1."""
        found = [
            int(match.group(1))
            for log in list(self.logs.values())
            for _, line in list(log.lines)
            if (match := pattern.search(line))
        ]
        return max(found, default=-1)

    def wait_new_checkpoint(self, describe: Callable[[], str]) -> int:
        """Wait for a checkpoint past the step the last run resumed at: the run after the next
        disruption must then resume from a newer checkpoint than the one before it."""
        resumed = self.newest(RESUME_RE)
        return wait_until(
            lambda: max(0, self.newest(CKPT_RE)) if self.newest(CKPT_RE) > resumed else None,
            timeout=RECOVERY_TIMEOUT,
            what=f"a checkpoint after step {resumed}, where the last run resumed",
            describe=lambda: describe() + "\n" + self.describe(),
        )

    def tails(self, lines: int = 60) -> str:
        """The last ``lines`` of every pod's log, oldest pod first (what a failed test shows:
        a pod that exited has no log left in the cluster to read)."""
        out = []
        for log in list(self.logs.values()):
            tail = [line for _, line in list(log.lines)[-lines:]]
            out.append(f"---- {log.name} uid={log.uid[:8]}, last {len(tail)} lines:")
            out.extend(tail)
        return "\n".join(out)

    def describe(self) -> str:
        out = [f"collector errors: {self.errors[-5:]}"] if self.errors else []
        for log in self.logs.values():
            out.append(
                f"{log.name} uid={log.uid[:8]}: {len(log.lines)} lines"
                + (f", {log.errors}" if log.errors else "")
            )
        return "\n".join(out)


@dataclasses.dataclass
class Rank0Run:
    """One run of rank 0's worker process: its resume line and what it logged after it."""

    pod: str
    uid: str
    resume: int
    world: int
    began: float
    """When its resume line arrived."""
    ended: float
    """When its last line arrived."""
    steps: list[int] = dataclasses.field(default_factory=list)
    worlds: set[int] = dataclasses.field(default_factory=set)
    ckpts: list[int] = dataclasses.field(default_factory=list)
    done: int | None = None

    def __str__(self) -> str:
        steps = f"{self.steps[0]}..{self.steps[-1]}" if self.steps else "none"
        done = f" done={self.done}" if self.done is not None else ""
        return (
            f"{self.pod} ({self.uid[:8]}) resume={self.resume} world={self.world} "
            f"steps={steps} ckpts={self.ckpts}{done}"
        )


def rank0_runs(log: PodLog) -> list[Rank0Run]:
    """The runs of rank 0 in one pod's log. A worker process logs its ``resume`` line first
    (nprocPerNode 1: one worker at a time per pod), so each resume line begins a run, of rank
    0 or of another rank, that lasts until the next one."""
    runs: list[Rank0Run] = []
    current: Rank0Run | None = None
    for at, line in log.lines:
        if resume := RESUME_RE.search(line):
            step, rank, world = map(int, resume.groups())
            current = Rank0Run(log.name, log.uid, step, world, at, at) if rank == 0 else None
            if current is not None:
                runs.append(current)
        elif current is None:
            continue
        elif step_line := STEP_RE.search(line):
            step, rank, world = map(int, step_line.groups())
            assert rank == 0, f"{log.name}: a rank {rank} step line in a run of rank 0: {line}"
            current.steps.append(step)
            current.worlds.add(world)
            current.ended = at
        elif ckpt := CKPT_RE.search(line):
            current.ckpts.append(int(ckpt.group(1)))
            current.ended = at
        elif done := DONE_RE.search(line):
            current.done = int(done.group(1))
            current.ended = at
    return runs


def lineage_problems(runs: list[Rank0Run], steps: int, every: int) -> list[str]:
    """Replay the runs of rank 0 in the order they began; what breaks "every step done once".

    The lineage is the list of completed steps the final model went through: a run resuming
    at checkpoint ``r`` keeps the lineage's first ``r`` steps and adds its own. Each run must
    resume at the last checkpoint a rank 0 logged before it began (the newest one it could
    see), or at the one the run before it was saving when it was stopped (its step line is
    logged before the save, the ``ckpt`` line after it); its steps must go on from there one
    by one, with a ``ckpt`` line at each multiple of ``every`` it passed; two runs must not
    overlap. At the end the lineage is exactly ``0..steps-1`` and the last run says ``done``.
    """
    problems: list[str] = []
    ordered = sorted(runs, key=lambda run: run.began)
    lineage: list[int] = []
    newest = 0  # the newest checkpoint written so far
    unlogged: int | None = None  # one the previous run may have written without logging it
    previous: Rank0Run | None = None
    for run in ordered:
        if previous is not None and previous.ended > run.began + OVERLAP_SLACK:
            problems.append(f"two rank 0s at once: [{previous}] logged until after [{run}] began")
        if run.resume != newest and run.resume != unlogged:
            could = f"{newest}" + (f" (or {unlogged}, being saved)" if unlogged else "")
            again = f": steps {run.resume}..{newest - 1} done again" if run.resume < newest else ""
            problems.append(
                f"[{run}] resumed at step {run.resume}, the last checkpoint it could see is "
                f"{could}{again}"
            )
        if run.resume > len(lineage):
            problems.append(f"[{run}]: steps {len(lineage)}..{run.resume - 1} were never done")
        if run.steps != list(range(run.resume, run.resume + len(run.steps))):
            problems.append(f"[{run}]: its steps do not follow on one by one: {run.steps}")
        if run.worlds - {run.world}:
            problems.append(f"[{run}]: step lines with world sizes {sorted(run.worlds)}")
        end = run.resume + len(run.steps)
        due = [s for s in range(run.resume + 1, end + 1) if s % every == 0 or s == steps]
        if run.ckpts == due:
            unlogged = None
        elif run.ckpts == due[:-1]:
            unlogged = due[-1]  # stopped after its step line, before or while saving
        else:
            problems.append(f"[{run}]: checkpoint lines {run.ckpts}, expected {due}")
            unlogged = None
        newest = max([newest, run.resume, *run.ckpts])
        lineage = lineage[: run.resume] + run.steps
        previous = run
    if lineage != list(range(steps)):
        twice = sorted({s for s in lineage if lineage.count(s) > 1})
        missing = sorted(set(range(steps)) - set(lineage))
        problems.append(
            f"the final lineage is not 0..{steps - 1} once each: {len(lineage)} steps, "
            f"missing {missing[:10]}{'...' if len(missing) > 10 else ''}, twice {twice[:10]}"
        )
    if ordered and (ordered[-1].done != steps or ordered[-1].steps[-1:] != [steps - 1]):
        problems.append(f"the last run of rank 0 did not finish at step {steps - 1}: {ordered[-1]}")
    finished = [run for run in ordered[:-1] if run.done is not None]
    if finished:
        problems.append(f"runs before the last one said done: {[str(r) for r in finished]}")
    return problems
