"""The kind binaries' build (tests/harness/kind/gobuild.py): pins, cache key, steps, and its errors.

No network and no compiler: ``go`` is a shell script, and the module cache is a directory here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.harness.kind import gobuild
from tests.harness.kube import build as kube_build


@pytest.fixture
def inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Copies of the three modules and a fake pause.c under ``tmp_path``; the cache there too."""
    root, real = tmp_path / "repo", gobuild.ROOT
    for module in (gobuild.KUBE_MODULE, gobuild.TOOLS_MODULE, gobuild.COREDNS_MODULE):
        shutil.copytree(module, root / module.relative_to(real))
    pause = tmp_path / "modcache" / "build" / "pause" / "linux" / "pause.c"
    pause.parent.mkdir(parents=True)
    pause.write_text("int main(void) { return 0; }\n")
    monkeypatch.setattr(gobuild, "ROOT", root)
    monkeypatch.setattr(gobuild, "KUBE_MODULE", root / "hack" / "kube")
    monkeypatch.setattr(gobuild, "TOOLS_MODULE", root / "hack" / "kind" / "tools")
    monkeypatch.setattr(gobuild, "COREDNS_MODULE", root / "hack" / "kind" / "coredns")
    monkeypatch.setattr(gobuild, "CACHE", root / ".cache" / "kind")
    monkeypatch.setattr(
        gobuild, "_PINS", {k: (root / v[0].relative_to(real), v[1]) for k, v in
                           gobuild._PINS.items()},
    )  # fmt: skip
    monkeypatch.setattr(gobuild, "_pause_source", lambda: pause)
    monkeypatch.setattr(gobuild, "_go", lambda: "/usr/bin/go")
    monkeypatch.setattr(gobuild, "_go_version", lambda go: "go1.26.8")
    monkeypatch.setattr(gobuild, "_gcc_version", lambda: "gcc (Debian 12.2.0-14) 12.2.0")
    return root


def test_the_pins_are_read_from_the_go_modules() -> None:
    assert gobuild.versions() == {
        "kind": "v0.33.0",
        "kubernetes": "v1.37.2",
        "containerd": "v2.3.4",
        "runc": "v1.4.3",
        "crictl": "v1.36.0",
        "cni": "v1.9.1",
        "coredns": "v1.14.6",
        "pause": "3.10.2",
    }


def test_kubernetes_is_the_control_planes_pin() -> None:
    assert gobuild.KUBE_MODULE == kube_build.MODULE
    assert gobuild.versions()["kubernetes"] == kube_build.kubernetes_version()
    tools = (gobuild.KUBE_MODULE / "go.mod").read_text()
    for name in ("kubelet", "kubeadm", "kubectl", "kube-proxy"):
        assert f"\tk8s.io/kubernetes/cmd/{name}\n" in tools


def test_the_steps_make_every_binary_once() -> None:
    made = [name for step in gobuild.steps() for name in step.binaries]
    assert sorted(made) == sorted(gobuild.BINARIES)
    assert len(set(made)) == len(made)
    by_name = {step.name: step for step in gobuild.steps()}
    assert by_name["runc"].cgo and set(by_name["runc"].tags) == {"seccomp", "urfave_cli_no_docs"}
    assert not by_name["containerd"].cgo
    assert set(by_name["containerd"].tags) == {"no_aufs", "no_btrfs", "no_devmapper", "no_zfs"}
    assert "gitVersion=v1.37.2" in by_name["kubeadm"].ldflags
    assert "version.Version=v2.3.4" in by_name["containerd"].ldflags
    # the tool lines let `go build` name packages of modules that are not imported
    for step in gobuild.steps():
        if step.name not in ("pause", "coredns"):
            gomod = (step.module / "go.mod").read_text()
            assert all(f"\t{package}\n" in gomod for package in step.packages), step.name


def test_the_cache_key_is_stable_and_names_the_versions(inputs: Path) -> None:
    first = gobuild.bin_dir()
    assert first == gobuild.bin_dir()
    assert first.name == "bin"
    assert first.parent.parent == inputs / ".cache" / "kind"
    assert first.parent.name.startswith("go-kind-v0.33.0-k8s-v1.37.2-")


@pytest.mark.parametrize(
    "changed",
    [
        "hack/kube/go.sum",
        "hack/kube/go.mod",
        "hack/kind/tools/go.mod",
        "hack/kind/tools/go.sum",
        "hack/kind/coredns/go.sum",
        "hack/kind/coredns/main.go",
    ],
)
def test_the_cache_key_changes_with_every_input_file(inputs: Path, changed: str) -> None:
    before = gobuild.bin_dir()
    with (inputs / changed).open("a") as file:
        file.write("// changed\n")
    assert gobuild.bin_dir() != before


def test_the_cache_key_changes_with_pause_c_go_gcc_and_the_flags(
    inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = {gobuild.bin_dir()}
    pause = tmp_path / "modcache" / "build" / "pause" / "linux" / "pause.c"
    pause.write_text("int main(void) { return 1; }\n")
    seen.add(gobuild.bin_dir())
    monkeypatch.setattr(gobuild, "_go_version", lambda go: "go1.26.9")
    seen.add(gobuild.bin_dir())
    monkeypatch.setattr(gobuild, "_gcc_version", lambda: "gcc (Debian 14.2.0-19) 14.2.0")
    seen.add(gobuild.bin_dir())
    monkeypatch.setattr(gobuild, "_CONTAINERD_TAGS", ("no_aufs",))
    seen.add(gobuild.bin_dir())
    assert len(seen) == 5


def test_a_missing_go_stops_with_one_line_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(gobuild.BuildError) as raised:
        gobuild._go()
    message = str(raised.value)
    assert "\n" not in message
    assert "`go` is not on PATH" in message and "install Go 1.26" in message


def _fake_go(tmp_path: Path, script: str) -> Path:
    fake = tmp_path / "fakebin"
    fake.mkdir(exist_ok=True)
    go = fake / "go"
    go.write_text("#!/bin/sh\n" + script)
    go.chmod(0o755)
    return go


def test_a_failed_step_names_itself_its_log_and_the_fix(
    inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    go = _fake_go(
        tmp_path, "echo 'go: github.com/opencontainers/runc@v1.4.3: 403 Forbidden' >&2\nexit 1\n"
    )
    monkeypatch.setattr(gobuild, "_go", lambda: str(go))
    with pytest.raises(gobuild.BuildError) as raised:
        gobuild.build(quiet=True)
    message = str(raised.value)
    target = gobuild.bin_dir()
    assert "\n" not in message
    assert message.startswith("building kind failed (go build, exit 1): go: github.com/")
    assert "403 Forbidden" in message
    assert str(target.parent / "build.log") in message
    assert "go env GOPROXY" in message and "hack/kind/tools/go.mod" in message
    assert not target.exists(), "no half-built cache entry"
    assert "403 Forbidden" in (target.parent / "build.log").read_text()


def test_a_build_resumes_at_the_first_missing_step_and_uses_the_flags(
    inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fake ``go build`` writes the binaries its ``-o`` dir and packages name; the runc
    step fails once, and the second build starts there."""
    calls = tmp_path / "calls"
    go = _fake_go(
        tmp_path,
        f'echo "$CGO_ENABLED $*" >> {calls}\n'
        'case "$*" in *opencontainers/runc*) [ -e ' + str(tmp_path / "runc-ok") + " ] || "
        "{ echo 'seccomp.h: No such file or directory'; exit 2; };; esac\n"
        'while [ "$1" != -o ]; do shift; done; out=$2; shift 2\n'
        'for p in "$@"; do n=${p##*/}; [ "$n" = . ] && n=coredns; : > "$out$n"; done\n',
    )
    gcc = tmp_path / "fakebin" / "gcc"
    gcc.write_text('#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done; : > "$2"\n')
    gcc.chmod(0o755)
    monkeypatch.setenv("PATH", f"{go.parent}:/usr/bin:/bin")
    monkeypatch.setattr(gobuild, "_go", lambda: str(go))
    with pytest.raises(gobuild.BuildError) as raised:
        gobuild.build(quiet=True, nice=True)
    message = str(raised.value)
    assert message.startswith("building runc failed (go build, exit 2): seccomp.h: No such file")
    assert "apt-get install gcc libseccomp-dev" in message
    staged = gobuild.bin_dir().parent / "bin.partial"
    assert (staged / "kubelet").is_file() and (staged / "ctr").is_file()

    (tmp_path / "runc-ok").touch()
    first_calls = calls.read_text().count("\n")
    target = gobuild.build(quiet=True)
    assert target == gobuild.bin_dir() and gobuild.built()
    assert sorted(p.name for p in target.iterdir()) == sorted(gobuild.BINARIES)
    again = calls.read_text().splitlines()[first_calls:]
    assert "opencontainers/runc" in again[0], "the staged steps are not built again"
    assert again[0].startswith("1 build -trimpath")  # CGO_ENABLED=1 for runc only
    assert all(line.startswith("0 ") for line in again[1:])
    assert gobuild.build(quiet=True) == target
    assert calls.read_text().count("\n") == first_calls + len(again), "nothing built when done"
