"""A training image needs only the agent: ``pip install ddpjob[worker]`` in a fresh venv.

It must bring torch and nothing of the operator side (kopf, the kubernetes client, pydantic,
rich), and ``ddpjob-agent --help`` must work there. This builds the real wheel and installs it,
so it also checks the packaging (torch comes from the pinned CPU build, see constraints.txt).
"""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPERATOR_SIDE = {"kopf", "kubernetes", "pydantic", "rich", "pyyaml", "psutil"}

pytestmark = pytest.mark.slow


def test_worker_extra_installs_the_agent_without_the_operator(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    install = subprocess.run(  # noqa: PLW1510 - the return code is asserted with stderr
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "-c",
            str(ROOT / "constraints.txt"),
            f"{ROOT}[worker]",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installed = {line.split("==")[0].lower() for line in listed.splitlines() if "==" in line}
    assert "torch" in installed
    assert "ddpjob" in installed
    assert not installed & OPERATOR_SIDE, sorted(installed & OPERATOR_SIDE)

    agent = subprocess.run(  # noqa: PLW1510 - asserted below
        [str(env_dir / "bin" / "ddpjob-agent"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert agent.returncode == 0, agent.stderr
    assert "--nproc-per-node" in agent.stdout and "--grace-seconds" in agent.stdout

    # The ddpjob command is there too, and says what to install instead of a traceback.
    cli = subprocess.run(  # noqa: PLW1510 - asserted below
        [str(env_dir / "bin" / "ddpjob"), "validate", "x.yaml"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 2
    assert "pip install 'ddpjob[operator]'" in cli.stderr
    assert "Traceback" not in cli.stderr
