"""tests.harness.kind.docker for real: the harness's Docker daemon in a network namespace of its own,
and the reaper that tears it down when its starter dies without stopping it.

Needs root and Debian's docker.io (what ``make e2e`` needs for the offline kind); skipped with
the reason elsewhere (CI installs no Docker: the kind suite is not part of ``make test``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.harness.kind.docker import Dockerd

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("dockerd") is None,
        reason="needs root and dockerd (apt-get install docker.io)",
    ),
]


def _ip_addresses() -> str:
    return subprocess.run(["ip", "-br", "addr"], check=True, capture_output=True, text=True).stdout


def test_a_starter_killed_with_a_container_running_leaves_nothing_behind(tmp_path: Path) -> None:
    name = f"t{uuid.uuid4().hex[:6]}"
    before = _ip_addresses()
    script = tmp_path / "starter.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from pathlib import Path
            sys.path.insert(0, {str(ROOT)!r})
            from tests.harness.kind.docker import Dockerd
            daemon = Dockerd({name!r}, data_root=Path({str(tmp_path / "data")!r}))
            daemon.start()
            daemon.docker("network", "create", "probe")  # a bridge, in its namespace only
            print("UP", daemon.pid, flush=True)
            time.sleep(600)
            """
        )
    )
    starter = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    daemon = Dockerd(name, data_root=tmp_path / "data")
    try:
        assert starter.stdout is not None
        line = starter.stdout.readline()
        assert line.startswith("UP"), line
        assert daemon.netns.exists() and daemon.answers()
        assert _ip_addresses() == before, "an address appeared in the machine's namespace"
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        deadline = time.monotonic() + 60
        while daemon.leftovers() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert daemon.leftovers() == []
        assert not daemon.netns.exists()
    finally:
        if starter.poll() is None:
            starter.kill()
        daemon.stop(force=True)
