"""The torch versions the agent is tested on. Stdlib only (checked before torch is imported).

The agent subclasses torch's ``LocalElasticAgent`` and reads private internals of
``torch.distributed.elastic`` (the monitor loop, ``_remaining_restarts``, the dynamic
rendezvous' state holder, ``PContext``'s signal handlers). Those change between releases
without notice, so ``ddpjob-agent`` refuses to start on a torch outside the tested range unless
told to (``DDPJOB_ALLOW_UNTESTED_TORCH=1``, then it warns).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

TESTED_TORCH = ">=2.13,<2.14"
"""The torch releases the agent is tested on (as a pip specifier, for humans)."""
TESTED_TORCH_MIN = (2, 13)
TESTED_TORCH_BELOW = (2, 14)
ALLOW_UNTESTED_TORCH = "DDPJOB_ALLOW_UNTESTED_TORCH"


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string such as ``2.13.0+cpu`` or ``2.14.0.dev20261201``."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        return None
    return int(match[1]), int(match[2])


def is_tested(version: str) -> bool:
    found = release(version)
    return found is not None and TESTED_TORCH_MIN <= found < TESTED_TORCH_BELOW


def check_torch(version: str | None, env: Mapping[str, str]) -> tuple[bool, str | None]:
    """``(may run, message)``: the message is an error when it may not run, else a warning."""
    if version is None:
        return False, (
            f"torch is not installed; ddpjob-agent needs torch {TESTED_TORCH} "
            f"(pip install 'ddpjob[worker]')"
        )
    if is_tested(version):
        return True, None
    message = (
        f"torch {version} is installed, but ddpjob-agent is tested only on torch {TESTED_TORCH}: "
        f"it relies on private internals of torch.distributed.elastic that change between "
        f"releases."
    )
    if env.get(ALLOW_UNTESTED_TORCH, "").strip().lower() in {"1", "true", "yes"}:
        return True, f"{message} Running anyway ({ALLOW_UNTESTED_TORCH} is set)."
    return False, f"{message} Set {ALLOW_UNTESTED_TORCH}=1 to run it anyway."


def installed_torch() -> str | None:
    """The installed torch's version, read from its metadata (torch is not imported)."""
    from importlib import metadata  # noqa: PLC0415

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
