"""``ddpjob-agent``: torchrun's command line, with our agent behind it.

Same flags and ``PET_*`` variables as ``torchrun`` (we reuse ``torch.distributed.run``'s parser),
plus ``--grace-seconds``, ``--state-file`` and ``--probe``. This module only parses, sets up
signals and logging, and maps outcomes to exit codes (see :mod:`ddpjob_worker.errors`).
"""

# torch is imported lazily so that `--probe` and `--help` of light paths stay torch-free.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from ddpjob_worker import snapdir
from ddpjob_worker.agent import compat, signals, warm
from ddpjob_worker.agent.blame import CAUSE_COMM, cause_of
from ddpjob_worker.agent.policy import (
    DEFAULT_HEARTBEAT_SECONDS,
    Settings,
    exit_code_for_worker,
    parse_bool,
    resolve_settings,
    static_master,
)
from ddpjob_worker.contract import (
    DDPJOB_GRACE_SECONDS,
    DDPJOB_SAVING_DIR,
    DDPJOB_SNAPSHOT_DIR,
    DDPJOB_STATE_FILE,
    DDPJOB_WARM_WORKERS,
    PET_NPROC_PER_NODE,
    PET_RDZV_ID,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
)
from ddpjob_worker.errors import (
    EXIT_INFRA,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_USAGE,
    EXIT_WORKER_FAILED,
    AgentError,
    ConfigError,
)
from ddpjob_worker.state import Failure, Phase, StateWriter

logger = logging.getLogger("ddpjob_worker.agent.cli")


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


@dataclasses.dataclass(frozen=True)
class _Plan:
    config: Any  # torch's LaunchConfig (torch is imported lazily)
    entrypoint: Callable[..., Any] | str
    args: list[str]
    settings: Settings


def _configure(args: argparse.Namespace) -> _Plan:
    """Everything checked before the run starts: a problem here is a usage error (exit 2)."""
    from torch.distributed.run import config_from_args

    _prepare(args)
    try:
        config, entrypoint, cmd_args = config_from_args(args)
        settings = resolve_settings(
            config.rdzv_configs,
            os.environ,
            grace_flag=args.grace_seconds,
            state_file_flag=args.state_file,
            shutdown_timeout_flag=args.shutdown_timeout,  # torchrun's own flag, if given
        )
        if config.rdzv_backend == "static":
            static_master(config.rdzv_endpoint)
    except (ValueError, AssertionError) as exc:
        # torchrun's config_from_args validates with AssertionError/ValueError.
        raise ConfigError(str(exc)) from exc
    return _Plan(config, entrypoint, list(cmd_args), settings)


def _run(plan: _Plan, writer: StateWriter, early: list[warm.Spare]) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    from ddpjob_worker.agent.launch import launch

    @record
    def run() -> dict[int, Any]:
        signals.check()
        return launch(
            plan.config,
            plan.entrypoint,
            plan.args,
            settings=plan.settings,
            state=writer,
            heartbeat_seconds=DEFAULT_HEARTBEAT_SECONDS,
            early_spares=early,
        )

    run()


def main(argv: Sequence[str] | None = None) -> int:
    """The ``ddpjob-agent`` console script. Returns only for ``--probe``: after running the
    agent it exits the process itself (see :func:`_exit_now`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--probe"]:
        from ddpjob_worker.agent.probe import main as probe_main

        return probe_main(argv[1:])
    logging.basicConfig(
        level=os.environ.get("LOGLEVEL", "INFO"),
        format="[ddpjob-agent %(asctime)s %(levelname)s %(name)s] %(message)s",
        stream=sys.stderr,
    )
    if not _torch_ok(argv):
        return _exit_now(EXIT_USAGE)
    apply_env_defaults(os.environ)
    early: list[warm.Spare] = []
    writer: StateWriter | None = None
    saving_dir: str | None = None
    snap_dir: Path | None = None

    def stopped_while_starting(sig: signal.Signals) -> NoReturn:
        logger.warning("stopped by %s while starting", sig.name)
        _clean_up(early, saving_dir, snap_dir)
        _exit_now(EXIT_STOPPED)

    signals.exit_early(stopped_while_starting)
    signals.install()
    try:
        saving_dir = _saving_dir(os.environ)
        snap_dir = _snapshot_dir(argv, os.environ)
        # Before torch's own import below: the first workers' imports overlap ours.
        _early_spares(argv, os.environ, early)
        args = build_parser().parse_args(argv)  # imports torch
        signals.exit_early(None)  # a stop raises from now on (SignalException)
        state_file = args.state_file or os.environ.get(DDPJOB_STATE_FILE) or None
        writer = StateWriter(state_file, max_restarts=args.max_restarts)
        writer.update(phase=Phase.WAITING)
        code = _main(args, writer, early)
    except Exception:
        # A SIGTERM before the agent runs (torch's import, the early spares, the settings) is
        # a stop like any other: 143, never the 1 of an uncaught exception, which
        # restartPolicy: ExitCode would take for a permanent failure.
        if not signals.stopping():
            raise
        logger.warning("stopped by a signal while starting")
        if writer is not None:
            writer.update(phase=Phase.STOPPED)
        code = EXIT_STOPPED
    finally:
        signals.exit_early(None)
        _clean_up(early, saving_dir, snap_dir)
    signals.ignore()
    return _exit_now(code)


def _clean_up(early: list[warm.Spare], saving_dir: str | None, snap_dir: Path | None) -> None:
    """Kill the early spares the agent did not take (it hands them over or kills them, unless
    it failed or never ran), and remove our checkpoint-marker and snapshot directories."""
    for spare in early:
        if spare.proc.stdin is not None and not spare.proc.stdin.closed:
            spare.kill()
    if saving_dir is not None:
        shutil.rmtree(saving_dir, ignore_errors=True)
        os.environ.pop(DDPJOB_SAVING_DIR, None)
    if snap_dir is not None:
        snapdir.remove(snap_dir)
        os.environ.pop(DDPJOB_SNAPSHOT_DIR, None)


def _saving_dir(env: MutableMapping[str, str]) -> str | None:
    """A directory of our own for ``ddpjob_worker.saving()`` markers, named to the workers (and
    the spares, before they start) in ``DDPJOB_SAVING_DIR``; None if one is set already."""
    if env.get(DDPJOB_SAVING_DIR):
        return None
    try:
        directory = tempfile.mkdtemp(prefix="ddpjob-saving-")
    except OSError as exc:  # workers then save unannounced, as under torchrun
        logger.warning("no directory for checkpoint markers (%s): saves are not waited for", exc)
        return None
    env[DDPJOB_SAVING_DIR] = directory
    return directory


def _snapshot_dir(argv: Sequence[str], env: MutableMapping[str, str]) -> Path | None:
    """The run's snapshot directory (:mod:`ddpjob_worker.snapdir`), made before the first
    workers (and the spares, whose environment must match theirs) start, and named to them in
    ``DDPJOB_SNAPSHOT_DIR``; kept across their restarts, removed when we exit. None if one is
    set already (an outer agent's) or it cannot be made (workers then keep their own)."""
    if env.get(DDPJOB_SNAPSHOT_DIR):
        return None
    try:
        directory = snapdir.make(_run_id(argv, env))
    except OSError as exc:
        logger.warning("no snapshot directory (%s): workers keep their snapshots themselves", exc)
        return None
    env[DDPJOB_SNAPSHOT_DIR] = str(directory)
    return directory


def _run_id(argv: Sequence[str], env: Mapping[str, str]) -> str:
    """The run id before torch's parser runs (it imports torch): ``--rdzv-id`` (or
    ``--rdzv_id``), else ``PET_RDZV_ID``, else ``none`` (torchrun's default; ``--standalone``
    makes a random one later, and the directory's pid tells agents apart anyway)."""
    for i, arg in enumerate(argv):
        for flag in ("--rdzv-id", "--rdzv_id"):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return env.get(PET_RDZV_ID, "").strip() or "none"


def _early_spares(argv: Sequence[str], env: Mapping[str, str], into: list[warm.Spare]) -> None:
    """Warm workers for the first group (:func:`warm.start_early`) into ``into``, one per
    ``PET_NPROC_PER_NODE`` (1 when it is not a number), unless they are off or cannot be used."""
    if {"-h", "--help", "--no-python", "--no_python"} & set(argv) or env.get("PET_NO_PYTHON"):
        return
    try:
        if not parse_bool(env.get(DDPJOB_WARM_WORKERS, "").strip() or "1"):
            return
    except ValueError:
        return  # resolve_settings reports it, naming the variable
    nproc = _nproc(argv, env)
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        # torchrun sets it so once it has parsed its flags, after our spares would have
        # started; a spare whose environment differs from its worker's is never used.
        os.environ["OMP_NUM_THREADS"] = "1"
        logger.info("OMP_NUM_THREADS=1 for %d workers per node, as torchrun sets it", nproc)
    warm.start_early(nproc, into)


def _nproc(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Workers per node from ``PET_NPROC_PER_NODE`` (how the operator says it), when no flag
    may override it; otherwise, or when it is not a number (``gpu``, ``auto``), 1: torchrun's
    own parser, which needs torch, has the last word."""
    if any(arg.startswith(("--nproc-per-node", "--nproc_per_node")) for arg in argv):
        return 1
    value = env.get(PET_NPROC_PER_NODE, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 1


def _torch_ok(argv: Sequence[str]) -> bool:
    """Refuse an untested torch (see :mod:`ddpjob_worker.agent.compat`); ``--help`` always works."""
    if "-h" in argv or "--help" in argv:
        return True
    may_run, message = compat.check_torch(compat.installed_torch(), os.environ)
    if message is not None:
        if may_run:
            logger.warning("%s", message)
        else:
            print(f"ddpjob-agent: error: {message}", file=sys.stderr, flush=True)
    return may_run


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


def _main(args: argparse.Namespace, writer: StateWriter, early: list[warm.Spare]) -> int:
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
        plan = _configure(args)
    except ConfigError as exc:
        print(f"ddpjob-agent: error: {exc}", file=sys.stderr, flush=True)
        return fail(str(exc), EXIT_USAGE)
    try:
        _run(plan, writer, early)
    except SignalException as exc:
        logger.warning("stopped by %s after forwarding it to the workers", exc.sigval.name)
        writer.update(phase=Phase.STOPPED)
        return EXIT_STOPPED
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr, flush=True)  # type: ignore[no-untyped-call]
        _, first = exc.get_first_failure()
        reason = f"workers failed: {exc.name} (first failure exit code {first.exitcode})"
        if cause_of(exc.failures) == CAUSE_COMM:
            # A peer went away under the collective: retryable, never the script's 1, which
            # restartPolicy: ExitCode takes for a permanent failure of the job.
            return fail(f"{reason}: a communication error (retryable)", EXIT_INFRA)
        return fail(reason, exit_code_for_worker(first.exitcode))
    except RendezvousClosedError as exc:
        # Only outside a DDPJob pod: there, agents that give up do not close the rendezvous.
        # Another agent closed it because its workers failed for good: the job has ended.
        message = "the rendezvous was closed by another agent: the job has ended"
        print(f"ddpjob-agent: error: {message} ({exc})", file=sys.stderr, flush=True)
        return fail(message, EXIT_WORKER_FAILED)
    except AgentError as exc:
        print(f"ddpjob-agent: error: {exc}", file=sys.stderr, flush=True)
        return fail(str(exc), exc.exit_code)
    except Exception as exc:
        # The rendezvous broke, the store failed, or a bug of ours: infrastructure, retryable.
        logger.exception("agent failed")
        return fail(f"{type(exc).__name__}: {exc}", EXIT_INFRA)
    writer.update(phase=Phase.SUCCEEDED)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
