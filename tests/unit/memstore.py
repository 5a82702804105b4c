"""A c10d store in memory, for the membership core's unit tests (``ddpjob_worker.membership.keys``,
``blame``, ``failover``): the methods they use, with the TCPStore's semantics (values are bytes,
``append`` creates the key, ``get`` of a missing key fails as the TCPStore's does after its
timeout). One lock, so that threads of one test may share it; ``down`` makes every request fail
as a store whose host is gone does."""

from __future__ import annotations

import threading
from collections.abc import Iterable


class StoreDownError(RuntimeError):
    """What a request to a store whose host is gone raises (torch's DistNetworkError is a
    RuntimeError too)."""


class MemStore:
    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.down = False
        self.requests = 0

    def _enter(self) -> None:
        if self.down:
            raise StoreDownError("the store's host is gone")
        self.requests += 1

    @staticmethod
    def _bytes(value: str | bytes) -> bytes:
        return value.encode() if isinstance(value, str) else value

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._enter()
            self._data[key] = self._bytes(value)

    def get(self, key: str) -> bytes:
        with self._lock:
            self._enter()
            if key not in self._data:
                raise RuntimeError(f"wait timeout: {key}")
            return self._data[key]

    def check(self, keys: Iterable[str]) -> bool:
        with self._lock:
            self._enter()
            return all(key in self._data for key in keys)

    def wait(self, keys: Iterable[str], timeout: object = None) -> None:
        """Nothing waits here: a key that is not there has timed out."""
        with self._lock:
            self._enter()
            missing = [key for key in keys if key not in self._data]
            if missing:
                raise RuntimeError(f"wait timeout: {missing}")

    def multi_get(self, keys: Iterable[str]) -> list[bytes]:
        with self._lock:
            self._enter()
            return [self._data[key] for key in keys]

    def append(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._enter()
            self._data[key] = self._data.get(key, b"") + self._bytes(value)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._data)
