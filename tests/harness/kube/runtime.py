"""What the process kubelet needs besides the API: images, pod sandboxes, volumes, cgroups.

A pod runs as real processes on this machine, with the same process layer as ``ddpjob run``
(:mod:`ddpjob_operator.local.pods`). What stands in for a container runtime:

* **Images** are a table (:class:`Images`): an image name maps to an entrypoint, a cmd, env, a
  working directory, a user and the files the image would carry (copy-on-write overlays of this
  machine's files, say the repo's ``examples/`` at ``/opt/ddpjob/examples``). The programs come from
  the dev venv. An image not in the table fails to pull, as a missing image would.
* **The sandbox** of a pod is a directory with its ``/etc/hosts`` and ``/etc/resolv.conf`` (as
  the kubelet writes them), its volumes, and an address of its own (local to this machine) as
  its pod IP. The network namespace is the machine's: pods have their own addresses but share
  the port space (binding ``0.0.0.0:P`` in two pods collides).
* **Each container** starts under ``unshare --mount --uts``: its own hostname, the pod's hosts
  and resolv.conf bind-mounted over the machine's, and each volume bind-mounted at its
  ``mountPath`` (memory-backed emptyDirs are a tmpfs of their ``sizeLimit``). Mount points
  that do not exist are created on the machine's filesystem (empty directories). Processes
  run as the kubelet's user (root); ``runAsUser`` is not applied, but ``runAsNonRoot`` is
  checked against the image's user as the kubelet does.
* **Memory limits** are a memory cgroup per container (v1 or v2, under the kubelet's own),
  when the machine lets us write one: a container over its limit is OOM-killed by the kernel
  and reported ``OOMKilled``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpjob_operator.builders import parse_quantity

JSON = dict[str, Any]
ROOT = Path(__file__).resolve().parents[3]
SETUP_FAILED = 128
"""The init's exit code when the container could not be set up (containerd: StartError)."""
SETUP_MARKER = "process-kubelet: container set-up failed"
"""The init's last line then (tests/harness/kube/init.py)."""


@dataclasses.dataclass(frozen=True)
class Image:
    name: str
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    working_dir: str = "/"
    user: int = 0
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """mount path in the container -> path on this machine (the image's contents)."""


def repository(reference: str) -> str:
    """``ghcr.io/x/y:1.0@sha256:...`` -> ``ghcr.io/x/y``."""
    name = reference.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


class Images:
    def __init__(self, images: Iterable[Image]) -> None:
        self.by_name = {image.name: image for image in images}

    def resolve(self, reference: str) -> Image | None:
        return self.by_name.get(reference) or self.by_name.get(repository(reference))

    def names(self) -> list[str]:
        return sorted(self.by_name)

    @classmethod
    def from_json(cls, items: Sequence[JSON]) -> Images:
        return cls(
            Image(
                name=str(item["name"]),
                entrypoint=tuple(item.get("entrypoint") or ()),
                cmd=tuple(item.get("cmd") or ()),
                env=dict(item.get("env") or {}),
                working_dir=str(item.get("workingDir") or "/"),
                user=int(item.get("user") or 0),
                files=dict(item.get("files") or {}),
            )
            for item in items
        )


def default_images() -> list[JSON]:
    """The images the tests and the examples use, made of this machine's dev venv and repo."""
    venv_bin = str(Path(sys.executable).parent)
    path = f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env = {"PATH": path, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    worker = {
        "env": env,
        "cmd": ["ddpjob-agent", "--help"],
        "workingDir": "/opt/ddpjob/examples",
        "user": 65532,
        # The Dockerfile's worker-cpu: examples/ at /opt/ddpjob/examples, and /app -> /opt/ddpjob.
        "files": {
            "/opt/ddpjob/examples": str(ROOT / "examples"),
            "/app/examples": str(ROOT / "examples"),
        },
    }
    operator = {"env": env, "entrypoint": ["ddpjob", "operator"], "user": 65532}
    plain = {"env": env, "user": 0}  # a shell and python, for init containers and test pods
    return [
        {"name": "ghcr.io/ddpjob/ddpjob-operator", **operator},
        {"name": "ddpjob-operator", **operator},
        {"name": "ghcr.io/ddpjob/ddpjob-worker-cpu", **worker},
        {"name": "ddpjob-worker-cpu", **worker},
        {"name": "ddpjob/worker-cpu", **worker},
        {"name": "busybox", **plain, "cmd": ["sh"]},
        {"name": "python", **plain, "cmd": ["python3"]},
    ]


def fake_trainer_image(control_dir: Path) -> JSON:
    """``ddpjob/fake-trainer``: :mod:`tests.harness.kube.fakepod`, told what to do in ``control_dir``."""
    venv_bin = str(Path(sys.executable).parent)
    return {
        "name": "ddpjob/fake-trainer",
        "entrypoint": [str(Path(venv_bin) / "python"), "-m", "tests.harness.kube.fakepod"],
        "env": {
            "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "FAKEPOD_DIR": str(control_dir),
        },
        "user": 65532,
    }


# ---- addresses ----------------------------------------------------------------------------


class Addresses:
    """Pod IPs from the node's pod CIDR; .1 is left out (a router's, by custom)."""

    def __init__(self, cidr: str) -> None:
        self.network = ipaddress.ip_network(cidr)
        self.used: set[str] = set()

    def take(self) -> str:
        for host in list(self.network.hosts())[1:]:
            address = str(host)
            if address not in self.used:
                self.used.add(address)
                return address
        raise RuntimeError(f"no pod IP left in {self.network}")

    def give_back(self, address: str) -> None:
        self.used.discard(address)


# ---- memory cgroups ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cgroups:
    """A directory of per-container memory cgroups under the kubelet's own (None: not writable)."""

    root: Path
    v2: bool

    @classmethod
    def named(cls, name: str) -> Cgroups | None:
        """``name`` under our own memory cgroup, whether or not it exists."""
        own = _own_memory_cgroup()
        return None if own is None else cls(own[0] / name, own[1])

    @classmethod
    def find(cls, name: str) -> Cgroups | None:
        """``name`` under the kubelet's own memory cgroup, if a child with a limit can be made."""
        own = _own_memory_cgroup()
        if own is None:
            return None
        base, v2 = own
        root = base / name
        try:
            probe = root / "probe"
            probe.mkdir(parents=True, exist_ok=True)
            limit = probe / ("memory.max" if v2 else "memory.limit_in_bytes")
            found = limit.exists()
            probe.rmdir()
        except OSError:
            return None
        return cls(root, v2) if found else None

    def create(self, key: str, limit_bytes: int | None) -> Path | None:
        """A container's cgroup: every process it starts stays in it (the kubelet reads its
        members to stop the container), with the memory limit if there is one."""
        path = self.root / key
        try:
            path.mkdir(parents=True, exist_ok=True)
            if limit_bytes is not None:
                name = "memory.max" if self.v2 else "memory.limit_in_bytes"
                (path / name).write_text(str(limit_bytes))
                if not self.v2:
                    with contextlib.suppress(OSError):  # no swap for a limited container
                        (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except OSError:
            return None
        return path

    def oom_kills(self, path: Path) -> int:
        name = "memory.events" if self.v2 else "memory.oom_control"
        try:
            for line in (path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, path: Path) -> None:
        with contextlib.suppress(OSError):
            path.rmdir()

    def remove_all(self) -> None:
        """This cgroup and every one under it (all empty once their processes are gone)."""
        for child in sorted(self.root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if child.is_dir():
                self.remove(child)
        self.remove(self.root)


def _own_memory_cgroup() -> tuple[Path, bool] | None:
    """The kubelet's memory cgroup directory, and whether it is cgroup v2."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), False
    for line in lines:
        if line.startswith("0::"):
            return Path("/sys/fs/cgroup") / line[3:].lstrip("/"), True
    return None


def memory_limit(container: Mapping[str, Any]) -> int | None:
    limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    return None if limit is None else int(parse_quantity(limit))


# ---- the sandbox and the wrapper -----------------------------------------------------------


def hosts_file(pod_ip: str, hostname: str, fqdn: str | None) -> str:
    """``/etc/hosts`` as the kubelet writes it for a pod."""
    lines = [
        "# Kubernetes-managed hosts file (process kubelet).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        "fe00::0\tip6-localnet",
        "fe00::0\tip6-mcastprefix",
        "fe00::1\tip6-allnodes",
        "fe00::2\tip6-allrouters",
        f"{pod_ip}\t{fqdn}\t{hostname}" if fqdn else f"{pod_ip}\t{hostname}",
    ]
    return "\n".join(lines) + "\n"


def resolv_conf(namespace: str, nameserver: str, domain: str) -> str:
    """``/etc/resolv.conf`` of a ``ClusterFirst`` pod."""
    search = f"{namespace}.svc.{domain} svc.{domain} {domain}"
    return f"search {search}\nnameserver {nameserver}\noptions ndots:5\n"


@dataclasses.dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False
    tmpfs_bytes: int | None = None
    """A tmpfs of this size instead of a bind mount of ``source``."""
    overlay: tuple[str, str] | None = None
    """(upper, work) directories: ``source`` copy-on-write, as an image's files are."""


def protected_paths() -> list[str]:
    """What the containers' programs live in: a volume mounted over a parent of one of them
    (an emptyDir at /tmp while the repo is under /tmp, say) must not hide it."""
    paths = {str(ROOT), sys.prefix, sys.base_prefix, str(Path(sys.executable).parent)}
    return sorted(p for p in paths if p != "/")


def wrapper(
    *,
    hostname: str,
    hosts: Path,
    resolv: Path,
    mounts: Sequence[Mount],
    working_dir: str,
    cgroup: Path | None,
    netns: Path | None = None,
) -> list[str]:
    """The argv prefix that sets a container up and then ``exec``s its command: new mount and
    UTS namespaces (``unshare``), then :mod:`tests.harness.kube.init` with this container's spec (which
    enters the pod's network namespace, if it has one)."""
    spec = {
        "hostname": hostname,
        "hosts": str(hosts),
        "resolv": str(resolv),
        "mounts": [
            {
                "source": m.source,
                "target": m.target,
                "readOnly": m.read_only,
                "tmpfsBytes": m.tmpfs_bytes,
                "overlay": list(m.overlay) if m.overlay else None,
            }
            for m in mounts
        ],
        "keep": protected_paths(),
        "workingDir": working_dir,
        "cgroup": None if cgroup is None else str(cgroup),
        "netns": None if netns is None else str(netns),
    }
    unshare = shutil.which("unshare") or "unshare"
    init = str(Path(__file__).with_name("init.py"))
    return [
        unshare, "--mount", "--uts", "--propagation", "private", "--",
        sys.executable, "-I", "-S", init, json.dumps(spec),
    ]  # fmt: skip


def mount_tmpfs(path: Path, size_bytes: int) -> bool:
    """A memory-backed emptyDir, shared by the pod's containers (unmounted at clean-up)."""
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


def unmount_all(directory: Path) -> None:
    """Unmount every mount under ``directory`` (deepest first)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return
    prefix = str(directory).rstrip("/") + "/"
    targets = [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]
    for target in sorted(targets, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)


def write_file(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(payload)
    os.chmod(tmp, mode)
    tmp.replace(path)
