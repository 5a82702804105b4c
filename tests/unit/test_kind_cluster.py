"""tests.harness.kind.cluster without Docker: the kind config, the pod network, and the forwarder that
makes an API server in another network namespace reachable on this one's 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.kind.cluster import Forwarder, cni_conflist, kind_config, routes
from tests.harness.kube import network


def test_kind_config_has_no_default_cni_and_one_control_plane() -> None:
    config = kind_config(3)
    assert config["networking"]["disableDefaultCNI"] is True
    assert config["networking"]["apiServerAddress"] == "127.0.0.1"
    assert config["nodes"] == [{"role": "control-plane"}, {"role": "worker"}, {"role": "worker"}]
    assert "failCgroupV1: false" in config["kubeadmConfigPatches"][0]
    with pytest.raises(ValueError, match="at least 1 node"):
        kind_config(0)


def test_kind_config_mounts_a_shared_directory_into_every_node() -> None:
    config = kind_config(2, {"/srv/ckpt": "/var/lib/ckpt"})
    mount = [{"hostPath": "/srv/ckpt", "containerPath": "/var/lib/ckpt"}]
    assert config["nodes"] == [
        {"role": "control-plane", "extraMounts": mount},
        {"role": "worker", "extraMounts": mount},
    ]


def test_cni_conflist_gives_the_node_its_range() -> None:
    conflist = cni_conflist("10.244.1.0/24")
    ptp, portmap = conflist["plugins"]
    assert ptp["type"] == "ptp"
    assert ptp["ipam"] == {
        "type": "host-local",
        "ranges": [[{"subnet": "10.244.1.0/24"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
    }
    assert portmap == {"type": "portmap", "capabilities": {"portMappings": True}}
    with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6 network"):
        cni_conflist("10.244.1.0/33")


def test_every_node_routes_every_other_range_through_its_owner() -> None:
    ranges = {
        "a-control-plane": ("172.18.0.2", "10.244.0.0/24"),
        "a-worker": ("172.18.0.3", "10.244.1.0/24"),
        "a-worker2": ("172.18.0.4", "10.244.2.0/24"),
    }
    assert routes(ranges) == {
        "a-control-plane": ["10.244.1.0/24 via 172.18.0.3", "10.244.2.0/24 via 172.18.0.4"],
        "a-worker": ["10.244.0.0/24 via 172.18.0.2", "10.244.2.0/24 via 172.18.0.4"],
        "a-worker2": ["10.244.0.0/24 via 172.18.0.2", "10.244.1.0/24 via 172.18.0.3"],
    }


@pytest.fixture
def netns() -> Iterator[Path]:
    name = f"ddpjob-fwd-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield network.NETNS_DIR / name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_forwarder_reaches_a_port_that_exists_only_in_another_namespace(netns: Path) -> None:
    with network.inside(netns):
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    # This namespace's 127.0.0.1 has no such listener (or another one): only the forwarder
    # can reach the server.
    answered: list[bytes] = []

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            data = conn.recv(1024)
            answered.append(data)
            conn.sendall(data.upper())

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    forwarder = Forwarder(netns, ("127.0.0.1", port)).start()
    try:
        with socket.create_connection(("127.0.0.1", forwarder.port), timeout=10) as client:
            client.sendall(b"hello")
            assert client.recv(1024) == b"HELLO"
        thread.join(timeout=10)
        assert answered == [b"hello"]
    finally:
        forwarder.stop()
        server.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", forwarder.port), timeout=2).close()
