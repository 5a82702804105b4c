"""What both kubelets of the tests say of their node the same way (the process kubelet,
kubelet.py, and the hollow one, hollow.py): the ``Node`` they register, its conditions, and the
``Lease`` they renew. A real kubelet registers its node once (a 409 means it exists: it posts
its status instead), renews its lease every ``renew`` seconds, and posts its conditions less
often; the node lifecycle controller reads both."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

from tests.harness.kube.client import ApiError, Client
from tests.harness.kube.podstatus import micro_time, rfc3339

JSON = dict[str, Any]
LEASES = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"


@dataclasses.dataclass
class NodeIdentity:
    """A node as its kubelet describes it: who it is, where, and what runs pods on it."""

    name: str
    pod_cidr: str
    node_ip: str
    capacity: Mapping[str, str]
    kubelet_version: str
    runtime: str
    """``process`` or ``hollow``: the container runtime's name, in its version and OS image."""
    kernel: str
    kubelet_port: int = 10250
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    taints: list[JSON] = dataclasses.field(default_factory=list)
    ready_message: str = "kubelet is posting ready status"
    transitions: dict[str, str] = dataclasses.field(default_factory=dict)
    """Each condition's ``lastTransitionTime``: its conditions never change, so their first."""

    def node_object(self) -> JSON:
        capacity = dict(self.capacity)
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    **self.labels,
                },
            },
            "spec": {
                "podCIDR": self.pod_cidr,
                "podCIDRs": [self.pod_cidr],
                **({"taints": list(self.taints)} if self.taints else {}),
            },
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "addresses": [
                    {"type": "InternalIP", "address": self.node_ip},
                    {"type": "Hostname", "address": self.name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
                "nodeInfo": {
                    "machineID": uuid.uuid4().hex,
                    "systemUUID": str(uuid.uuid4()),
                    "bootID": str(uuid.uuid4()),
                    "kernelVersion": self.kernel,
                    "osImage": f"ddpjob {self.runtime} kubelet",
                    "containerRuntimeVersion": f"{self.runtime}://1",
                    "kubeletVersion": self.kubelet_version,
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
                "conditions": self.conditions(),
            },
        }

    def conditions(self) -> list[JSON]:
        now = rfc3339()
        rows = (
            ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            ("Ready", "True", "KubeletReady", self.ready_message),
        )  # fmt: skip
        return [
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": self.transitions.setdefault(kind, now),
            }
            for kind, status, reason, message in rows
        ]

    def register(self, api: Client) -> None:
        """Create the Node; if it exists (a kubelet restarted), post its status instead."""
        try:
            api.create("/api/v1/nodes", self.node_object())
        except ApiError as exc:
            if exc.status != 409:
                raise
            self.post_status(api)

    def post_status(self, api: Client) -> None:
        api.patch(
            f"/api/v1/nodes/{self.name}/status", {"status": {"conditions": self.conditions()}}
        )

    def renew_lease(self, api: Client, lease_seconds: int) -> None:
        """Renew the node's Lease, or create it (owned by the Node) if there is none."""
        spec = {
            "holderIdentity": self.name,
            "leaseDurationSeconds": lease_seconds,
            "renewTime": micro_time(),
        }
        try:
            api.patch(f"{LEASES}/{self.name}", {"spec": spec}, kind="merge-patch")
        except ApiError as exc:
            if exc.status != 404:
                raise
            node = api.get(f"/api/v1/nodes/{self.name}")
            owner = {"apiVersion": "v1", "kind": "Node", "name": self.name}
            owner["uid"] = node["metadata"]["uid"]
            api.create(
                LEASES, {"metadata": {"name": self.name, "ownerReferences": [owner]}, "spec": spec}
            )
