"""How a job restarts, cleans up, is secured, is gang-scheduled, meets (the rendezvous) and
backs off: the spec's policies."""

from __future__ import annotations

import enum
from typing import Annotated, Self

import pydantic
from pydantic import ConfigDict, Field

from ddpjob_operator.api.base import Model
from ddpjob_operator.api.status import PodFailure
from ddpjob_worker import contract


class RestartPolicy(enum.StrEnum):
    """What happens when a pod fails.

    * ``OnFailure``: replace the pod. Every failure except a disruption (preemption, eviction,
      node loss, deletion, or the agent's graceful stop with exit code 143) is charged to
      ``backoffLimit``.
    * ``ExitCode``: exit codes 1-127 are permanent (the job fails at once); 128-255 (killed by a
      signal) are retryable and charged to ``backoffLimit``, like ``OnFailure``. Disruptions are
      replaced free of charge. Unlike Kubeflow's (trainer#2045), this honours ``backoffLimit``.
    * ``Never``: the first failed pod fails the job, whatever its reason.
    """

    ON_FAILURE = "OnFailure"
    EXIT_CODE = "ExitCode"
    NEVER = "Never"

    def charges(self, disruption: bool) -> bool:
        """Whether a failure counts against ``backoffLimit``: unless it was a disruption, and
        always under ``Never``."""
        return self is RestartPolicy.NEVER or not disruption

    def fails_job(self, failure: PodFailure) -> bool:
        """Whether this failure alone fails the job: any under ``Never``; under ``ExitCode``,
        a trainer's exit code 1-127."""
        if self is RestartPolicy.NEVER:
            return True
        if self is RestartPolicy.EXIT_CODE and failure.exit_code is not None:
            return failure.reason.startswith("ExitCode") and 1 <= failure.exit_code <= 127
        return False


class CleanPodPolicy(enum.StrEnum):
    """Which pods are deleted when the job finishes.

    ``Running`` (default): pods still running are deleted, finished ones are kept for their
    logs. ``All``: every pod is deleted. ``None``: nothing is deleted.
    """

    RUNNING = "Running"
    ALL = "All"
    NONE = "None"


class SecurityProfile(enum.StrEnum):
    """The pod security defaults ddpjob adds (values set in the template always win).

    * ``Baseline`` (default): ``seccompProfile: RuntimeDefault`` and no privilege escalation.
      Images that run as root (``pytorch/pytorch``, the NGC PyTorch images) work unchanged, and
      so does NCCL over InfiniBand, which needs ``IPC_LOCK``. Meets the Kubernetes *baseline*
      Pod Security Standard.
    * ``Restricted``: also ``runAsNonRoot: true`` and every capability dropped, on every
      container. Meets the *restricted* Pod Security Standard; the image must run as a non-root
      user (or the template must set ``runAsUser``).
    """

    BASELINE = "Baseline"
    RESTRICTED = "Restricted"


class GangScheduling(enum.StrEnum):
    """How the job's pods are placed.

    * ``None`` (default): pod by pod, as the scheduler finds room for each.
    * ``Native``: as a gang. ddpjob makes one ``scheduling.k8s.io/v1beta1`` PodGroup per job
      with ``minCount`` = ``minReplicas``, and every pod names it: the scheduler binds none of
      the first ``minReplicas`` pods until it can bind them all. Pods above the minimum, and
      replacements while the minimum is bound, are placed one by one (the job stays elastic).
      Needs Kubernetes 1.37 with the ``GenericWorkload`` feature gate on (beta, off by
      default) and the API version served; elsewhere the job runs without a gang and its
      ``GangScheduled`` condition says why.
    """

    NONE = "None"
    NATIVE = "Native"


class Rendezvous(Model):
    """The c10d rendezvous that pod 0 hosts. Timeouts are chosen for fast recovery.

    torch's defaults (30 s last call, 5 s x 3 heartbeats) cost about 46 s per lost node.
    Ours detect a lost node in about 5 s and close a round 2 s after minReplicas have joined.
    """

    port: Annotated[
        int, Field(ge=1, le=65535, description="TCP port of the c10d store on pod 0.")
    ] = contract.DEFAULT_RDZV_PORT
    join_timeout_seconds: Annotated[
        int,
        Field(
            ge=1,
            description=(
                "How long a rendezvous round may take to gather minReplicas nodes. Also how long "
                "the job may run below minReplicas before it fails."
            ),
        ),
    ] = 600
    last_call_seconds: Annotated[
        int,
        Field(ge=0, description="Extra wait for more nodes once minReplicas have joined a round."),
    ] = 2
    close_timeout_seconds: Annotated[
        int, Field(ge=1, description="How long closing a round may take.")
    ] = 30
    heartbeat_seconds: Annotated[
        int, Field(ge=1, description="Interval between an agent's keep-alive heartbeats.")
    ] = 1
    heartbeat_miss_limit: Annotated[
        int, Field(ge=1, description="Missed heartbeats after which a node counts as lost.")
    ] = 5


class PodBackoff(Model):
    """How long the next pod of an index waits after a failure of that index: the Job
    controller's and the kubelet's CrashLoopBackOff schedule (10 s, doubling, at most 6 min,
    reset after 10 min of running), here per pod index.

    A failure that is charged to ``backoffLimit``, and one whose trainer never started (the
    kubelet rejected the pod at admission), delay the index's next pod by
    ``initialDelaySeconds * 2**(n-1)``, at most ``maxDelaySeconds``, where ``n`` counts such
    failures of the index in a row. A pod of the index that runs ``resetAfterSeconds`` starts
    the count over. Disruptions (preemption, eviction, node loss, deletion, a graceful stop)
    are replaced at once, as ever.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": (
                        "(has(self.initialDelaySeconds) ? self.initialDelaySeconds : 10) <= "
                        "(has(self.maxDelaySeconds) ? self.maxDelaySeconds : 360)"
                    ),
                    "message": (
                        "podBackoff.maxDelaySeconds must be >= initialDelaySeconds: raise "
                        "maxDelaySeconds or lower initialDelaySeconds"
                    ),
                    "fieldPath": ".maxDelaySeconds",
                }
            ]
        }
    )

    initial_delay_seconds: Annotated[
        int,
        Field(
            ge=0,
            description=(
                "Delay before the next pod of an index after its first failure in a row; it "
                "doubles with each further one. 0: no delay (replace at once)."
            ),
        ),
    ] = 10
    max_delay_seconds: Annotated[
        int,
        Field(
            ge=0,
            description=(
                "The longest delay (the Job controller's 6 min; the kubelet's "
                "crashLoopBackOff.maxContainerRestartPeriod)."
            ),
        ),
    ] = 360
    reset_after_seconds: Annotated[
        int,
        Field(
            ge=0,
            description=(
                "A pod of the index that has run this long starts its count of failures in a "
                "row over (the kubelet's 10 min)."
            ),
        ),
    ] = 600

    @pydantic.model_validator(mode="after")
    def _check_cap(self) -> Self:
        if self.max_delay_seconds < self.initial_delay_seconds:
            raise ValueError(
                f"maxDelaySeconds ({self.max_delay_seconds}) must be >= initialDelaySeconds "
                f"({self.initial_delay_seconds}): raise maxDelaySeconds or lower "
                "initialDelaySeconds"
            )
        return self

    def delay(self, failures: int) -> float:
        """Seconds the next pod waits after ``failures`` delayed failures in a row."""
        if failures <= 0 or self.initial_delay_seconds == 0:
            return 0.0
        return float(
            min(self.initial_delay_seconds * 2 ** min(failures - 1, 62), self.max_delay_seconds)
        )
