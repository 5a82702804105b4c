"""``ddpjob run``'s process layer on real processes (no torch): freezing a pod's whole tree.

The tree is built as a torch agent builds its own: a child in the root's session, and a child in
a session of its own (as torch starts its workers) with a grandchild, so a process group or a
session would miss some of it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ddpjob_operator.local.pods import ContainerProcess, spawn
from tests.harness.agents import TAG_ENV, tagged_pids, wait_until

TREE = """
import subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
subprocess.Popen(sleeper)
worker = [sys.executable, "-c", "import subprocess, sys, time; "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
          "time.sleep(600)"]
subprocess.Popen(worker, start_new_session=True)
time.sleep(600)
"""
TREE_SIZE = 4
"""The root, its child, the new-session child and that one's child."""


def proc_state(pid: int) -> str:
    """The one-letter state in ``/proc/PID/stat`` ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[ContainerProcess, str]]:
    tag = uuid.uuid4().hex
    env = {"PATH": str(Path(sys.executable).parent), TAG_ENV: tag}
    container = spawn(
        [sys.executable, "-c", TREE], env=env, cwd=tmp_path, log_path=tmp_path / "pod.log"
    )
    try:
        wait_until("the whole tree", lambda: len(tagged_pids(tag)) == TREE_SIZE, timeout=60)
        yield container, tag
    finally:
        container.kill()
        with contextlib.suppress(Exception):
            container.process.wait(timeout=10)
        container.close()


def test_freeze_stops_every_process_of_the_tree_and_thaw_continues_them(
    tree: tuple[ContainerProcess, str],
) -> None:
    container, tag = tree
    assert container.freeze(now=1.0) == TREE_SIZE
    assert container.frozen_since == 1.0
    states = {pid: proc_state(pid) for pid in tagged_pids(tag)}
    assert len(states) == TREE_SIZE
    assert set(states.values()) == {"T"}, states
    container.thaw()
    assert container.frozen_since is None
    wait_until(
        "every process continued",
        lambda: all(proc_state(pid) not in ("T", "t", "") for pid in tagged_pids(tag)),
        timeout=30,
    )
    assert len(tagged_pids(tag)) == TREE_SIZE


def test_kill_ends_a_frozen_tree_without_a_thaw(tree: tuple[ContainerProcess, str]) -> None:
    """SIGKILL needs no SIGCONT: nothing of a frozen pod is left stopped (or at all)."""
    container, tag = tree
    container.freeze(now=1.0)
    container.kill()
    assert container.frozen_since is None
    wait_until("the tree gone", lambda: container.reap(now=2.0), timeout=30)
    assert container.exit_code == 137
    wait_until("no process of the tree left", lambda: not tagged_pids(tag), timeout=30)


ORPHAN = """
import subprocess, sys, time
sleeper = "import time; time.sleep(600)"
# A grandchild whose parent exits at once: re-parented, it is no longer in the root's tree.
subprocess.run([sys.executable, "-c",
                f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleeper!r}])"])
time.sleep(600)
"""


def _orphaned(tag: str) -> bool:
    """Exactly the root and the orphan (the sleeper) are left of the ORPHAN script's tree."""
    pids = tagged_pids(tag)
    commands = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            commands.append(" ".join(psutil.Process(pid).cmdline()))
    return len(pids) == 2 and any("import time; time.sleep(600)" in c for c in commands)


def test_a_container_with_a_cgroup_kills_the_orphans_its_tree_lost(tmp_path: Path) -> None:
    """The process kubelet reads a container's members from its cgroup (``members``): an
    orphan whose parent died has left the root's tree, never the cgroup, and dies with it."""
    from tests.harness.kube.runtime import Cgroups  # noqa: PLC0415

    cgroups = Cgroups.find(f"ddpjob-test-{uuid.uuid4().hex[:8]}")
    if cgroups is None:
        pytest.skip("no writable memory cgroup on this machine")
    group = cgroups.create("orphans", None)
    assert group is not None
    tag = uuid.uuid4().hex
    env = {"PATH": str(Path(sys.executable).parent), TAG_ENV: tag}
    join = 'echo $$ > "$0" && exec "$@"'
    members = group / "cgroup.procs"
    container = spawn(
        ["/bin/sh", "-c", join, str(members), sys.executable, "-c", ORPHAN],
        env=env, cwd=tmp_path, log_path=tmp_path / "pod.log", members=members,
    )  # fmt: skip
    try:
        # Not merely two tagged processes: for a moment the root and the short-lived middle one
        # are two too, before the orphan is started.
        wait_until("the root and the orphan", lambda: _orphaned(tag), timeout=60)
        assert len(container.all_processes()) == 2
        container.kill()
        wait_until("the container gone", lambda: container.reap(now=2.0), timeout=30)
        wait_until("no process of it left", lambda: not tagged_pids(tag), timeout=30)
    finally:
        with contextlib.suppress(OSError):
            for pid in tagged_pids(tag):
                os.kill(pid, signal.SIGKILL)
        container.close()
        cgroups.remove_all()
