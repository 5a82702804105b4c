"""The training-state API under ``ddpjob-agent`` with real processes (2 workers, gloo): a worker
SIGKILLed mid-run, the restarted workers resume at the last committed step from the in-memory
snapshots in the agent's directory, and a rank whose snapshot file is gone receives the state
from the other by broadcast. The agent removes the directory when it exits."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import wait_until

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("snap_train.py")
REPO = Path(__file__).resolve().parents[2]


def lines(log: Path, kind: str) -> list[dict[str, str]]:
    """The ``SNAP <kind>`` records of the log (two workers share it: a record may follow
    another's on one line)."""
    pattern = rf"SNAP {kind}((?: \w+=[^\s]+)+)"
    text = log.read_text(errors="replace")
    return [
        dict(item.split("=", 1) for item in match.group(1).split())
        for match in re.finditer(pattern, text)
    ]


def committed_on_both(agent: subprocess.Popen[bytes], log: Path, step: int) -> bool:
    if agent.poll() is not None:
        raise AssertionError(f"the agent exited {agent.returncode} early:\n{log.read_text()}")
    return {c["rank"] for c in lines(log, "committed") if int(c["step"]) >= step} == {"0", "1"}


def test_a_killed_worker_resumes_from_the_survivors_snapshot(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "DDPJOB_WARM_WORKERS": "0",  # two cores: no spares competing with the workers
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "worker"), str(REPO), os.environ.get("PYTHONPATH", "")]
        ),
    }
    argv = [
        sys.executable,
        "-m",
        "ddpjob_worker.cli",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.1",
        str(SCRIPT),
        "--steps",
        "30",
        "--drop-on-restart",
        "1",
    ]
    with log.open("wb") as out:
        agent = subprocess.Popen(
            argv,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            start_new_session=True,
        )
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
    done = lines(log, "done")
    assert [d["step"] for d in done] == ["30", "30"], text
    assert done[0]["sum"] == done[1]["sum"]
    assert not snap_dir.exists(), "the agent left its snapshot directory behind"
    ms = sorted(float(c["ms"]) for c in lines(log, "committed"))
    print(f"snapshot write: median {ms[len(ms) // 2]:.2f} ms, max {ms[-1]:.2f} ms")
