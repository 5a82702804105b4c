"""A lost store's survivor that cannot host the next generation (``ddpjob_worker.agent.storelink``).

The whole suite saw it once: pod 0's node lost, pod 1 (the successor) could not reach the
store it had just made at its own address within its 10 s (torch names the address it connects
to, and the resolver stalled), and its agent ended, so the job trained on without it. Now it
waits for the store at the endpoint, where the old host's replacement hosts.

The backend is a stand-in whose ``host()`` fails as the real one does when its store
never answers; the endpoint is a real listener on 127.0.0.1, the lost host a closed port.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from typing import Any, cast

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from ddpjob_worker.agent.hubrdzv import HubBackend
from ddpjob_worker.agent.policy import Settings
from ddpjob_worker.agent.storelink import StoreLink
from ddpjob_worker.membership.failover import StoreView
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.nodes import NodeIdent, NodeRepr
from ddpjob_worker.membership.seal import Seal
from ddpjob_worker.membership.watch import RoundView
from ddpjob_worker.state import StateWriter
from tests.harness.agents import free_port


class Handler:
    """A rendezvous handler as far as the link needs one (it is never a hub's)."""

    def __init__(self, name: str) -> None:
        self.name = name


class Rendezvous:
    """Our round control: only our address is read when we host."""

    address = "127.0.0.1"


class Backend:
    """``host()`` fails on every port as the real backend does when its store never answers;
    ``client()`` reaches the store at the endpoint."""

    def __init__(self) -> None:
        self.hosted: list[str] = []
        self.clients: list[str] = []

    def host(self, params: RendezvousParameters, **_: object) -> Handler:
        self.hosted.append(params.endpoint)
        raise RendezvousConnectionError(
            f"could not host the store at {params.endpoint}: the client socket has timed out"
        )

    def client(self, params: RendezvousParameters) -> Handler:
        self.clients.append(params.endpoint)
        return Handler(f"client of {params.endpoint}")


@pytest.fixture
def endpoint() -> Iterator[socket.socket]:
    """The old host's replacement: its store accepts at the endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s


def test_a_survivor_that_cannot_host_the_next_store_waits_for_the_endpoint(
    endpoint: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    port = endpoint.getsockname()[1]
    lost = f"127.0.0.1:{free_port()}"  # the lost host's liveness address: refused, GONE
    host, me = NodeRepr("127.0.0.9_9_0"), NodeIdent("127.0.0.1_1")
    round_ = RoundView(
        me=me,
        base_id="1.1",
        ranks={NodeIdent("127.0.0.9_9"): 0, me: 1},
        addresses={NodeIdent("127.0.0.9_9"): lost},
        base={NodeIdent("127.0.0.9_9"): 0, me: 1},
        host=host,
        host_address=lost,
        world=2,
    )
    used: list[Any] = []
    backend = Backend()
    params = RendezvousParameters(
        backend="ddpjob", endpoint=f"127.0.0.1:{port}", run_id="job", min_nodes=1, max_nodes=2
    )
    settings = Settings(
        is_host=False,
        join_timeout=30,
        grace_seconds=5,
        state_file=None,
        in_ddpjob_pod=True,
        pod_index=1,
        peers=("127.0.0.9:1",),
    )
    link = StoreLink(
        cast(Any, Handler("the lost store's")),
        params,
        settings=settings,
        state=StateWriter(None),
        seal=Seal(None),
        view=StoreView(gen=1, hosting=False, address=params.endpoint),
        use=used.append,
        last_round=lambda: round_,
        listener=None,
        backend=cast(HubBackend, backend),
    )
    link.rdzv = cast(Any, Rendezvous())

    with caplog.at_level(logging.INFO, logger="ddpjob_worker.agent.storelink"):
        link.recover(time.monotonic() + 20, Health.GONE)

    configured = str(params.endpoint).rpartition(":")[2]
    assert backend.hosted == [f"127.0.0.1:{configured}", "127.0.0.1:0"]
    assert backend.clients == [params.endpoint]
    assert [h.name for h in used] == [f"client of {params.endpoint}"]
    assert link.view == StoreView(gen=1, hosting=False, address=params.endpoint, recoveries=1)
    assert "could not host the rendezvous store on any port: waiting for the store at the " \
        "endpoint instead" in caplog.text  # fmt: skip
