"""The job's spec (:class:`DDPJobSpec`) and the rules its fields document."""

from __future__ import annotations

import decimal
import re
from typing import Annotated, Literal, Self

import pydantic
from pydantic import ConfigDict, Field

from ddpjob_operator.api.base import Model
from ddpjob_operator.api.policy import (
    CleanPodPolicy,
    GangScheduling,
    PodBackoff,
    Rendezvous,
    RestartPolicy,
    SecurityProfile,
)
from ddpjob_operator.api.template import (
    QUANTITY_PATTERN,
    Container,
    PodTemplate,
)

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


class DDPJobSpec(Model):
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
