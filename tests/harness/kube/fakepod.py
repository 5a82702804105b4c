"""A stand-in trainer for operator scenarios on the real control plane.

It runs as a real process in a real pod (image ``ddpjob/fake-trainer``), and does what a test
tells it through a file ``$FAKEPOD_DIR/<pod uid>`` (``$POD_UID`` comes from a fieldRef):

* a number N: exit with code N;
* ``oom``: allocate memory until the kernel OOM-kills it (the container needs a memory limit);

and on SIGTERM it exits 143 at once, as ddpjob-agent does after a graceful stop.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

POLL_SECONDS = 0.05
EXIT_STOPPED = 143


def _stopped(signum: int, _: FrameType | None) -> None:
    sys.exit(EXIT_STOPPED)


def command_file() -> Path:
    return Path(os.environ["FAKEPOD_DIR"]) / os.environ["POD_UID"]


def exhaust_memory() -> None:
    hoard = []
    while True:
        hoard.append(bytearray(16 * 2**20))


def main() -> int:
    signal.signal(signal.SIGTERM, _stopped)
    path = command_file()
    print(f"fake trainer {os.environ.get('POD_NAME', '?')} waiting for {path}", flush=True)
    while not path.exists():
        time.sleep(POLL_SECONDS)
    order = path.read_text().strip()
    print(f"told: {order}", flush=True)
    if order == "oom":
        exhaust_memory()
    return int(order)


if __name__ == "__main__":
    sys.exit(main())
