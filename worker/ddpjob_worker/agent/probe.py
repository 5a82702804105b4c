"""Readiness probe: exit 0 only when the agent's workers are running and its state is fresh.

``python -m ddpjob_worker.agent.probe [--state-file PATH] [--max-age SECONDS]`` or
``ddpjob-agent --probe ...``. Stdlib only: it never imports torch, so it is cheap to run often.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ddpjob_worker.contract import DDPJOB_STATE_FILE, DEFAULT_STATE_FILE
from ddpjob_worker.state import is_ready, read_state

DEFAULT_MAX_AGE = 30.0
"""The agent rewrites its state every 5 s while running; 30 s tolerates a busy node."""

EXIT_READY = 0
EXIT_NOT_READY = 1
EXIT_NO_STATE = 3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddpjob-agent --probe", description=__doc__)
    parser.add_argument(
        "--state-file",
        default=os.environ.get(DDPJOB_STATE_FILE) or DEFAULT_STATE_FILE,
        help=f"the agent's state file (default: ${DDPJOB_STATE_FILE} or {DEFAULT_STATE_FILE})",
    )
    parser.add_argument(
        "--max-age",
        type=float,
        default=DEFAULT_MAX_AGE,
        help="seconds since the last update before the state counts as stale",
    )
    args = parser.parse_args(argv)
    try:
        state = read_state(args.state_file)
    except OSError as exc:
        print(f"not ready: cannot read {args.state_file}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NO_STATE
    except ValueError as exc:
        print(f"not ready: {args.state_file}: {exc}", file=sys.stderr)
        return EXIT_NO_STATE
    if is_ready(state, max_age=args.max_age):
        print(f"ready: phase={state.phase.value} round={state.rdzv_round} world={state.world_size}")
        return EXIT_READY
    print(
        f"not ready: phase={state.phase.value}, updated {state.age():.1f}s ago "
        f"(max {args.max_age:g}s)",
        file=sys.stderr,
    )
    return EXIT_NOT_READY


if __name__ == "__main__":
    sys.exit(main())
