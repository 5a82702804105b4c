"""Sealing what the agents write to the rendezvous store with the job's key.

A c10d TCPStore has no authentication: whoever reaches pod 0's port and knows the run id (the
job's uid, in every pod's env) can write any key. torch's rendezvous state is a pickle, so a
forged one runs code in every agent that loads it; ddpjob's own keys steer recovery (a round
announced over for every future round is an endless free restart, a node written to ``left`` is
never waited for again, a forged failure report charges a healthy node).

A DDPJob's pods get a key of their own, ``DDPJOB_STORE_KEY``, from a Secret the operator creates
for the job (``ddpjob run`` makes one per run). With it, every value an agent writes carries an
HMAC-SHA256 of the store key it is written under and the value, and a value read without a
valid one is dropped (an item of an appended list) or refused (torch's state: the rendezvous
fails with :class:`SealError` rather than unpickle it). The MAC covers the store key, so a
value cannot be moved to another key, round or job either.

What it does not cover: torch's own per-round keys (rank assignment, the master address) and
the collectives' bootstrap keys, which torch writes and reads itself; and denial of service
(anyone who reaches the port can still delete or overwrite keys, and the job fails loudly
instead of being steered). A NetworkPolicy (``spec.networkPolicy``) keeps others off the port.

Without the key (plain torchrun, or a pod made by an operator older than this), nothing is
sealed and everything read is taken as written, as before. Stdlib only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping

KEY_ENV = "DDPJOB_STORE_KEY"
"""The job's key (any non-empty text), from the job's Secret."""
_MARK = "#"
"""Between a value and its MAC (never in a node's name, a reason or an address)."""
_MAC_CHARS = 32
"""Hex characters of the MAC kept on a text value: 128 bits."""
_MAC_BYTES = 32
"""Bytes of the MAC appended to a binary value (torch's state): the whole SHA-256."""


class SealError(RuntimeError):
    """A value that should be sealed with the job's key is not."""


class Seal:
    """The job's key, and the sealing of text values, list items and bytes with it."""

    def __init__(self, key: bytes | None) -> None:
        self._key = key or None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Seal:
        value = (os.environ if env is None else env).get(KEY_ENV, "")
        return cls(value.encode() if value else None)

    @property
    def on(self) -> bool:
        return self._key is not None

    def _mac(self, name: str, data: bytes) -> bytes:
        assert self._key is not None
        return hmac.new(self._key, name.encode() + b"\0" + data, hashlib.sha256).digest()

    # -- text: one value, or the items of an appended list ----------------------------------

    def value(self, name: str, text: str) -> str:
        """``text`` as written under store key ``name``."""
        if self._key is None:
            return text
        return f"{text}{_MARK}{self._mac(name, text.encode()).hex()[:_MAC_CHARS]}"

    def open(self, name: str, sealed: str) -> str | None:
        """The text of a value read under ``name``; None if its seal is not the job's."""
        if self._key is None:
            return sealed
        text, mark, mac = sealed.rpartition(_MARK)
        if not mark:
            return None
        expected = self._mac(name, text.encode()).hex()[:_MAC_CHARS]
        return text if hmac.compare_digest(mac, expected) else None

    def items(self, name: str, items: Iterable[str]) -> str:
        """``items`` as appended under ``name``: each sealed, each ended by ``;``."""
        return "".join(f"{self.value(name, item)};" for item in items)

    def open_items(self, name: str, raw: str) -> list[str]:
        """The items of a list read under ``name`` whose seal is the job's, in order (the
        others are dropped: nobody with the key wrote them)."""
        opened = (self.open(name, item) for item in raw.split(";") if item)
        return [item for item in opened if item is not None]

    # -- bytes: torch's rendezvous state ----------------------------------------------------

    def seal_bytes(self, name: str, data: bytes) -> bytes:
        if self._key is None:
            return data
        return data + self._mac(name, data)

    def open_bytes(self, name: str, sealed: bytes) -> bytes:
        """The data of ``sealed``, read under ``name``; :class:`SealError` if its seal is not
        the job's (never unpickle it)."""
        if self._key is None:
            return sealed
        data, mac = sealed[:-_MAC_BYTES], sealed[-_MAC_BYTES:]
        if len(sealed) < _MAC_BYTES or not hmac.compare_digest(mac, self._mac(name, data)):
            raise SealError(
                f"the value of {name!r} in the rendezvous store is not sealed with this job's "
                f"key ({KEY_ENV}): written by something outside the job (an agent without the "
                "key, such as plain torchrun, or someone else who reached the store's port). "
                "Refusing to load it; every pod of a job must run ddpjob-agent with the same key"
            )
        return data
