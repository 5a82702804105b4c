"""The round being formed at the hub (:mod:`ddpjob_worker.membership.hub`): who asked to join,
at most one agent per pod index; who of the expected survivors is still missing; when the last
call ends; and when the round may complete. Pure: no sockets, no clock of its own (the hub
passes ``now``), no messages (the hub tells the members).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Generic, Protocol, TypeVar

from ddpjob_worker.membership.nodes import NodeIdent


class Joiner(Protocol):
    """What the formation reads of a member's session."""

    @property
    def ident(self) -> NodeIdent: ...

    @property
    def index(self) -> int | None: ...

    @property
    def fresh(self) -> bool:
        """It was never given a round (a new pod): the old holder of its index yields to it."""
        ...


S = TypeVar("S", bound=Joiner)


class Admitted(enum.Enum):
    ADDED = "added"
    WAITS = "waits"
    """Another agent of its pod index asked first and keeps the place."""
    REPLACED = "replaced"
    """Its pod index belongs to its replacement: it must stop without training."""


class Forming(Generic[S]):
    """One round in the making, from the last round's ``base`` (its members and their pod
    indexes) and the members it waits for (``expected``: the survivors; None: torch's last
    call decides)."""

    def __init__(
        self, base: Mapping[NodeIdent, int | None], expected: frozenset[NodeIdent] | None
    ) -> None:
        self._base = base
        self.joined: dict[NodeIdent, S] = {}
        """The members that asked to be in the round."""
        self._by_index: dict[int, NodeIdent] = {}
        """Which of them holds each pod index (one per index: :meth:`admit`)."""
        self._holders = holders(base)
        """The last round's member of each pod index."""
        self.expected = expected
        self._missing: set[NodeIdent] = set(expected or ())
        """The expected members not in it yet."""
        self._call_at: float | None = None
        """When the last call ends (set once ``minimum`` have joined)."""

    def admit(self, session: S) -> tuple[Admitted, NodeIdent | None]:
        """Add ``session``, at most one agent per pod index: the operator makes pod *i* again
        only once the old pod object is gone, so of two agents of one index one belongs to a
        pod that no longer exists. The outcome, and for :attr:`Admitted.REPLACED` the member
        that holds the index.

        * One that was a member before, is not in the last round (it was cut off) and whose
          index a member of the last round holds (its replacement) was replaced, whether that
          replacement has asked to join yet or not.
        * Of two that both asked, an agent never given a round (the replacement of a pod
          whose object was deleted) goes before the last round's holder of the index, which
          the hub then tells it was replaced; otherwise the first to ask stays.

        One look per join (a map of the indexes), not a pass over every member."""
        self._missing.discard(session.ident)  # it asked: whether it is in or not
        index = session.index
        if index is not None:
            holder = self._holders.get(index)
            if self._claim(session) == 0 and holder is not None and holder != session.ident:
                self.unjoin(session.ident)
                return Admitted.REPLACED, holder
            other = self.joined.get(self._by_index.get(index, session.ident))
            if other is not None and other.ident != session.ident:  # not itself, reconnected
                if self._claim(session) <= self._claim(other):
                    return Admitted.WAITS, None  # the first to ask stays
                self.unjoin(other.ident)
                self._missing.discard(other.ident)
            self._by_index[index] = session.ident
        self.joined[session.ident] = session
        return Admitted.ADDED, None

    def unjoin(self, ident: NodeIdent) -> None:
        """``ident`` is no longer asking (its connection closed: it asks again once back)."""
        session = self.joined.pop(ident, None)
        index = None if session is None else session.index
        if index is not None and self._by_index.get(index) == ident:
            del self._by_index[index]

    def drop(self, idents: Iterable[NodeIdent]) -> None:
        """Members that will not be in this round (cut, or left)."""
        gone = set(idents)
        for ident in gone:
            self.unjoin(ident)
            self._missing.discard(ident)
        if self.expected is not None:
            self.expected = self.expected - gone

    def due(self, now: float, minimum: int, maximum: int, last_call: float) -> bool:
        """Whether the round may complete now (the hub checks the majority): ``minimum`` have
        joined and either it is full (``maximum``, or every expected member) or the last call,
        which starts once ``minimum`` have joined, is over."""
        count = len(self.joined)
        if count >= minimum and self._call_at is None:
            self._call_at = now + last_call
        if count < minimum:
            return False
        full = count >= maximum or (self.expected is not None and not self._missing)
        return full or (self._call_at is not None and now >= self._call_at)

    def _claim(self, session: S) -> int:
        """How strong a member's claim to its pod index is: 2 for an agent never given a
        round (a new pod), 1 for a member of the last round, 0 for another (it was in an
        earlier round, and cut off)."""
        if session.fresh:
            return 2
        return 1 if session.ident in self._base else 0


def holders(base: Mapping[NodeIdent, int | None]) -> dict[int, NodeIdent]:
    """Each pod index's member in a round's ``base``."""
    return {index: ident for ident, index in base.items() if index is not None}
