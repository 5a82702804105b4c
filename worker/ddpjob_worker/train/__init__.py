"""The training library: what a training script imports to lose no step to a failure.

``from ddpjob_worker.train import TrainState, ElasticSampler`` is the API. The names are
resolved on first use, so that the light rooms of this package (the sampler, the cadence, the
snapshot file) import without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpjob_worker.train.payload import model_checksum as model_checksum
    from ddpjob_worker.train.restore import Restored as Restored
    from ddpjob_worker.train.sampler import Batch as Batch
    from ddpjob_worker.train.sampler import ElasticSampler as ElasticSampler
    from ddpjob_worker.train.snapshot import newest as newest
    from ddpjob_worker.train.snapshot import snapshot_path as snapshot_path
    from ddpjob_worker.train.trainstate import Stats as Stats
    from ddpjob_worker.train.trainstate import TrainState as TrainState

_HOMES = {
    "Batch": "ddpjob_worker.train.sampler",
    "ElasticSampler": "ddpjob_worker.train.sampler",
    "Restored": "ddpjob_worker.train.restore",
    "TrainState": "ddpjob_worker.train.trainstate",
    "model_checksum": "ddpjob_worker.train.payload",
    "newest": "ddpjob_worker.train.snapshot",
    "snapshot_path": "ddpjob_worker.train.snapshot",
    "Stats": "ddpjob_worker.train.trainstate",
}

__all__ = [
    "Batch",
    "ElasticSampler",
    "Restored",
    "Stats",
    "TrainState",
    "model_checksum",
    "newest",
    "snapshot_path",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
