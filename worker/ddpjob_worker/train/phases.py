"""Where the worker is in its step, told to its agent for hang detection: a progress record
in the agent's directory (:mod:`ddpjob_worker.progress`), and a communication hook that marks
the moment a step's gradients go to DDP's all-reduce."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpjob_worker import progress
from ddpjob_worker.contract import DDPJOB_SNAPSHOT_DIR
from ddpjob_worker.hang import StepTimes
from ddpjob_worker.progress import Phase

logger = logging.getLogger("ddpjob_worker.train")


class Marks:
    """This worker's progress record and the step times its hang threshold is learned from;
    marks nothing outside a ddpjob-agent (nobody would read them)."""

    def __init__(self, model: torch.nn.Module, env: dict[str, str] | os._Environ[str]) -> None:
        self._progress = _progress_writer(env)
        self._step_times = StepTimes()
        self._collective = False
        """This step's gradients went to the all-reduce (the hook marked it)."""
        self._step = 0
        self.on = self._progress is not None
        """Marks are written (the hot path asks before it calls :meth:`mark`)."""
        if self._progress is not None:
            _watch_collective(model, self._entered_collective)

    def mark(self, step: int, phase: Phase) -> None:
        """Tell the agent that this worker is in ``phase`` of ``step`` now."""
        if self._progress is None:
            return
        now = time.monotonic()
        self._step = step
        if phase is Phase.COMPUTE:
            self._collective = False
            self._step_times.observe(progress.Progress(step, phase, now))
        self._progress.mark(step, phase, now, self._step_times.threshold())

    def _entered_collective(self) -> None:
        if not self._collective:
            self._collective = True
            self.mark(self._step, Phase.COLLECTIVE)


def _progress_writer(env: dict[str, str] | os._Environ[str]) -> progress.ProgressWriter | None:
    """This local rank's progress record, in the agent's directory; None outside a
    ddpjob-agent (nobody would read it) or where it cannot be made."""
    directory = env.get(DDPJOB_SNAPSHOT_DIR)
    if not directory:
        return None
    path = progress.path_for(Path(directory), int(env.get("LOCAL_RANK", "0")))
    try:
        return progress.ProgressWriter(path)
    except OSError as exc:
        logger.warning("no progress record for hang detection (%s): %s", path, exc)
        return None


def _watch_collective(model: torch.nn.Module, entered: Callable[[], None]) -> None:
    """Call ``entered()`` when a step's gradients go to DDP's all-reduce: a communication hook
    that marks it, then all-reduces as DDP's default does. A model that is not DDP, or that
    has a hook of its own already, is not watched (hang detection then sees no rank waiting
    in the collective, and pins nothing)."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    if not isinstance(model, DistributedDataParallel):
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415

    def hook(state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        entered()
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    # DDP checks a hook's annotations as objects, and this module's are strings.
    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,  # type: ignore[attr-defined]
        "return": torch.futures.Future[torch.Tensor],
    }
    try:
        model.register_comm_hook(None, hook)
    except RuntimeError as exc:
        logger.warning("hang detection does not see this model's all-reduce: %s", exc)
