"""How much memory the container has left: its cgroup's limit minus its working set.

Warm spares (:mod:`ddpjob_worker.agent.warm`) start only when it holds them. The kubelet and the OOM
killer judge a container by its working set: what the cgroup has charged (``memory.current``,
or ``memory.usage_in_bytes`` under cgroup v1) less the inactive page cache the kernel can drop
at once (``inactive_file``). Stdlib only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

UNLIMITED = 1 << 62
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is none."""


@dataclasses.dataclass(frozen=True)
class Memory:
    """A cgroup's memory limit and working set, in bytes."""

    limit: int
    working_set: int

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.working_set)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _stat(path: Path, key: str) -> int:
    text = _read(path) or ""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _cgroup_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and cgroup v1 memory path, from ``/proc/self/cgroup``."""
    unified = v1 = None
    for line in (_read(proc_cgroup) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            unified = path
        elif "memory" in controllers.split(","):
            v1 = path
    return unified, v1


def _candidates(root: Path, path: str | None) -> list[Path]:
    """The cgroup's directory, then the mount's root (a container with a cgroup namespace of its
    own sees its cgroup there, while ``/proc/self/cgroup`` may name a path outside it)."""
    found = [root / path.lstrip("/")] if path and path != "/" else []
    return [*found, root]


def container_memory(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> Memory | None:
    """This process's cgroup memory, or None when it has no limit or none can be read."""
    unified, v1 = _cgroup_paths(proc_cgroup)
    if unified is not None and (root / "cgroup.controllers").exists():
        for directory in _candidates(root, unified):
            limit, current = _read(directory / "memory.max"), _read(directory / "memory.current")
            if limit is None or current is None or not current.isdigit():
                continue
            if not limit.isdigit() or int(limit) >= UNLIMITED:
                return None
            inactive = _stat(directory / "memory.stat", "inactive_file")
            return Memory(int(limit), max(0, int(current) - inactive))
    if v1 is not None:
        for directory in _candidates(root / "memory", v1):
            limit = _read(directory / "memory.limit_in_bytes")
            usage = _read(directory / "memory.usage_in_bytes")
            if limit is None or usage is None or not limit.isdigit() or not usage.isdigit():
                continue
            if int(limit) >= UNLIMITED:
                return None
            inactive = _stat(directory / "memory.stat", "total_inactive_file")
            return Memory(int(limit), max(0, int(usage) - inactive))
    return None
