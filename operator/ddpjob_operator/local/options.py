"""The command-line options of ``ddpjob run`` (light: no process code is imported)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from ddpjob_operator.errors import DDPJobError

CHAOS_KINDS = {
    "kill": "SIGKILL the pod's process tree (a lost node; the default)",
    "freeze": (
        "SIGSTOP the pod's process tree (a frozen node: connections stay open, nothing answers); "
        "it stays frozen until --chaos-thaw, or is killed and replaced as a lost node after "
        "--chaos-node-lost-after"
    ),
    "worker": (
        "SIGKILL one training process of the pod (a crashed or OOM-killed trainer): the pod and "
        "its agent live, and the agent restarts the group"
    ),
    "mixed": "kill or freeze, chosen at random for each fault",
}
"""The faults ``--chaos`` can inject, and what each does."""

NOT_LOCAL_CHAOS_KINDS = {
    "partition": (
        "partition is not possible under `ddpjob run`: every local pod listens on 127.0.0.1 in "
        "this machine's one network namespace, so no pod can be cut off from the others alone; "
        "use --chaos-kind freeze instead, the silent fault that can be done here (SIGSTOP: "
        "connections stay open, nothing answers), or partition a pod on a cluster"
    ),
}
"""Kinds a user may ask for that ``ddpjob run`` refuses, with why and what to use instead."""

FREEZE_KINDS = frozenset({"freeze", "mixed"})
"""The kinds that can freeze a pod (``--chaos-thaw`` and ``--chaos-node-lost-after`` apply)."""


class RunUsageError(DDPJobError):
    """``ddpjob run``'s options do not make sense together."""


def chaos_kind(text: str) -> str:
    """``--chaos-kind``'s value; an unknown or impossible kind says why (argparse exits 2)."""
    if text in NOT_LOCAL_CHAOS_KINDS:
        raise argparse.ArgumentTypeError(NOT_LOCAL_CHAOS_KINDS[text])
    if text not in CHAOS_KINDS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a chaos kind; choose from {', '.join(CHAOS_KINDS)}"
        )
    return text


def _seconds(*, zero: bool) -> Callable[[str], float]:
    """A number of seconds: finite, more than 0 (or 0 too when ``zero``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            least = "0 or more" if zero else "more than 0"
            raise argparse.ArgumentTypeError(f"{text!r}: give {least} seconds")
        return value

    return parse


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="FILE", help="the DDPJob manifest to run")
    parser.add_argument("--run-dir", help="where logs, state and checkpoints go")
    parser.add_argument(
        "--chaos",
        type=_seconds(zero=False),
        metavar="SECONDS",
        help="inject a fault (--chaos-kind) into a random pod about every SECONDS seconds",
    )
    parser.add_argument(
        "--chaos-kind",
        type=chaos_kind,
        metavar="{" + ",".join(CHAOS_KINDS) + "}",
        help="the fault --chaos injects: "
        + "; ".join(f"{kind}: {what}" for kind, what in CHAOS_KINDS.items())
        + ". (partition is refused: pods on one machine share its network)",
    )
    parser.add_argument(
        "--chaos-thaw",
        type=_seconds(zero=False),
        metavar="SECONDS",
        help="SIGCONT a frozen pod after SECONDS (a long stall, a node that comes back); "
        "default: it stays frozen, a dead machine",
    )
    parser.add_argument(
        "--chaos-node-lost-after",
        type=_seconds(zero=True),
        metavar="SECONDS",
        help="a pod frozen this long (and not thawed) reads as a lost node: SIGKILLed and "
        "replaced without charging backoffLimit (default: the job's "
        "spec.nodeLostTolerationSeconds, 30 unless set)",
    )
    parser.add_argument(
        "--chaos-faults",
        "--chaos-kills",
        dest="chaos_faults",
        type=int,
        default=3,
        metavar="N",
        help="most chaos faults (default 3; --chaos-kills is its old name)",
    )
    parser.add_argument("--seed", type=int, help="seed for --chaos")
    parser.add_argument("--plain", action="store_true", help="plain log lines even on a TTY")


def check_run_arguments(args: argparse.Namespace) -> None:
    """Options that are valid alone but not together: a :class:`RunUsageError` naming them."""
    if args.chaos is None:
        given = [
            flag
            for flag, value in (
                ("--chaos-kind", args.chaos_kind),
                ("--chaos-thaw", args.chaos_thaw),
                ("--chaos-node-lost-after", args.chaos_node_lost_after),
            )
            if value is not None
        ]
        if given:
            raise RunUsageError(
                f"{', '.join(given)} without --chaos SECONDS does nothing: add --chaos SECONDS "
                "(how often a fault is injected)"
            )
        return
    kind = args.chaos_kind or "kill"
    if kind not in FREEZE_KINDS:
        for flag, value in (
            ("--chaos-thaw", args.chaos_thaw),
            ("--chaos-node-lost-after", args.chaos_node_lost_after),
        ):
            if value is not None:
                raise RunUsageError(
                    f"{flag} applies to frozen pods, and --chaos-kind {kind} freezes none: "
                    "add --chaos-kind freeze (or mixed), or drop it"
                )
