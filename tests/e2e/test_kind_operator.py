"""The operator end to end on a real cluster (kind): recovery, scaling, suspend, success.

The session fixtures (conftest.py) build the ``operator`` and ``worker-cpu`` images, load them
into a kind cluster and install charts/ddpjob serving the namespace ``ddpjob-e2e``. This test
runs examples/kind-cpu.yaml there (2 pods of examples/train.py on CPU with gloo, ~3 minutes of
steps, checkpoints on a hostPath directory every pod of the single node shares) and:

1. waits for it to run (``phase: Running``, ``readyReplicas: 2``) and write a checkpoint;
2. deletes a worker pod, then the master (pod 0, the rendezvous store host): each is replaced
   under the same name and the job keeps training (pod 0's replacement resumes from the
   checkpoint, not from step 0), with ``restarts: 2``, ``backoffCount: 0``, two ``Deleted``
   failures, no kubelet restart of any container, and ``PodFailed``/``CreatedPods`` Events;
3. ``kubectl scale ddpj/kind-cpu --replicas=3``, then 2: ``status.worldSize`` and the world
   size the agents report in their step lines (``DDPJOB step=N rank=R world=W``) follow;
4. suspends (every pod goes away, ``phase: Suspended``) and resumes (pods come back and resume
   from the checkpoint);
5. waits for ``Succeeded`` and checks the final status, the pods and the Events;
6. checks that every step was done once: from the first pod on, :class:`PodLogs` streams the
   trainer log of every pod of the job (``kubectl logs --follow``, one stream per pod uid, so
   the logs of the deleted, scaled-down and suspended pods are kept), and
   :func:`lineage_problems` replays every run of rank 0's worker process in the order they
   began: each resumes at the last checkpoint a rank 0 had written before it, its steps follow
   on without a gap, and the last run ends at step ``STEPS - 1`` with ``done``. The final
   lineage of completed steps is then exactly ``0..STEPS-1``, each step once. Before each
   disruption the test waits for a checkpoint past the step the last run resumed at, so each
   run must resume from a newer checkpoint than the run before it (without these waits, the
   disruptions come faster than the checkpoints, and every run resumed from the first one).

Opt-in: skipped with the reason without kind or Docker (``make e2e`` makes that a failure).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import yaml

from tests.e2e.cluster import ROOT, Doc, Installed, Kube, wait_until

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "examples" / "kind-cpu.yaml"
JOB = "kind-cpu"
STEPS = 400  # examples/kind-cpu.yaml: --steps=400
CKPT_EVERY = 20  # examples/kind-cpu.yaml: --ckpt-every=20
MIN_RANK0_RUNS = 6
"""Runs of rank 0's worker the scenario makes at least: the first, one after each pod deleted
(2), one after each scale (2), one after the resume."""
OVERLAP_SLACK = 1.0
"""Seconds by which the arrival of one run's last line may trail the next run's resume line
(each log stream has its own delivery delay; a stale rank 0 training on would trail by steps
of 0.5 s, and its steps would break the lineage anyway)."""

STEP_RE = re.compile(r"DDPJOB step=(\d+) rank=(\d+) world=(\d+)")
RESUME_RE = re.compile(r"DDPJOB resume step=(\d+) rank=(\d+) world=(\d+)")
CKPT_RE = re.compile(r"DDPJOB ckpt step=(\d+)")
DONE_RE = re.compile(r"DDPJOB done steps=(\d+)")

# Generous: a cold kind node, the init container, the agent's and the worker's `import torch`
# on a shared CI runner, and an elastic rendezvous round.
START_TIMEOUT = 600
RECOVERY_TIMEOUT = 420
FINISH_TIMEOUT = 1200


def pod_name(index: int) -> str:
    return f"{JOB}-worker-{index}"


def manifest(worker_image: str) -> str:
    """examples/kind-cpu.yaml with the image the fixtures built and loaded."""
    document = yaml.safe_load(EXAMPLE.read_text())
    spec = document["spec"]["template"]["spec"]
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        container["image"] = worker_image
    return yaml.safe_dump(document, sort_keys=False)


def is_ready(pod: Doc) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def last_step(log: str) -> tuple[int, int] | None:
    """(step, world size) of the last step line in a pod's log."""
    found = STEP_RE.findall(log)
    if not found:
        return None
    step, _rank, world = found[-1]
    return int(step), int(world)


class Job:
    def __init__(self, kube: Kube, name: str) -> None:
        self.kube = kube
        self.name = name

    def status(self) -> Doc:
        job = self.kube.get_or_none("ddpjob", self.name)
        status: Doc = (job or {}).get("status") or {}
        return status

    def pods(self) -> dict[str, Doc]:
        items = self.kube.items("pods", "-l", f"ddpjob.io/job-name={self.name}")
        return {p["metadata"]["name"]: p for p in items}

    def describe(self) -> str:
        status = {k: v for k, v in self.status().items() if k != "accountedPods"}
        pods = [
            f"{name} uid={p['metadata']['uid'][:8]} phase={p.get('status', {}).get('phase')} "
            f"ready={is_ready(p)} deleting={bool(p['metadata'].get('deletionTimestamp'))}"
            for name, p in sorted(self.pods().items())
        ]
        return f"status: {json.dumps(status, indent=1)}\npods:\n  " + "\n  ".join(pods)

    def event_reasons(self) -> dict[str, list[str]]:
        """Event reason -> messages, for the Events about this job."""
        out: dict[str, list[str]] = {}
        for event in self.kube.events_of("DDPJob", self.name):
            out.setdefault(event.get("reason", ""), []).append(event.get("message", ""))
        return out

    def patch_spec(self, **spec: object) -> None:
        self.kube.kubectl(
            "patch", f"ddpjob/{self.name}", "--type=merge", "-p", json.dumps({"spec": spec})
        )

    # ---- waits ----------------------------------------------------------------------------

    def wait_running(self, ready: int, timeout: float, **expected: object) -> Doc:
        """phase Running with ``ready`` ready pods (status and pods agree), and any other
        ``status`` fields given (``restarts=2``)."""

        def probe() -> Doc | None:
            status = self.status()
            ready_pods = [p for p in self.pods().values() if is_ready(p)]
            fields_match = all(status.get(k) == v for k, v in expected.items())
            if (
                status.get("phase") == "Running"
                and status.get("readyReplicas") == ready
                and len(ready_pods) == ready
                and fields_match
            ):
                return status
            return None

        what = f"phase Running with {ready} ready pods" + "".join(
            f", {k}={v}" for k, v in expected.items()
        )
        return wait_until(probe, timeout=timeout, what=what, describe=self.describe)

    def wait_world(self, pods: list[str], world: int, timeout: float) -> dict[str, int]:
        """Every pod's latest step line reports ``world``; returns each pod's step."""

        def probe() -> dict[str, int] | None:
            steps: dict[str, int] = {}
            for pod in pods:
                last = last_step(self.kube.logs(pod))
                if last is None or last[1] != world:
                    return None
                steps[pod] = last[0]
            return steps

        return wait_until(
            probe,
            timeout=timeout,
            what=f"step lines with world={world} from {', '.join(pods)}",
            describe=lambda: self.describe() + self._last_lines(pods),
        )

    def _last_lines(self, pods: list[str]) -> str:
        tails = []
        for pod in pods:
            lines = [line for line in self.kube.logs(pod).splitlines() if "DDPJOB" in line]
            tails.append(f"\n{pod} last DDPJOB lines: {lines[-3:]}")
        return "".join(tails)

    def assert_not_finished(self, before: str) -> None:
        phase = self.status().get("phase")
        assert phase in ("Running", "Restarting", "Pending"), (
            f"the job is {phase} before {before}: the scenario needs it still training "
            f"(raise --steps in {EXAMPLE.name}, or the machine is much faster than expected)"
        )

    def replace_pod(self, index: int, restarts_after: int) -> Doc:
        """Delete pod ``index`` (as a user would) and wait until its replacement runs
        under the same name and the job has counted it. Returns the new pod."""
        name = pod_name(index)
        old_uid = self.kube.get("pod", name)["metadata"]["uid"]
        # --wait=false: the pod is held by the ddpjob.io/pod-tracking finalizer until the
        # operator has counted it.
        self.kube.kubectl("delete", "pod", name, "--wait=false")

        def replaced() -> Doc | None:
            pod = self.kube.get_or_none("pod", name)
            if pod is not None and pod["metadata"]["uid"] != old_uid and is_ready(pod):
                return pod
            return None

        new = wait_until(
            replaced,
            timeout=RECOVERY_TIMEOUT,
            what=f"{name} replaced by a new, ready pod",
            describe=self.describe,
        )
        self.wait_running(2, RECOVERY_TIMEOUT, restarts=restarts_after)
        wait_until(
            lambda: last_step(self.kube.logs(name)),
            timeout=RECOVERY_TIMEOUT,
            what=f"a training step in the new {name}",
            describe=self.describe,
        )
        return new


def trainer_restart_counts(pods: dict[str, Doc]) -> dict[str, int]:
    counts = {}
    for name, pod in pods.items():
        for status in pod.get("status", {}).get("containerStatuses") or []:
            if status["name"] == "trainer":
                counts[name] = status["restartCount"]
    return counts


def first_resume_step(log: str) -> int | None:
    found = RESUME_RE.findall(log)
    return int(found[0][0]) if found else None


def resumed_at(kube: Kube, pod: str) -> int | None:
    """1 + the step the pod's workers first resumed at (so step 0 is still truthy), or None."""
    step = first_resume_step(kube.logs(pod))
    return None if step is None else step + 1


# ---- every step done once: the logs of every pod, and the lineage of rank 0's steps ----------


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


@pytest.fixture
def pod_logs() -> Iterator[Callable[[Kube, str, str], PodLogs]]:
    """Start a :class:`PodLogs`; every stream it opened is closed after the test."""
    started: list[PodLogs] = []

    def start(kube: Kube, job: str, job_uid: str) -> PodLogs:
        started.append(PodLogs(kube, job, job_uid).start())
        return started[-1]

    yield start
    for collector in started:
        print(collector.tails())  # shown by pytest when the test failed
        collector.close()


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


def test_recovers_scales_suspends_and_succeeds(
    ddpjob_install: Installed, pod_logs: Callable[[Kube, str, str], PodLogs]
) -> None:
    kube = ddpjob_install.kube
    job = Job(kube, JOB)
    # A reused cluster may still have the job of an earlier run.
    kube.kubectl("delete", "ddpjob", JOB, "--ignore-not-found", "--timeout=300s", timeout=330)
    kube.kubectl("apply", "-f", "-", stdin=manifest(ddpjob_install.worker_image))
    # Every pod's log, the deleted ones' too (the uid: not the pods of an earlier job's).
    logs = pod_logs(kube, JOB, kube.get("ddpjob", JOB)["metadata"]["uid"])

    # 1. It runs, and writes a checkpoint (the replacements below must resume from one).
    job.wait_running(2, START_TIMEOUT)
    job.wait_world([pod_name(0), pod_name(1)], 2, START_TIMEOUT)
    wait_until(
        lambda: any(CKPT_RE.search(kube.logs(p)) for p in (pod_name(0), pod_name(1))),
        timeout=RECOVERY_TIMEOUT,
        what="a checkpoint (DDPJOB ckpt step=...)",
        describe=job.describe,
    )

    # 2. A worker pod, then the master pod, deleted by hand: replaced, not charged.
    job.assert_not_finished("deleting a worker pod")
    job.replace_pod(1, restarts_after=1)
    logs.wait_new_checkpoint(job.describe)
    job.assert_not_finished("deleting the master pod")
    job.replace_pod(0, restarts_after=2)
    resumed = first_resume_step(kube.logs(pod_name(0)))
    assert resumed is not None and resumed > 0, (
        f"the new {pod_name(0)} should resume from the shared checkpoint, it resumed at "
        f"{resumed}:\n{kube.logs(pod_name(0))[-2000:]}"
    )
    status = job.status()
    assert status["restarts"] == 2, job.describe()
    assert status.get("backoffCount", 0) == 0, job.describe()
    failures = [(f["pod"], f["reason"], f["charged"]) for f in status.get("failures", [])]
    assert failures == [(pod_name(1), "Deleted", False), (pod_name(0), "Deleted", False)], failures
    # The operator replaces pods (restartPolicy: Never); the kubelet restarted nothing.
    assert trainer_restart_counts(job.pods()) == {pod_name(0): 0, pod_name(1): 0}
    events = job.event_reasons()
    failed_events = events.get("PodFailed", [])
    for index in (1, 0):
        assert any(
            pod_name(index) in m and "Deleted" in m and "not charged" in m for m in failed_events
        ), (index, failed_events)
    assert events.get("CreatedPods"), events

    # 3. Scaling: the scale subresource, the status and the agents agree on the world size.
    logs.wait_new_checkpoint(job.describe)
    job.assert_not_finished("scaling up")
    kube.kubectl("scale", f"ddpj/{JOB}", "--replicas=3")
    status = job.wait_running(3, RECOVERY_TIMEOUT, replicas=3, worldSize=3)
    job.wait_world([pod_name(i) for i in range(3)], 3, RECOVERY_TIMEOUT)
    logs.wait_new_checkpoint(job.describe)
    job.assert_not_finished("scaling down")
    kube.kubectl("scale", f"ddpj/{JOB}", "--replicas=2")
    wait_until(
        lambda: pod_name(2) not in job.pods(),
        timeout=RECOVERY_TIMEOUT,
        what=f"{pod_name(2)} removed by the scale-down",
        describe=job.describe,
    )
    status = job.wait_running(2, RECOVERY_TIMEOUT, replicas=2, worldSize=2)
    job.wait_world([pod_name(0), pod_name(1)], 2, RECOVERY_TIMEOUT)
    assert status["restarts"] == 2, "a scale-down is not a failure: " + job.describe()
    assert "ScalingDown" in job.event_reasons()

    # 4. Suspend: every pod goes; resume: they come back and resume from the checkpoint.
    logs.wait_new_checkpoint(job.describe)
    job.assert_not_finished("suspending")
    before = {name: p["metadata"]["uid"] for name, p in job.pods().items()}
    job.patch_spec(suspend=True)
    wait_until(
        lambda: not job.pods() and job.status().get("phase") == "Suspended",
        timeout=RECOVERY_TIMEOUT,
        what="no pods and phase Suspended",
        describe=job.describe,
    )
    assert job.status()["restarts"] == 2, "pods deleted by a suspend are not failures"
    job.patch_spec(suspend=False)
    job.wait_running(2, START_TIMEOUT, restarts=2)
    after = {name: p["metadata"]["uid"] for name, p in job.pods().items()}
    assert sorted(after) == [pod_name(0), pod_name(1)]
    assert not set(after.values()) & set(before.values()), "resumed pods must be new pods"
    for pod in after:
        step = wait_until(
            functools.partial(resumed_at, kube, pod),
            timeout=RECOVERY_TIMEOUT,
            what=f"a resume line in {pod}",
            describe=job.describe,
        )
        assert step - 1 > 0, f"{pod} resumed at step {step - 1}, not from the checkpoint"
    reasons = job.event_reasons()
    assert "Suspended" in reasons, reasons
    assert "Resumed" in reasons, reasons

    # 5. Success.
    wait_until(
        lambda: job.status().get("phase") in ("Succeeded", "Failed"),
        timeout=FINISH_TIMEOUT,
        what="the job to finish",
        describe=job.describe,
    )
    status = job.status()
    assert status["phase"] == "Succeeded", job.describe()
    assert status["restarts"] == 2, job.describe()
    assert status.get("backoffCount", 0) == 0, job.describe()
    assert status.get("succeeded") == 2, job.describe()
    assert status.get("completionTime"), job.describe()
    assert [f["reason"] for f in status.get("failures", [])] == ["Deleted", "Deleted"]
    conditions = {c["type"]: c for c in status.get("conditions", [])}
    assert conditions["Succeeded"]["status"] == "True", conditions
    # cleanPodPolicy Running (the default) keeps the finished pods, with their logs. The job
    # succeeds on its trainers' exit codes; a real kubelet gives the pod its terminal phase a
    # moment later (it stops the sandbox first: seen 1-2 s on kind), so wait for the phase.
    pods = job.pods()
    assert sorted(pods) == [pod_name(0), pod_name(1)], job.describe()
    pods = wait_until(
        lambda: (
            found
            if sorted(found := job.pods()) == [pod_name(0), pod_name(1)]
            and all(p.get("status", {}).get("phase") == "Succeeded" for p in found.values())
            else None
        ),
        timeout=RECOVERY_TIMEOUT,
        what="both finished pods kept, with phase Succeeded",
        describe=job.describe,
    )
    for name in pods:
        done = DONE_RE.search(kube.logs(name))
        assert done is not None and int(done.group(1)) == STEPS, f"{name}: no `DDPJOB done`"
    reasons = job.event_reasons()
    for reason in ("PodFailed", "CreatedPods", "ScalingDown", "Suspended", "Resumed", "Succeeded"):
        assert reason in reasons, (reason, sorted(reasons))
    assert len(reasons["PodFailed"]) == 2, reasons["PodFailed"]

    # 6. Every step done once: the lineage of rank 0's runs, over every pod the job had.
    logs.finish()
    runs = [run for log in logs.logs.values() for run in rank0_runs(log)]
    summary = "\n".join(str(run) for run in sorted(runs, key=lambda run: run.began))
    assert len(runs) >= MIN_RANK0_RUNS, (
        f"{len(runs)} runs of rank 0 in the logs of {len(logs.logs)} pods, the scenario makes "
        f"at least {MIN_RANK0_RUNS}: logs were lost\n{summary}\n{logs.describe()}"
    )
    problems = lineage_problems(runs, STEPS, CKPT_EVERY)
    assert not problems, (
        "not every step done once:\n  " + "\n  ".join(problems)
        + f"\nruns of rank 0, in order:\n{summary}\n{logs.describe()}"
    )  # fmt: skip
    print(f"every step done once over {len(runs)} runs of rank 0:\n{summary}")

    # Only on success: a failed run keeps the job for the diagnostics dump (conftest.py).
    kube.kubectl("delete", "ddpjob", JOB, "--timeout=300s", timeout=330)
