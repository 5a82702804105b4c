"""The training-state API under ``ddpjob-agent`` with real processes (2 workers, gloo): a worker
SIGKILLed mid-run, the restarted workers resume at the last committed step from the in-memory
snapshots in the agent's directory, and a rank whose snapshot file is gone receives the state
from the other by broadcast. The agent removes the directory when it exits."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness.agents import Cluster, descendants, wait_until

MakeCluster = Callable[..., Cluster]

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "harness" / "snap_train.py"
REPO = Path(__file__).resolve().parents[2]


def records(text: str, kind: str, prefix: str = "SNAP") -> list[dict[str, str]]:
    """The ``<prefix> <kind> key=value...`` records of a log (two workers share it: a record
    may follow another's on one line)."""
    pattern = rf"{prefix} {kind}((?: \w+=[^\s]+)+)"
    return [
        dict(item.split("=", 1) for item in match.group(1).split())
        for match in re.finditer(pattern, text)
    ]


def lines(log: Path, kind: str) -> list[dict[str, str]]:
    return records(log.read_text(errors="replace"), kind)


def standalone(
    tmp_path: Path, log: Path, script_argv: list[str], **env: str
) -> subprocess.Popen[bytes]:
    """``ddpjob-agent --standalone`` with 2 workers of ``script_argv``, appending to ``log``,
    in a session of its own; no warm spares (two cores: none competing with the workers)."""
    environ = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DDPJOB_WARM_WORKERS": "0",
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "worker"), str(REPO), os.environ.get("PYTHONPATH", "")]
        ),
        **env,
    }
    argv = [
        sys.executable,
        "-m",
        "ddpjob_worker.agent.cli",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    argv += ["--max-restarts", "1", "--monitor-interval", "0.1", *script_argv]
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            start_new_session=True,
        )


def committed_on_both(agent: subprocess.Popen[bytes], log: Path, step: int) -> bool:
    if agent.poll() is not None:
        raise AssertionError(f"the agent exited {agent.returncode} early:\n{log.read_text()}")
    return {c["rank"] for c in lines(log, "committed") if int(c["step"]) >= step} == {"0", "1"}


def test_a_killed_worker_resumes_from_the_survivors_snapshot(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    agent = standalone(tmp_path, log, [str(SCRIPT), "--steps", "30", "--drop-on-restart", "1"])
    try:
        wait_until("step 8 committed on both ranks", lambda: committed_on_both(agent, log, 8), 60)
        starts = lines(log, "start")
        victim = next(int(s["pid"]) for s in starts if s["rank"] == "1")
        snap_dir = Path(starts[0]["dir"])
        assert snap_dir.is_dir() and snap_dir.name.startswith("ddpjob-")
        os.kill(victim, signal.SIGKILL)
        before = max(int(c["step"]) for c in lines(log, "committed"))
        assert agent.wait(60) == 0, log.read_text()
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    text = log.read_text()
    resumed = {r["rank"]: r for r in lines(log, "resumed") if r["source"] != "none"}
    assert set(resumed) == {"0", "1"}, text
    step = int(resumed["0"]["step"])
    assert int(resumed["1"]["step"]) == step
    # Committed before the kill (printed after the write): at most one step lost.
    assert before - 1 <= step <= before + 1, (before, step)
    assert resumed["0"]["source"] == resumed["1"]["source"] == "0"
    assert (resumed["0"]["local"], resumed["1"]["local"]) == ("1", "0")  # rank 1 received it
    # The state both resumed with (model and optimizer, read or received) is the one the
    # ranks had when they committed that step before the kill.
    had = {c["sum"] for c in lines(log, "committed") if int(c["step"]) == step}
    assert len(had) == 1 and {resumed["0"]["sum"], resumed["1"]["sum"]} == had, (had, resumed)
    done = lines(log, "done")
    assert [d["step"] for d in done] == ["30", "30"], text
    assert done[0]["sum"] == done[1]["sum"]
    assert not snap_dir.exists(), "the agent left its snapshot directory behind"
    ms = sorted(float(c["ms"]) for c in lines(log, "committed"))
    print(f"snapshot write: median {ms[len(ms) // 2]:.2f} ms, max {ms[-1]:.2f} ms")


def test_a_worker_hung_in_user_code_ends_the_round_once_and_the_job_resumes_at_its_step(
    make_cluster: MakeCluster, tmp_path: Path
) -> None:
    # Three agents, one worker each; rank 2 deadlocks in step 10 before its backward, while
    # its agent and both peers live (so nothing closes, nothing is silent). Ranks 0 and 1
    # wait in step 10's all-reduce; the hub sees that from the workers' progress records and
    # ends the round after the floor threshold (the steps are short), long before gloo's
    # 30-minute timeout, naming node 2: its agent kills its worker and charges the restart to
    # itself, and all three form the next round at once (one restart, nobody cut). Everyone
    # resumes at step 10 from the in-memory snapshots.
    cluster = make_cluster(min_nodes=2, max_nodes=3)
    marker = tmp_path / "hung-once"
    args = ["--steps", "40", "--step-sleep", "0.05", "--hang-at", "10", "--hang-rank", "2"]
    args += ["--hang-marker", str(marker)]
    nodes = [
        cluster.start(i, args, script=SCRIPT, env={"DDPJOB_WARM_WORKERS": "0"}) for i in range(3)
    ]
    wait_until("rank 2 hanging in step 10", lambda: "SNAP hanging" in nodes[2].text(), 120)
    for node in nodes:
        assert node.wait_exit(180) == 0, cluster.logs()
    text = "".join(node.text() for node in nodes)
    hung = re.findall(r"hold round [\d.]+ up: .*\(hung\): (\S+)", text)
    assert len(hung) == 1, cluster.logs()  # one verdict, on node 2's member alone
    assert "cutting" not in text, cluster.logs()
    assert "round 1.0 is over (failure, hung): forming round 1" in text, cluster.logs()
    assert "round 1.1 formed with 3 members" in text and "round 1.2" not in text, cluster.logs()
    assert "charged to this node" in nodes[2].text() and "charged to this node" not in (
        nodes[0].text() + nodes[1].text()
    ), cluster.logs()
    assert [node.text().count("SNAP start") for node in nodes] == [2, 2, 2], cluster.logs()
    assert [h["rank"] for h in records(text, "hanging")] == ["2"]
    # Node 0's first worker committed steps 0-9 (printed as 1-10), then waited in step 10.
    first = nodes[0].text().split("SNAP start")[1]
    assert max(int(c["step"]) for c in records(first, "committed")) == 10, cluster.logs()
    resumed = [r for r in records(text, "resumed") if r["source"] != "none"]
    assert resumed, cluster.logs()
    assert {int(r["step"]) for r in resumed} == {10}, resumed  # no step lost, none redone twice
    had = {c["sum"] for c in records(first, "committed") if c["step"] == "10"}
    assert len(had) == 1 and {r["sum"] for r in resumed} == had, (had, resumed)
    done = records(text, "done")
    assert {d["step"] for d in done} == {"40"}, cluster.logs()
    assert len({d["sum"] for d in done}) == 1  # the same model on every rank
    cluster.assert_clean()


EXAMPLE = REPO / "examples" / "train.py"


def example_agent(tmp_path: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """2 workers of examples/train.py on the training-state API, as pod 0 of a job
    (``DDPJOB_POD_INDEX``), checkpoints in ``tmp_path/ckpt``."""
    argv = [str(EXAMPLE), "--snapshots", "--steps", "30", "--ckpt-every", "5"]
    argv += ["--ckpt-dir", str(tmp_path / "ckpt"), *args]
    return standalone(tmp_path, log, argv, DDPJOB_POD_INDEX="0")


def test_the_example_on_the_api_loses_no_step_to_a_crash_and_falls_back_to_its_checkpoint(
    tmp_path: Path,
) -> None:
    log = tmp_path / "agent.log"
    # A worker exits 1 before step 12: both restart from the snapshots at step 12.
    agent = example_agent(tmp_path, log, "--crash-once-on-pod", "0", "--crash-step", "12")
    try:
        assert agent.wait(120) == 0, log.read_text()
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    text = log.read_text()
    resumes = records(text, "resume", "DDPJOB")
    assert sorted((r["rank"], r["step"], r["from"]) for r in resumes) == [
        ("0", "0", "none"),
        ("0", "12", "snapshot"),
        ("1", "0", "none"),
        ("1", "12", "snapshot"),
    ], text
    steps = sorted((int(r), int(s)) for s, r in re.findall(r"DDPJOB step=(\d+) rank=(\d+)", text))
    # Every step once on each rank: none lost, none trained twice.
    assert steps == [(rank, step) for rank in (0, 1) for step in range(30)], text
    assert [d["steps"] for d in records(text, "done", "DDPJOB")] == ["30", "30"]

    # The agent SIGKILLed with its workers: its snapshots are gone with it (a new agent has a
    # directory of its own), so the next one resumes from the last checkpoint on disk.
    (tmp_path / "ckpt" / "state.pt").unlink()
    log2 = tmp_path / "agent2.log"
    agent = example_agent(tmp_path, log2, "--step-sleep", "0.4")
    try:
        # Killed 2 s (5 steps) before its next checkpoint at the latest.
        wait_until("the checkpoint of step 15", lambda: "ckpt step=15" in log2.read_text(), 90)
        victims = [agent.pid, *descendants(agent.pid)]  # the pod whole: torch's workers
        os.killpg(agent.pid, signal.SIGKILL)  # run in sessions of their own
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        agent.wait()
        for left in Path("/dev/shm").glob(f"ddpjob-*-{agent.pid}"):  # its own run: nobody sweeps
            shutil.rmtree(left)
        ckpts = [int(c["step"]) for c in records(log2.read_text(), "ckpt", "DDPJOB")]
        agent = example_agent(tmp_path, log2)
        assert agent.wait(120) == 0, log2.read_text()
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    text = log2.read_text()
    last = max(ckpts)
    resumed = [r for r in records(text, "resume", "DDPJOB") if r["from"] != "none"]
    assert sorted((r["rank"], r["step"], r["from"]) for r in resumed) == [
        ("0", str(last), "checkpoint"),
        ("1", str(last), "checkpoint"),
    ], text
    assert [d["steps"] for d in records(text, "done", "DDPJOB")] == ["30", "30"]
