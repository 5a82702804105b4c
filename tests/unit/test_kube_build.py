"""The real control plane's build (tests/harness/kube/build.py): pins, cache key, and its errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.harness.kube import build


def test_the_pins_are_read_from_the_go_module() -> None:
    pins = build.versions()
    assert pins["k8s.io/kubernetes"] == "v1.37.2"
    assert pins["go.etcd.io/etcd/server/v3"].startswith("v3.")
    assert build.bin_dir().parent.name.startswith(
        f"v1.37.2-etcd-{pins['go.etcd.io/etcd/server/v3']}-"
    )


def test_every_staging_module_is_replaced_at_the_matching_release() -> None:
    """k8s.io/kubernetes requires its staging modules at v0.0.0; a dependent module must replace
    each with the release of the same minor and patch, or the build fails with
    ``k8s.io/api@v0.0.0: unknown revision``."""
    text = (build.MODULE / "go.mod").read_text()
    replaces = re.findall(r"^\s*(k8s\.io/\S+) => (k8s\.io/\S+) (v\S+)$", text, re.M)
    assert len(replaces) == 33
    assert all(left == right and version == "v0.37.2" for left, right, version in replaces)
    assert "go.etcd.io/etcd/server/v3" in text and "tool (" in text


def test_a_missing_go_stops_with_one_line_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "CACHE", tmp_path)
    monkeypatch.setattr(build, "bin_dir", lambda: tmp_path / "key" / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(build.BuildError) as raised:
        build.build(quiet=True)
    message = str(raised.value)
    assert "\n" not in message
    assert "`go` is not on PATH" in message and "install Go 1.26" in message


def test_a_failed_build_names_the_step_its_log_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    go = fake / "go"
    go.write_text("#!/bin/sh\necho 'k8s.io/api@v0.0.0: unknown revision v0.0.0' >&2\nexit 1\n")
    go.chmod(0o755)
    monkeypatch.setattr(build, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(build, "bin_dir", lambda: tmp_path / "cache" / "key" / "bin")
    monkeypatch.setenv("PATH", str(fake))
    with pytest.raises(build.BuildError) as raised:
        build.build(quiet=True)
    message = str(raised.value)
    assert "\n" not in message
    assert "go build, exit 1" in message
    assert "unknown revision" in message
    assert str(tmp_path / "cache" / "key" / "build.log") in message
    assert not (tmp_path / "cache" / "key" / "bin").exists(), "no half-built cache entry"
