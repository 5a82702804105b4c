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

import functools
import json
from collections.abc import Callable, Iterator

import pytest
import yaml

from tests.harness.kubectl import ROOT, Doc, Installed, Kube, wait_until
from tests.harness.podlogs import (
    CKPT_RE,
    DONE_RE,
    RECOVERY_TIMEOUT,
    RESUME_RE,
    STEP_RE,
    PodLogs,
    lineage_problems,
    rank0_runs,
)

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "examples" / "kind-cpu.yaml"
JOB = "kind-cpu"
STEPS = 400  # examples/kind-cpu.yaml: --steps=400
CKPT_EVERY = 20  # examples/kind-cpu.yaml: --ckpt-every=20
MIN_RANK0_RUNS = 6
"""Runs of rank 0's worker the scenario makes at least: the first, one after each pod deleted
(2), one after each scale (2), one after the resume."""


# Generous: a cold kind node, the init container, the agent's and the worker's `import torch`
# on a shared CI runner, and an elastic rendezvous round.
START_TIMEOUT = 600
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
