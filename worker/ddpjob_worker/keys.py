"""The run's own keys in the rendezvous store, sealed with the job's key. No torch.

Beside torch's ``torch.rendezvous.<run id>*`` keys, the agents keep ``ddpjob.<run id>.*``:

========================  ==============================================================
``hosted``                the store's host wrote it as soon as it hosted the store: this
                          store is the job's (a name may lead to another pod's store)
``host``                  which node hosts this store
``alive``                 every node's liveness address, one list for the whole run
``index.<ident>``         a node's pod index (a replacement has its predecessor's)
``left``                  nodes that left the run on SIGTERM
``base``                  the members (ident -> pod index) a later round needs a majority of
``gone.<base id>``        members of that base known gone (dead, left or handed over)
``round.<N>.over``        why round N is over, as its members said (``reason@node``)
``round.<N>.silent``      members of round N a peer found silent
========================  ==============================================================

Every value is sealed (:mod:`ddpjob_worker.seal`): one read without a valid seal is dropped (and
logged), so whoever reaches the store's port cannot steer recovery. Lists are appended to, so
that writers never race; a reader gets every item in one request.

:class:`RunKeys` works on any store with the c10d ``Store`` methods it uses (torch's TCPStore in
the agent, a dict in the unit tests).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any, Protocol

from ddpjob_worker.failover import has_quorum
from ddpjob_worker.nodes import NodeIdent, NodeRepr, ident
from ddpjob_worker.seal import Seal

logger = logging.getLogger("ddpjob_worker.keys")

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

    def publish(self, address: str, *, host: bool = False, index: int | None = None) -> None:
        """Publish where our liveness socket listens and our pod index (again on every store:
        a recovered store starts empty), and, from the store's host, which node it is."""
        self._add("alive", [f"{self.me}={address}"])
        if index is not None:
            self._put(f"index.{ident(self.me)}", str(index))
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

    def indexes(self, nodes: Iterable[NodeIdent]) -> dict[NodeIdent, int | None]:
        """The pod index each node published (None: none)."""
        names = list(nodes)
        out: dict[NodeIdent, int | None] = dict.fromkeys(names)
        found = self._read_many(f"index.{node}" for node in names)
        for node in names:
            try:
                out[node] = int(found[f"index.{node}"])
            except (KeyError, ValueError):
                continue
        return out

    def add_left(self) -> None:
        """Say that we leave the run (SIGTERM): never wait for us again."""
        self._add("left", [self.me])

    def left(self) -> set[NodeRepr]:
        """The nodes that left the run on SIGTERM."""
        return {NodeRepr(node) for node in self._items("left")}

    # -- the majority ---------------------------------------------------------------------------

    def record_base(self, base_id: str, members: dict[NodeIdent, int | None]) -> None:
        """Record the members (-> pod index) a later round needs a majority of."""
        self._put("base", json.dumps({"id": base_id, "members": members}))

    def base(self) -> tuple[str, dict[NodeIdent, int | None]] | None:
        """``(id, members)`` recorded by :meth:`record_base`, if any."""
        raw = self._read("base")
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            members = {NodeIdent(str(node)): index for node, index in record["members"].items()}
            return str(record["id"]), members
        except (ValueError, KeyError, TypeError, AttributeError):
            logger.warning("ignoring a malformed base record in the store")
            return None

    def confirm_gone(self, nodes: Iterable[NodeIdent], base_id: str | None = None) -> None:
        """Name members of the base known to be gone (dead, left or handed over), so a majority
        is counted among the others."""
        names = sorted(nodes)
        if not names:
            return
        if base_id is None:
            base = self.base()
            if base is None:
                return
            base_id = base[0]
        self._add(f"gone.{base_id}", names)

    def confirmed_gone(self, base_id: str) -> set[NodeIdent]:
        """The members known gone: named for this base, or left the run."""
        named = {NodeIdent(node) for node in self._items(f"gone.{base_id}")}
        return {ident(node) for node in self.left()} | named

    def quorum(self, participants: Iterable[NodeRepr]) -> bool:
        """Whether ``participants`` hold a majority of the base
        (:func:`ddpjob_worker.failover.has_quorum`); any do while no base is recorded."""
        base = self.base()
        if base is None:
            return True
        base_id, members = base
        names = [ident(node) for node in participants]
        gone = self.confirmed_gone(base_id)
        if has_quorum(names, members, gone, self.indexes(names)):
            return True
        logger.debug("no majority of base %s %s (gone %s) in %s", base_id, members, gone, names)
        return False

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
