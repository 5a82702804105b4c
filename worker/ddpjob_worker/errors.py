"""The agent's errors and exit codes. Stdlib only."""

from __future__ import annotations

from ddpjob_worker.contract import EXIT_STOPPED_BY_SIGNAL

EXIT_OK = 0
EXIT_FAILED = 1
"""Workers failed and the restart budget is used up, or the agent hit an error (as torchrun)."""
EXIT_USAGE = 2
"""Bad flags or env (argparse's code)."""
EXIT_ENDPOINT_UNREACHABLE = 69
"""The rendezvous endpoint never resolved/accepted connections within the join timeout
(``EX_UNAVAILABLE`` from sysexits.h)."""
EXIT_STOPPED = EXIT_STOPPED_BY_SIGNAL
"""Stopped by SIGTERM/SIGINT after forwarding it to the workers (143)."""


class AgentError(Exception):
    """Base of the agent's own errors."""

    exit_code = EXIT_FAILED


class EndpointUnreachableError(AgentError):
    """The rendezvous endpoint did not come up within the join timeout."""

    exit_code = EXIT_ENDPOINT_UNREACHABLE


class ConfigError(AgentError):
    """A flag or environment variable has a bad value; the message names it."""

    exit_code = EXIT_USAGE
