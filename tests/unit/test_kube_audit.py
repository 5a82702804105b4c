"""Reading the test control plane's audit log from an offset (tests.harness.kube.controlplane)."""

from __future__ import annotations

from pathlib import Path

from tests.harness.kube.controlplane import ControlPlane


def test_an_offset_taken_mid_line_skips_that_line_and_a_half_written_last_line(
    tmp_path: Path,
) -> None:
    """The size of the log taken while the API server wrote a line (a whole-suite run had a
    test fail on the half line's JSON): that line began before the offset and is not read; nor
    is a last line still being written."""
    cluster = ControlPlane(tmp_path)
    cluster.audit_log.parent.mkdir(parents=True)
    cluster.audit_log.write_bytes(b'{"n": 1}\n{"n": 2}\n{"n": 3}\n{"n": ')
    first, second = len(b'{"n": 1}\n'), len(b'{"n": 1}\n{"n": 2}\n')
    assert [e["n"] for e in cluster.audit()] == [1, 2, 3]
    assert [e["n"] for e in cluster.audit(since=first)] == [2, 3]
    assert [e["n"] for e in cluster.audit(since=first + 3)] == [3]  # mid-line: not line 2
    assert [e["n"] for e in cluster.audit(since=second)] == [3]
    assert cluster.audit(since=second + 9) == []
