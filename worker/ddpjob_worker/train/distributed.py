"""``init_distributed()``: the one call a training script needs under ``ddpjob-agent``.

torch is imported inside the function, so importing :mod:`ddpjob_worker` stays light.
"""

# torch is imported inside init_distributed so `import ddpjob_worker` stays light.
# ruff: noqa: PLC0415

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import TracebackType

    import torch

DEFAULT_TIMEOUT_SECONDS = 120.0
"""Collective timeout. torch's default is 10-30 min; a dead peer should surface sooner so the
agent can restart the group, but a slow checkpoint must not trip it."""


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def choose_backend(*, cuda_available: bool, device_count: int, local_rank: int) -> str:
    """``nccl`` when this process has a GPU of its own (LOCAL_RANK maps to a device), else gloo."""
    if cuda_available and 0 <= local_rank < device_count:
        return "nccl"
    return "gloo"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from exc


_recording: list[bool] = []


def _record_uncaught_errors() -> None:
    """Write an uncaught exception of the script to torch's error file
    (``TORCHELASTIC_ERROR_FILE``, in the format of torch's ``@record``), as ``@record`` would:
    the agent reads it to tell a worker's own error from a collective that failed under it
    (docs/agent.md, "Recovery rules"). Once per process; a file already written (by
    ``@record``) is kept."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or _recording:
        return
    _recording.append(True)
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        try:
            if not os.path.exists(path):
                message = {
                    "message": f"{kind.__name__}: {value}",
                    "extraInfo": {
                        "py_callstack": "".join(traceback.format_exception(kind, value, tb)),
                        "timestamp": str(int(time.time())),
                    },
                }
                with open(path, "w", encoding="utf-8") as handle:
                    json.dump({"message": message}, handle)
        except Exception:  # noqa: S110 - the traceback below is what matters
            pass
        previous(kind, value, tb)

    sys.excepthook = hook


def init_distributed(
    *, backend: str | None = None, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
) -> DistInfo:
    """Pick the backend, set the device and call ``init_process_group`` from the torchrun env.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT as set by ``ddpjob-agent`` (or
    torchrun). Without them (a plain ``python train.py``) it runs as a world of one.
    """
    import torch
    import torch.distributed as dist

    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    cuda = torch.cuda.is_available()
    chosen = backend or choose_backend(
        cuda_available=cuda,
        device_count=torch.cuda.device_count() if cuda else 0,
        local_rank=local_rank,
    )
    if chosen == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    _record_uncaught_errors()
    if not dist.is_initialized():
        dist.init_process_group(
            backend=chosen,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_seconds),
        )
    return DistInfo(
        rank=rank, world_size=world_size, local_rank=local_rank, backend=chosen, device=device
    )
