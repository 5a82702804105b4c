"""``ddpjob operator``: a thin wrapper around kopf's own runner.

It loads the credentials (in-cluster, else ``KUBECONFIG``), refuses to start without the DDPJob
CRD, configures kopf (structured JSON logs, our finalizer and annotation prefix, peering), serves
Prometheus metrics, and hands over to ``kopf.run`` with the handlers of
:mod:`ddpjob_operator.handlers`.
"""

from __future__ import annotations

# kopf, aiohttp and prometheus_client are imported when the operator starts, not when the
# `ddpjob` command builds its parser.
# ruff: noqa: PLC0415
import argparse
import asyncio
import hashlib
import logging
import socket
from typing import TYPE_CHECKING

from ddpjob_operator import api
from ddpjob_operator.errors import DDPJobError

if TYPE_CHECKING:
    from ddpjob_operator.kube import KubeApi

DEFAULT_METRICS_PORT = 8080
DEFAULT_HEALTH_PORT = 8081


def add_operator_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="serve DDPJobs in this namespace (repeat for several)",
    )
    where.add_argument(
        "--all-namespaces", "-A", action="store_true", help="serve DDPJobs in every namespace"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=DEFAULT_METRICS_PORT,
        help=f"Prometheus /metrics port, 0 to disable (default {DEFAULT_METRICS_PORT})",
    )
    parser.add_argument(
        "--health-port",
        type=int,
        default=DEFAULT_HEALTH_PORT,
        help=f"liveness endpoint /healthz port, 0 to disable (default {DEFAULT_HEALTH_PORT})",
    )
    parser.add_argument(
        "--peering",
        metavar="NAME",
        default=None,
        help="run as one of several replicas, one active (kopf peering object NAME must exist)",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority; replicas must differ (default: derived from the host name)",
    )
    parser.add_argument(
        "--network-policy",
        action="store_true",
        help="give every job a NetworkPolicy that guards its rendezvous and collective ports "
        "(a job's spec.networkPolicy overrides this)",
    )
    parser.add_argument(
        "--ask-agents",
        action="store_true",
        help="ask the pods' agents what they do (they answer on the rendezvous port + 1), so "
        "that status.worldSize is the world that trains now and status.storeHost names the "
        "store's host; the operator must reach the pods' addresses",
    )
    parser.add_argument(
        "--security-profile",
        choices=[p.value for p in api.SecurityProfile],
        default=api.SecurityProfile.BASELINE.value,
        help="pod security defaults for jobs that do not set spec.securityProfile",
    )
    parser.add_argument(
        "--log-format", choices=["json", "plain"], default="json", help="log format"
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def default_priority(hostname: str | None = None) -> int:
    """Distinct per replica (equal priorities make kopf pause every operator)."""
    name = hostname or socket.gethostname()
    return 1 + int(hashlib.sha256(name.encode()).hexdigest(), 16) % 10_000


async def _preflight(kube: KubeApi) -> None:
    try:
        await kube.check_crd()
    finally:
        await kube.close()


def run_operator(args: argparse.Namespace) -> int:
    import kopf

    from ddpjob_operator.controller import Controller, OperatorConfig
    from ddpjob_operator.kube import KubeApi, load_credentials
    from ddpjob_operator.metrics import Metrics

    if not args.namespace and not args.all_namespaces:
        raise DDPJobError(
            "say which DDPJobs to serve: --namespace NS (repeatable) or --all-namespaces"
        )
    metrics = Metrics()
    kube = KubeApi(load_credentials(), on_error=metrics.api_error)
    asyncio.run(_preflight(kube))
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN,
    )
    logging.getLogger("ddpjob_operator").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    from ddpjob_operator import handlers  # noqa: F401 - registers the handlers with kopf

    if args.metrics_port:
        metrics.serve(args.metrics_port)
    config = OperatorConfig(
        network_policy=args.network_policy,
        ask_agents=args.ask_agents,
        security_profile=api.SecurityProfile(args.security_profile),
    )
    peering = args.peering
    priority = args.priority if args.priority is not None else default_priority()
    kopf.run(
        clusterwide=bool(args.all_namespaces),
        namespaces=list(args.namespace),
        standalone=peering is None,
        peering_name=peering,
        priority=priority,
        liveness_endpoint=(
            f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
        ),
        memo=kopf.Memo(controller=Controller(kube, metrics, config)),
    )
    return 0
