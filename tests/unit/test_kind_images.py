"""tests.harness.kind.images, tests.harness.kind.docker and the runc-capfilter runtime, without Docker: the cache
keys, kind's files as we change them, the capability filter, and the messages of failures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.kind import docker, images
from tests.harness.kind import runc_capfilter as capfilter

# ---- cache keys -----------------------------------------------------------------------------


def test_digest_is_length_prefixed() -> None:
    assert images.digest("ab", "c") != images.digest("a", "bc")
    assert images.digest("ab", "c") == images.digest("ab", b"c")


def test_rootfs_key_follows_the_package_set_not_its_order() -> None:
    key = images.rootfs_key(["iptables", "nftables"])
    assert key == images.rootfs_key(["nftables", "iptables"])
    assert key != images.rootfs_key(["iptables", "nftables", "ipset"])
    assert key != images.rootfs_key(["iptables", "nftables"], suite="trixie")


def _binary(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    path.chmod(0o755)
    return path


def test_component_key_changes_with_its_binary_and_nothing_else(tmp_path: Path) -> None:
    binary = _binary(tmp_path / "kube-apiserver", b"v1")
    component = images.Component(
        refs=("registry.k8s.io/kube-apiserver:v1.37.2",),
        files=(("usr/local/bin/kube-apiserver", binary),),
    )
    first = component.key()
    assert component.key() == first  # unchanged input: same key, nothing rebuilt
    _binary(binary, b"v2")
    os.utime(binary, ns=(1, 1))  # a new mtime: the memo must not hide the change
    assert component.key() != first
    retagged = images.Component(refs=("registry.k8s.io/kube-apiserver:v1.37.3",),
                                files=component.files)  # fmt: skip
    assert retagged.key() != component.key()
    proxied = images.Component(refs=component.refs, files=component.files,
                               rootfs=("kube-proxy", images.PROXY_PACKAGES))  # fmt: skip
    assert proxied.key() != component.key()


def test_component_changes_carry_the_key_as_a_label() -> None:
    component = images.Component(refs=("registry.k8s.io/pause:3.10.2",), files=(),
                                 entrypoint=("/pause",), user="65535:65535", env=())  # fmt: skip
    assert component.changes("abc") == [
        'ENTRYPOINT ["/pause"]',
        "USER 65535:65535",
        f"LABEL {images.LABEL}=abc",
    ]


def _fake_kind(root: Path) -> Path:
    files = root / "images" / "base" / "files"
    (files / "usr" / "local" / "bin").mkdir(parents=True)
    (files / "usr" / "local" / "bin" / "entrypoint").write_text("#!/bin/bash\n")
    (files / "etc" / "containerd").mkdir(parents=True)
    (files / "etc" / "containerd" / "config.toml").write_text(CONTAINERD_CONFIG)
    (files / "etc" / "default").mkdir(parents=True)
    (files / "etc" / "default" / "kubelet").write_text(
        "KUBELET_EXTRA_ARGS=--runtime-cgroups=/system.slice/containerd.service"
    )
    (files / "etc" / "sysctl.d").mkdir(parents=True)
    (files / "kind" / "bin").mkdir(parents=True)
    (files / "kind" / "bin" / "mount-product-files.sh").write_text("#!/bin/sh\n")
    (files / "kind" / "README.txt").write_text("kind\n")
    return root


def test_base_key_changes_when_a_kind_file_changes(tmp_path: Path) -> None:
    kind = _fake_kind(tmp_path / "kind")
    first = images.base_key(kind)
    assert images.base_key(kind) == first
    script = kind / "images" / "base" / "files" / "usr" / "local" / "bin" / "entrypoint"
    script.write_text("#!/bin/bash\necho changed\n")
    assert images.base_key(kind) != first


def test_node_key_follows_base_components_and_binaries(tmp_path: Path) -> None:
    for names in images.NODE_FILES.values():
        for name in names:
            _binary(tmp_path / name, name.encode())
    key = images.node_key("base:1", ["a", "b"], tmp_path, "v1.37.2")
    assert key == images.node_key("base:1", ["a", "b"], tmp_path, "v1.37.2")
    assert key != images.node_key("base:2", ["a", "b"], tmp_path, "v1.37.2")
    assert key != images.node_key("base:1", ["a", "c"], tmp_path, "v1.37.2")
    _binary(tmp_path / "kubelet", b"another kubelet")
    assert key != images.node_key("base:1", ["a", "b"], tmp_path, "v1.37.2")


def test_node_files_follow_kinds_layout(tmp_path: Path) -> None:
    placed = dict(images.node_files(tmp_path))
    assert placed["usr/bin/kubelet"] == tmp_path / "kubelet"
    assert placed["usr/local/sbin/runc"] == tmp_path / "runc"
    assert placed["usr/local/bin/crictl"] == tmp_path / "crictl"
    assert placed["opt/cni/bin/host-local"] == tmp_path / "host-local"


# ---- kind's files and our changes to them ---------------------------------------------------

CONTAINERD_CONFIG = """version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10"
  tolerate_missing_hugepages_controller = true
  # restrict_oom_score_adj needs to be true when running inside UserNS (rootless)
  restrict_oom_score_adj = false
"""


def test_containerd_config_gets_restrict_oom_score_adj() -> None:
    patched = images.patch_containerd_config(CONTAINERD_CONFIG)
    assert "  restrict_oom_score_adj = true\n" in patched
    assert "= false" not in patched
    with pytest.raises(images.ImageError, match="restrict_oom_score_adj = false"):
        images.patch_containerd_config(patched)


def test_kubelet_default_gets_fail_cgroupv1_false_once() -> None:
    kind = "KUBELET_EXTRA_ARGS=--runtime-cgroups=/system.slice/containerd.service"
    patched = images.patch_kubelet_default(kind)
    assert patched == f"{kind} --fail-cgroupv1=false\n"
    assert images.patch_kubelet_default(patched) == patched
    assert images.patch_kubelet_default("") == "KUBELET_EXTRA_ARGS=--fail-cgroupv1=false\n"


def test_install_base_files_modes_and_changes(tmp_path: Path) -> None:
    kind = _fake_kind(tmp_path / "kind")
    tree = tmp_path / "root"
    tree.mkdir()
    images.install_base_files(images.base_files(kind), tree)
    assert (tree / "usr/local/bin/entrypoint").stat().st_mode & 0o777 == 0o755
    assert (tree / "kind/bin/mount-product-files.sh").stat().st_mode & 0o777 == 0o755
    assert (tree / "kind/README.txt").stat().st_mode & 0o777 == 0o644
    assert "restrict_oom_score_adj = true" in (tree / "etc/containerd/config.toml").read_text()
    assert "--fail-cgroupv1=false" in (tree / "etc/default/kubelet").read_text()
    assert "net.ipv4.ip_forward=1" in (tree / images.FORWARD_SYSCTL_PATH).read_text()
    assert images.sandbox_image(kind) == "registry.k8s.io/pause:3.10"


def test_base_files_says_when_the_dir_is_not_kind(tmp_path: Path) -> None:
    with pytest.raises(images.ImageError, match="no usr/local/bin/entrypoint"):
        images.base_files(tmp_path)


def test_cri_base_spec_adds_the_hook_and_drops_rlimits() -> None:
    spec: dict[str, object] = {
        "ociVersion": "1.2.0",
        "process": {"rlimits": [{"type": "RLIMIT_NOFILE"}], "cwd": "/"},
        "hooks": {"createContainer": [{"path": "/other"}]},
    }
    out = images.cri_base_spec(spec)
    assert out["hooks"] == {
        "createContainer": [{"path": "/other"}, {"path": "/kind/bin/mount-product-files.sh"}]
    }
    assert out["process"] == {"cwd": "/"}
    assert images.cri_base_spec({})["hooks"] == {
        "createContainer": [{"path": "/kind/bin/mount-product-files.sh"}]
    }


# ---- component list -------------------------------------------------------------------------

KUBEADM_LIST = [
    "registry.k8s.io/kube-apiserver:v1.37.2",
    "registry.k8s.io/kube-controller-manager:v1.37.2",
    "registry.k8s.io/kube-scheduler:v1.37.2",
    "registry.k8s.io/kube-proxy:v1.37.2",
    "registry.k8s.io/coredns/coredns:v1.14.6",
    "registry.k8s.io/pause:3.10.2",
    "registry.k8s.io/etcd:3.7.0-0",
]


def test_components_use_kubeadms_names_and_both_pause_tags(tmp_path: Path) -> None:
    for name in (*images.CONTROL_PLANE, "kube-proxy", "coredns", "pause"):
        _binary(tmp_path / name, name.encode())
    comps = images.components(KUBEADM_LIST, tmp_path, tmp_path, "registry.k8s.io/pause:3.10")
    refs = sorted(ref for component in comps for ref in component.refs)
    assert refs == sorted([*KUBEADM_LIST, "registry.k8s.io/pause:3.10"])
    pause = next(c for c in comps if "registry.k8s.io/pause:3.10.2" in c.refs)
    assert pause.user == "65535:65535"
    assert pause.entrypoint == ("/pause",)
    proxy = next(c for c in comps if c.refs == ("registry.k8s.io/kube-proxy:v1.37.2",))
    assert proxy.rootfs == ("kube-proxy", images.PROXY_PACKAGES)
    etcd = next(c for c in comps if c.refs == ("registry.k8s.io/etcd:3.7.0-0",))
    assert etcd.files == (("usr/local/bin/etcd", tmp_path / "etcd"),)


def test_components_name_the_missing_binaries(tmp_path: Path) -> None:
    with pytest.raises(images.ImageError, match=r"binaries missing.*make kube"):
        images.components(KUBEADM_LIST, None, tmp_path)


def test_components_refuse_an_image_we_do_not_make(tmp_path: Path) -> None:
    with pytest.raises(images.ImageError, match="kindnetd"):
        images.components([*KUBEADM_LIST, "docker.io/kindest/kindnetd:v1"], None, tmp_path)


def test_kubeadm_images_from_the_module_cache_match_kubeadm_1_37_2() -> None:
    gomodcache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True,
                                check=False).stdout.strip()  # fmt: skip
    if not (Path(gomodcache) / "k8s.io/kubernetes@v1.37.2").is_dir():
        pytest.skip("k8s.io/kubernetes@v1.37.2 is not in the Go module cache")
    assert sorted(images.kubeadm_images(None, "v1.37.2")) == sorted(KUBEADM_LIST)


# ---- the capability filter ------------------------------------------------------------------

THIS_MACHINE = "000001fffeffffff"  # every capability but CAP_SYS_RESOURCE (bit 24)


def test_missing_capabilities_from_the_bounding_set() -> None:
    mask = capfilter.bounding_set(f"Name:\tx\nCapBnd:\t{THIS_MACHINE}\n")
    assert capfilter.missing(mask) == {"CAP_SYS_RESOURCE"}
    assert capfilter.missing((1 << len(capfilter.CAPABILITIES)) - 1) == set()
    with pytest.raises(ValueError, match="CapBnd"):
        capfilter.bounding_set("Name:\tx\n")


def _config(caps: list[str]) -> dict[str, object]:
    sets = {kind: list(caps) for kind in ("bounding", "effective", "permitted", "inheritable")}
    return {"ociVersion": "1.0.2-dev", "process": {"args": ["true"], "capabilities": sets}}


def test_filter_drops_only_the_missing_capabilities_from_config_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config(["CAP_CHOWN", "CAP_SYS_RESOURCE", "CAP_SYS_ADMIN"])))
    assert capfilter.filter_file(str(path), {"CAP_SYS_RESOURCE"})
    doc = json.loads(path.read_text())
    for names in doc["process"]["capabilities"].values():
        assert names == ["CAP_CHOWN", "CAP_SYS_ADMIN"]
    assert doc["process"]["args"] == ["true"]
    before = path.read_text()
    assert not capfilter.filter_file(str(path), {"CAP_SYS_RESOURCE"})  # untouched
    assert path.read_text() == before


def test_filter_handles_an_exec_process_file() -> None:
    process = {"args": ["sh"], "capabilities": {"bounding": ["CAP_KILL", "CAP_SYS_RESOURCE"]}}
    assert capfilter.filter_document(process, {"CAP_SYS_RESOURCE"})
    assert process["capabilities"] == {"bounding": ["CAP_KILL"]}
    assert not capfilter.filter_document({"ociVersion": "1", "process": {}}, {"CAP_KILL"})


def test_target_finds_the_file_runc_reads() -> None:
    create = ["--root", "/run/r", "--log", "/l.json", "--log-format", "json", "--systemd-cgroup",
              "create", "--bundle", "/b", "--pid-file", "/p", "id"]  # fmt: skip
    assert capfilter.target(create) == "/b/config.json"
    assert capfilter.target(["run", "--bundle=/b2", "id"]) == "/b2/config.json"
    assert capfilter.target(["create", "id"]) == "./config.json"
    exec_argv = ["--root", "/r", "exec", "--process", "/tmp/p.json", "--detach", "id"]
    assert capfilter.target(exec_argv) == "/tmp/p.json"
    assert capfilter.target(["exec", "-p", "/tmp/q.json", "id"]) == "/tmp/q.json"
    assert capfilter.target(["exec", "id", "sh"]) is None
    for argv in (["--root", "create", "start", "id"], ["start", "id"], ["--version"], []):
        assert capfilter.target(argv) is None


def test_the_wrapper_execs_the_real_runc_with_the_same_arguments(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(_config(["CAP_CHOWN"])))
    argv = ["--root", "/r", "create", "--bundle", str(bundle), "id"]
    result = subprocess.run(
        [sys.executable, str(docker.CAPFILTER), *argv], capture_output=True, text=True,
        env={**os.environ, "RUNC_REAL": "/bin/echo"}, check=True,
    )  # fmt: skip
    assert result.stdout.split() == argv


# ---- the daemon, without starting it --------------------------------------------------------


def test_dockerd_layout_and_flags() -> None:
    daemon = docker.Dockerd("unit")
    assert daemon.netns == Path("/run/netns/ddpjob-kind-unit")
    assert daemon.env({})["DOCKER_HOST"] == "unix:///run/ddpjob-kind/unit/docker.sock"
    assert daemon.netns_argv(["kind", "get", "clusters"])[:2] == [
        "nsenter", "--net=/run/netns/ddpjob-kind-unit",
    ]  # fmt: skip
    argv = daemon.argv()
    for flag in ("--bridge=none", "--iptables=false", "--ip-masq=false",
                 "--default-runtime=capfilter", f"--add-runtime=capfilter={docker.CAPFILTER}",
                 "--exec-root=/run/ddpjob-kind/unit/exec"):  # fmt: skip
        assert flag in argv
    assert daemon.data_root == docker.CACHE / "docker-unit"
    assert docker.Dockerd().data_root == docker.CACHE / "docker"
    assert "--cgroup-parent=/ddpjob" in docker.Dockerd("unit", cgroup_parent="/ddpjob").argv()


def test_the_capfilter_is_executable() -> None:
    assert os.access(docker.CAPFILTER, os.X_OK)


def test_start_says_it_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(docker.DockerError, match="needs root"):
        docker.Dockerd("unit").start()


def test_start_names_a_missing_tool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "dockerd" else "/x")
    with pytest.raises(docker.DockerError, match=r"`dockerd` is not on PATH; apt-get install"):
        docker.Dockerd("unit").start()


def test_a_kept_daemon_survives_a_plain_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(docker, "RUN_BASE", tmp_path)
    daemon = docker.Dockerd("unit")
    daemon.run_dir.mkdir(parents=True)
    (daemon.run_dir / "owner").write_text("keep")
    assert "kept" in daemon._keep_reason()
    (daemon.run_dir / "owner").write_text("999999999")  # a starter that is gone
    assert daemon._keep_reason() == ""
