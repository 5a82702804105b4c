"""``ddpjob-agent``: torchrun's command line, with our agent behind it.

Same flags and ``PET_*`` variables as ``torchrun`` (we reuse ``torch.distributed.run``'s parser),
plus ``--grace-seconds``, ``--state-file`` and ``--probe``. This module only parses, sets up
signals and logging, and maps outcomes to exit codes (see :mod:`ddpjob_worker.errors`).
"""

# torch is imported lazily so that `--probe` and `--help` of light paths stay torch-free.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import MutableMapping, Sequence
from types import FrameType
from typing import Any, NoReturn

from ddpjob_worker.contract import (
    DDPJOB_GRACE_SECONDS,
    DDPJOB_STATE_FILE,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
)
from ddpjob_worker.errors import (
    EXIT_ENDPOINT_UNREACHABLE,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_USAGE,
    EndpointUnreachableError,
)
from ddpjob_worker.policy import DEFAULT_HEARTBEAT_SECONDS, resolve_settings
from ddpjob_worker.state import Failure, Phase, StateWriter

logger = logging.getLogger("ddpjob_worker.cli")


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser with our flags added."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "ddpjob-agent"
    parser.description = (
        "Elastic PyTorch DDP agent: a drop-in for torchrun that survives losing the rendezvous "
        "store host. Run `ddpjob-agent --probe --help` for the readiness probe."
    )
    parser.add_argument(
        "--grace-seconds",
        type=float,
        default=None,
        help=f"after SIGTERM/SIGINT, how long the workers get before SIGKILL "
        f"(env {DDPJOB_GRACE_SECONDS}; default: --shutdown-timeout if set, else 25)",
    )
    parser.add_argument(
        "--state-file",
        default=None,
        help=f"where to write the agent's JSON state (env {DDPJOB_STATE_FILE}; default: none)",
    )
    return parser


def apply_env_defaults(environ: MutableMapping[str, str]) -> None:
    """Reliability defaults, set only where the user has not: the workers' process group gets
    its own store instead of reusing the rendezvous store (stock torchrun hangs without it,
    TORCHRUN-BASELINE.md)."""
    environ.setdefault(TORCH_DISABLE_SHARE_RDZV_TCP_STORE, "1")


def _raise_signal(signum: int, frame: FrameType | None) -> None:
    from torch.distributed.elastic.multiprocessing import SignalException

    # One-shot: a second signal during the grace period must not abort the shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    sigval = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def _prepare(args: argparse.Namespace) -> None:
    """torchrun's ``run()`` pre-processing: --standalone and the single-node static default."""
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _run(args: argparse.Namespace, writer: StateWriter) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import config_from_args

    from ddpjob_worker.agent import launch

    _prepare(args)
    config, entrypoint, cmd_args = config_from_args(args)
    grace = args.grace_seconds
    if grace is None and not os.environ.get(DDPJOB_GRACE_SECONDS, "").strip():
        grace = args.shutdown_timeout  # torchrun's own flag, if given
    settings = resolve_settings(
        config.rdzv_configs, os.environ, grace_flag=grace, state_file_flag=args.state_file
    )

    @record
    def run() -> dict[int, Any]:
        return launch(
            config,
            entrypoint,
            cmd_args,
            settings=settings,
            state=writer,
            heartbeat_seconds=DEFAULT_HEARTBEAT_SECONDS,
        )

    run()


def main(argv: Sequence[str] | None = None) -> int:
    """The ``ddpjob-agent`` console script. Returns only for ``--probe``: after running the
    agent it exits the process itself (see :func:`_exit_now`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--probe"]:
        from ddpjob_worker.probe import main as probe_main

        return probe_main(argv[1:])
    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "INFO"),
        format="[ddpjob-agent %(asctime)s %(levelname)s %(name)s] %(message)s",
        stream=sys.stderr,
    )
    apply_env_defaults(os.environ)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_signal)

    args = build_parser().parse_args(argv)
    state_file = args.state_file or os.environ.get(DDPJOB_STATE_FILE) or None
    writer = StateWriter(state_file, max_restarts=args.max_restarts)
    writer.update(phase=Phase.WAITING)
    code = _main(args, writer)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    return _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """Exit without interpreter finalization.

    torch's rendezvous keep-alive runs in a daemon thread that may be inside a TCPStore call
    when we exit (always likely after losing the store host). Finalizing the interpreter then
    ends that thread with ``pthread_exit`` inside C++ code, which aborts the process
    ("terminate called without an active exception", exit -6) and loses our exit code. Our
    state file is written and the workers are gone by now, so skip finalization.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(args: argparse.Namespace, writer: StateWriter) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    def fail(reason: str, code: int) -> int:
        writer.update(
            phase=Phase.FAILED,
            last_failure=Failure(reason=reason, exit_code=code, at=time.time()),
        )
        return code

    try:
        _run(args, writer)
    except SignalException as exc:
        logger.warning("stopped by %s after forwarding it to the workers", exc.sigval.name)
        writer.update(phase=Phase.STOPPED)
        return EXIT_STOPPED
    except EndpointUnreachableError as exc:
        print(f"ddpjob-agent: error: {exc}", file=sys.stderr, flush=True)
        return fail(str(exc), EXIT_ENDPOINT_UNREACHABLE)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr, flush=True)  # type: ignore[no-untyped-call]
        return fail(f"workers failed: {exc.name}", EXIT_FAILED)
    except RendezvousClosedError as exc:
        message = "the rendezvous was closed by another agent: the job has ended"
        print(f"ddpjob-agent: error: {message} ({exc})", file=sys.stderr, flush=True)
        return fail(message, EXIT_FAILED)
    except (ValueError, AssertionError) as exc:
        # torchrun's config_from_args validates with AssertionError/ValueError.
        print(f"ddpjob-agent: error: {exc}", file=sys.stderr, flush=True)
        return fail(str(exc), EXIT_USAGE)
    except Exception as exc:
        logger.exception("agent failed")
        return fail(f"{type(exc).__name__}: {exc}", EXIT_FAILED)
    writer.update(phase=Phase.SUCCEEDED)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
