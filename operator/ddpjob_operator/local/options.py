"""The command-line options of ``ddpjob run`` (light: no process code is imported)."""

from __future__ import annotations

import argparse


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", metavar="FILE", help="the DDPJob manifest to run")
    parser.add_argument("--run-dir", help="where logs, state and checkpoints go")
    parser.add_argument(
        "--chaos",
        type=float,
        metavar="SECONDS",
        help="SIGKILL a random pod's process tree about every SECONDS seconds",
    )
    parser.add_argument("--chaos-kills", type=int, default=3, help="most chaos kills (default 3)")
    parser.add_argument("--seed", type=int, help="seed for --chaos")
    parser.add_argument("--plain", action="store_true", help="plain log lines even on a TTY")
