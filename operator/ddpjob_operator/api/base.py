"""The API's names, the constants both sides of the API share, and the models' base
classes."""

from __future__ import annotations

import pydantic
from pydantic import ConfigDict
from pydantic.alias_generators import to_camel

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


class Model(pydantic.BaseModel):
    """Frozen, camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_enum_values=False,
    )


class OpenModel(Model):
    """A Kubernetes object we only partly model; other fields are kept as they are."""

    model_config = ConfigDict(
        extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )


def job_selector(job_name: str) -> str:
    return f"{LABEL_JOB}={job_name}"


LABEL_JOB = "ddpjob.io/job-name"
LABEL_INDEX = "ddpjob.io/replica-index"
LABEL_ROLE = "ddpjob.io/role"
