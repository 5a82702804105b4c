"""The ``DDPJob`` API (``ddpjob.io/v1alpha1``) as frozen pydantic models.

These models are the single source of truth: the CRD's openAPIV3Schema is generated from them
(:mod:`ddpjob_operator.crd`), ``ddpjob validate`` and the operator parse with them, and the pure
core reads them.

Lifecycle of a job (``status.phase``)::

    Pending ──► Running ◄──► Restarting
       │           │              │
       └──► Suspended ◄───────────┘      (spec.suspend; resuming goes back to Pending)
                   │
          Succeeded | Failed             (terminal)

* ``Pending``: pods are being created and none is running yet.
* ``Running``: at least ``minReplicas`` pods are running.
* ``Restarting``: the job had been running and has fewer than ``minReplicas`` running pods
  while failed pods are replaced.
* ``Suspended``: ``spec.suspend`` is true; every pod is deleted, the budget is kept.
* ``Succeeded``: every pod that was still part of the job terminated successfully.
* ``Failed``: the backoff budget is spent, a permanent exit code was seen, the deadline passed,
  or running pods stayed below ``minReplicas`` longer than the rendezvous join timeout.
"""

from __future__ import annotations

import copy
import datetime as dt
import decimal
import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal, Self

import pydantic
from pydantic import ConfigDict, Field
from pydantic.alias_generators import to_camel

from ddpjob_operator.errors import FieldProblem, SpecError
from ddpjob_worker import contract

GROUP = "ddpjob.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DDPJob"
PLURAL = "ddpjobs"
SINGULAR = "ddpjob"
SHORT_NAME = "ddpj"

MAX_JOB_NAME = 40
"""Pod names are ``<job>-worker-<index>`` and must be valid 63-character DNS labels."""

JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_RECENT_FAILURES = 20
POD_FINALIZER = "ddpjob.io/pod-tracking"
"""On every pod ddpjob creates; removed only once the pod's outcome is in the job's status, so
a pod that is force-deleted or garbage-collected is still counted exactly once (the Job
controller's ``batch.kubernetes.io/job-tracking``)."""
POD_GROUP_API = "scheduling.k8s.io/v1beta1"
"""The native gang API (Kubernetes 1.37: beta, behind the ``GenericWorkload`` feature gate)."""
KUEUE_API = "kueue.x-k8s.io/v1beta2"
"""Kueue's Workloads (v0.19+; its storage version), ResourceFlavors and WorkloadPriorityClasses."""
STORE_KEY_ENV = "DDPJOB_STORE_KEY"
"""The trainer's env var holding the job's store key: the agent HMAC-signs what it writes to
the rendezvous store with it. The operator fills it from the job's store-key Secret
(``builders.build_store_key_secret``); ``ddpjob run`` with a key of its own per run."""


class _Model(pydantic.BaseModel):
    """Frozen, camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )


class _OpenModel(_Model):
    """A Kubernetes object we only partly model; other fields are kept as they are."""

    model_config = ConfigDict(
        extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )


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


class Rendezvous(_Model):
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


class PodBackoff(_Model):
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


# ---- the core/v1 objects of the template ------------------------------------------------------
#
# The CRD keeps every core/v1 field of the template (x-kubernetes-preserve-unknown-fields), but
# the API server's CEL sees only the fields the schema declares: two objects that differ only
# in undeclared keys, one on each side (nodeSelector dropped, affinity added), compare equal, so
# the transition rule that keeps the template fixed while the job runs would let such a change
# through. Every core/v1 field name is therefore declared, the ones ddpjob does not model as
# opaque values (no type: compared whole), and the rule compares both ways. tests/unit/test_crd.py
# checks these lists against the newest Kubernetes schema.

POD_SPEC_FIELDS = (
    "activeDeadlineSeconds", "affinity", "automountServiceAccountToken", "containers",
    "dnsConfig", "dnsPolicy", "enableServiceLinks", "ephemeralContainers", "evictionResponders",
    "hostAliases", "hostIPC", "hostNetwork", "hostPID", "hostUsers", "hostname",
    "hostnameOverride", "imagePullSecrets", "initContainers", "nodeName", "nodeSelector", "os",
    "overhead", "preemptionPolicy", "priority", "priorityClassName", "readinessGates",
    "resourceClaims", "resources", "restartPolicy", "runtimeClassName", "schedulerName",
    "schedulingGates", "schedulingGroup", "securityContext", "serviceAccount",
    "serviceAccountName", "setHostnameAsFQDN", "shareProcessNamespace", "subdomain",
    "terminationGracePeriodSeconds", "tolerations", "topologySpreadConstraints", "volumes",
)  # fmt: skip
"""core/v1 PodSpec's fields (Kubernetes 1.37)."""

CONTAINER_FIELDS = (
    "args", "command", "env", "envFrom", "image", "imagePullPolicy", "lifecycle",
    "livenessProbe", "name", "ports", "readinessProbe", "resizePolicy", "resources",
    "restartPolicy", "restartPolicyRules", "securityContext", "startupProbe", "stdin",
    "stdinOnce", "terminationMessagePath", "terminationMessagePolicy", "tty", "volumeDevices",
    "volumeMounts", "workingDir",
)  # fmt: skip
"""core/v1 Container's fields (Kubernetes 1.37)."""

ENV_VAR_FIELDS = ("name", "value", "valueFrom")
"""core/v1 EnvVar's fields (Kubernetes 1.37)."""


def _declare(
    fields: tuple[str, ...], what: str, typed: Mapping[str, Mapping[str, Any]] | None = None
) -> Any:
    """``json_schema_extra`` for an open model: declare the core/v1 fields it does not model
    (opaque, unless ``typed`` gives a field's schema)."""

    def extra(schema: dict[str, Any]) -> None:
        schema["x-kubernetes-preserve-unknown-fields"] = True
        properties = schema.setdefault("properties", {})
        for name in fields:
            properties.setdefault(
                name,
                {
                    "description": f"core/v1 {what}.{name}, passed to the pods as it is.",
                    **copy.deepcopy(dict((typed or {}).get(name) or {})),
                },
            )
            properties[name].setdefault("x-kubernetes-preserve-unknown-fields", True)

    return extra


ENV_NAME_PATTERN = r"^[ -<>-~]+$"
"""What the API server accepts as an env var name since Kubernetes 1.32 (beta, on by default;
GA in 1.34): printable ASCII except ``=``. An older cluster refuses more when it creates the
pod, and says so in an ActionFailed event."""

_NUMBER = r"([0-9]+(\.[0-9]*)?|\.[0-9]+)"
QUANTITY_PATTERN = rf"^\+?{_NUMBER}([KMGTPE]i|[numkMGTPE]|[eE][+-]?{_NUMBER})?$"
"""A non-negative Kubernetes quantity, as the API server parses one (``resource.Quantity``):
``8Gi``, ``512Mi``, ``1e9``, ``1.5G``, ``.5Gi``."""


def _env_name(value: str) -> str:
    if not re.match(ENV_NAME_PATTERN, value):
        raise ValueError(
            f"env var name {value!r} must be printable ASCII characters other than '=': rename it"
        )
    return value


class EnvVar(_OpenModel):
    model_config = ConfigDict(json_schema_extra=_declare(ENV_VAR_FIELDS, "EnvVar"))

    name: Annotated[
        str,
        pydantic.AfterValidator(_env_name),
        Field(min_length=1, json_schema_extra={"pattern": ENV_NAME_PATTERN}),
    ]
    value: str | None = None


class Container(_OpenModel):
    """A core/v1 Container. Only the fields ddpjob reads are checked; the rest is kept."""

    model_config = ConfigDict(json_schema_extra=_declare(CONTAINER_FIELDS, "Container"))

    name: Annotated[
        str,
        Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"),
    ]
    image: Annotated[str, Field(min_length=1, description="The container image. Required.")]
    command: list[str] | None = None
    args: list[str] | None = None
    env: list[EnvVar] | None = None


class PodSpec(_OpenModel):
    """A core/v1 PodSpec. The first container is the trainer."""

    model_config = ConfigDict(
        json_schema_extra=_declare(
            POD_SPEC_FIELDS,
            "PodSpec",
            # Typed, so that the spec's CEL rule for gangScheduling can ask whether it is set
            # (the API server's CEL knows no untyped field).
            typed={
                "schedulingGroup": {
                    "type": "object",
                    "properties": {"podGroupName": {"type": "string"}},
                }
            },
        )
    )

    containers: Annotated[
        list[Container],
        Field(min_length=1, description="The first container is the trainer; others are sidecars."),
    ]


class TemplateMetadata(_Model):
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class PodTemplate(_Model):
    """A core/v1 PodTemplateSpec."""

    metadata: TemplateMetadata = TemplateMetadata()
    spec: PodSpec


NprocPerNode = Annotated[int, Field(ge=1)] | Literal["auto"]

IMMUTABLE_WHILE_RUNNING = (
    "minReplicas",
    "maxReplicas",
    "nprocPerNode",
    "rendezvous",
    "maxRestarts",
    "nodeLostTolerationSeconds",
    "gangScheduling",
    "template",
)
"""Spec fields baked into the pods: fixed unless the job is suspended (or being suspended)."""


def _immutable_rule(field: str) -> pydantic.JsonValue:
    suspended = "(has(self.suspend) && self.suspend) || (has(oldSelf.suspend) && oldSelf.suspend)"
    # Both ways: the API server's equality of objects skips a key the receiver has and the
    # other side lacks when the schema does not declare it (see POD_SPEC_FIELDS).
    same = (
        f"has(self.{field}) == has(oldSelf.{field}) && "
        f"(!has(self.{field}) || (self.{field} == oldSelf.{field} && "
        f"oldSelf.{field} == self.{field}))"
    )
    return {
        "rule": f"{suspended} || ({same})",
        "message": (
            f"spec.{field} cannot change while the job runs (its pods are built from it): "
            "set spec.suspend: true first, change it, then resume; or delete and re-create the "
            "job"
        ),
        "fieldPath": f".{field}",
    }


def _shm_size(value: int | str | None) -> int | str | None:
    if value is None:
        return None
    match = re.match(QUANTITY_PATTERN, str(value))
    if match is None:
        raise ValueError(
            "must be a Kubernetes quantity such as 16Gi, 512Mi or 1e9: use a suffix "
            "Ki/Mi/Gi/Ti or k/M/G/T with no space, or drop shmSize for the default"
        )
    if decimal.Decimal(match.group(1)) == 0:
        raise ValueError("must be more than 0: drop shmSize for the default")
    return value


class DDPJobSpec(_Model):
    """What the user asks for. ``minReplicas <= replicas <= maxReplicas``."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": (
                        "(has(self.minReplicas) ? self.minReplicas : self.replicas)"
                        " <= self.replicas && self.replicas <="
                        " (has(self.maxReplicas) ? self.maxReplicas : self.replicas)"
                    ),
                    "message": "replicas must lie within minReplicas..maxReplicas",
                    "fieldPath": ".replicas",
                },
                {
                    "rule": (
                        "!(has(self.gangScheduling) && self.gangScheduling == 'Native' && "
                        "has(self.template.spec.schedulingGroup))"
                    ),
                    "message": (
                        "gangScheduling: Native makes the job's own PodGroup: remove "
                        "template.spec.schedulingGroup, or set gangScheduling: None"
                    ),
                    "fieldPath": ".gangScheduling",
                },
                *[_immutable_rule(field) for field in IMMUTABLE_WHILE_RUNNING],
            ]
        }
    )

    replicas: Annotated[int, Field(ge=1, description="Pods to run now. `kubectl scale` sets it.")]
    min_replicas: Annotated[
        int | None,
        Field(ge=1, description="Fewest pods training may continue with. Defaults to replicas."),
    ] = None
    max_replicas: Annotated[
        int | None,
        Field(ge=1, description="Most pods the job may scale to. Defaults to replicas."),
    ] = None
    nproc_per_node: Annotated[
        NprocPerNode,
        Field(
            description=(
                "Worker processes per pod: an integer, or auto (= the GPUs the trainer "
                "requests, else 1)."
            ),
            json_schema_extra={
                "x-kubernetes-validations": [
                    {
                        "rule": "type(self) == int ? self >= 1 : self == 'auto'",
                        "message": "nprocPerNode must be an integer >= 1 or 'auto'",
                    }
                ]
            },
        ),
    ] = "auto"
    rendezvous: Rendezvous = Rendezvous()
    restart_policy: RestartPolicy = RestartPolicy.ON_FAILURE
    max_restarts: Annotated[
        int,
        Field(
            ge=0, description="Worker-group restarts the agent makes in a pod before the pod fails."
        ),
    ] = 3
    backoff_limit: Annotated[
        int,
        Field(ge=0, description="Failed pods replaced (charged ones only) before the job fails."),
    ] = 6
    active_deadline_seconds: Annotated[
        int | None, Field(ge=1, description="The job fails when it has run this long.")
    ] = None
    ttl_seconds_after_finished: Annotated[
        int | None, Field(ge=0, description="Delete the finished job after this long.")
    ] = None
    suspend: Annotated[
        bool, Field(description="Delete every pod and keep the job; false resumes.")
    ] = False
    pod_backoff: Annotated[
        PodBackoff,
        Field(
            description=(
                "Back-off between a failed pod and the next pod of its index (charged failures "
                "and pods that never started; disruptions are replaced at once)."
            )
        ),
    ] = PodBackoff()
    clean_pod_policy: CleanPodPolicy = CleanPodPolicy.RUNNING
    security_profile: Annotated[
        SecurityProfile | None,
        Field(
            description=(
                "Pod security defaults: Baseline (works with root images) or Restricted "
                "(non-root, no capabilities). Default: the operator's --security-profile, "
                "else Baseline."
            )
        ),
    ] = None
    network_policy: Annotated[
        bool | None,
        Field(
            description=(
                "Create a NetworkPolicy that lets only this job's pods reach the rendezvous store "
                "and the collective ports; other traffic may reach only the ports the template "
                "declares. Default: the operator's --network-policy setting."
            )
        ),
    ] = None
    force_delete_after_seconds: Annotated[
        int,
        Field(
            ge=0,
            description=(
                "A deleted pod still Terminating this long after its grace period ended (its "
                "node is lost and no kubelet confirms) is force-deleted, so that it can be "
                "replaced under the same name."
            ),
        ),
    ] = 30
    node_lost_toleration_seconds: Annotated[
        int,
        Field(
            ge=0,
            description=(
                "How long pods stay bound to a node that is not ready or unreachable before they "
                "are evicted and replaced (a NoExecute toleration on every pod; the cluster's "
                "default is 300). A toleration of the template for those taints wins."
            ),
        ),
    ] = 30
    shm_size: Annotated[
        pydantic.StrictInt | str | None,
        pydantic.AfterValidator(_shm_size),
        Field(
            description=(
                "Size of the memory-backed /dev/shm (a Kubernetes quantity: 16Gi, 512Mi, 1e9). "
                "Defaults to half the trainer's memory limit (or request), else 1Gi."
            ),
            json_schema_extra={"pattern": QUANTITY_PATTERN},
        ),
    ] = None
    gang_scheduling: Annotated[
        GangScheduling,
        Field(
            description=(
                "None (default): pods are placed one by one. Native: the first minReplicas pods "
                "are placed all at once or not at all (a scheduling.k8s.io/v1beta1 PodGroup, "
                "Kubernetes 1.37+ with the GenericWorkload feature gate)."
            )
        ),
    ] = GangScheduling.NONE
    template: PodTemplate

    @pydantic.model_validator(mode="after")
    def _check_gang(self) -> Self:
        group = (self.template.spec.model_extra or {}).get("schedulingGroup")
        if self.gang_scheduling is GangScheduling.NATIVE and group is not None:
            raise ValueError(
                "gangScheduling: Native makes the job's own PodGroup, and "
                "template.spec.schedulingGroup names another: remove "
                "template.spec.schedulingGroup, or set gangScheduling: None to use your own group"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _check_bounds(self) -> Self:
        low, high = self.min_replicas, self.max_replicas
        if low is not None and low > self.replicas:
            raise ValueError(
                f"minReplicas ({low}) must be <= replicas ({self.replicas}): "
                f"lower minReplicas or raise replicas"
            )
        if high is not None and high < self.replicas:
            raise ValueError(
                f"maxReplicas ({high}) must be >= replicas ({self.replicas}): "
                f"raise maxReplicas or lower replicas"
            )
        return self

    @property
    def effective_min(self) -> int:
        return self.replicas if self.min_replicas is None else self.min_replicas

    @property
    def effective_max(self) -> int:
        return self.replicas if self.max_replicas is None else self.max_replicas

    @property
    def trainer(self) -> Container:
        return self.template.spec.containers[0]


class JobPhase(enum.StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    QUEUED = "Queued"
    """A Kueue job (``kueue.x-k8s.io/queue-name``) that Kueue has not admitted, or evicted: it
    has no pods, and waits in its queue."""
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    @property
    def is_finished(self) -> bool:
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED)


class ConditionType(enum.StrEnum):
    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    GANG_SCHEDULED = "GangScheduled"
    """Only with ``gangScheduling: Native``: True once the job's first ``minReplicas`` pods
    are bound together; False while they wait for room (reason ``Unschedulable``, with the
    scheduler's message), or when the cluster serves no PodGroups (``PodGroupsNotServed``: the
    job runs without a gang)."""
    ADMITTED = "Admitted"
    """Only for a Kueue job (label ``kueue.x-k8s.io/queue-name``): True while Kueue admits its
    Workload (the message names the ClusterQueue, the flavors and the admitted size); False
    while it waits in line (``Queued``, ``Inactive``) or after an eviction (``Preempted``, and
    Kueue's other eviction reasons)."""
    INVALID_SPEC = "InvalidSpec"
    """True while the operator cannot parse the spec (it then acts on nothing). Not terminal:
    fixing the spec clears it and the job goes on."""


class Condition(_Model):
    """A Kubernetes-style condition. ``lastTransitionTime`` changes only when ``status`` does.

    ``type`` is any string: a condition another controller (or a newer ddpjob) wrote must not
    make the job unparseable. :class:`ConditionType` lists the ones ddpjob writes.
    """

    model_config = ConfigDict(extra="ignore")

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: dt.datetime


def set_condition(
    conditions: Sequence[Condition],
    type_: ConditionType,
    status: bool,
    reason: str,
    message: str,
    now: dt.datetime,
) -> list[Condition]:
    """Replace one condition; ``lastTransitionTime`` moves only when its status flips."""
    wanted = "True" if status else "False"
    old = next((c for c in conditions if c.type == type_), None)
    since = old.last_transition_time if old is not None and old.status == wanted else now
    new = Condition(
        type=type_, status=wanted, reason=reason, message=message, last_transition_time=since
    )
    return [c for c in conditions if c.type != type_] + [new]


def condition_true(conditions: Iterable[Condition], type_: ConditionType) -> bool:
    return any(c.type == type_ and c.status == "True" for c in conditions)


class PodFailure(_Model):
    """One pod that ended badly, with a classified reason.

    ``reason`` is one of ``Preempted``, ``Evicted``, ``OOMKilled``, ``NodeLost``, ``Deleted`` or
    ``ExitCode(n)`` (read leniently: another version may write others). ``charged`` says
    whether it counted against ``backoffLimit``; ``started`` whether the trainer had started
    (a pod the kubelet rejected at admission never did: its replacement waits, see
    ``reconcile``).
    """

    model_config = ConfigDict(extra="ignore")

    pod: str
    index: int
    uid: str | None = None
    reason: str
    exit_code: int | None = None
    message: str = ""
    node: str | None = None
    charged: bool
    started: bool = True
    time: dt.datetime

    @property
    def delays_next_pod(self) -> bool:
        """The next pod of the index waits (:class:`PodBackoff`): the failure was charged, or
        the trainer never started (a node that rejects the pod at admission would reject the
        next one in a tight loop). A disruption of a pod that ran is replaced at once."""
        return self.charged or not self.started


class PodWaiting(_Model):
    """A pod of the job that cannot start yet, and why (image pull, scheduling, config; or
    ``BackOff``: it is not created before ``retryTime``)."""

    model_config = ConfigDict(extra="ignore")

    pod: str
    reason: str
    message: str = ""
    index: int | None = None
    retry_time: Annotated[
        dt.datetime | None,
        Field(description="When the pod is created (reason BackOff)."),
    ] = None


class IndexBackoff(_Model):
    """The back-off state of one pod index (see :class:`PodBackoff`): it lives in the status,
    so that it survives an operator restart."""

    model_config = ConfigDict(extra="ignore")

    index: int
    failures: Annotated[int, Field(ge=0, description="Delayed failures of this index in a row.")]
    last_failure_time: Annotated[
        dt.datetime,
        Field(description="When the last of them ended (the pod's finish time, when known)."),
    ]


class DDPJobStatus(_Model):
    """What the operator observed and decided. Written once per reconcile pass."""

    model_config = ConfigDict(extra="ignore")

    phase: JobPhase = JobPhase.PENDING
    conditions: list[Condition] = []
    observed_generation: int | None = None
    replicas: Annotated[int, Field(ge=0, description="Pods that are pending or running.")] = 0
    ready_replicas: Annotated[
        int, Field(ge=0, description="Pods whose agent runs its workers.")
    ] = 0
    world_size: Annotated[
        int,
        Field(ge=0, description="Worker processes in the world that trains now (0: none does)."),
    ] = 0
    store_host: Annotated[
        str | None,
        Field(
            description=(
                "The pod that hosts the rendezvous store now, as its agent says (pod 0 at "
                "first, a survivor after a failover); unset while unknown."
            )
        ),
    ] = None
    restarts: Annotated[
        int, Field(ge=0, description="Pods replaced after a failure, all reasons.")
    ] = 0
    backoff_count: Annotated[
        int, Field(ge=0, description="Replacements charged to backoffLimit.")
    ] = 0
    selector: str | None = None
    start_time: dt.datetime | None = None
    completion_time: dt.datetime | None = None
    below_min_since: dt.datetime | None = None
    succeeded: Annotated[
        int, Field(ge=0, description="Pods whose trainer finished successfully.")
    ] = 0
    failures: Annotated[
        list[PodFailure],
        Field(
            description=(
                f"The {MAX_RECENT_FAILURES} most recent pod failures (for people: the counts "
                "above are exact, this list is not the ledger)."
            )
        ),
    ] = []
    waiting: Annotated[
        list[PodWaiting],
        Field(description="Pods that cannot start yet, with the reason (until the job has run)."),
    ] = []
    pod_backoff: Annotated[
        list[IndexBackoff],
        Field(
            description=(
                "Pod indices whose recent failures delay their next pod (spec.podBackoff), "
                "lowest index first."
            )
        ),
    ] = []
    accounted_pods: Annotated[
        list[str],
        Field(
            description=(
                "UIDs of pods whose outcome is already in this status (counted, or deleted by "
                f"the operator) and whose {POD_FINALIZER} finalizer is still to be removed."
            )
        ),
    ] = []


class ObjectMeta(_Model):
    """The parts of metadata ddpjob reads; the rest is ignored."""

    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(min_length=1, max_length=MAX_JOB_NAME, pattern=JOB_NAME_PATTERN)]
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] | None = None
    creation_timestamp: dt.datetime | None = None
    deletion_timestamp: dt.datetime | None = None


class DDPJob(_Model):
    """A DDPJob object as stored by the API server (or read from a local file)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["ddpjob.io/v1alpha1"]
    kind: Literal["DDPJob"]
    metadata: ObjectMeta
    spec: DDPJobSpec
    status: DDPJobStatus = DDPJobStatus()

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace


# ---- parsing with errors a person can act on ---------------------------------------------------

_HINTS = {
    "metadata.name": (
        f"use a lowercase DNS label of at most {MAX_JOB_NAME} characters, e.g. 'mnist-ddp' "
        "(pod names are <name>-worker-<index>)"
    ),
    "spec.template.spec.containers": "give at least one container; the first one is the trainer",
    "apiVersion": f"use apiVersion: {API_VERSION}",
    "kind": f"use kind: {KIND}",
}


_UNION_TAG = re.compile(r"^(constrained-|function-|literal\[)")


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("int", "str") or _UNION_TAG.match(part):
            continue  # pydantic's union-branch and validator tags, not field names
        else:
            out += f".{part}" if out else str(part)
    return out


def _allowed_fields(root: type[pydantic.BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    model: type[pydantic.BaseModel] | None = root
    for part in loc[:-1]:
        if model is None or isinstance(part, int):
            continue
        field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return []
        model = _model_of(field.annotation)
    if model is None:
        return []
    return sorted(f.alias or name for name, f in model.model_fields.items())


def _model_of(annotation: Any) -> type[pydantic.BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _problem(error: Mapping[str, Any]) -> FieldProblem:
    loc = tuple(error["loc"])
    path = _path(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_fields(DDPJob, loc)
        hint = f"; valid fields here: {', '.join(allowed)}" if allowed else ""
        return FieldProblem(path, f"unknown field{hint}")
    if kind == "missing":
        return FieldProblem(path, "required field is missing" + _hint(path))
    if path == "spec.nprocPerNode":
        return FieldProblem(path, f"must be an integer >= 1 or 'auto' (got {error.get('input')!r})")
    message = str(error["msg"]).removeprefix("Value error, ")
    given = error.get("input")
    got = "" if isinstance(given, Mapping | list) else f" (got {given!r})"
    return FieldProblem(path, f"{message}{got}{_hint(path)}")


def _hint(path: str) -> str:
    generic = re.sub(r"\[\d+\]", "", path)
    hint = _HINTS.get(path) or _HINTS.get(generic)
    return f": {hint}" if hint else ""


def parse_job(document: object, source: str = "<input>") -> DDPJob:
    """Validate a manifest (already parsed from YAML/JSON) into a :class:`DDPJob`.

    Raises :class:`SpecError` listing every problem with its field path.
    """
    if not isinstance(document, Mapping):
        raise SpecError(
            source,
            [FieldProblem("", f"expected a DDPJob mapping, got {type(document).__name__}")],
        )
    try:
        return DDPJob.model_validate(document)
    except pydantic.ValidationError as exc:
        problems: list[FieldProblem] = []
        for error in exc.errors():
            problem = _problem(error)
            if problem not in problems:
                problems.append(problem)
        raise SpecError(source, problems) from exc


def parse_job_lenient(document: object, source: str = "<input>") -> tuple[DDPJob, list[str]]:
    """:func:`parse_job` for the operator: fields this version does not know are ignored (and
    returned, as paths), the way Kubernetes clients skip fields of a newer API.

    A newer CRD defaults its new fields on every read, so an operator that refused unknown
    fields would find every job invalid after the CRD upgrade. Every other problem still
    raises :class:`SpecError`.
    """
    if not isinstance(document, Mapping):
        return parse_job(document, source), []
    data = copy.deepcopy(dict(document))
    ignored: list[str] = []
    for _ in range(32):  # each round drops what the last validation reported
        try:
            return DDPJob.model_validate(data), ignored
        except pydantic.ValidationError as exc:
            extra = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
            if not extra:
                break
            for loc in extra:
                if _drop(data, loc):
                    ignored.append(_path(tuple(loc)))
    return parse_job(data, source), ignored


def _drop(data: Any, loc: Sequence[int | str]) -> bool:
    """Delete the value at ``loc`` (pydantic's union tags, which are no keys, are skipped)."""
    node = data
    for part in loc[:-1]:
        in_map = isinstance(node, Mapping) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and part < len(node)
        if in_map or in_list:
            node = node[part]
    last = loc[-1]
    if isinstance(node, dict) and last in node:
        del node[last]
        return True
    return False


def job_selector(job_name: str) -> str:
    return f"{LABEL_JOB}={job_name}"


LABEL_JOB = "ddpjob.io/job-name"
LABEL_INDEX = "ddpjob.io/replica-index"
LABEL_ROLE = "ddpjob.io/role"
