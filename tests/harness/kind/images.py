"""The kind node image, and every image baked into it, built here with no registry.

Three layers, each cached by a hash of its inputs (the label ``io.ddpjob.kind.input`` on the
image; tarballs carry it in their name), so an unchanged input is never rebuilt and a changed
one always is:

1. **Root filesystems** (``.cache/kind/rootfs/*.tar``): ``debootstrap --variant=minbase`` of
   Debian bookworm, one for the node (:data:`BASE_PACKAGES`) and a small one with iptables for
   kube-proxy (:data:`PROXY_PACKAGES`). Bookworm, not trixie: its systemd 252 still runs
   under this machine's cgroup v1.
2. **The base image** ``ddpjob-local/kind-base:<hash>``: that rootfs plus kind v0.33.0's
   ``images/base/files`` (from the Go module), the steps of kind's ``images/base/Dockerfile``
   done here in a chroot, and three changes this machine needs (KIND-OFFLINE.md §3.5):
   containerd's ``restrict_oom_score_adj = true`` (no CAP_SYS_RESOURCE: runc cannot set a
   negative oom_score_adj), the kubelet's ``--fail-cgroupv1=false`` (cgroup v1 host), and
   IPv4/IPv6 forwarding from sysctl.d (node namespaces inherit 0 from the machine's).
3. **Component images**, under the exact names kubeadm asks for (``kubeadm config images
   list``): kube-apiserver, kube-controller-manager, kube-scheduler, etcd, coredns, pause (also
   under the ``sandbox_image`` tag of kind's containerd config) FROM scratch, kube-proxy on the
   iptables rootfs. Then **the node image** (``kindest/node:<version>-ddpjob``): the base with
   the node binaries copied in, every component image imported into its containerd
   (``ctr import --no-unpack``, pinned), committed with kind's entrypoint.

There is no ``/kind/manifests/default-cni.yaml`` (we do not vendor kindnetd): clusters must set
``networking.disableDefaultCNI: true`` (kind then skips its CNI step; without it kind fails
with "failed to read CNI manifest") and bring their own CNI config. There is no
``default-storage.yaml`` either: kind then applies a plain "standard" StorageClass.

``python -m tests.harness.kind.images [--check]`` builds (and checks) with the cached binaries.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness.kind import gobuild
from tests.harness.kind.docker import Dockerd, DockerError
from tests.harness.kube import build as kube_build

ROOT = Path(__file__).resolve().parents[3]
CACHE = ROOT / ".cache" / "kind"
ROOTFS_DIR = CACHE / "rootfs"
LABEL = "io.ddpjob.kind.input"
SUITE = "bookworm"
MIRROR = os.environ.get("DDPJOB_DEBIAN_MIRROR", "http://deb.debian.org/debian")

# kind's images/base/Dockerfile list, without what a ddpjob cluster does not use (nfs-common,
# open-iscsi, e2fsprogs, fuse-overlayfs for rootless, curl).
BASE_PACKAGES = (
    "systemd", "conntrack", "iptables", "nftables", "iproute2", "ethtool", "util-linux", "mount",
    "kmod", "libseccomp2", "pigz", "bash", "ca-certificates", "jq", "procps",
)  # fmt: skip
PROXY_PACKAGES = ("iptables", "nftables", "conntrack", "ipset")

# Bump a recipe when what a step does changes in a way its inputs do not show.
ROOTFS_RECIPE = "rootfs-1"
BASE_RECIPE = "base-2"
COMPONENT_RECIPE = "component-1"
NODE_RECIPE = "node-1"

# The chroot steps of kind's images/base/Dockerfile (v0.33.0), after its files are copied.
BASE_CHROOT_SCRIPT = """set -eu
find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete
rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \
  /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \
  /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/*
echo ReadKMsg=no >> /etc/systemd/journald.conf
ln -sf /usr/lib/systemd/systemd /sbin/init
systemctl enable kubelet.service containerd.service undo-mount-hacks.service
systemctl mask systemd-binfmt.service
mkdir -p /etc/kubernetes/manifests /opt/cni/bin
chmod 755 /kind /kind/bin
"""
FAIL_CGROUPV1 = "--fail-cgroupv1=false"
FORWARD_SYSCTL = "net.ipv4.ip_forward=1\nnet.ipv6.conf.all.forwarding=1\n"
FORWARD_SYSCTL_PATH = "etc/sysctl.d/20-ddpjob-forward.conf"
ENTRYPOINT = '["/usr/local/bin/entrypoint", "/sbin/init"]'

# Where the node binaries go (kind's layout).
NODE_FILES = {
    "usr/bin": ("kubelet", "kubeadm", "kubectl"),
    "usr/local/bin": ("containerd", "containerd-shim-runc-v2", "ctr", "crictl"),
    "usr/local/sbin": ("runc",),
    "opt/cni/bin": ("host-local", "loopback", "ptp", "bridge", "portmap"),
}
CONTROL_PLANE = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd")
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# kind's docker run flags for a node (pkg/cluster/internal/providers/docker/provision.go),
# without the /lib/modules bind (this machine has none; -v would create it on the machine).
KIND_RUN_FLAGS = (
    "--detach", "--tty", "--restart=on-failure:1", "--init=false", "--cgroupns=private",
    "--privileged", "--security-opt", "seccomp=unconfined", "--security-opt",
    "apparmor=unconfined", "--tmpfs", "/tmp", "--tmpfs", "/run", "--volume", "/var",
)  # fmt: skip
READY = re.compile(r"Reached target .*Multi-User System")

TIMINGS: list[tuple[str, float]] = []


class ImageError(DockerError):
    """An image could not be built or failed its check; the message names the step and fix."""


# ---- small helpers ----------------------------------------------------------------------------


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[kind.images] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(name: str, quiet: bool = False) -> Iterator[None]:
    """Print ``==> name`` and, at the end, how long it took (kept in :data:`TIMINGS`)."""
    _say(f"==> {name}", quiet)
    started = time.monotonic()
    yield
    took = time.monotonic() - started
    TIMINGS.append((name, took))
    _say(f"<== {name}: {took:.1f}s", quiet)


def digest(*parts: str | bytes) -> str:
    """sha256 over the parts (length-prefixed, so ('ab', 'c') != ('a', 'bc'))."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(f"{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


_FILE_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: Path) -> str:
    """sha256 of a file's content and executable bit (memoized on size and mtime)."""
    info = path.stat()
    memo = (str(path.resolve()), info.st_size, info.st_mtime_ns)
    if memo not in _FILE_DIGESTS:
        h = hashlib.sha256()
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                h.update(chunk)
        _FILE_DIGESTS[memo] = digest(h.hexdigest(), str(bool(info.st_mode & 0o111)))
    return _FILE_DIGESTS[memo]


def tree_digest(root: Path) -> str:
    """sha256 over every file under ``root``: relative path and content."""
    parts: list[str] = []
    for path in sorted(root.rglob("*")):
        if path.is_file():
            parts += [str(path.relative_to(root)), file_digest(path)]
    return digest(*parts)


def _run(argv: Sequence[str], what: str, fix: str, **kwargs: object) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        tail = (result.stderr or result.stdout or "").strip().splitlines()[-3:]
        raise ImageError(f"{what}: exit {result.returncode}: {' | '.join(tail)}; {fix}")
    return str(result.stdout)


def image_label(dockerd: Dockerd, ref: str) -> str | None:
    """The input hash an image was built from, or None if the image is not there."""
    result = dockerd.docker("image", "inspect", "--format", f'{{{{index .Config.Labels "{LABEL}"}}}}',
                            ref, check=False)  # fmt: skip
    if result.returncode != 0:
        return None
    return result.stdout.strip()


def _is_current(dockerd: Dockerd, refs: Iterable[str], key: str) -> bool:
    return all(image_label(dockerd, ref) == key for ref in refs)


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    (CACHE / "tmp").mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE / "tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---- 1. root filesystems ----------------------------------------------------------------------


def rootfs_key(packages: Sequence[str], suite: str = SUITE) -> str:
    return digest(ROOTFS_RECIPE, suite, *sorted(packages))


def rootfs_tar(label: str, packages: Sequence[str], *, quiet: bool = False) -> Path:
    """The cached debootstrap tarball for ``packages`` (made if missing)."""
    key = rootfs_key(packages)
    target = ROOTFS_DIR / f"{label}-{SUITE}-{key[:12]}.tar"
    with step(f"rootfs {label} ({SUITE} minbase + {len(packages)} packages)", quiet):
        if target.is_file():
            _say(f"cached: {target}", quiet)
            return target
        if shutil.which("debootstrap") is None:
            raise ImageError("rootfs: `debootstrap` is not on PATH; apt-get install debootstrap")
        ROOTFS_DIR.mkdir(parents=True, exist_ok=True)
        with _scratch() as tmp:
            tree = tmp / "root"
            log = ROOTFS_DIR / f"{label}-debootstrap.log"
            with log.open("w") as handle:
                result = subprocess.run(
                    ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
                     SUITE, str(tree), MIRROR],
                    stdout=handle, stderr=subprocess.STDOUT, check=False,
                )  # fmt: skip
            if result.returncode != 0:
                raise ImageError(
                    f"rootfs {label}: debootstrap exit {result.returncode}: "
                    f"{_last_line(log)}; the whole output is in {log}; check that {MIRROR} "
                    "answers (DDPJOB_DEBIAN_MIRROR picks another mirror)"
                )
            for junk in ("var/lib/apt/lists", "var/cache/apt", "usr/share/doc", "usr/share/man",
                         "usr/share/info", "var/log"):  # fmt: skip
                for child in (tree / junk).glob("*"):
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
            partial = target.with_suffix(".partial")
            _run(["tar", "--numeric-owner", "-C", str(tree), "-cf", str(partial), "."],
                 f"rootfs {label}: tar", "is the disk full?")  # fmt: skip
            partial.rename(target)
        _say(f"built: {target} ({target.stat().st_size >> 20} MiB)", quiet)
        return target


def _last_line(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines()
    return lines[-1][:200] if lines else "?"


# ---- 2. the base image ------------------------------------------------------------------------


def base_files(kind_dir: Path) -> Path:
    files = kind_dir / "images" / "base" / "files"
    if not (files / "usr" / "local" / "bin" / "entrypoint").is_file():
        raise ImageError(f"base: {files} has no usr/local/bin/entrypoint; is {kind_dir} kind?")
    return files


def base_key(kind_dir: Path) -> str:
    return digest(BASE_RECIPE, rootfs_key(BASE_PACKAGES), tree_digest(base_files(kind_dir)),
                  BASE_CHROOT_SCRIPT, FAIL_CGROUPV1, FORWARD_SYSCTL, ENTRYPOINT)  # fmt: skip


def patch_containerd_config(text: str) -> str:
    """kind's containerd config with ``restrict_oom_score_adj = true``."""
    patched, count = re.subn(
        r"(?m)^([ \t]*restrict_oom_score_adj[ \t]*=[ \t]*)false[ \t]*$", r"\1true", text
    )
    if count != 1:
        raise ImageError(
            "base: kind's etc/containerd/config.toml has no `restrict_oom_score_adj = false` "
            "line to turn on; kind's files changed: update patch_containerd_config"
        )
    return patched


def patch_kubelet_default(text: str) -> str:
    """kind's /etc/default/kubelet with ``--fail-cgroupv1=false`` in KUBELET_EXTRA_ARGS."""
    lines = text.strip().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("KUBELET_EXTRA_ARGS="):
            if FAIL_CGROUPV1 not in line:
                lines[index] = f"{line.rstrip()} {FAIL_CGROUPV1}"
            return "\n".join(lines) + "\n"
    return "\n".join([*lines, f"KUBELET_EXTRA_ARGS={FAIL_CGROUPV1}"]) + "\n"


def install_base_files(files: Path, tree: Path) -> None:
    """Copy kind's base files into ``tree`` with the Dockerfile's modes (scripts 0755, the rest
    0644, directories 0755), then the three changes for this machine."""
    for source in sorted(files.rglob("*")):
        relative = source.relative_to(files)
        dest = tree / relative
        if source.is_dir():
            dest.mkdir(parents=True, exist_ok=True)
            dest.chmod(0o755)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
        script = relative.parts[:3] == ("usr", "local", "bin") or relative.parts[:2] == (
            "kind",
            "bin",
        )
        dest.chmod(0o755 if script else 0o644)
    config = tree / "etc" / "containerd" / "config.toml"
    config.write_text(patch_containerd_config(config.read_text()))
    default = tree / "etc" / "default" / "kubelet"
    default.write_text(patch_kubelet_default(default.read_text()))
    (tree / FORWARD_SYSCTL_PATH).write_text(FORWARD_SYSCTL)


def base_image(dockerd: Dockerd, kind_dir: Path, *, quiet: bool = False) -> str:
    """``ddpjob-local/kind-base:<hash>``, built if missing."""
    key = base_key(kind_dir)
    ref = f"ddpjob-local/kind-base:{key[:12]}"
    if _is_current(dockerd, [ref], key):
        _say(f"cached: {ref}", quiet)
        return ref
    tar_path = rootfs_tar("node", BASE_PACKAGES, quiet=quiet)
    with step(f"base image {ref}", quiet), _scratch() as tmp:
        tree = tmp / "root"
        tree.mkdir()
        _run(["tar", "--numeric-owner", "-C", str(tree), "-xf", str(tar_path)],
             "base: untar the rootfs", f"remove {tar_path} to make it again")  # fmt: skip
        install_base_files(base_files(kind_dir), tree)
        _run(["chroot", str(tree), "/bin/sh", "-c", BASE_CHROOT_SCRIPT],
             "base: kind's Dockerfile steps in a chroot", "see the message")  # fmt: skip
        raw = f"ddpjob-local/kind-base-raw:{key[:12]}"
        packer = subprocess.Popen(["tar", "--numeric-owner", "-C", str(tree), "-cf", "-", "."],
                                  stdout=subprocess.PIPE)  # fmt: skip
        imported = dockerd.docker(
            "import", "--change", "ENV container=docker", "--change", f"ENTRYPOINT {ENTRYPOINT}",
            "-", raw, stdin=packer.stdout, check=False,
        )  # fmt: skip
        packer.wait()
        if imported.returncode != 0 or packer.returncode != 0:
            raise ImageError(f"base: docker import: {imported.stderr.strip()}")
        # docker 20.10's import refuses STOPSIGNAL; a two-line build adds it (and the label).
        context = tmp / "context"
        context.mkdir()
        (context / "Dockerfile").write_text(
            f"FROM {raw}\nSTOPSIGNAL SIGRTMIN+3\nLABEL {LABEL}={key}\n"
        )
        built = dockerd.docker("build", "--network=none", "-q", "-t", ref, str(context),
                               check=False, env_extra={"DOCKER_BUILDKIT": "0"})  # fmt: skip
        if built.returncode != 0:
            raise ImageError(f"base: docker build (STOPSIGNAL): {built.stderr.strip()}")
        dockerd.docker("rmi", raw, check=False)
        _drop_other_tags(dockerd, ref)
    return ref


def _drop_other_tags(dockerd: Dockerd, ref: str) -> None:
    """Untag the older builds of ``ref``'s repository (their layers go when nothing uses them)."""
    repository = ref.rsplit(":", 1)[0]
    listed = dockerd.docker("images", "--format", "{{.Repository}}:{{.Tag}}", repository,
                            check=False).stdout.split()  # fmt: skip
    for other in listed:
        if other != ref:
            dockerd.docker("rmi", other, check=False)


# ---- 3. component images ----------------------------------------------------------------------


@dataclass(frozen=True)
class Component:
    """An image kubeadm or kind starts: exact references, the files it carries, its config."""

    refs: tuple[str, ...]
    files: tuple[tuple[str, Path], ...]  # (path in the image, source)
    entrypoint: tuple[str, ...] = ()
    user: str = ""
    rootfs: tuple[str, tuple[str, ...]] | None = None  # (label, packages) of a debootstrap base
    env: tuple[str, ...] = (PATH_ENV,)

    def key(self) -> str:
        parts: list[str] = [COMPONENT_RECIPE, *self.refs, *self.entrypoint, self.user, *self.env]
        for path, source in self.files:
            parts += [path, file_digest(source)]
        if self.rootfs is not None:
            parts.append(rootfs_key(self.rootfs[1]))
        return digest(*parts)

    def changes(self, key: str) -> list[str]:
        changes = [f"ENV {entry}" for entry in self.env]
        if self.entrypoint:
            changes.append(f"ENTRYPOINT {json.dumps(list(self.entrypoint))}")
        if self.user:
            changes.append(f"USER {self.user}")
        changes.append(f"LABEL {LABEL}={key}")
        return changes


def _image_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1].split(":", 1)[0]


def kubeadm_images(kubeadm: Path | None, version: str) -> list[str]:
    """The images kubeadm wants for ``version``: ``kubeadm config images list`` if we have the
    binary, else the constants of k8s.io/kubernetes in the Go module cache."""
    if kubeadm is not None and kubeadm.is_file():
        out = _run([str(kubeadm), "config", "images", "list", "--kubernetes-version", version],
                   "kubeadm config images list", f"does {kubeadm} run?")  # fmt: skip
        return [line.strip() for line in out.splitlines() if line.strip()]
    gomodcache = _run(["go", "env", "GOMODCACHE"], "go env", "install Go").strip()
    constants = (
        Path(gomodcache) / f"k8s.io/kubernetes@{version}/cmd/kubeadm/app/constants/constants.go"
    )
    text = constants.read_text()

    def const(name: str) -> str:
        found = re.search(rf'^\s*{name}\s*=\s*"([^"]+)"', text, re.M)
        if found is None:
            raise ImageError(f"images: no {name} in {constants}")
        return found.group(1)

    registry = "registry.k8s.io"
    return [
        *(f"{registry}/{name}:{version}" for name in
          ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy")),
        f"{registry}/coredns/coredns:{const('CoreDNSVersion')}",
        f"{registry}/pause:{const('PauseVersion')}",
        f"{registry}/etcd:{const('DefaultEtcdVersion')}",
    ]  # fmt: skip


def sandbox_image(kind_dir: Path) -> str:
    """The ``sandbox_image`` of kind's containerd config (kind bakes pause under it too)."""
    text = (base_files(kind_dir) / "etc" / "containerd" / "config.toml").read_text()
    found = re.search(r'sandbox_image\s*=\s*"([^"]+)"', text)
    if found is None:
        raise ImageError("images: kind's containerd config.toml has no sandbox_image")
    return found.group(1)


def components(
    wanted: Sequence[str], bins: Path | None, control_plane_bins: Path, extra_pause: str = ""
) -> list[Component]:
    """One :class:`Component` per image in ``wanted`` (kubeadm's list). Images whose binary
    lives in ``bins`` (kube-proxy, coredns, pause) are left out when ``bins`` is None."""
    by_name = {_image_name(ref): ref for ref in wanted}
    unknown = set(by_name) - {*CONTROL_PLANE, "kube-proxy", "coredns", "pause"}
    if unknown:
        raise ImageError(f"images: kubeadm wants images we do not make: {sorted(unknown)}")
    result = []
    missing = [name for name in CONTROL_PLANE if not (control_plane_bins / name).is_file()]
    if bins is not None:
        missing += [
            str(bins / n) for n in ("kube-proxy", "coredns", "pause") if not (bins / n).is_file()
        ]
    if missing:
        raise ImageError(
            f"images: binaries missing: {missing} (control plane in {control_plane_bins}); "
            "build them first (make kube; python -m tests.harness.kind build)"
        )
    for name in CONTROL_PLANE:
        binary = control_plane_bins / name
        result.append(Component(refs=(by_name[name],),
                                files=((f"usr/local/bin/{name}", binary),)))  # fmt: skip
    if bins is None:
        return result
    result.append(Component(
        refs=(by_name["kube-proxy"],), files=(("usr/local/bin/kube-proxy", bins / "kube-proxy"),),
        rootfs=("kube-proxy", PROXY_PACKAGES),
    ))  # fmt: skip
    result.append(Component(refs=(by_name["coredns"],), files=(("coredns", bins / "coredns"),),
                            entrypoint=("/coredns",), env=()))  # fmt: skip
    pause_refs = tuple(dict.fromkeys([by_name["pause"], *([extra_pause] if extra_pause else [])]))
    result.append(Component(refs=pause_refs, files=(("pause", bins / "pause"),),
                            entrypoint=("/pause",), user="65535:65535", env=()))  # fmt: skip
    return result


def _scratch_tar(component: Component) -> Callable[[tarfile.TarFile], None]:
    def write(tar: tarfile.TarFile) -> None:
        tmp = tarfile.TarInfo("tmp")
        tmp.type, tmp.mode = tarfile.DIRTYPE, 0o1777
        tar.addfile(tmp)
        for path, source in component.files:
            if not source.is_file():
                raise ImageError(f"images: {source} is missing (for {component.refs[0]})")
            info = tar.gettarinfo(str(source), arcname=path)
            info.mode, info.uid, info.gid, info.uname, info.gname = 0o755, 0, 0, "root", "root"
            with source.open("rb") as handle:
                tar.addfile(info, handle)

    return write


def _rootfs_plus(tar_path: Path, component: Component) -> Callable[[tarfile.TarFile], None]:
    extra = _scratch_tar(component)

    def write(tar: tarfile.TarFile) -> None:
        with tarfile.open(tar_path, "r:") as source:
            for member in source:
                if member.name.lstrip("./") == "tmp":
                    continue
                handle = source.extractfile(member) if member.isreg() else None
                tar.addfile(member, handle)
        extra(tar)

    return write


def _docker_import(dockerd: Dockerd, ref: str, changes: Sequence[str],
                   write: Callable[[tarfile.TarFile], None]) -> None:  # fmt: skip
    argv = ["docker", "import"]
    for change in changes:
        argv += ["--change", change]
    process = subprocess.Popen([*argv, "-", ref], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=dockerd.env())  # fmt: skip
    assert process.stdin is not None
    try:
        with tarfile.open(fileobj=process.stdin, mode="w|", format=tarfile.GNU_FORMAT) as tar:
            write(tar)
    except BrokenPipeError:
        pass
    finally:
        with contextlib.suppress(BrokenPipeError):
            process.stdin.close()
    assert process.stderr is not None
    err = process.stderr.read()
    process.wait()
    if process.returncode != 0:
        raise ImageError(f"images: docker import {ref}: {err.decode(errors='replace').strip()}")


def component_image(dockerd: Dockerd, component: Component, *, quiet: bool = False) -> str:
    """Build ``component`` unless an image with its input hash carries all its refs; returns
    the key."""
    key = component.key()
    first = component.refs[0]
    if _is_current(dockerd, component.refs, key):
        _say(f"cached: {' '.join(component.refs)}", quiet)
        return key
    if component.rootfs is not None:
        base_tar = rootfs_tar(component.rootfs[0], component.rootfs[1], quiet=quiet)
    with step(f"component {first}", quiet):
        old = dockerd.docker("image", "inspect", "--format", "{{.Id}}", first, check=False)
        write = (_rootfs_plus(base_tar, component) if component.rootfs is not None
                 else _scratch_tar(component))  # fmt: skip
        _docker_import(dockerd, first, component.changes(key), write)
        for ref in component.refs[1:]:
            dockerd.docker("tag", first, ref)
        _drop_if_dangling(dockerd, old.stdout.strip() if old.returncode == 0 else "")
    return key


def _drop_if_dangling(dockerd: Dockerd, image_id: str) -> None:
    """Remove an image we replaced, if no tag and no container holds it any more."""
    if not image_id:
        return
    tags = dockerd.docker("image", "inspect", "--format", "{{len .RepoTags}}", image_id,
                          check=False)  # fmt: skip
    if tags.returncode == 0 and tags.stdout.strip() == "0":
        dockerd.docker("rmi", image_id, check=False)


# ---- 4. the node image ------------------------------------------------------------------------


def node_image_ref(version: str) -> str:
    return os.environ.get("KIND_NODE_IMAGE") or f"kindest/node:{version}-ddpjob"


def node_files(bins: Path) -> list[tuple[str, Path]]:
    return [(f"{where}/{name}", bins / name) for where, names in NODE_FILES.items()
            for name in names]  # fmt: skip


def node_key(base: str, component_keys: Sequence[str], bins: Path, version: str) -> str:
    parts = [NODE_RECIPE, base, version, *component_keys]
    for path, source in node_files(bins):
        parts += [path, file_digest(source)]
    return digest(*parts)


def kubernetes_version(bins: Path) -> str:
    out = _run([str(bins / "kubeadm"), "version", "-o", "short"], "kubeadm version",
               f"is {bins / 'kubeadm'} a kubeadm binary?")  # fmt: skip
    return out.strip()


def _docker_cp(
    dockerd: Dockerd, container: str, entries: Sequence[tuple[str, Path | bytes]]
) -> None:
    """Stream a tar of ``entries`` (path in the container: a binary, 0755, or bytes, 0644,
    owned by root) into ``docker cp - CONTAINER:/``."""
    process = subprocess.Popen(
        ["docker", "cp", "-", f"{container}:/"], stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dockerd.env(),
    )  # fmt: skip
    assert process.stdin is not None and process.stderr is not None
    with contextlib.suppress(BrokenPipeError):
        with tarfile.open(fileobj=process.stdin, mode="w|", format=tarfile.GNU_FORMAT) as tar:
            for path, content in entries:
                info = tarfile.TarInfo(path)
                info.mtime = int(time.time())
                if isinstance(content, bytes):
                    info.size, info.mode = len(content), 0o644
                    tar.addfile(info, io.BytesIO(content))
                else:
                    info.size, info.mode = content.stat().st_size, 0o755
                    with content.open("rb") as handle:
                        tar.addfile(info, handle)
        process.stdin.close()
    err = process.stderr.read().decode(errors="replace").strip()
    if process.wait() != 0:
        raise ImageError(f"node: docker cp into the build container: {err}")


def cri_base_spec(spec: dict[str, object]) -> dict[str, object]:
    """kind's cri-base.json from ``ctr oci spec``: a createContainer hook that mounts the
    product files, and no rlimits."""
    hooks = spec.setdefault("hooks", {})
    assert isinstance(hooks, dict)
    hooks.setdefault("createContainer", []).append({"path": "/kind/bin/mount-product-files.sh"})
    process = spec.get("process")
    if isinstance(process, dict):
        process.pop("rlimits", None)
    return spec


def _wait(probe: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.3)
    raise ImageError(what)


def bake(dockerd: Dockerd, base: str, bins: Path, comps: Sequence[Component], version: str,
         ref: str, key: str, *, quiet: bool = False) -> None:  # fmt: skip
    """kind's ``build node-image`` without any fetch: every component imported from here."""
    with step("node: start the build container", quiet):
        container = dockerd.docker(
            "run", "-d", "--network=none", "--entrypoint=sleep", "--security-opt",
            "seccomp=unconfined", base, "infinity",
        ).stdout.strip()  # fmt: skip
    try:
        with step("node: copy binaries and /kind/version", quiet):
            missing = [str(source) for _, source in node_files(bins) if not source.is_file()]
            if missing:
                raise ImageError(f"node: binaries missing from {bins}: {missing}; run gobuild")
            files: list[tuple[str, Path | bytes]] = [
                *node_files(bins),
                ("kind/version", version.encode()),
            ]
            _docker_cp(dockerd, container, files)
            spec = json.loads(dockerd.docker("exec", container, "ctr", "oci", "spec").stdout)
            cri = json.dumps(cri_base_spec(spec), indent=2).encode()
            _docker_cp(dockerd, container, [("etc/containerd/cri-base.json", cri)])
        with step("node: containerd + ctr import of every component", quiet):
            dockerd.docker("exec", container, "sh", "-c",
                           "nohup containerd >/tmp/containerd.log 2>&1 &")  # fmt: skip
            _wait(lambda: dockerd.docker("exec", container, "ctr", "version",
                                         check=False).returncode == 0,
                  60, "node: containerd did not start in the build container "
                  f"(docker exec {container} cat /tmp/containerd.log)")  # fmt: skip
            for component in comps:
                _ctr_import(dockerd, container, component.refs)
            listed = set(dockerd.docker("exec", container, "ctr", "-n", "k8s.io", "images", "ls",
                                        "-q").stdout.split())  # fmt: skip
            absent = [r for c in comps for r in c.refs if r not in listed]
            if absent:
                raise ImageError(f"node: not in the node's containerd after import: {absent}")
            dockerd.docker("exec", container, "pkill", "containerd")
            # `sleep` is PID 1 here and reaps nobody: a stopped containerd stays a zombie.
            live = "for p in $(pgrep -x containerd); do grep -q '^State:.*Z' /proc/$p/status || exit 0; done; exit 1"
            _wait(
                lambda: (
                    dockerd.docker("exec", container, "sh", "-c", live, check=False).returncode != 0
                ),
                30,
                "node: containerd did not stop in the build container",
            )
            dockerd.docker("exec", container, "rm", "-f", "/tmp/containerd.log")
        with step(f"node: docker commit {ref}", quiet):
            old = dockerd.docker("image", "inspect", "--format", "{{.Id}}", ref, check=False)
            dockerd.docker("commit", "--change", f"ENTRYPOINT {ENTRYPOINT}", "--change",
                           f"LABEL {LABEL}={key}", container, ref)  # fmt: skip
            _drop_if_dangling(dockerd, old.stdout.strip() if old.returncode == 0 else "")
    finally:
        dockerd.docker("rm", "-f", container, check=False)


def _ctr_import(dockerd: Dockerd, container: str, refs: Sequence[str]) -> None:
    saver = subprocess.Popen(["docker", "save", *refs], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=dockerd.env())  # fmt: skip
    importer = subprocess.run(
        ["docker", "exec", "-i", container, "ctr", "-n", "k8s.io", "images", "import",
         "--label=io.cri-containerd.pinned=pinned", "--all-platforms", "--no-unpack",
         "--digests", "-"],
        stdin=saver.stdout, capture_output=True, text=True, env=dockerd.env(), check=False,
    )  # fmt: skip
    assert saver.stderr is not None and saver.stdout is not None
    saver.stdout.close()
    saved_err = saver.stderr.read().decode(errors="replace")
    saver.wait()
    if saver.returncode != 0 or importer.returncode != 0:
        raise ImageError(
            f"node: docker save {' '.join(refs)} | ctr import: "
            f"{saved_err.strip()} {importer.stderr.strip()}"
        )


def build_node_image(
    dockerd: Dockerd, bins: Path, control_plane_bins: Path, *, quiet: bool = False
) -> str:
    """The node image for the binaries in ``bins`` (tests.harness.kind.gobuild.build()) and
    ``control_plane_bins`` (tests.harness.kube.build.bin_dir()); built if its inputs changed. Returns
    its reference (``kindest/node:<version>-ddpjob``, or ``$KIND_NODE_IMAGE``)."""
    with kube_build.exclusive(CACHE / "images.lock"), step("node image (all steps)", quiet):
        kind_dir = gobuild.kind_module_dir()
        version = kubernetes_version(bins)
        ref = node_image_ref(version)
        base = base_image(dockerd, kind_dir, quiet=quiet)
        dockerd.check_privileged(base)
        wanted = kubeadm_images(bins / "kubeadm", version)
        comps = components(wanted, bins, control_plane_bins, sandbox_image(kind_dir))
        keys = [component_image(dockerd, component, quiet=quiet) for component in comps]
        key = node_key(base, keys, bins, version)
        if image_label(dockerd, ref) == key:
            _say(f"cached: {ref}", quiet)
            return ref
        bake(dockerd, base, bins, comps, version, ref, key, quiet=quiet)
        _say(f"built: {ref}", quiet)
        return ref


# ---- checks -----------------------------------------------------------------------------------


@dataclass
class NodeCheck:
    """What :func:`check_node` saw."""

    ready_after: float = 0.0
    images: list[str] = field(default_factory=list)
    containerd: str = ""


def check_node(dockerd: Dockerd, ref: str, expected: Iterable[str] = (), *,
               quiet: bool = False) -> NodeCheck:  # fmt: skip
    """Start ``ref`` as kind starts a node (its docker run flags, on a bridge network of its
    own), wait for systemd's multi-user target, list the baked images, remove it all."""
    network = "ddpjob-probe"
    name = "ddpjob-probe-node"
    dockerd.docker("rm", "-f", "-v", name, check=False)
    if dockerd.docker("network", "inspect", network, check=False).returncode != 0:
        dockerd.docker("network", "create", network)
    result = NodeCheck()
    try:
        with step(f"check: boot {ref} with kind's flags", quiet):
            started = time.monotonic()
            dockerd.docker("run", *KIND_RUN_FLAGS, "--net", network, "--name", name,
                           "--hostname", name, ref)  # fmt: skip

            def ready() -> bool:
                logs = dockerd.docker("logs", name, check=False)
                if READY.search(logs.stdout + logs.stderr):
                    return True
                state = dockerd.docker("inspect", "--format", "{{.State.Running}}", name,
                                       check=False).stdout.strip()  # fmt: skip
                if state == "false":
                    raise ImageError(
                        f"check: node exited before systemd was up:\n{logs.stdout[-2000:]}"
                    )
                return False

            _wait(ready, 120, f"check: no 'Reached target Multi-User System' in 120s "
                  f"(docker logs {name})")  # fmt: skip
            result.ready_after = time.monotonic() - started
        with step("check: baked images and containerd in the node", quiet):
            _wait(lambda: dockerd.docker("exec", name, "ctr", "version",
                                         check=False).returncode == 0,
                  60, "check: containerd in the node does not answer")  # fmt: skip
            out = dockerd.docker("exec", "--privileged", name, "ctr", "-n", "k8s.io", "images",
                                 "ls", "-q").stdout  # fmt: skip
            result.images = sorted(line for line in out.split() if not line.startswith("sha256:"))
            result.containerd = dockerd.docker(
                "exec", name, "containerd", "--version"
            ).stdout.strip()
            absent = sorted(set(expected) - set(result.images))
            if absent:
                raise ImageError(f"check: images missing in the node: {absent}")
    finally:
        dockerd.docker("rm", "-f", "-v", name, check=False)
        dockerd.docker("network", "rm", network, check=False)
    return result


def _cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.kind.images", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--check", action="store_true", help="boot the node image and list images")
    parser.add_argument("--control-plane-only", action="store_true",
                        help="only the base image and the four control-plane images")  # fmt: skip
    parser.add_argument("--keep-daemon", action="store_true", help="leave dockerd running")
    parser.add_argument("--control-plane-bins", type=Path, default=None,
                        help="default: tests.harness.kube.build.bin_dir()")  # fmt: skip
    args = parser.parse_args(argv)
    control_plane = args.control_plane_bins or kube_build.bin_dir()
    started = time.monotonic()
    dockerd = Dockerd()
    try:
        dockerd.start(keep=args.keep_daemon)
        if args.control_plane_only:
            kind_dir = gobuild.kind_module_dir()
            base = base_image(dockerd, kind_dir)
            with step("check: docker run --rm --privileged"):
                dockerd.check_privileged(base)
            wanted = kubeadm_images(None, kube_build.kubernetes_version())
            for component in components(wanted, None, control_plane):
                component_image(dockerd, component)
        else:
            bins = gobuild.bin_dir()
            ref = build_node_image(dockerd, bins, control_plane)
            if args.check:
                wanted = kubeadm_images(bins / "kubeadm", kubernetes_version(bins))
                seen = check_node(dockerd, ref, wanted)
                print(f"node ready after {seen.ready_after:.1f}s; {seen.containerd}")
                print("\n".join(seen.images))
    except DockerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        if not args.keep_daemon:
            dockerd.stop()
    for name, took in TIMINGS:
        print(f"{took:7.1f}s  {name}", file=sys.stderr)
    print(f"{time.monotonic() - started:7.1f}s  total", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
