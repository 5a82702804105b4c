"""Network namespaces for the agent tests and benchmarks: a network of its own for each node, so
that a node can be cut off for real (a partition), not only frozen.

Each :class:`Fabric` makes a hub namespace with a bridge, and one namespace per node joined to
it by a veth pair (``eth0`` inside the node, ``h<i>`` on the bridge) with the address
``10.250.0.<i+1>/24``. All of it lives in namespaces this process made: nothing is added to the
machine's own namespace, and nothing leaves the machine (the bridge has no uplink). A node's
processes run under ``ip netns exec``; :meth:`Fabric.cut` takes its bridge port down, so its
packets go nowhere and nothing answers, with no reset (a network partition), and
:meth:`Fabric.heal` brings it back. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2.
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid

SUBNET = "10.250.0"


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


class Fabric:
    """A bridge and a namespace per node; see the module doc."""

    def __init__(self) -> None:
        self.prefix = f"ddpj-{uuid.uuid4().hex[:8]}"
        self.hub = f"{self.prefix}-hub"
        self._nodes: set[int] = set()
        _ip("netns", "add", self.hub)
        try:
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
        except RuntimeError:
            self.close()
            raise

    def namespace(self, index: int) -> str:
        return f"{self.prefix}-{index}"

    @staticmethod
    def address(index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def node(self, index: int) -> str:
        """The namespace of node ``index`` (made on first use, kept for its replacements)."""
        name = self.namespace(index)
        if index in self._nodes:
            return name
        _ip("netns", "add", name)
        self._nodes.add(index)
        port = f"h{index}"
        _ip("link", "add", port, "netns", self.hub, "type", "veth", "peer", "name", "eth0",
            "netns", name)  # fmt: skip
        _ip("-n", self.hub, "link", "set", port, "master", "br0")
        _ip("-n", self.hub, "link", "set", port, "up")
        _ip("-n", name, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def wrap(self, index: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``index``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.node(index), *argv]

    def cut(self, index: int) -> None:
        """Partition node ``index`` from every other: its packets are dropped, silently."""
        _ip("-n", self.hub, "link", "set", f"h{index}", "down")

    def heal(self, index: int) -> None:
        _ip("-n", self.hub, "link", "set", f"h{index}", "up")

    def split(self, side: set[int]) -> None:
        """Partition the nodes of ``side`` from the others, each side whole: their bridge
        ports move to a second bridge with no link to the first (:meth:`join` undoes it)."""
        with contextlib.suppress(RuntimeError):
            _ip("-n", self.hub, "link", "add", "br1", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br1", "up")
        for index in sorted(side):
            _ip("-n", self.hub, "link", "set", f"h{index}", "master", "br1")

    def join(self, side: set[int]) -> None:
        for index in sorted(side):
            _ip("-n", self.hub, "link", "set", f"h{index}", "master", "br0")

    def block(self, index: int, other: int) -> None:
        """Drop what node ``index`` sends to node ``other`` and what it receives from it (one
        link of the network down, the others up), with nftables in ``index``'s namespace."""
        ns, peer = self.node(index), self.address(other)
        rules = (
            "add table inet cut\n"
            "add chain inet cut out { type filter hook output priority 0 ; }\n"
            "add chain inet cut in { type filter hook input priority 0 ; }\n"
            f"add rule inet cut out ip daddr {peer} drop\n"
            f"add rule inet cut in ip saddr {peer} drop\n"
        )
        result = subprocess.run(
            ["ip", "netns", "exec", ns, "nft", "-f", "-"],
            input=rules,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"nft in {ns}: {result.stderr.strip()}")

    def unblock(self, index: int) -> None:
        subprocess.run(
            ["ip", "netns", "exec", self.node(index), "nft", "delete", "table", "inet", "cut"],
            capture_output=True,
            check=False,
        )

    def close(self) -> None:
        """Remove every namespace (their processes must be gone: the cluster kills them)."""
        for index in sorted(self._nodes):
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", self.namespace(index))
        self._nodes.clear()
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", self.hub)
