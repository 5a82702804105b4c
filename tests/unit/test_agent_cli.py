"""``ddpjob-agent``'s command line: torchrun's flags and env, plus ours; exit codes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpjob_worker.agent.cli import apply_env_defaults, build_parser
from ddpjob_worker.errors import EXIT_USAGE


def test_parser_is_torchruns_with_our_flags() -> None:
    args = build_parser().parse_args(
        [
            "--nnodes=1:4",
            "--nproc-per-node=2",
            "--max-restarts=5",
            "--grace-seconds",
            "7",
            "--state-file",
            "/tmp/s.json",
            "train.py",
            "--steps",
            "3",
        ]
    )
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("1:4", "2", 5)
    assert (args.grace_seconds, args.state_file) == (7.0, "/tmp/s.json")
    assert (args.training_script, args.training_script_args) == ("train.py", ["--steps", "3"])


def test_pet_environment_variables_work_as_for_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NNODES", "2:3")
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "pod-0.svc:29400")
    monkeypatch.setenv("PET_RDZV_CONF", "is_host=false,join_timeout=30")
    args = build_parser().parse_args(["train.py"])
    assert (args.nnodes, args.rdzv_endpoint) == ("2:3", "pod-0.svc:29400")
    assert args.rdzv_conf == "is_host=false,join_timeout=30"


def test_bad_configuration_exits_with_the_usage_code() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpjob_worker.agent.cli",
            "--nnodes=3:1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:1",
            "train.py",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "min_nodes must be > 0 and <= max_nodes" in result.stderr


@pytest.mark.parametrize(
    ("before", "after"),
    [({}, "1"), ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}, "0")],
)
def test_store_sharing_is_off_unless_the_user_chose(before: dict[str, str], after: str) -> None:
    env = dict(before)
    apply_env_defaults(env)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == after


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (its ``SigCgt`` mask)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_a_sigterm_while_the_agent_starts_is_a_stop(tmp_path: Path) -> None:
    """Once the agent handles SIGTERM it is still importing torch and starting its early
    spares (seconds, longer on a loaded node): a SIGTERM then must exit 143 like any stop, not
    1 from an uncaught exception, which ``restartPolicy: ExitCode`` takes for a permanent
    failure (review finding 12)."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")
    state = tmp_path / "state.json"
    agent = subprocess.Popen(
        [sys.executable, "-m", "ddpjob_worker.agent.cli", "--nnodes=1", "--nproc-per-node=1",
         "--state-file", str(state), str(script)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not catches(agent.pid, signal.SIGTERM):
            assert agent.poll() is None and time.monotonic() < deadline, agent.stderr
            time.sleep(0.001)
        agent.send_signal(signal.SIGTERM)
        _, stderr = agent.communicate(timeout=60)
    finally:
        agent.kill()
    assert agent.returncode == 143, stderr
    assert "Traceback" not in stderr, stderr
