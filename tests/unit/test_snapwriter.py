"""Snapshots whose parameters and optimizer state are copied in the background
(:mod:`ddpjob_worker.train.snapwriter`): the slot holds the committed step though the next step ran
meanwhile, ``optimizer.step`` waits for the copy, a failed or disturbed copy is raised and never
published, and a process killed mid-copy (or one that simply exits) leaves a whole snapshot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpjob_worker.train import ElasticSampler, TrainState, flat, newest
from ddpjob_worker.train.snapshot import SnapshotError, SnapshotFile


class Ramp(torch.nn.Module):
    """One parameter that SGD (lr 1) raises by exactly 1 per step: after step k every element
    is k, so a slot holding two steps' bytes shows."""

    seen: torch.Tensor

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(numel))
        self.register_buffer("seen", torch.zeros(1))

    def forward(self) -> torch.Tensor:
        self.seen += 1  # a buffer the forward changes: copied at the commit
        return -self.weight.sum()


def make(path: Path, *, numel: int = 1 << 16, background: bool | None = True) -> TrainState:
    model = Ramp(numel)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return TrainState(
        model=model,
        optimizer=opt,
        sampler=ElasticSampler(1000, batch_size=1, shuffle=False),
        path=path,
        background=background,
        snapshot_every=1,
    )


def ramp(state: TrainState) -> Ramp:
    assert isinstance(state.model, Ramp)
    return state.model


def first(state: TrainState) -> float:
    return float(ramp(state).weight[0].detach())


def step(state: TrainState) -> None:
    """The body of one step: forward, backward, optimizer.step."""
    state.optimizer.zero_grad()
    state.model().backward()
    state.optimizer.step()


def committed(path: Path) -> tuple[int, float, float] | None:
    """(step, the weight's single value, the buffer) of the file's newest snapshot."""
    if not path.exists():  # a first file is moved to its name once a snapshot is published
        return None
    snap = newest(SnapshotFile.open(path, flat.page_sums))
    if snap is None:
        return None
    loaded = flat.load(snap.payload)
    weight = loaded["model"]["weight"]
    assert bool((weight == weight[0]).all()), "a torn slot: two steps' bytes"
    return snap.step, float(weight[0]), float(loaded["model"]["seen"][0])


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold every background copy until the test sets the event."""
    opened = threading.Event()
    copy = flat.Target.copy

    def held(self: flat.Target, tensors: Any) -> None:
        if threading.current_thread().name.startswith("ddpjob-snapshot"):
            assert opened.wait(10), "the gate was never opened"
        copy(self, tensors)

    monkeypatch.setattr(flat.Target, "copy", held)
    yield opened
    opened.set()


def test_the_slot_holds_the_committed_step_though_the_next_step_ran_and_its_update_waited(
    tmp_path: Path, gate: threading.Event
) -> None:
    path = tmp_path / "rank0.snap"
    state = make(path)
    batches = state.batches()
    next(batches)
    with state.step():
        step(state)
    gate.set()
    state.flush()
    assert committed(path) == (1, 1.0, 1.0)
    gate.clear()

    next(batches)
    with state.step():
        step(state)  # step 2: its copy is held at the gate
    assert committed(path) == (1, 1.0, 1.0)  # not published yet: the step before is newest
    next(batches)
    state.optimizer.zero_grad()
    state.model().backward()  # the next step's forward and backward overlap the copy
    stepped = threading.Event()

    def update() -> None:
        state.optimizer.step()
        stepped.set()

    updater = threading.Thread(target=update)
    updater.start()
    assert not stepped.wait(0.3)  # optimizer.step waits for the copy of the parameters
    assert first(state) == 2.0
    gate.set()
    updater.join(5)
    assert stepped.is_set() and first(state) == 3.0
    state.flush()
    # The slot holds step 2 as committed (weight 2, the buffer as the commit saw it), not the
    # weight or buffer after the next step's forward and update.
    assert committed(path) == (2, 2.0, 2.0)
    assert state.stats.wait_seconds >= 0.25


def test_a_small_state_is_written_whole_at_the_commit(tmp_path: Path) -> None:
    path = tmp_path / "rank0.snap"
    state = make(path, numel=64, background=None)
    batches = state.batches()
    next(batches)
    with state.step():
        step(state)
    assert committed(path) == (1, 1.0, 1.0)  # no flush: nothing was left to a thread


def test_a_failed_background_copy_is_raised_and_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "rank0.snap"
    state = make(path)
    batches = state.batches()
    next(batches)
    with state.step():
        step(state)
    state.flush()
    copy = flat.Target.copy

    def broken(self: flat.Target, tensors: Any) -> None:
        if threading.current_thread().name.startswith("ddpjob-snapshot"):
            raise OSError("no room left")
        copy(self, tensors)

    monkeypatch.setattr(flat.Target, "copy", broken)
    next(batches)
    with caplog.at_level("ERROR", logger="ddpjob_worker.train.snapwriter"), state.step():
        step(state)
    next(batches)
    failed = pytest.raises(SnapshotError, match=r"snapshot of step 2 failed: no room left")
    with failed, state.step():
        step(state)  # the next optimizer.step surfaces it: this step is not committed
    assert "failed in the background" in caplog.text
    assert state.step_no == 2 and first(state) == 2.0
    assert committed(path) == (1, 1.0, 1.0)  # the torn slot is never read
    monkeypatch.setattr(flat.Target, "copy", copy)
    next(batches)
    with state.step():
        step(state)  # snapshots go on
    state.flush()
    assert committed(path) == (3, 3.0, 4.0)


def test_a_parameter_changed_while_it_is_copied_is_caught(
    tmp_path: Path, gate: threading.Event
) -> None:
    path = tmp_path / "rank0.snap"
    state = make(path)
    batches = state.batches()
    next(batches)
    with state.step():
        step(state)
    with torch.no_grad():
        ramp(state).weight.add_(10)  # outside optimizer.step, before the copy ran
    gate.set()
    with pytest.raises(SnapshotError, match="changed while step 1's snapshot copied them"):
        state.flush()
    assert committed(path) is None


_SCRIPT = """
import sys, threading, time
from pathlib import Path
import torch
sys.path[:0] = {paths!r}
from ddpjob_worker.train import flat
from tests.unit.test_snapwriter import make, step
slow = float(sys.argv[3])
if slow:
    copy = flat.Target.copy
    def slowly(self, tensors):
        if threading.current_thread().name.startswith("ddpjob-snapshot"):
            time.sleep(slow)
        copy(self, tensors)
    flat.Target.copy = slowly
state = make(Path(sys.argv[1]), numel=8 << 20)
for _ in state.batches():
    if state.step_no >= int(sys.argv[2]):
        break  # no flush: the interpreter's exit must finish the last snapshot
    with state.step():
        step(state)
    print(state.step_no, flush=True)
"""


def run_script(path: Path, steps: int, slow: float) -> subprocess.Popen[str]:
    repo = Path(__file__).resolve().parents[2]
    script = _SCRIPT.format(paths=[str(repo), str(repo / "worker")])
    return subprocess.Popen(
        [sys.executable, "-c", script, str(path), str(steps), str(slow)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )


def test_a_worker_killed_mid_copy_keeps_a_whole_snapshot_at_most_one_step_back(
    tmp_path: Path,
) -> None:
    """A real process trains a 32 MB parameter with background copies and is SIGKILLed at
    some point: the newest readable snapshot is whole (every element the same step's), and at
    most one step behind the last commit it reported."""
    path = tmp_path / "rank0.snap"
    for delay in (0.0, 0.011, 0.029, 0.053):
        worker = run_script(path, 10**6, 0.0)
        assert worker.stdout is not None
        last = 0
        while last < 2:  # step 1 published: its file has its name
            last = int(worker.stdout.readline())
        time.sleep(delay)
        worker.send_signal(signal.SIGKILL)
        rest, _ = worker.communicate()
        last = max([last, *map(int, rest.split())])
        found = committed(path)
        assert found is not None, delay
        assert last - 1 <= found[0] <= last + 1, (delay, found, last)
        assert found[1] == found[0], (delay, found)  # weight == step: the committed state


def test_a_script_that_returns_leaves_its_last_snapshot_whole(tmp_path: Path) -> None:
    path = tmp_path / "rank0.snap"
    worker = run_script(path, 3, 0.5)  # each copy takes 0.5 s; the script stops after 3
    out, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0 and out.split() == ["1", "2", "3"]
    assert committed(path) == (3, 3.0, 3.0)
