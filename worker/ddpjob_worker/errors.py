"""The agent's errors and exit codes. Stdlib only.

The codes themselves live in :mod:`ddpjob_worker.contract` (the operator reads them too); the
table is in docs/agent.md.
"""

from __future__ import annotations

from ddpjob_worker.contract import (
    EXIT_INFRA,
    EXIT_OK,
    EXIT_STOPPED_BY_SIGNAL,
    EXIT_USAGE,
    EXIT_WORKER_FAILED,
)

__all__ = [
    "EXIT_ENDPOINT_UNREACHABLE",
    "EXIT_INFRA",
    "EXIT_OK",
    "EXIT_STOPPED",
    "EXIT_USAGE",
    "EXIT_WORKER_FAILED",
    "AgentError",
    "ConfigError",
    "EndpointUnreachableError",
    "StoreSilentError",
    "StoreUnreachableError",
    "WorkersStuckError",
]

EXIT_ENDPOINT_UNREACHABLE = EXIT_INFRA
"""The rendezvous endpoint never resolved/accepted connections within the join timeout.
Retryable infrastructure trouble (it was 69, ``EX_UNAVAILABLE``, which ``restartPolicy:
ExitCode`` reads as permanent)."""
EXIT_STOPPED = EXIT_STOPPED_BY_SIGNAL
"""Stopped by SIGTERM/SIGINT after forwarding it to the workers (143)."""


class AgentError(Exception):
    """Base of the agent's own errors."""

    exit_code = EXIT_INFRA


class EndpointUnreachableError(AgentError):
    """The rendezvous endpoint did not come up within the join timeout."""

    exit_code = EXIT_ENDPOINT_UNREACHABLE


class ConfigError(AgentError):
    """A flag or environment variable has a bad value; the message names it."""

    exit_code = EXIT_USAGE


class WorkersStuckError(AgentError):
    """torch's watchdog found a worker stuck in the kernel and disabled restarts."""


class StoreUnreachableError(AgentError):
    """The rendezvous store failed a request (its connection broke, or it refused): its host
    may be gone. torch's own errors for it are translated to this at the agent's edge."""


class StoreSilentError(AgentError, RuntimeError):
    """A store request got no reply in time: its host is silent (frozen, partitioned, or its
    machine lost without a reset), or slower than the store's read timeout."""
