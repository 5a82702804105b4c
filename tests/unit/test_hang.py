"""Hang detection's pieces: the workers' progress records (:mod:`ddpjob_worker.progress`), read
by another process while they are written, and the pure verdict of which rank holds the others
up (:mod:`ddpjob_worker.hang`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from ddpjob_worker.hang import (
    FACTOR,
    FLOOR_SECONDS,
    WARMUP_STEPS,
    StepTimes,
    stuck,
)
from ddpjob_worker.progress import RECORD, Phase, Progress, ProgressWriter, path_for, read

C, W, IDLE, M = Phase.COMPUTE, Phase.COLLECTIVE, Phase.IDLE, Phase.COMMIT


def p(step: int, phase: Phase, since: float) -> Progress:
    return Progress(step=step, phase=phase, since=since)


# -- the record ---------------------------------------------------------------------------------


def test_a_record_reads_back_what_was_marked_last(tmp_path: Path) -> None:
    path = path_for(tmp_path, 3)
    assert path.name == "rank3.progress"
    assert read(path) is None  # no worker yet
    writer = ProgressWriter(path)
    assert path.stat().st_size == RECORD.size == 32
    assert read(path) == p(0, IDLE, read(path).since)  # type: ignore[union-attr]
    writer.mark(7, C, now=100.5)
    writer.mark(7, W, now=101.25, threshold=6.5)
    assert read(path) == Progress(7, W, 101.25, 6.5)
    writer.close()
    assert read(path) == Progress(7, W, 101.25, 6.5)  # it outlives its writer


def test_a_record_being_written_or_garbage_is_never_taken(tmp_path: Path) -> None:
    path = tmp_path / "rank0.progress"
    path.write_bytes(RECORD.pack(5, 9, int(C), 1.0, 0.0))  # an odd sequence: mid-write
    assert read(path) is None
    path.write_bytes(RECORD.pack(6, 9, 77, 1.0, 0.0))  # no such phase
    assert read(path) is None
    path.write_bytes(b"short")
    assert read(path) is None


def test_another_process_never_reads_a_torn_record(tmp_path: Path) -> None:
    # The writer marks (n, phase n % 4, since n) as fast as it can; every record read whole
    # has fields of one mark.
    path = tmp_path / "rank0.progress"
    ProgressWriter(path).close()
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from ddpjob_worker.progress import Phase, ProgressWriter
        w = ProgressWriter(Path({str(path)!r}))
        for n in range(1, 200_000):
            w.mark(n, Phase(n % 4), now=float(n))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    seen = 0
    while proc.poll() is None:
        record = read(path)
        if record is not None and record.step > 0:
            assert (int(record.phase), record.since) == (record.step % 4, float(record.step))
            seen += 1
    assert proc.returncode == 0
    assert seen > 0


# -- the threshold ------------------------------------------------------------------------------


def test_the_threshold_is_the_floor_until_steps_are_seen() -> None:
    times = StepTimes()
    assert times.threshold() == FLOOR_SECONDS
    for step in range(WARMUP_STEPS + 1):  # warm-up steps are not counted
        times.observe(p(step, C, 100.0 * step))
    assert times.threshold() == FLOOR_SECONDS


def test_the_threshold_follows_the_slowest_steps_with_a_margin() -> None:
    times = StepTimes()
    now = 0.0
    for step in range(WARMUP_STEPS + 101):
        now += 3.0 if step in (50, 70) else 0.5  # two slow steps in a hundred: the p99
        times.observe(p(step, C, now))
        times.observe(p(step, W, now + 0.1))  # the same step again: nothing new
    assert times.threshold() == FACTOR * 3.0


def test_a_step_that_jumps_is_not_a_step_time() -> None:
    times = StepTimes()
    for step in range(WARMUP_STEPS + 2):
        times.observe(p(step, C, float(step)))
    times.observe(p(40, C, 1000.0))  # a restore to a later step: no time of one step
    times.observe(p(41, C, 1001.0))
    assert times.threshold() == FLOOR_SECONDS  # 1 s steps: the floor still rules


# -- the verdict --------------------------------------------------------------------------------


def test_one_rank_that_never_reaches_the_collective_is_stuck() -> None:
    records = {0: p(12, W, 101.0), 1: p(12, W, 100.5), 2: p(12, C, 100.0), 3: p(12, W, 101.0)}
    assert stuck(records, now=106.0, threshold=4.0) == {2}
    assert stuck(records, now=104.0, threshold=4.0) == set()  # the waiting is not long yet


def test_a_rank_stuck_writing_the_step_before_is_stuck_too() -> None:
    records = {0: p(13, W, 101.0), 1: p(12, M, 100.0), 2: p(13, W, 101.0)}
    assert stuck(records, now=110.0, threshold=5.0) == {1}


def test_a_rank_writing_a_checkpoint_to_disk_is_never_stuck() -> None:
    # Rank 1 committed step 12 and writes a checkpoint (save_checkpoint) while the others wait
    # in step 13's all-reduce: slow storage, not a hang.
    records = {0: p(13, W, 101.0), 1: p(12, Phase.SAVING, 100.0), 2: p(13, W, 101.0)}
    assert stuck(records, now=200.0, threshold=5.0) == set()


def test_a_slow_job_is_not_a_hung_rank() -> None:
    # Everyone computes (an evaluation, a slow step): no majority waits, nobody is pinned.
    records = {k: p(12, C, 100.0) for k in range(4)}
    assert stuck(records, now=1000.0, threshold=5.0) == set()
    # Half waiting is no majority either.
    half = {0: p(12, W, 100.0), 1: p(12, W, 100.0), 2: p(12, C, 100.0), 3: p(12, C, 100.0)}
    assert stuck(half, now=1000.0, threshold=5.0) == set()


def test_a_rank_that_just_moved_is_not_stuck() -> None:
    # Its record changed lately (it is slow, not stuck): it may still reach the collective.
    records = {0: p(12, W, 100.0), 1: p(12, W, 100.0), 2: p(12, C, 108.0)}
    assert stuck(records, now=110.0, threshold=5.0) == set()


def test_a_rank_ahead_of_the_waiting_ones_is_not_the_culprit() -> None:
    # Ranks 0 and 1 wait in step 12's collective; rank 2 is already computing step 13 (it
    # finished step 12 and was restarted, say): it does not hold step 12 up.
    records = {0: p(12, W, 100.0), 1: p(12, W, 100.0), 2: p(13, C, 100.0)}
    assert stuck(records, now=110.0, threshold=5.0) == set()


def test_the_hang_modules_import_without_torch() -> None:
    code = "import sys, ddpjob_worker.hang; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
