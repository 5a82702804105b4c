"""Judging the members of a round: who is alive, silent or gone. No torch.

Two ways, both through the members' liveness sockets (:mod:`ddpjob_worker.liveness`) and the
run's keys (:mod:`ddpjob_worker.keys`):

* while a round trains, each agent asks a few members a few times a second
  (:func:`watched`, :class:`ddpjob_worker.liveness.PeerWatch`);
* before a round is re-formed, the agent probes the last round's members once
  (:func:`judge`), so the next round waits for the ones that come back and for no one else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ddpjob_worker import liveness
from ddpjob_worker.keys import RunKeys
from ddpjob_worker.liveness import Health
from ddpjob_worker.nodes import NodeRepr

WATCH_ALL_UP_TO = 16
"""Rounds of up to this many other members: every agent asks every other one. In larger rounds
each asks its next :data:`WATCH_NEIGHBOURS` in node order (a ring, so every member is asked by
that many peers) and the store's host, which keeps the questions per agent constant."""
WATCH_NEIGHBOURS = 8


def watched(
    addresses: Mapping[NodeRepr, str], *, me: NodeRepr, host: NodeRepr | None
) -> dict[NodeRepr, str]:
    """Which of the round's other members (-> liveness address) one agent asks (see
    :data:`WATCH_ALL_UP_TO`)."""
    if len(addresses) <= WATCH_ALL_UP_TO:
        return dict(addresses)
    ring = sorted([*addresses, me])
    at = ring.index(me)
    chosen = {ring[(at + step) % len(ring)] for step in range(1, WATCH_NEIGHBOURS + 1)}
    if host is not None and host in addresses:
        chosen.add(host)
    return {node: addresses[node] for node in sorted(chosen)}


def judge(
    keys: RunKeys,
    nodes: Iterable[NodeRepr],
    *,
    silent: Iterable[NodeRepr] = (),
    timeout: float = liveness.PROBE_TIMEOUT_SECONDS,
) -> dict[NodeRepr, Health]:
    """The health of ``nodes`` (ourselves left out): GONE if they left the run or their
    address refuses; SILENT if a peer named them so in the round (``silent``); ALIVE if they
    accept; UNKNOWN if they never published an address or did not answer in time (only torch's
    heartbeats can tell then). Two store requests and one parallel probe, whatever their number.
    """
    others = {node for node in nodes if node != keys.me}
    left, named = keys.left(), set(silent)
    health = dict.fromkeys(others & left, Health.GONE)
    health.update(dict.fromkeys(others - left & named, Health.SILENT))
    rest = others - health.keys()
    addresses = keys.addresses(rest)
    health.update(dict.fromkeys(rest - addresses.keys(), Health.UNKNOWN))
    health.update(liveness.probe_all(addresses, timeout))
    return health
