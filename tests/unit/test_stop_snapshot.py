"""A worker that is stopped, or whose step fails, writes the step it has committed
(:mod:`ddpjob_worker.train.onstop`, ``TrainState.step``): real gloo groups of two processes
(``stop_train.py``) whose periodic snapshots are 1,000 steps apart, so only that write can
hold the newest step. Also :mod:`ddpjob_worker.train.cadence`, and the agent's side
(:func:`ddpjob_worker.agent.workers.terminate`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpjob_worker.agent.workers import terminate
from ddpjob_worker.train import cadence, flat, newest, onstop
from ddpjob_worker.train.payload import tensor_bytes
from ddpjob_worker.train.snapshot import SnapshotFile
from tests.harness.agents import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("stop_train.py")


class Group:
    """``world`` ranks of ``stop_train.py``, each logging to its own file."""

    def __init__(self, tmp_path: Path, world: int, *argv: str) -> None:
        self.tmp = tmp_path
        port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(world):
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(REPO / "worker"), str(REPO)]),
                "PYTHONUNBUFFERED": "1",
                "RANK": str(rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": "stop-test",  # as torchrun or ddpjob-agent start it
            }
            with self.log(rank).open("wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(SCRIPT), "--path", str(self.path(rank)), *argv],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        cwd=tmp_path,
                    )
                )

    def log(self, rank: int) -> Path:
        return self.tmp / f"rank{rank}.log"

    def path(self, rank: int) -> Path:
        return self.tmp / f"rank{rank}.snap"

    def text(self, rank: int) -> str:
        return self.log(rank).read_text(errors="replace")

    def committed(self, rank: int) -> int:
        """The newest step ``rank`` says it committed (0: none)."""
        steps = [
            int(line.rsplit("step=", 1)[1])
            for line in self.text(rank).splitlines()
            if line.startswith("STOP committed")
        ]
        return max(steps, default=0)

    def newest(self, rank: int) -> tuple[int, dict[str, Any]]:
        """(step, state) of ``rank``'s newest snapshot."""
        snaps = SnapshotFile.open(self.path(rank), flat.page_sums)
        try:
            snap = newest(snaps)
            assert snap is not None, self.text(rank)
            return snap.step, flat.load(snap.payload)
        finally:
            snaps.close()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def torch_checksum(tree: Any) -> int:
    """CRC-32 of a state dict: its tensors' bytes and the rest's repr, in order."""
    if isinstance(tree, dict):
        return zlib.crc32(b"".join(f"{k}:{torch_checksum(v)};".encode() for k, v in tree.items()))
    if isinstance(tree, list | tuple):
        return zlib.crc32(b"".join(f"{torch_checksum(v)};".encode() for v in tree))
    if isinstance(tree, torch.Tensor):
        return zlib.crc32(tensor_bytes(tree))
    return zlib.crc32(repr(tree).encode())


def blocked(group: Group, rank: int) -> None:
    wait_until(
        f"rank {rank} blocking",
        lambda: "STOP blocking" in group.text(rank) or _died(group),
        60,
    )
    assert not _died(group), [group.text(r) for r in range(len(group.procs))]
    time.sleep(0.5)  # the other rank is in the all-reduce by now (it waits there for this one)


def stalled(tmp_path: Path, where: str) -> Group:
    """Two ranks, rank 1 stuck in step 10 (``where``: before its backward, or after its
    ``optimizer.step``), rank 0 waiting for it in the all-reduce."""
    group = Group(tmp_path, 2, "--block-at", "10", "--block-rank", "1", "--where", where)
    try:
        blocked(group, 1)
    except BaseException:
        group.close()
        raise
    return group


def _died(group: Group) -> bool:
    return any(proc.poll() is not None for proc in group.procs)


def test_a_rank_stopped_in_the_all_reduce_writes_its_committed_step_as_does_its_peer(
    tmp_path: Path,
) -> None:
    group = stalled(tmp_path, "before-backward")
    try:
        assert group.committed(0) == 10
        assert group.newest(0)[0] == 1  # the periodic snapshot: the first commit's only
        group.procs[0].send_signal(signal.SIGTERM)  # blocked in gloo: no Python handler runs
        assert group.procs[0].wait(30) == onstop.EXIT_CODE, group.text(0)
        group.procs[1].send_signal(signal.SIGTERM)  # in user code, before its backward
        assert group.procs[1].wait(30) == onstop.EXIT_CODE, group.text(1)
        step0, state0 = group.newest(0)
        step1, state1 = group.newest(1)
        assert (step0, step1) == (10, 10), (group.text(0), group.text(1))
        # DDP: the same model and optimizer on both ranks (Python's RNG is seeded per process).
        assert state0["sampler"] == state1["sampler"] == {"epoch": 0, "processed": 80, "size": 1024}
        for key in ("model", "optimizer"):
            assert torch_checksum(state0[key]) == torch_checksum(state1[key]), key
    finally:
        group.close()


def test_a_rank_stopped_past_its_optimizer_step_keeps_its_older_snapshot(tmp_path: Path) -> None:
    group = stalled(tmp_path, "after-step")
    try:
        # Rank 1 applied step 10's update and never commits it: its parameters are neither
        # step 10's nor step 11's. Rank 0 committed step 10 and waits in step 11's all-reduce.
        group.procs[1].send_signal(signal.SIGTERM)
        assert group.procs[1].wait(30) == onstop.EXIT_CODE, group.text(1)
        assert group.newest(1)[0] == 1, group.text(1)  # not the half-applied state
        assert "past its optimizer.step" in group.text(1)
        group.procs[0].kill()  # its peer is gone: it fails out of the all-reduce
        group.procs[0].wait(30)
    finally:
        group.close()


def test_a_rank_whose_peer_dies_under_the_all_reduce_writes_its_step_before_it_raises(
    tmp_path: Path,
) -> None:
    group = stalled(tmp_path, "before-backward")
    try:
        group.procs[1].kill()  # SIGKILL: its sockets close, rank 0's all-reduce fails
        code = group.procs[0].wait(60)
        assert code not in (0, onstop.EXIT_CODE), group.text(0)  # the error, raised
        assert group.newest(0)[0] == 10, group.text(0)
    finally:
        group.close()


def test_a_scripts_own_sigterm_handler_still_decides_and_the_step_is_written(
    tmp_path: Path,
) -> None:
    group = Group(tmp_path, 1, "--own-handler")
    try:
        wait_until("step 20 committed", lambda: group.committed(0) >= 20 or _died(group), 60)
        group.procs[0].send_signal(signal.SIGTERM)
        assert group.procs[0].wait(30) == 7, group.text(0)  # the script's handler: sys.exit(7)
        text = group.text(0)
        handled = [line for line in text.splitlines() if line.startswith("STOP handler")]
        assert len(handled) == 1, text
        # The handler ran between steps, or at the commit of a step past its optimizer.step
        # (held until then): the stop's snapshot holds the step committed when it ran.
        at = int(handled[0].rsplit("step=", 1)[1])
        assert at >= 20 and group.newest(0)[0] == at, text
    finally:
        group.close()


# -- the agent's side ----------------------------------------------------------------------------

SAVER = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    marker = pathlib.Path(sys.argv[1]) / str(os.getpid())
    def on_term(signum, frame):
        marker.touch()
        time.sleep(1.0)  # a snapshot being written
        marker.unlink()
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    while True:
        time.sleep(0.1)
    """
)
DEAF = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + (
    "print('ready', flush=True)\ntime.sleep(60)\n"
)


def _spawn(code: str, *argv: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        env=env,
        stdout=subprocess.PIPE,
        start_new_session=True,  # torch's workers lead process groups of their own
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def test_terminate_waits_for_a_worker_writing_its_state_and_not_for_one_that_ignores_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDPJOB_SAVING_DIR", str(tmp_path))
    env = {**os.environ}
    saver = _spawn(SAVER, str(tmp_path), env=env)
    deaf = _spawn(DEAF, env=env)
    try:
        terminate([saver, deaf], 0.2, 10.0)
        assert saver.poll() == 0  # it finished its write: the stop waited for it
        assert deaf.poll() is None  # no marker: not waited for past the limit (torch kills it)
    finally:
        for proc in (saver, deaf):
            if proc.poll() is None:
                proc.kill()
            proc.wait()


# -- the cadence ---------------------------------------------------------------------------------


def test_the_cadence_learns_the_interval_that_keeps_snapshots_at_the_budget() -> None:
    pace = cadence.Cadence(budget=0.01)
    assert pace.due(1)
    pace.wrote(1, 0.002)  # 2 ms at the commit
    assert pace.waiting
    pace.stepped(0.100)
    pace.copied(0.008)  # and 8 ms in the background: 10 ms a snapshot
    assert not pace.waiting and pace.cost() == pytest.approx(0.010)
    for _ in range(5):
        pace.stepped(0.100)
    pace.stepped(60.0)  # an evaluation between two steps: one outlier among the step times
    assert pace.typical() == pytest.approx(0.100)
    assert pace.interval == cadence.FIRST_INTERVAL  # worked out when a snapshot could be due
    # 10 ms against 1 % of a 100 ms step: one snapshot every 10 steps.
    assert not pace.due(1 + cadence.FIRST_INTERVAL)
    assert pace.interval == 10
    assert not pace.due(10) and pace.due(11)


def test_one_costly_snapshot_does_not_stop_the_snapshots() -> None:
    pace = cadence.Cadence(budget=0.01)
    for _ in range(5):
        pace.stepped(1.0)
    assert pace.due(1)
    pace.wrote(1, 4.0)  # the first: a new 2.3 GB file page-faulted in
    pace.copied(0.0)
    written = []
    for step in range(2, 200):
        if pace.due(step):
            written.append(step)
            pace.wrote(step, 0.1)  # 0.1 s against 1 % of a 1 s step: every 10 steps
            pace.copied(0.0)
    # 16, then 32 (the median of two is half the costly one), then the median is right.
    assert written[:4] == [17, 49, 59, 69], written
    assert pace.interval == 10


def test_a_fixed_cadence_and_a_bad_one() -> None:
    pace = cadence.Cadence(3)
    written = []
    for step in range(1, 12):
        if pace.due(step):
            pace.wrote(step, 0.0)
            written.append(step)
    assert written == [1, 4, 7, 10]
    with pytest.raises(ValueError, match="snapshot_every=0: give a count of steps >= 1"):
        cadence.Cadence(0)


# -- the watch, in this process ------------------------------------------------------------------


def test_the_watch_runs_beside_a_scripts_handler_and_holds_it_during_a_step() -> None:
    calls: list[str] = []
    stopped = threading.Event()

    def mine(signum: int, frame: object) -> None:
        calls.append("handler")

    def on_stop() -> None:
        calls.append("on_stop")
        stopped.set()

    previous = signal.signal(signal.SIGTERM, mine)
    past_step = [False]
    try:
        watch = onstop.install(on_stop, lambda: past_step[0])
        assert watch is not None and onstop.install(on_stop) is watch  # once per process
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.wait(10)
        wait_until("the handler", lambda: "handler" in calls, 5)
        assert sorted(calls) == ["handler", "on_stop"]  # the process lives: the script decides
        calls.clear()
        stopped.clear()
        watch.hold = lambda: past_step[0]
        past_step[0] = True  # between optimizer.step and the commit
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopped.wait(10)
        wait_until("the signal held", lambda: watch.pending is not None, 5)
        assert calls == ["on_stop"]
        watch.release()  # the commit
        assert calls == ["on_stop", "handler"] and watch.pending is None
    finally:
        onstop.uninstall()
        assert signal.getsignal(signal.SIGTERM) == mine  # the script's, as it was
        signal.signal(signal.SIGTERM, previous)


def test_no_watch_where_sigterm_is_ignored_or_the_wakeup_fd_is_taken() -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert onstop.install(lambda: None) is None
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        taken = signal.set_wakeup_fd(write_fd)
        try:
            assert onstop.install(lambda: None) is None
            assert signal.set_wakeup_fd(taken) == write_fd  # left as it was
        finally:
            os.close(read_fd)
            os.close(write_fd)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


FORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from ddpjob_worker.train import onstop
    out = Path(sys.argv[1])
    onstop.install(lambda: out.write_text("parent wrote"))
    child = os.fork()
    if child == 0:  # a DataLoader worker, say: SIGTERMed by its parent or the agent
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        os._exit(0)  # not reached: SIGTERM's default action
    _, status = os.waitpid(child, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    time.sleep(1)  # the parent's thread would have woken by now
    print("parent alive", flush=True)
    """
)


def test_a_forked_child_sigtermed_neither_wakes_nor_stops_the_parent(tmp_path: Path) -> None:
    out = tmp_path / "wrote"
    env = {**os.environ, "PYTHONPATH": str(REPO / "worker")}
    done = subprocess.run(
        [sys.executable, "-c", FORKER, str(out)],
        check=False,
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done
    assert done.stdout.decode().split("\n")[:2] == [f"child {-signal.SIGTERM}", "parent alive"]
    assert not out.exists()
