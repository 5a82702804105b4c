"""In-memory snapshots (:mod:`ddpjob_worker.train.snapshot`): two slots, so that a writer killed in
the middle of a copy never loses the snapshot before it; torn or corrupt slots are never read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpjob_worker.train.snapshot import (
    HEADER_BYTES,
    SnapshotError,
    SnapshotFile,
    SnapshotTooLargeError,
    file_bytes,
)


def test_a_fresh_file_has_no_snapshot(tmp_path: Path) -> None:
    snaps = SnapshotFile.create(tmp_path / "s", capacity=1024)
    assert snaps.latest() is None
    assert (tmp_path / "s").stat().st_size == file_bytes(1024) == HEADER_BYTES + 2048


def test_writes_alternate_slots_and_the_newest_is_read(tmp_path: Path) -> None:
    snaps = SnapshotFile.create(tmp_path / "s", capacity=64)
    assert snaps.write(1, 3, b"one") == 0
    assert snaps.write(2, 3, b"two") == 1
    assert snaps.write(3, 3, b"three") == 0
    newest = snaps.latest()
    assert newest is not None
    assert (newest.step, newest.generation, newest.payload) == (3, 3, b"three")
    older = snaps.read(1)
    assert older is not None and (older.step, older.payload) == (2, b"two")
    # Another process's view (a reader that opens the file) is the same.
    assert SnapshotFile.open(tmp_path / "s").latest() == newest


def test_a_newer_generation_wins_and_a_generation_can_be_asked_for(tmp_path: Path) -> None:
    snaps = SnapshotFile.create(tmp_path / "s", capacity=64)
    snaps.write(10, 1, b"old round")
    snaps.write(4, 2, b"new round")
    newest = snaps.latest()
    assert newest is not None and (newest.generation, newest.step) == (2, 4)
    old = snaps.latest(generation=1)
    assert old is not None and old.payload == b"old round"
    assert snaps.latest(generation=3) is None


def test_a_corrupt_slot_is_never_read(tmp_path: Path) -> None:
    path = tmp_path / "s"
    snaps = SnapshotFile.create(path, capacity=64)
    snaps.write(1, 1, b"good")
    snaps.write(2, 1, b"flipped")
    with path.open("r+b") as raw:  # one bit of slot 1's payload
        raw.seek(HEADER_BYTES + 64)
        byte = raw.read(1)
        raw.seek(HEADER_BYTES + 64)
        raw.write(bytes([byte[0] ^ 1]))
    newest = SnapshotFile.open(path).latest()
    assert newest is not None and (newest.step, newest.payload) == (1, b"good")


def test_a_state_larger_than_a_slot_is_refused_and_nothing_is_lost(tmp_path: Path) -> None:
    snaps = SnapshotFile.create(tmp_path / "s", capacity=8)
    snaps.write(1, 1, b"fits")
    with pytest.raises(SnapshotTooLargeError, match="9 bytes and a snapshot slot holds 8"):
        snaps.write(2, 1, b"too large")
    newest = snaps.latest()
    assert newest is not None and newest.payload == b"fits"


def test_a_file_that_is_not_a_snapshot_file_is_refused_by_name(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.write_bytes(b"\0" * (HEADER_BYTES + 16))
    with pytest.raises(SnapshotError, match="is not a version-2 snapshot file"):
        SnapshotFile.open(other)
    with pytest.raises(SnapshotError, match="cannot open the snapshot file"):
        SnapshotFile.open(tmp_path / "missing")


_WRITER = """
import sys
from pathlib import Path
from ddpjob_worker.train.snapshot import SnapshotFile
snaps = SnapshotFile.open(Path(sys.argv[1]))
size = snaps.capacity
step = 0
while True:
    step += 1
    snaps.write(step, 7, bytes([step % 251]) * size)
    if step == 2:
        print("wrote 2", flush=True)
"""


def test_a_writer_killed_mid_copy_loses_at_most_that_copy(tmp_path: Path) -> None:
    """A real process writes 32 MiB snapshots in a loop and is SIGKILLed at some point of a
    copy: the newest good snapshot is whole (its bytes all one value, its CRC checked), and
    its step is the last or the one before the last the writer began."""
    path = tmp_path / "s"
    SnapshotFile.create(path, capacity=32 << 20)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for delay in (0.0, 0.013, 0.037, 0.071):
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, env=env, text=True
        )
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "wrote 2"
        time.sleep(delay)
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        snaps = SnapshotFile.open(path)
        newest = snaps.latest()
        assert newest is not None, delay
        assert newest.generation == 7
        assert newest.payload == bytes([newest.step % 251]) * (32 << 20), delay
        other = snaps.read(1 - newest.slot)
        # The other slot is either the step before (whole) or the copy that was cut (torn).
        assert other is None or other.step == newest.step - 1, (delay, other and other.step)
        snaps.close()


_FULL_TMPFS = """
import sys
from pathlib import Path
from ddpjob_worker.train.snapshot import SnapshotFile
try:
    snaps = SnapshotFile.create(Path(sys.argv[1]) / "s", capacity=4 << 20)
    snaps.write(1, 0, bytes(4 << 20))
except OSError as exc:
    print("refused:", exc.strerror, sorted(p.name for p in Path(sys.argv[1]).iterdir()))
else:
    print("written")
"""


def test_a_snapshot_file_that_does_not_fit_its_tmpfs_is_refused_not_a_sigbus(
    tmp_path: Path,
) -> None:
    """A /dev/shm too small for the slots (a pod's sizeLimit, a node's tmpfs): the file is
    refused when it is made (ENOSPC, no file left behind), where a sparse file's pages were
    found missing only by the first write through the mapping, with a SIGBUS that killed the
    worker. A 1 MiB tmpfs in a private mount namespace of a child process."""
    mount = tmp_path / "shm"
    mount.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    script = 'mount -t tmpfs -o size=1m ddpjob-test "$1" && exec "$2" -c "$3" "$1"'
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], check=False, capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here: {probe.stderr.decode().strip()}")
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         str(mount), sys.executable, _FULL_TMPFS],
        check=False, capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, "refused: No space left on device []"), (
        done.returncode,
        done.stderr[-2000:],
    )
