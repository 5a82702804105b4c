"""ddpjob's worker side: the ``ddpjob-agent`` elastic launcher, ``init_distributed()`` and
``saving()``.

Importing this package does not import torch; :func:`init_distributed` imports it when called.
"""

from ddpjob_worker.saving import saving
from ddpjob_worker.train.distributed import DistInfo, init_distributed

__all__ = ["DistInfo", "init_distributed", "saving"]
