"""Run a training script with its optimizer steps logged, without a line of it changed: the
baseline's side of ``bench/bench_scripts.py``.

``python -m steplog SCRIPT [ARGS...]`` (``ddpjob-agent -m steplog SCRIPT ...``, with this folder
on ``PYTHONPATH``) registers a global optimizer step hook and wraps
``DistributedSampler.set_epoch``, then runs ``SCRIPT`` as ``__main__``. Each rank appends to
``$STEPLOG/rank<rank>-<pid>.jsonl`` one line per epoch begun (``{"t", "epoch"}``) and per
optimizer step taken (``{"t", "step": epoch}``): enough to count, after a restart, the steps the
script did again (its own snapshot is older than its last step).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DistributedSampler

_directory = Path(os.environ["STEPLOG"])
_directory.mkdir(parents=True, exist_ok=True)
_file = (_directory / f"rank{os.environ.get('RANK', '0')}-{os.getpid()}.jsonl").open(
    "a", buffering=1, encoding="utf-8"
)
_epoch: list[int] = [-1]


def _write(line: dict[str, Any]) -> None:
    line["t"] = time.time()
    _file.write(json.dumps(line) + "\n")


_set_epoch = DistributedSampler.set_epoch


def _logged_set_epoch(self: DistributedSampler[Any], epoch: int) -> None:
    _epoch[0] = epoch
    _write({"epoch": epoch})
    _set_epoch(self, epoch)


def _stepped(*_: Any) -> None:
    _write({"step": _epoch[0]})


DistributedSampler.set_epoch = _logged_set_epoch  # type: ignore[method-assign]
register_optimizer_step_post_hook(_stepped)

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
    runpy.run_path(sys.argv[0], run_name="__main__")
