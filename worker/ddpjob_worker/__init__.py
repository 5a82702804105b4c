"""ddpjob's worker side: the ``ddpjob-agent`` elastic launcher and ``init_distributed()``.

Importing this package does not import torch; :func:`init_distributed` imports it when called.
"""

from ddpjob_worker.distributed import DistInfo, init_distributed

__all__ = ["DistInfo", "init_distributed"]
