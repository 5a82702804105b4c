"""The network of a test cluster, in namespaces of its own.

Nothing here adds an address to the machine's own network namespace. A cluster with the pod
range ``10.<c>.0.0/16`` has:

* a **hub** namespace (``ddpjob-kube-<c>``, made with ``ip netns add``) holding the bridge
  ``br0`` with the gateway address ``10.<c>.0.1/16``; its ``lo`` holds the cluster DNS
  (``10.<c>.0.10``, :mod:`tests.harness.kube.dns` binds there) and the ``kubernetes`` Service's
  ClusterIP (``10.96.0.1:443``, a :func:`forward` process passes it to the API server on
  127.0.0.1);
* a **namespace per pod**, made by its node's kubelet (:func:`add_pod`): ``eth0`` with the pod's
  address, a veth whose other end (``v<x>-<y>`` for the address ``10.<c>.<x>.<y>``) is a port of
  the hub's bridge, and a default route through the gateway. A pod has its own port space as
  in a real cluster: two jobs on the default rendezvous port do not collide. Its containers
  enter it (:mod:`tests.harness.kube.init`), as a real pod's containers share the pause container's.

The namespace of a pod is a bind mount of ``/proc/<pid>/ns/net`` on a file in the pod's
directory, inside its kubelet's mount namespace: when the node is lost (its PID namespace
killed), the processes of its pods close their connections as they die (their peers see a reset
or an end of stream), then the namespaces go with the last of them. Cutting a node off
(:func:`set_ports`) takes its pods' bridge ports down: packets are dropped, nothing answers,
nothing resets.

The machine's own namespace reaches a cluster address only by entering the hub for a moment
(:func:`inside`, :func:`connect`); the kubelets and the API server stay on loopback. Needs root
(CAP_NET_ADMIN, CAP_SYS_ADMIN), iproute2 and util-linux.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ipaddress
import logging
import os
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

log = logging.getLogger("tests.harness.kube.network")

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
API_SERVICE_IP = "10.96.0.1"
API_SERVICE_PORT = 443
PREFIX_LENGTH = 16

_libc = ctypes.CDLL(None, use_errno=True)


class NetworkError(RuntimeError):
    """A namespace, link or address could not be made; the message has ``ip``'s own words."""


def hub(octet: int) -> str:
    """The name of the hub namespace of the cluster with pods in ``10.<octet>.0.0/16``."""
    return f"ddpjob-kube-{octet}"


def hub_path(octet: int) -> Path:
    return NETNS_DIR / hub(octet)


def gateway(octet: int) -> str:
    return f"10.{octet}.0.1"


def dns_address(octet: int) -> str:
    return f"10.{octet}.0.10"


def port_name(address: str) -> str:
    """The hub's end of a pod's veth: ``v<x>-<y>`` for ``10.<c>.<x>.<y>`` (at most 15 bytes)."""
    third, fourth = address.split(".")[2:]
    return f"v{third}-{fourth}"


def _run(argv: Sequence[str], stdin: str | None = None) -> None:
    result = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        what = stdin.strip().replace("\n", "; ") if stdin else " ".join(argv)
        raise NetworkError(f"{what}: {result.stderr.strip()}")


def _batch(commands: Sequence[str], *, netns: str | None = None, path: Path | None = None) -> None:
    """``ip -batch`` in the named namespace, or in the one bound at ``path``."""
    prefix = ["nsenter", f"--net={path}"] if path is not None else []
    named = ["-n", netns] if netns is not None else []
    _run([*prefix, "ip", *named, "-batch", "-"], stdin="\n".join(commands) + "\n")


# ---- the hub --------------------------------------------------------------------------------


def make_hub(octet: int) -> None:
    """The cluster's hub namespace, its bridge and its service addresses."""
    name = hub(octet)
    _run(["ip", "netns", "add", name])
    try:
        _batch(
            [
                "link set lo up",
                "link add br0 type bridge",
                f"addr add {gateway(octet)}/{PREFIX_LENGTH} dev br0",
                "link set br0 up",
                f"addr add {dns_address(octet)}/32 dev lo",
                f"addr add {API_SERVICE_IP}/32 dev lo",
            ],
            netns=name,
        )
    except NetworkError:
        remove_hub(octet)
        raise


def remove_hub(octet: int) -> None:
    """The hub namespace (its bridge and ports go with it)."""
    subprocess.run(["ip", "netns", "del", hub(octet)], capture_output=True, check=False)


def hubs() -> list[int]:
    """The octets of every hub namespace on this machine."""
    octets = []
    for path in NETNS_DIR.glob("ddpjob-kube-*"):
        with contextlib.suppress(ValueError):
            octets.append(int(path.name.rsplit("-", 1)[1]))
    return octets


def set_ports(octet: int, cidr: str, *, up: bool) -> list[str]:
    """Take the bridge ports of every pod whose address is in ``cidr`` down (``up=False``: their
    packets are dropped, silently) or up again. Returns the ports changed.

    A port may vanish between the listing and the change (its pod torn down meanwhile): then
    the ports still there are listed and changed again."""
    for attempt in range(3):
        ports = _ports(octet, cidr)
        if not ports:
            return ports
        state = "up" if up else "down"
        try:
            _batch([f"link set {port} {state}" for port in ports], netns=hub(octet))
        except NetworkError:
            if attempt == 2 or set(_ports(octet, cidr)) >= set(ports):
                raise
            continue
        return ports
    raise AssertionError("unreachable")


def remove_ports(octet: int, cidr: str) -> list[str]:
    """Delete the bridge ports of ``cidr``'s pods that are left over from a node that is gone
    (their pods' namespaces not torn down yet): a new node of that range gives its pods the
    same addresses, and a stale port of the same name would refuse their veths."""
    ports = _ports(octet, cidr)
    if ports:
        with contextlib.suppress(NetworkError):
            _batch([f"link del {port}" for port in ports], netns=hub(octet))
    return ports


def _ports(octet: int, cidr: str) -> list[str]:
    listed = subprocess.run(
        ["ip", "-n", hub(octet), "-o", "link", "show", "master", "br0"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    network = ipaddress.ip_network(cidr)
    ports = []
    for line in listed.stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        with contextlib.suppress(ValueError, IndexError):
            third, fourth = name[1:].split("-")
            if ipaddress.ip_address(f"10.{octet}.{third}.{fourth}") in network:
                ports.append(name)
    return ports


def answer_for(octet: int, cidr: str, *, on: bool) -> None:
    """Make the hub itself answer for ``cidr`` (a lost node's pod range): a connect there is
    refused at once, as it is to a machine whose processes died (``on=False`` undoes it)."""
    verb = "add" if on else "del"
    subprocess.run(
        ["ip", "-n", hub(octet), "route", verb, "local", cidr, "dev", "lo"],
        capture_output=True, check=False,
    )  # fmt: skip


# ---- pods -----------------------------------------------------------------------------------


def add_pod(path: Path, octet: int, address: str) -> None:
    """A network namespace bound at ``path`` with ``address`` on its ``eth0``, joined to the
    hub's bridge, its default route through the gateway."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    _run(["unshare", f"--net={path}", "true"])
    port = port_name(address)
    try:
        _batch(
            [
                "link set lo up",
                f"link add eth0 type veth peer name {port} netns {hub(octet)}",
                f"addr add {address}/{PREFIX_LENGTH} dev eth0",
                "link set eth0 up",
                f"route add default via {gateway(octet)}",
            ],
            path=path,
        )
        _batch([f"link set {port} master br0", f"link set {port} up"], netns=hub(octet))
    except NetworkError:
        remove_pod(path)
        raise


def remove_pod(path: Path) -> None:
    """The pod's namespace: gone once no process is left in it (its veth goes with it)."""
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
    path.unlink(missing_ok=True)


def remove_port(octet: int, address: str) -> None:
    """Delete a pod's veth from the hub's end (both ends go), as a CNI's DEL does. Its
    namespace can outlive the pod (while anything holds it: a copy of its bind mount in a
    container's mount namespace, say), and the next pod at ``address`` needs the port's name:
    a pod 1 created again waited 30 s for it ("RTNETLINK answers: File exists")."""
    subprocess.run(
        ["ip", "-n", hub(octet), "link", "del", port_name(address)],
        capture_output=True, check=False,
    )  # fmt: skip


def enter(path: Path | str) -> None:
    """Move the calling thread into the network namespace at ``path`` (for good)."""
    fd = os.open(str(path), os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd, str(path))
    finally:
        os.close(fd)


def _setns(fd: int, what: str) -> None:
    """Move the calling thread into the network namespace open at ``fd``."""
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns {what}: {os.strerror(error)}")


@contextlib.contextmanager
def inside(path: Path | str) -> Iterator[None]:
    """The calling thread in the network namespace at ``path`` for the block: sockets made
    there stay there after it (the thread only comes back)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter(path)
        try:
            yield
        finally:
            _setns(own, "back")
    finally:
        os.close(own)


def connect(path: Path | str, address: tuple[str, int], timeout: float) -> socket.socket:
    """A TCP connection from the namespace at ``path`` (a pod's, or a cluster's hub)."""
    with inside(path):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


# ---- the kubernetes Service -----------------------------------------------------------------


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy bytes from ``reader`` to ``writer`` until either side closes, then close
    ``writer`` (also when its loop is already closing: a forwarder that stops)."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


async def _forward(listener: socket.socket, target: tuple[str, int]) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*target)
        except OSError as exc:
            log.warning("cannot reach %s:%d: %s", *target, exc)
            writer.close()
            return
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    server = await asyncio.start_server(serve, sock=listener)
    async with server:
        await server.serve_forever()


def forward(netns: Path, listen: tuple[str, int], target: tuple[str, int]) -> None:
    """Accept TCP on ``listen`` inside ``netns`` and pass each connection to ``target`` in this
    process's own namespace (the API server on loopback), byte for byte."""
    with inside(netns):
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(listen)
    listener.listen(128)
    log.info("forwarding %s:%d in %s to %s:%d", *listen, netns, *target)
    asyncio.run(_forward(listener, target))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.harness.kube.network", description=__doc__
    )
    parser.add_argument("--netns", required=True, type=Path, help="the hub namespace's path")
    parser.add_argument("--listen", required=True, help="ADDRESS:PORT inside --netns")
    parser.add_argument("--to", required=True, help="ADDRESS:PORT in this namespace")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    listen_host, listen_port = args.listen.rsplit(":", 1)
    to_host, to_port = args.to.rsplit(":", 1)
    forward(args.netns, (listen_host, int(listen_port)), (to_host, int(to_port)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
