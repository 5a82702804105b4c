"""The operator's Prometheus metrics (``prometheus_client``), served on ``--metrics-port``.

* ``ddpjob_jobs{phase}``: DDPJobs this operator serves, by phase;
* ``ddpjob_pods_replaced_total{reason}``: pods replaced after a failure, by classified reason;
* ``ddpjob_reconcile_seconds``: how long one reconcile pass takes (decide and do);
* ``ddpjob_api_errors_total{code}``: API errors by HTTP status (0: no connection), retries
  included;
* ``ddpjob_status_conflicts_total``: status writes refused as stale (409), each followed by a
  fresh read and a new decision.

Each operator process has its own registry (not the global one), so tests can run several.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ddpjob_operator.api import JobPhase


@dataclasses.dataclass
class Metrics:
    registry: CollectorRegistry = dataclasses.field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.jobs = Gauge(
            "ddpjob_jobs", "DDPJobs served, by phase", ["phase"], registry=self.registry
        )
        self.pods_replaced = Counter(
            "ddpjob_pods_replaced",
            "Pods replaced after a failure, by classified reason",
            ["reason"],
            registry=self.registry,
        )
        self.reconcile_seconds = Histogram(
            "ddpjob_reconcile_seconds",
            "Duration of one reconcile pass (observe, decide, write status, act)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.api_errors = Counter(
            "ddpjob_api_errors",
            "Kubernetes API errors by HTTP status code (0: connection error)",
            ["code"],
            registry=self.registry,
        )
        self.status_conflicts = Counter(
            "ddpjob_status_conflicts",
            "Status writes refused as stale (409) and decided again",
            registry=self.registry,
        )
        for phase in JobPhase:
            self.jobs.labels(phase=phase.value).set(0)

    def api_error(self, code: int) -> None:
        self.api_errors.labels(code=str(code)).inc()

    def replaced(self, reasons: Iterable[str]) -> None:
        for reason in reasons:
            self.pods_replaced.labels(reason=reason).inc()

    def set_phases(self, phases: Mapping[Any, JobPhase]) -> None:
        counts = dict.fromkeys(JobPhase, 0)
        for phase in phases.values():
            counts[phase] += 1
        for phase, count in counts.items():
            self.jobs.labels(phase=phase.value).set(count)

    def serve(self, port: int, address: str = "0.0.0.0") -> None:  # noqa: S104 - a pod's port
        start_http_server(port, addr=address, registry=self.registry)
