"""A stop signal at any moment of the agent's start-up ends it: exit 143, promptly, with its
workers and spares gone (a deleted or evicted pod must not train on through its grace period and
then read as a success).

A SIGTERM raised while torch was being imported used to be swallowed by torch itself (its CUDA
preload runs under ``except Exception: pass``): the agent ran the script to its end and exited 0.
A signal before Python has
installed the handler kills the process outright (-SIGTERM here, 143 in a container's status).
The points are spread over the start-up as this machine takes it (measured first: launch to the
first step), so a slow machine is probed where its start-up really is.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpjob_worker.contract import EXIT_STOPPED_BY_SIGNAL
from tests.harness.agents import TAG_ENV, tagged_pids, wait_until

pytestmark = pytest.mark.slow

SCRIPT = """\
import time
for step in range(1200):
    print(f"step {step}", flush=True)
    time.sleep(0.1)
print("done", flush=True)
"""
"""A worker that needs no torch and runs two minutes: longer than any stop may take."""
FRACTIONS = (
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.13,
    0.16,
    0.2,
    0.25,
    0.3,
    *(n / 10 for n in range(4, 11)),
    1.2,
)
"""Where in the start-up (launch to the first step) the SIGTERM goes."""
STOP_BOUND_SECONDS = 20.0
"""How long a stopped agent may take to exit: under the default grace period (25 s), far under
the script's own two minutes."""


class Agent:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.tag = uuid.uuid4().hex
        self.script = tmp / "worker.py"
        self.script.write_text(SCRIPT)
        self.log = tmp / f"agent-{self.tag}.log"
        env = {**os.environ, TAG_ENV: self.tag, "PYTHONUNBUFFERED": "1"}
        for key in [key for key in env if key.startswith(("PET_", "DDPJOB_"))]:
            del env[key]
        env[TAG_ENV] = self.tag
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ddpjob_worker.agent.cli",
                    "--standalone",
                    "--nproc-per-node",
                    "1",
                    str(self.script),
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=tmp,
            )
        self.started = time.monotonic()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stepped(self) -> bool:
        return "step 0" in self.text()

    def kill(self) -> None:
        for pid in [self.proc.pid, *tagged_pids(self.tag)]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[Agent]]:
    started: list[Agent] = []
    yield started
    for agent in started:
        if agent.proc.poll() is None or tagged_pids(agent.tag):
            agent.kill()


@pytest.fixture(scope="module")
def startup_seconds(tmp_path_factory: pytest.TempPathFactory) -> float:
    """Launch to the first step, on this machine now (the median of 2)."""
    times = []
    for _ in range(2):
        agent = Agent(tmp_path_factory.mktemp("calibrate"))
        try:
            wait_until("the first step", agent.stepped, 120)
            times.append(time.monotonic() - agent.started)
        finally:
            agent.kill()
    return max(times)


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_a_sigterm_anywhere_in_the_start_up_ends_the_agent_with_143(
    agents: list[Agent], tmp_path: Path, startup_seconds: float, fraction: float
) -> None:
    agent = Agent(tmp_path)
    agents.append(agent)
    time.sleep(max(0.0, agent.started + fraction * startup_seconds - time.monotonic()))
    sent = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    try:
        code = agent.proc.wait(STOP_BOUND_SECONDS)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"still running {STOP_BOUND_SECONDS:g}s after a SIGTERM at "
            f"{sent - agent.started:.2f}s (start-up {startup_seconds:.2f}s):\n{agent.text()}"
        )
    # -SIGTERM: killed before Python installed the handler, which a container reports as 143.
    assert code in (EXIT_STOPPED_BY_SIGNAL, -signal.SIGTERM), agent.text()
    assert "done" not in agent.text().splitlines()
    wait_until("no worker or spare left", lambda: not tagged_pids(agent.tag), 10)
