"""Cluster DNS for the test control plane: what CoreDNS's kubernetes plugin answers, from the
real Services and EndpointSlices the real controllers write.

``python -m tests.harness.kube.dns --kubeconfig K [--netns HUB] --listen IP --domain cluster.local``
serves UDP and TCP on ``IP:53`` (inside the cluster's hub namespace, :mod:`tests.harness.kube.network`,
while it reaches the API server from the machine's own); every pod's resolv.conf (written by the process kubelet) points at it. It
answers A queries for

* ``<service>.<ns>.svc.<domain>``: the ClusterIP, or for a headless Service the addresses of
  its ready endpoints (with ``publishNotReadyAddresses`` the EndpointSlice controller marks
  every endpoint ready, terminating ones included, as CoreDNS then serves them);
* ``<hostname>.<service>.<ns>.svc.<domain>``: the endpoint with that ``hostname`` (a pod's
  ``hostname`` and ``subdomain``);

with CoreDNS's TTL of 5 s, NXDOMAIN for other names of the cluster domain and REFUSED for the
rest (there is no upstream). Its data follow watches of Services and EndpointSlices, so a name
resolves as soon as the EndpointSlice controller has written it, as in a cluster (CoreDNS adds
up to 30 s of cache; there is none here).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSServer

from tests.harness.kube import network
from tests.harness.kube.client import Client, Endpoint

JSON = dict[str, Any]
TTL = 5
log = logging.getLogger("cluster-dns")


class Records:
    """Names -> addresses, rebuilt from the latest Services and EndpointSlices."""

    def __init__(self, domain: str) -> None:
        self.domain = domain.strip(".")
        self.lock = threading.Lock()
        self.services: dict[tuple[str, str], JSON] = {}
        self.slices: dict[tuple[str, str], JSON] = {}
        self.names: dict[str, list[str]] = {}

    def replace(self, store: dict[tuple[str, str], JSON]) -> Callable[[list[JSON]], None]:
        def listed(items: list[JSON]) -> None:
            with self.lock:
                store.clear()
                for item in items:
                    store[_key(item)] = item
                self._rebuild()

        return listed

    def update(self, store: dict[tuple[str, str], JSON]) -> Callable[[str, JSON], None]:
        def event(kind: str, item: JSON) -> None:
            with self.lock:
                if kind == "DELETED":
                    store.pop(_key(item), None)
                else:
                    store[_key(item)] = item
                self._rebuild()

        return event

    def _rebuild(self) -> None:
        names: dict[str, list[str]] = {}
        for (namespace, name), service in self.services.items():
            base = f"{name}.{namespace}.svc.{self.domain}"
            cluster_ip = (service.get("spec") or {}).get("clusterIP")
            if cluster_ip and cluster_ip != "None":
                names[base] = [cluster_ip]
        for (namespace, _), endpoint_slice in self.slices.items():
            service_name = (endpoint_slice["metadata"].get("labels") or {}).get(
                "kubernetes.io/service-name"
            )
            owner = self.services.get((namespace, str(service_name)))
            if owner is None or (owner.get("spec") or {}).get("clusterIP") != "None":
                continue
            base = f"{service_name}.{namespace}.svc.{self.domain}"
            for endpoint in endpoint_slice.get("endpoints") or []:
                if (endpoint.get("conditions") or {}).get("ready") is False:
                    continue
                addresses = [str(a) for a in endpoint.get("addresses") or []]
                names.setdefault(base, []).extend(addresses)
                if endpoint.get("hostname"):
                    names.setdefault(f"{endpoint['hostname']}.{base}", []).extend(addresses)
        self.names = {name: sorted(set(addresses)) for name, addresses in names.items()}

    def lookup(self, name: str) -> tuple[int, list[str]]:
        name = name.rstrip(".").lower()
        with self.lock:
            found = self.names.get(name)
        if found:
            return RCODE.NOERROR, found
        if name == self.domain or name.endswith("." + self.domain):
            return RCODE.NXDOMAIN, []
        return RCODE.NXDOMAIN, []  # CoreDNS would ask upstream; there is none


def _key(item: JSON) -> tuple[str, str]:
    return str(item["metadata"]["namespace"]), str(item["metadata"]["name"])


class Resolver(BaseResolver):  # type: ignore[misc]
    def __init__(self, records: Records) -> None:
        self.records = records

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        name = str(request.q.qname)
        code, addresses = self.records.lookup(name)
        reply.header.rcode = code
        if request.q.qtype in (QTYPE.A, QTYPE.ANY):
            for address in addresses:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=TTL))
        return reply


class QuietLogger:
    def __getattr__(self, _: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def serve(
    kubeconfig: Path, listen: str, domain: str, port: int = 53, netns: Path | None = None
) -> None:
    endpoint = Endpoint.from_kubeconfig(kubeconfig)
    records = Records(domain)
    stop = threading.Event()
    watches = (
        ("/api/v1/services", records.services),
        ("/apis/discovery.k8s.io/v1/endpointslices", records.slices),
    )
    for path, store in watches:
        client = Client(endpoint, "cluster-dns")
        threading.Thread(
            target=client.watch,
            args=(path, records.replace(store), records.update(store), stop),
            daemon=True,
        ).start()
    resolver = Resolver(records)
    with network.inside(netns) if netns is not None else contextlib.nullcontext():
        servers = [  # their sockets are made, and stay, in the cluster's hub
            DNSServer(resolver, address=listen, port=port, tcp=tcp, logger=QuietLogger())
            for tcp in (False, True)
        ]
    for server in servers:
        server.start_thread()

    def finish(signum: int, _: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    log.info("serving %s on %s:%d", domain, listen, port)
    stop.wait()
    for server in servers:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.kube.dns")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--netns", type=Path, help="the namespace to serve in")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--port", type=int, default=53)
    parser.add_argument("--domain", default="cluster.local")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    serve(args.kubeconfig, args.listen, args.domain, args.port, args.netns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
