"""ddpjob_worker.agent.memory: a container's memory limit and working set, from cgroup trees laid out
as the kernel lays them out (v2, v1, a cgroup namespace of its own, no limit)."""

from __future__ import annotations

from pathlib import Path

from ddpjob_worker.agent.memory import Memory, container_memory

GIB = 1 << 30


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_headroom_is_the_limit_less_the_working_set(tmp_path: Path) -> None:
    proc = tree(tmp_path, {"cgroup": "0::/kubepods/pod1/ctr\n"}) / "cgroup"
    root = tree(
        tmp_path / "fs",
        {
            "cgroup.controllers": "cpu memory pids\n",
            "kubepods/pod1/ctr/memory.max": f"{8 * GIB}\n",
            "kubepods/pod1/ctr/memory.current": f"{5 * GIB}\n",
            "kubepods/pod1/ctr/memory.stat": f"anon 1\ninactive_file {GIB}\nactive_file 7\n",
        },
    )
    memory = container_memory(root, proc)
    assert memory == Memory(limit=8 * GIB, working_set=4 * GIB)
    assert memory.headroom == 4 * GIB


def test_a_cgroup_namespace_of_its_own_is_read_at_the_mounts_root(tmp_path: Path) -> None:
    # /proc/self/cgroup names a path the container cannot see; its own cgroup is the root.
    proc = tree(tmp_path, {"cgroup": "0::/../../kubepods/pod1/ctr\n"}) / "cgroup"
    root = tree(
        tmp_path / "fs",
        {
            "cgroup.controllers": "memory\n",
            "memory.max": f"{2 * GIB}\n",
            "memory.current": f"{3 * GIB}\n",
            "memory.stat": "inactive_file 0\n",
        },
    )
    memory = container_memory(root, proc)
    assert memory == Memory(limit=2 * GIB, working_set=3 * GIB)
    assert memory.headroom == 0


def test_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    proc = tree(tmp_path, {"cgroup": "5:cpu,cpuacct:/x\n4:memory:/kubepods/pod2/ctr\n0::/\n"})
    root = tree(
        tmp_path / "fs",
        {
            "memory/kubepods/pod2/ctr/memory.limit_in_bytes": f"{4 * GIB}\n",
            "memory/kubepods/pod2/ctr/memory.usage_in_bytes": f"{3 * GIB}\n",
            "memory/kubepods/pod2/ctr/memory.stat": f"cache 5\ntotal_inactive_file {GIB}\n",
        },
    )
    memory = container_memory(root, proc / "cgroup")
    assert memory == Memory(limit=4 * GIB, working_set=2 * GIB)


def test_no_limit_or_nothing_readable_is_none(tmp_path: Path) -> None:
    proc = tree(tmp_path, {"cgroup": "0::/\n"}) / "cgroup"
    v2 = tree(
        tmp_path / "v2",
        {"cgroup.controllers": "memory\n", "memory.max": "max\n", "memory.current": "7\n"},
    )
    assert container_memory(v2, proc) is None
    v1_proc = tree(tmp_path / "p1", {"cgroup": "4:memory:/\n"}) / "cgroup"
    v1 = tree(
        tmp_path / "v1",
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": "4333314048\n",
        },
    )
    assert container_memory(v1, v1_proc) is None
    assert container_memory(tmp_path / "nothing", proc) is None
    assert container_memory(tmp_path / "nothing", tmp_path / "no-such-file") is None
