"""The Kueue controller's build (tests/harness/kueue/build.py): the pin, the cache key, and its errors.

No network and no compiler: ``go`` is a shell script, and the module is a copy under tmp_path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.harness.kube import build as kube_build
from tests.harness.kueue import build


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of hack/kueue under ``tmp_path``; the cache there too."""
    copy = tmp_path / "hack" / "kueue"
    shutil.copytree(build.MODULE, copy)
    monkeypatch.setattr(build, "MODULE", copy)
    monkeypatch.setattr(build, "CACHE", tmp_path / ".cache" / "kueue")
    build._module_dir.cache_clear()
    return copy


def fake_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    go = bin_dir / "go"
    go.write_text(f"#!/bin/sh\n{script}\n")
    go.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_the_pin_is_read_from_the_go_module() -> None:
    assert build.version() == "v0.19.2"
    gomod = (build.MODULE / "go.mod").read_text()
    # the tool line keeps the module through `go mod tidy` and lets `go build` name the package
    assert f"tool {build.PACKAGE}\n" in gomod or f"\t{build.PACKAGE}\n" in gomod
    assert f"{build.KUEUE} v0.19.2 h1:" in (build.MODULE / "go.sum").read_text()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("require (\n\tsigs.k8s.io/kueue v0.19.2 // indirect\n)\n", "v0.19.2"),
        ("require sigs.k8s.io/kueue v0.17.0\n", "v0.17.0"),
        ("require (\n\tsigs.k8s.io/kueue v0.20.0-rc.1\n)\n", "v0.20.0-rc.1"),
        # a module whose path only starts with kueue's is not kueue
        (
            "require (\n\tsigs.k8s.io/kueue-extra v1.0.0\n\tsigs.k8s.io/kueue v0.18.1\n)\n",
            "v0.18.1",
        ),
    ],
)
def test_parse_version(text: str, expected: str) -> None:
    assert build.parse_version(text) == expected


@pytest.mark.parametrize(
    "text",
    ["module x\n\ngo 1.26.0\n", "tool sigs.k8s.io/kueue/cmd/kueue\n", "// sigs.k8s.io/kueue x\n"],
)
def test_a_go_mod_without_the_pin_stops_with_one_line(text: str) -> None:
    with pytest.raises(build.BuildError) as raised:
        build.parse_version(text)
    message = str(raised.value)
    assert "\n" not in message
    assert "does not require sigs.k8s.io/kueue" in message and "restore it from git" in message


def test_the_cache_key_is_stable_and_names_the_version(module: Path, tmp_path: Path) -> None:
    first = build.bin_dir()
    assert first == build.bin_dir()
    assert first.name == "bin"
    assert first.parent.parent == tmp_path / ".cache" / "kueue"
    assert first.parent.name == f"v0.19.2-{kube_build.module_digest(module)}"
    assert len(first.parent.name.rpartition("-")[2]) == 12


@pytest.mark.parametrize("changed", ["go.sum", "go.mod"])
def test_the_cache_key_changes_with_go_mod_and_go_sum(module: Path, changed: str) -> None:
    before = build.bin_dir()
    with (module / changed).open("a") as file:
        file.write("// changed\n")
    after = build.bin_dir()
    assert after != before
    assert after.parent.name.startswith("v0.19.2-")


def test_a_new_pin_builds_into_a_directory_named_after_it(module: Path) -> None:
    gomod = module / "go.mod"
    gomod.write_text(
        gomod.read_text().replace("sigs.k8s.io/kueue v0.19.2", "sigs.k8s.io/kueue v0.19.1")
    )
    assert build.bin_dir().parent.name.startswith("v0.19.1-")


def test_the_version_is_stamped_into_the_binary() -> None:
    flags = build._ldflags("v0.19.2")
    assert "-X sigs.k8s.io/kueue/pkg/version.GitVersion=v0.19.2" in flags


def test_a_missing_go_stops_with_one_line_naming_the_fix(
    module: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    for call in (build.build, build.crd_bases):
        with pytest.raises(build.BuildError) as raised:
            call()
        message = str(raised.value)
        assert "\n" not in message
        assert "`go` is not on PATH" in message and "python -m tests.harness.kueue build" in message
    assert not build.bin_dir().exists()


def test_a_failed_build_names_the_step_its_log_and_the_fix(
    module: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_go(tmp_path, monkeypatch, "echo 'verifying module: checksum mismatch' >&2\nexit 1")
    with pytest.raises(build.BuildError) as raised:
        build.build(quiet=True)
    message = str(raised.value)
    log = build.bin_dir().parent / "build.log"
    assert "\n" not in message
    assert "building Kueue v0.19.2" in message and "go build, exit 1" in message
    assert "checksum mismatch" in message and str(log) in message and "GOPROXY" in message
    assert "checksum mismatch" in log.read_text()
    assert not build.bin_dir().exists(), "no half-built cache entry"


def test_a_built_binary_is_not_built_again(
    module: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = tmp_path / "calls"
    fake_go(
        tmp_path,
        monkeypatch,
        f'echo "$@" >> {calls}\n'
        'while [ "$1" != "-o" ]; do shift; done\n'
        'printf "#!/bin/sh\\n" > "$2/kueue"',
    )
    target = build.build(quiet=True)
    assert target == build.bin_dir() and build.built()
    assert build.build(quiet=True) == target
    argv = calls.read_text().splitlines()
    assert len(argv) == 1
    assert argv[0].startswith("build -trimpath -ldflags")
    assert argv[0].endswith(" sigs.k8s.io/kueue/cmd/kueue")


def test_the_crds_and_webhooks_are_found_in_the_module(
    module: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extracted = tmp_path / "modcache" / "sigs.k8s.io" / "kueue@v0.19.2"
    info = json.dumps({"Path": build.KUEUE, "Version": "v0.19.2", "Dir": str(extracted)})
    fake_go(tmp_path, monkeypatch, f"echo '{info}'")
    assert build.module_dir() == extracted
    assert build.crd_bases() == extracted / "config" / "components" / "crd" / "bases"
    assert build.webhook_manifests() == (
        extracted / "config" / "components" / "webhook" / "manifests.yaml"
    )


def test_a_failed_download_names_the_step_and_the_fix(
    module: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    error = json.dumps({"Path": build.KUEUE, "Error": "sigs.k8s.io/kueue@v0.19.2: 410 Gone"})
    fake_go(tmp_path, monkeypatch, f"echo '{error}'\nexit 1")
    with pytest.raises(build.BuildError) as raised:
        build.crd_bases()
    message = str(raised.value)
    assert "\n" not in message
    assert "locating sigs.k8s.io/kueue v0.19.2 failed (go mod download, exit 1)" in message
    assert "410 Gone" in message and "GOPROXY" in message
