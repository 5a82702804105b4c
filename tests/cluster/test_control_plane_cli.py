"""``python -m tests.harness.kube up`` by hand: it comes up, serves, and leaves nothing behind.

Nothing may be left running after a Ctrl-C, nor after the process that started the cluster
dies without a chance to clean up (a SIGKILL, a crash of pytest): every component carries
``PR_SET_PDEATHSIG``, and each node's kubelet takes its pods with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import tools
from tests.harness.kube import controlplane, network

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def start_up(workdir: Path) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.harness.kube",
            "up",
            "--nodes",
            "1",
            "--workdir",
            str(workdir),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line.startswith("KUBECONFIG="), line
    kubeconfig = line.split("=", 1)[1]
    assert Path(kubeconfig).is_absolute() and Path(kubeconfig).exists()
    return process, kubeconfig


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def alive(processes: list[psutil.Process]) -> list[str]:
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(process.cmdline()[:3]))
        except psutil.NoSuchProcess:
            continue
    return left


def run_a_pod(kubeconfig: str) -> None:
    env = {**os.environ, "KUBECONFIG": kubeconfig}
    kubectl = str(tools.tool("kubectl"))
    nodes = subprocess.run(
        [kubectl, "get", "nodes", "-o", "name"], env=env, capture_output=True, text=True, check=True
    )
    assert nodes.stdout.split() == ["node/node-1"]
    subprocess.run(
        [kubectl, "run", "sleeper", "--image=busybox", "--restart=Never", "--", "sleep", "600"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    subprocess.run(
        [kubectl, "wait", "--for=condition=Ready", "pod/sleeper", "--timeout=60s"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip


def claimed_octet(pid: int) -> int:
    """The pod range ``10.<octet>.0.0/16`` that the control plane started by ``pid`` claimed."""
    (octet,) = [
        int(claim.name)
        for claim in controlplane.ROUTES.glob("*")
        if claim.read_text().strip() == str(pid)
    ]
    return octet


def hub_exists(octet: int) -> bool:
    """Whether the cluster's hub namespace (its bridge, DNS and Service addresses) is there."""
    return network.hub(octet) in controlplane._ip("netns", "list").stdout.split()


def machine_addresses() -> str:
    """Every address of the machine's own namespace: the clusters must add none."""
    return controlplane._ip("-o", "addr", "show").stdout


def wait_gone(processes: list[psutil.Process], timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(processes)


def test_ctrl_c_stops_everything_it_started(tmp_path: Path) -> None:
    process, kubeconfig = start_up(tmp_path)
    try:
        run_a_pod(kubeconfig)
        started = descendants(process.pid)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        for component in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            assert component in names
        assert "sleep 600" in names, "the pod's process"
        octet = claimed_octet(process.pid)
        assert hub_exists(octet)
        assert f" 10.{octet}." not in machine_addresses(), "pod addresses live in namespaces"
        assert " 10.96." not in machine_addresses(), "so do ClusterIPs"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        assert wait_gone(started) == []
        assert not hub_exists(octet), "a clean stop removes its network"
    finally:
        if process.poll() is None:
            process.kill()


def test_the_death_of_its_starter_takes_every_component_and_pod_along(tmp_path: Path) -> None:
    process, kubeconfig = start_up(tmp_path)
    try:
        run_a_pod(kubeconfig)
        started = descendants(process.pid)
        octet = claimed_octet(process.pid)
        assert hub_exists(octet)
        process.send_signal(signal.SIGKILL)  # no cleanup of its own
        process.wait(timeout=30)
        assert wait_gone(started) == []
        # Its hub namespace stays (a bind mount the kernel keeps) until the next start
        # releases it; its pods' namespaces went with their node's processes.
        assert hub_exists(octet)
        # The nftables table a frozen node leaves (ControlPlane.freeze_node) goes with the range.
        table = controlplane.nft_table(octet)
        assert controlplane._nft("add", "table", "inet", table).returncode == 0
        assert octet in controlplane.release_abandoned_ranges()
        assert not hub_exists(octet)
        assert table not in controlplane._nft("list", "tables").stdout
        assert not (controlplane.ROUTES / str(octet)).exists()
    finally:
        if process.poll() is None:
            process.kill()
