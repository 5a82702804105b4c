"""`ddpjob run` end to end: real processes, real torch (gloo on CPU), real SIGKILLs and SIGSTOPs.

Each test runs the `ddpjob` CLI as a user would, drives it (kills pods, edits the manifest,
sends Ctrl-C, asks for chaos), and asserts on exit codes, the summary, and the training script's step logs.
No test sleeps blindly: every wait polls for a log line or an exit, with a bound.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.harness.agents import processes_with_env

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
BIN = Path(sys.executable).parent
DDPJOB = shutil.which("ddpjob", path=str(BIN)) or "ddpjob"
STEP = re.compile(r"DDPJOB step=(\d+) rank=(\d+) world=(\d+)")
RESUME = re.compile(r"DDPJOB resume step=(\d+) rank=(\d+) world=(\d+)")

pytestmark = pytest.mark.slow


def manifest(
    tmp: Path,
    *,
    replicas: int = 2,
    low: int = 1,
    high: int = 3,
    steps: int = 120,
    ckpt_every: int = 10,
    sleep: float = 0.05,
    extra_args: tuple[str, ...] = (),
    command: str = "ddpjob-agent",
    **spec: Any,
) -> Path:
    document = {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": "itest"},
        "spec": {
            "replicas": replicas,
            "minReplicas": low,
            "maxReplicas": high,
            "nprocPerNode": 1,
            "maxRestarts": 3,
            "backoffLimit": 3,
            # A charged failure's replacement waits 1 s, not 10 s (test_crash_loop_backs_off).
            "podBackoff": {"initialDelaySeconds": 1, "maxDelaySeconds": 2},
            **spec,
            "template": {
                "spec": {
                    "terminationGracePeriodSeconds": 10,
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "unused-locally",
                            "command": [command],
                            "args": [
                                str(TRAIN),
                                "--steps",
                                str(steps),
                                "--ckpt-every",
                                str(ckpt_every),
                                "--step-sleep",
                                str(sleep),
                                *extra_args,
                            ],
                        }
                    ],
                }
            },
        },
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


class Run:
    """One `ddpjob run` process and its run directory."""

    def __init__(self, path: Path, run_dir: Path, *extra: str) -> None:
        self.run_dir = run_dir
        self.out = (run_dir.parent / "ddpjob-run.out").open("w+")
        self.process = subprocess.Popen(
            [DDPJOB, "run", str(path), "--plain", "--run-dir", str(run_dir), *extra],
            stdout=self.out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def output(self) -> str:
        self.out.flush()
        return Path(self.out.name).read_text()

    def diagnosis(self) -> str:
        """The runner's output, the end of every pod's log, and where each live process of the
        run is (py-spy, native frames too: a hang in torch's C++ shows only there): what a hang
        needs to be understood after the fact."""
        parts = [self.output()]
        for name, text in self.logs().items():
            tail = "\n".join(text.splitlines()[-40:])
            parts.append(f"--- {name} (last 40 lines)\n{tail}")
        spy = shutil.which("py-spy", path=str(BIN)) or ""
        for line in leftovers(self.run_dir) if spy else []:
            pid = line.split(":")[0]
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                dump = subprocess.run(
                    [spy, "dump", "--native", "--pid", pid],
                    check=False,
                    capture_output=True,
                    text=True,
                    timeout=20,
                )
                parts.append(f"--- py-spy dump of {line}\n{dump.stdout}{dump.stderr}")
        return "\n".join(parts)

    def logs(self) -> dict[str, str]:
        logs = sorted((self.run_dir / "logs").glob("*.log"), key=lambda p: p.stat().st_mtime)
        return {p.name: p.read_text(errors="replace") for p in logs}

    def steps(self) -> list[tuple[int, int, int]]:
        found: list[tuple[int, int, int]] = []
        for text in self.logs().values():
            found += [tuple(map(int, m.groups())) for m in STEP.finditer(text)]  # type: ignore[misc]
        return found

    def max_step(self) -> int:
        return max((s for s, _, _ in self.steps()), default=-1)

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            if self.process.poll() is not None:
                raise AssertionError(
                    f"ddpjob run exited ({self.process.returncode}) before {what}:\n"
                    f"{self.diagnosis()}"
                )
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}:\n{self.diagnosis()}")

    def wait(self, timeout: float = 150) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"ddpjob run did not finish in {timeout}s:\n{self.diagnosis()}"
            ) from None

    def pod_processes(self, index: int) -> list[psutil.Process]:
        """The pod's whole tree: the trainer command and every descendant."""
        for child in psutil.Process(self.process.pid).children():
            with contextlib.suppress(psutil.Error):
                if child.environ().get("DDPJOB_POD_INDEX") == str(index):
                    return [child, *child.children(recursive=True)]
        raise AssertionError(f"pod {index} is not running")

    def kill_pod(self, index: int) -> None:
        for process in self.pod_processes(index):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def zombie_children(pid: int) -> list[int]:
    """The <defunct> children of a process (reaped ones are gone)."""
    found = []
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() == psutil.STATUS_ZOMBIE:
                found.append(child.pid)
    return found


def wchan(pid: int) -> str:
    """The kernel function a process sleeps in ("" if unknown)."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return ""


def leftovers(run_dir: Path) -> list[str]:
    """Processes, anywhere on the machine, that were started for this run."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if process.environ().get("DDPJOB_RUN_DIR") == str(run_dir):
                found.append(f"{process.pid}: {' '.join(process.info['cmdline'] or [])}")
    return found


def stopped(run_dir: Path) -> list[int]:
    """Processes started for this run that are stopped (SIGSTOP: state T or t in /proc)."""
    return [
        pid
        for pid, state in processes_with_env("DDPJOB_RUN_DIR", str(run_dir))
        if state in ("T", "t")
    ]


def frozen_victim(out: str) -> tuple[str, int]:
    """The pod a freeze hit, and how many processes the runner stopped."""
    found = re.search(
        r"chaos: SIGSTOP the process tree of (itest-worker-\d+) \((\d+) processes; "
        r"a frozen node: nothing answers\)",
        out,
    )
    assert found, out
    return found.group(1), int(found.group(2))


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def _start(path: Path, *extra: str) -> Run:
        run = Run(path, tmp_path / "run", *extra)
        runs.append(run)
        return run

    yield _start
    for run in runs:
        if run.process.poll() is None:
            os.killpg(run.process.pid, signal.SIGKILL)
            run.process.wait()
        for line in leftovers(run.run_dir):
            pid = int(line.split(":")[0])
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        run.out.close()


def assert_clean_finish(run: Run, code: int) -> None:
    assert run.wait() == code, run.output()
    assert stopped(run.run_dir) == [], "processes of the run are left stopped"
    assert leftovers(run.run_dir) == [], "processes outlived ddpjob run"


def test_two_node_job_succeeds(tmp_path: Path, start: Callable[..., Run]) -> None:
    run = start(manifest(tmp_path, steps=40, sleep=0.0))
    assert_clean_finish(run, 0)
    out = run.output()
    assert "DDPJob itest Succeeded" in out
    assert "pods replaced: 0" in out
    assert {(s, r) for s, r, w in run.steps() if w == 2} >= {(39, 0), (39, 1)}
    assert (tmp_path / "run" / "ckpt" / "latest.pt").exists()


@pytest.mark.parametrize("victim", [1, 0], ids=["worker-pod", "master-pod"])
def test_killed_pod_is_replaced_and_training_resumes(
    tmp_path: Path, start: Callable[..., Run], victim: int
) -> None:
    every = 10
    # Steps enough that the survivor, training alone, is still at it when the replacement's
    # cold start is done.
    run = start(manifest(tmp_path, steps=300, ckpt_every=every))
    run.wait_for("step 45", lambda: run.max_step() >= 45)
    before = run.max_step()
    run.kill_pod(victim)
    replacement_log = f"itest-worker-{victim}.1.log"
    run.wait_for("the replacement", lambda: "resume" in run.logs().get(replacement_log, ""))
    # The killed agent's workers were re-parented to the runner (a child subreaper): it must
    # wait for them, no <defunct> entries stay behind while it runs.
    # (While it runs: once it exits, init inherits and reaps them, which would prove nothing.)
    run.wait_for(
        "no zombies", lambda: run.process.poll() is None and not zombie_children(run.process.pid)
    )
    assert_clean_finish(run, 0)
    out = run.output()
    assert "DDPJob itest Succeeded" in out
    assert f"pods replaced: 1 (itest-worker-{victim} ExitCode(137))" in out
    # The survivor's workers failed only because their peer died: a membership change, so its
    # agent refunded the restart it charged.
    assert "worker restarts inside pods: 0" in out
    replacement = run.logs()[replacement_log]
    resumed = [int(m.group(1)) for m in RESUME.finditer(replacement)]
    assert resumed, replacement
    # At most one checkpoint interval is redone (plus the steps in flight when it died).
    assert before - resumed[0] <= every + 1, (before, resumed)
    assert {(299, 0), (299, 1)} <= {(s, r) for s, r, _ in run.steps()}


def test_frozen_pod_is_lost_after_the_toleration_and_replaced(
    tmp_path: Path, start: Callable[..., Run]
) -> None:
    """``--chaos-kind freeze``: a silent fault. Nothing answers from the frozen pod until the
    runner, as a cluster's taint manager, gives up on its node and replaces it.

    minReplicas 2: the survivor cannot go on alone, however soon its agent notices the silent
    peer, so the job can only finish through the replacement (whatever the agent does).
    """
    path = manifest(tmp_path, low=2, steps=150, ckpt_every=10)
    chaos = ("--chaos", "4", "--chaos-kind", "freeze", "--chaos-faults", "1", "--seed", "3")
    run = start(path, *chaos, "--chaos-node-lost-after", "3")
    assert_clean_finish(run, 0)
    out = run.output()
    victim, count = frozen_victim(out)
    assert count >= 1
    assert "a lost node in 3s unless thawed" in out
    assert re.search(
        rf"chaos: {victim} frozen \d+\.\ds, past the node-lost toleration \(3s\): "
        r"SIGKILL the process tree \(a lost node\)",
        out,
    ), out
    assert "DDPJob itest Succeeded" in out
    # A lost node: replaced, backoffLimit not spent.
    assert f"pods replaced: 1 ({victim} NodeLost)" in out
    assert f"{victim}.1.log" in run.logs()
    assert {(149, 0), (149, 1)} <= {(s, r) for s, r, _ in run.steps()}


def test_chaos_worker_kills_a_training_process_and_the_pod_lives(
    tmp_path: Path, start: Callable[..., Run]
) -> None:
    """``--chaos-kind worker``: one training process SIGKILLed (a crashed or OOM-killed trainer).
    Its agent lives and restarts the group in the same pod: nothing is replaced."""
    chaos = ("--chaos", "4", "--chaos-kind", "worker", "--chaos-faults", "1", "--seed", "3")
    run = start(manifest(tmp_path, steps=150, ckpt_every=10), *chaos)
    assert_clean_finish(run, 0)
    out = run.output()
    found = re.search(
        r"chaos: SIGKILL the training process (\d+) of (itest-worker-\d+) \(a crashed worker; "
        r"the pod lives\)",
        out,
    )
    assert found, out
    assert "DDPJob itest Succeeded" in out
    assert "pods replaced: 0" in out
    assert "worker restarts inside pods: 1" in out
    # The victim's agent ran a second group in the same pod: a second resume line in its log.
    log = run.logs()[f"{found.group(2)}.0.log"]
    assert len(RESUME.findall(log)) == 2, log
    assert {(149, 0), (149, 1)} <= {(s, r) for s, r, _ in run.steps()}


def test_ctrl_c_kills_a_frozen_pod(tmp_path: Path, start: Callable[..., Run]) -> None:
    """A frozen pod would keep Ctrl-C's SIGTERM pending forever: the runner SIGKILLs it, and
    nothing of the run is left stopped (a dead machine: no thaw, a node-lost toleration that
    does not end during the test)."""
    chaos = ("--chaos", "3", "--chaos-kind", "freeze", "--chaos-faults", "1", "--seed", "3")
    run = start(manifest(tmp_path, steps=10_000), *chaos, "--chaos-node-lost-after", "600")
    run.wait_for("the freeze", lambda: "chaos: SIGSTOP" in run.output())
    victim, count = frozen_victim(run.output())
    # The message comes once the freeze is done: every process of the pod is stopped.
    processes = run.pod_processes(int(victim.rsplit("-", 1)[1]))
    assert len(processes) == count
    assert sorted(p.pid for p in processes) == sorted(stopped(run.run_dir))
    run.process.send_signal(signal.SIGINT)
    assert_clean_finish(run, 130)
    out = run.output()
    assert (
        f"stopping: SIGKILL the process tree of {victim} (frozen: it cannot stop gracefully)"
    ) in out
    assert "interrupted: every process of the job is stopped" in out


def test_scale_up_and_down_while_running(tmp_path: Path, start: Callable[..., Run]) -> None:
    path = manifest(tmp_path, steps=600, ckpt_every=10)
    run = start(path)
    run.wait_for("step 20", lambda: run.max_step() >= 20)
    scale = [DDPJOB, "scale", str(path)]
    assert subprocess.run([*scale, "3"], check=False, capture_output=True).returncode == 0
    run.wait_for("world 3", lambda: any(w == 3 for _, _, w in run.steps()), timeout=120)
    grown = run.max_step()
    assert subprocess.run([*scale, "2"], check=False, capture_output=True).returncode == 0
    run.wait_for(
        "world 2 again", lambda: any(w == 2 and s > grown for s, _, w in run.steps()), timeout=120
    )
    assert_clean_finish(run, 0)
    out = run.output()
    assert "spec.replicas changed: 2 -> 3" in out
    assert "spec.replicas changed: 3 -> 2" in out
    assert "DDPJob itest Succeeded" in out
    assert "pods replaced: 0" in out


def test_always_crashing_job_fails_after_backoff_limit(
    tmp_path: Path, start: Callable[..., Run]
) -> None:
    path = manifest(tmp_path, extra_args=("--crash-always",), maxRestarts=0, backoffLimit=2)
    run = start(path)
    assert_clean_finish(run, 1)
    out = run.output()
    assert "DDPJob itest Failed" in out
    assert "BackoffLimitExceeded" in out
    assert "ExitCode(1)" in out
    assert str(tmp_path / "run" / "logs") in out


def test_crash_loop_backs_off_and_counts_in_order(
    tmp_path: Path, start: Callable[..., Run]
) -> None:
    """Issue 23: a 2-pod job whose script exits 1 after 0.5 s was Failed in 1.4 s, its first
    two failures both "2/3 of backoffLimit". Each index now waits 1 s, then 2 s, before its
    next pod, and the counts go up one by one."""
    document = {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": "crashy"},
        "spec": {
            "replicas": 2,
            "backoffLimit": 4,
            "podBackoff": {"initialDelaySeconds": 1, "maxDelaySeconds": 2},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "unused-locally",
                            "command": [sys.executable, "-c"],
                            "args": ["import time; time.sleep(0.5); raise SystemExit(1)"],
                        }
                    ]
                }
            },
        },
    }
    path = tmp_path / "crashy.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    run = start(path)
    assert_clean_finish(run, 1)
    out = run.output()
    counts = re.findall(
        r"PodFailed: pod crashy-worker-\d failed \(ExitCode\(1\), charged, (\d)/4", out
    )
    # One by one, in the order they happened; the last round's two failures may be seen in
    # one pass (5/4 and 6/4), or the first of them may end the job (5/4).
    assert counts in (["1", "2", "3", "4", "5"], ["1", "2", "3", "4", "5", "6"]), out
    waits = re.findall(
        r"BackOff: pod (crashy-worker-\d) is re-created in \d+s, at \S+: back-off (\d+)s", out
    )
    # Each index backs off once per failure (not once per pass): 1 s, then 2 s; the failure
    # that spends the budget starts none.
    assert sorted(waits) == [
        ("crashy-worker-0", "1"),
        ("crashy-worker-0", "2"),
        ("crashy-worker-1", "1"),
        ("crashy-worker-1", "2"),
    ], out
    assert "BackoffLimitExceeded" in out
    took = re.search(r"DDPJob crashy Failed in ([\d.]+)s", out)
    assert took is not None, out
    # Three runs of 0.5 s with waits of 1 s and 2 s between them: 4.5 s at the least.
    assert float(took.group(1)) >= 4.0, out
    assert sorted(run.logs()) == [f"crashy-worker-{i}.{n}.log" for i in (0, 1) for n in (0, 1, 2)]


def test_ctrl_c_stops_every_process(tmp_path: Path, start: Callable[..., Run]) -> None:
    run = start(manifest(tmp_path, steps=10_000))
    run.wait_for("training", lambda: run.max_step() >= 5)
    run.process.send_signal(signal.SIGINT)
    assert_clean_finish(run, 130)
    assert "interrupted" in run.output()


def test_second_ctrl_c_forces(tmp_path: Path, start: Callable[..., Run]) -> None:
    run = start(manifest(tmp_path, steps=10_000))
    run.wait_for("training", lambda: run.max_step() >= 5)
    run.process.send_signal(signal.SIGINT)
    run.process.send_signal(signal.SIGINT)
    assert_clean_finish(run, 130)


def test_ctrl_c_while_a_pod_starts_stops_it_and_starts_no_more(
    tmp_path: Path, start: Callable[..., Run]
) -> None:
    """Ctrl-C lands in the middle of carrying out the first tick's CreatePods.

    Pod 0's log is a FIFO, so the runner blocks opening it, inside the CreatePod of pod 0, until
    the test opens the other end, after the SIGINT. The pod started in that tick is SIGTERMed
    too, and pod 1 never starts.
    """
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    fifo = logs / "itest-worker-0.0.log"
    os.mkfifo(fifo)
    run = start(manifest(tmp_path, steps=10_000))
    run.wait_for("pod 0's log open", lambda: wchan(run.process.pid) == "wait_for_partner")
    run.process.send_signal(signal.SIGINT)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert_clean_finish(run, 130)
    finally:
        os.close(reader)
    assert "interrupted" in run.output()
    assert sorted(p.name for p in logs.glob("*.log")) == [fifo.name], "pod 1 was started"


def test_failed_job_with_clean_pod_policy_none_ends(
    tmp_path: Path, start: Callable[..., Run]
) -> None:
    """On a cluster, cleanPodPolicy None keeps the pods; a local run stops them and ends."""
    path = manifest(tmp_path, steps=10_000, activeDeadlineSeconds=3, cleanPodPolicy="None")
    run = start(path)
    assert_clean_finish(run, 1)
    out = run.output()
    assert "DDPJob itest Failed" in out
    assert "DeadlineExceeded" in out
    assert "cleanPodPolicy None keeps" in out


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such file"),
        ("yaml", "malformed YAML"),
        ("spec", "spec: minReplicas (3) must be <= replicas (2)"),
        ("command", "'no-such-trainer' is not a command on this machine"),
    ],
)
def test_bad_input_exits_2_and_starts_nothing(tmp_path: Path, case: str, message: str) -> None:
    path = tmp_path / "job.yaml"
    if case == "yaml":
        path.write_text("spec: {replicas: [\n")
    elif case == "spec":
        manifest(tmp_path, low=3)
    elif case == "command":
        manifest(tmp_path, command="no-such-trainer")
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [DDPJOB, "run", str(path), "--plain", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert leftovers(run_dir) == []
    assert not (run_dir / "logs").exists() or not any((run_dir / "logs").iterdir())


def test_two_jobs_run_side_by_side(tmp_path: Path) -> None:
    """Each run picks its own free rendezvous port, so jobs don't clash."""
    runs = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        runs.append(Run(manifest(folder, steps=30, sleep=0.0), folder / "run"))
    try:
        for run in runs:
            assert_clean_finish(run, 0)
            assert "DDPJob itest Succeeded" in run.output()
    finally:
        for run in runs:
            if run.process.poll() is None:
                os.killpg(run.process.pid, signal.SIGKILL)
            for line in leftovers(run.run_dir):  # the pods run in sessions of their own
                with contextlib.suppress(psutil.Error):
                    psutil.Process(int(line.split(":")[0])).kill()
            run.out.close()
