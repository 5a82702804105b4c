"""A step's state, as the snapshots and checkpoints carry it: its version, this process's RNG
states, and a checksum of the model that every rank compares after a restore."""

from __future__ import annotations

import ctypes
import functools
import importlib
import random
import zlib
from typing import Any, Protocol

import torch

PAYLOAD_VERSION = 1
"""The version of :meth:`~ddpjob_worker.train.trainstate.TrainState.state_dict`'s layout."""


class Stateful(Protocol):
    """What a scheduler (or anything else restored) must have."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@functools.cache
def _numpy() -> Any:
    """numpy's module if it is installed (its RNG is then part of the state), else None. Looked
    up once: every step's snapshot asks, and a failed import searches the whole path again."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def rng_state() -> dict[str, Any]:
    """This process's RNG states."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    np = _numpy()
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np = _numpy()
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])


def derived_seed(seed: int, rank: int, step: int) -> int:
    """A seed for a rank that has no RNG state of its own at ``step``: a function of
    (seed, rank, step) only, so the same in any rerun."""
    return zlib.crc32(f"{seed}/{rank}/{step}".encode()) | (seed & 0xFFFF) << 32


def seed_rng(value: int) -> None:
    torch.manual_seed(value)
    random.seed(value)
    np = _numpy()
    if np is not None:
        np.random.seed(value % 2**32)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A CPU copy of ``tensor``'s bytes (no numpy needed)."""
    flat = tensor.detach().cpu().contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


def model_checksum(model: torch.nn.Module) -> int:
    """CRC-32 over the model's state (parameters and buffers, in order): equal on every rank
    after a good restore."""
    crc = 0
    for name, value in model.state_dict().items():
        crc = zlib.crc32(name.encode(), crc)
        if isinstance(value, torch.Tensor):
            crc = zlib.crc32(tensor_bytes(value), crc)
    return crc
