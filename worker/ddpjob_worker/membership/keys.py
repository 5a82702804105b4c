"""The run's own keys in the rendezvous store, sealed with the job's key. No torch.

Beside torch's ``torch.rendezvous.<run id>*`` keys, the agents keep ``ddpjob.<run id>.*``:

========================  ==============================================================
``hosted``                the store's host wrote it as soon as it hosted the store: this
                          store is the job's (a name may lead to another pod's store)
``host``                  which node hosts this store
``alive``                 every node's liveness address, one list for the whole run
``left``                  nodes that left the run on SIGTERM
``hub``                   where the store's host's hub listens (in a DDPJob pod)
``round.<N>.over``        why round N is over, as its members said (``reason@node``)
``round.<N>.silent``      members of round N a peer found silent
========================  ==============================================================

Every value is sealed (:mod:`ddpjob_worker.membership.seal`): one read without a valid seal is
dropped (and logged), so whoever reaches the store's port cannot steer recovery. Lists are appended
to, so that writers never race; a reader gets every item in one request.

:class:`RunKeys` works on any store with the c10d ``Store`` methods it uses (torch's TCPStore in
the agent, a dict in the unit tests).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Protocol

from ddpjob_worker.membership.nodes import NodeRepr, ident
from ddpjob_worker.membership.seal import Seal

logger = logging.getLogger("ddpjob_worker.membership.keys")

HOSTED = "hosted"
"""The run's key that a store's host writes as soon as it hosts the store (sealed)."""

# Why a round is over (``round.<N>.over``):
END_FAILURE = "failure"
"""A member's workers failed (or it gave up): the group is broken."""
END_LEAVE = "leave"
"""A member leaves on SIGTERM: the group is broken."""
END_JOIN = "join"
"""A node waits to join: the group is intact, the round only grows."""
END_HANDOVER = "handover"
"""The store's host leaves on SIGTERM: the others carry on around a new host at once."""
END_DROPPED = "dropped"
"""We are no longer a participant of our round (read from the state, not announced): our
heartbeats lapsed (a store that stalled, for one, as torch's store server does while it looks
up a new client's name in a DNS that does not answer) and a newcomer's sync removed us and
opened the next round. Training on would leave that newcomer waiting alone for good."""


class Store(Protocol):
    """The c10d store methods the run's keys use (torch's ``Store``)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...

    def append(self, key: str, value: str) -> None: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...


def key(run_id: str, what: str) -> str:
    """The store key of one of the run's keys."""
    return f"ddpjob.{run_id}.{what}"


class RunKeys:
    """The run's keys in one store, as node ``me`` reads and writes them."""

    def __init__(self, store: Store | Any, run_id: str, seal: Seal, me: NodeRepr) -> None:
        self.store = store
        self.run_id = run_id
        self.me = me
        self._seal = seal

    # -- sealed values and lists --------------------------------------------------------------

    def _name(self, what: str) -> str:
        return key(self.run_id, what)

    def _put(self, what: str, value: str) -> None:
        name = self._name(what)
        self.store.set(name, self._seal.value(name, value))

    def _read(self, what: str) -> str | None:
        """The value of one of the run's keys; None when it is not there, or not sealed with
        the job's key (logged: nobody of the job wrote it)."""
        name = self._name(what)
        if not self.store.check([name]):
            return None
        return self._opened(name, bytes(self.store.get(name)))

    def _wait_read(self, what: str, timeout: timedelta) -> str | None:
        """The value of one of the run's keys once it is there (the store raises past
        ``timeout``); None when it is not sealed with the job's key. Two requests: every member
        asks this of a new store at once."""
        name = self._name(what)
        self.store.wait([name], timeout)
        return self._opened(name, bytes(self.store.get(name)))

    def _read_many(self, whats: Iterable[str]) -> dict[str, str]:
        """The values of those of the run's keys that are there (and sealed), in one request."""
        names = {what: self._name(what) for what in whats}
        present = {what: name for what, name in names.items() if self.store.check([name])}
        if not present:
            return {}
        values = self.store.multi_get(list(present.values()))
        found = {}
        for (what, name), raw in zip(present.items(), values, strict=True):
            value = self._opened(name, bytes(raw))
            if value is not None:
                found[what] = value
        return found

    def _opened(self, name: str, raw: bytes) -> str | None:
        value = self._seal.open(name, raw.decode(errors="replace"))
        if value is None:
            logger.warning("ignoring %s in the store: not sealed with this job's key", name)
        return value

    def _add(self, what: str, items: Iterable[str]) -> None:
        """Append ``items`` (no ``;`` in them) to one of the run's lists."""
        name = self._name(what)
        self.store.append(name, self._seal.items(name, items))

    def _items(self, what: str) -> list[str]:
        """The items of one of the run's lists that the job's agents wrote, in order."""
        name = self._name(what)
        if not self.store.check([name]):
            return []
        return self._seal.open_items(name, bytes(self.store.get(name)).decode(errors="replace"))

    # -- the store and its members --------------------------------------------------------------

    def mark_hosted(self) -> None:
        """Say, as the store's host, that this store is the job's."""
        self._put(HOSTED, ident(self.me))

    def publish(self, address: str, *, host: bool = False) -> None:
        """Publish where our liveness socket listens (again on every store: a recovered store
        starts empty), and, from the store's host, which node it is."""
        self._add("alive", [f"{self.me}={address}"])
        if host:
            self._put("host", self.me)

    def host(self) -> NodeRepr | None:
        """The node that hosts this store, if it said so."""
        found = self._read("host")
        return None if found is None else NodeRepr(found)

    def addresses(self, nodes: Iterable[NodeRepr]) -> dict[NodeRepr, str]:
        """The liveness addresses that ``nodes`` published; those that published none are left
        out. One request, whatever the number of nodes."""
        wanted = set(nodes)
        found = {}
        for item in self._items("alive"):
            node, _, address = item.rpartition("=")
            if node in wanted and address:
                found[NodeRepr(node)] = address
        return found

    def add_left(self) -> None:
        """Say that we leave the run (SIGTERM): never wait for us again."""
        self._add("left", [self.me])

    def left(self) -> set[NodeRepr]:
        """The nodes that left the run on SIGTERM."""
        return {NodeRepr(node) for node in self._items("left")}

    # -- a round's end --------------------------------------------------------------------------

    def announce_end(self, round_: int, *reasons: str) -> None:
        """Tell round ``round_``'s members it is over, and why."""
        self._add(f"round.{round_}.over", [f"{reason}@{self.me}" for reason in reasons])

    def ends(self, round_: int, members: Iterable[NodeRepr]) -> frozenset[str]:
        """Why round ``round_`` is over, as its ``members`` said (a round's end is its members'
        to say: anyone else's word is ignored); empty: it is not."""
        authors = set(members)
        reasons = set()
        for item in self._items(f"round.{round_}.over"):
            reason, _, author = item.partition("@")
            if author in authors:
                reasons.add(reason)
        return frozenset(reasons)

    def announce_silent(self, round_: int, nodes: Iterable[NodeRepr]) -> None:
        """Name the members of round ``round_`` that stopped answering."""
        self._add(f"round.{round_}.silent", nodes)

    def silent(self, round_: int) -> set[NodeRepr]:
        """The members of round ``round_`` that a peer found silent."""
        return {NodeRepr(node) for node in self._items(f"round.{round_}.silent")}
