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

from ddpjob_operator.api.base import (
    API_VERSION as API_VERSION,
)
from ddpjob_operator.api.base import (
    GROUP as GROUP,
)
from ddpjob_operator.api.base import (
    JOB_NAME_PATTERN as JOB_NAME_PATTERN,
)
from ddpjob_operator.api.base import (
    KIND as KIND,
)
from ddpjob_operator.api.base import (
    KUEUE_API as KUEUE_API,
)
from ddpjob_operator.api.base import (
    LABEL_INDEX as LABEL_INDEX,
)
from ddpjob_operator.api.base import (
    LABEL_JOB as LABEL_JOB,
)
from ddpjob_operator.api.base import (
    LABEL_ROLE as LABEL_ROLE,
)
from ddpjob_operator.api.base import (
    MAX_JOB_NAME as MAX_JOB_NAME,
)
from ddpjob_operator.api.base import (
    MAX_RECENT_FAILURES as MAX_RECENT_FAILURES,
)
from ddpjob_operator.api.base import (
    PLURAL as PLURAL,
)
from ddpjob_operator.api.base import (
    POD_FINALIZER as POD_FINALIZER,
)
from ddpjob_operator.api.base import (
    POD_GROUP_API as POD_GROUP_API,
)
from ddpjob_operator.api.base import (
    SHORT_NAME as SHORT_NAME,
)
from ddpjob_operator.api.base import (
    SINGULAR as SINGULAR,
)
from ddpjob_operator.api.base import (
    STORE_KEY_ENV as STORE_KEY_ENV,
)
from ddpjob_operator.api.base import (
    VERSION as VERSION,
)
from ddpjob_operator.api.base import (
    job_selector as job_selector,
)
from ddpjob_operator.api.job import (
    DDPJob as DDPJob,
)
from ddpjob_operator.api.job import (
    ObjectMeta as ObjectMeta,
)
from ddpjob_operator.api.policy import (
    CleanPodPolicy as CleanPodPolicy,
)
from ddpjob_operator.api.policy import (
    GangScheduling as GangScheduling,
)
from ddpjob_operator.api.policy import (
    PodBackoff as PodBackoff,
)
from ddpjob_operator.api.policy import (
    Rendezvous as Rendezvous,
)
from ddpjob_operator.api.policy import (
    RestartPolicy as RestartPolicy,
)
from ddpjob_operator.api.policy import (
    SecurityProfile as SecurityProfile,
)
from ddpjob_operator.api.spec import (
    IMMUTABLE_WHILE_RUNNING as IMMUTABLE_WHILE_RUNNING,
)
from ddpjob_operator.api.spec import (
    DDPJobSpec as DDPJobSpec,
)
from ddpjob_operator.api.spec import (
    NprocPerNode as NprocPerNode,
)
from ddpjob_operator.api.status import (
    Condition as Condition,
)
from ddpjob_operator.api.status import (
    ConditionType as ConditionType,
)
from ddpjob_operator.api.status import (
    DDPJobStatus as DDPJobStatus,
)
from ddpjob_operator.api.status import (
    IndexBackoff as IndexBackoff,
)
from ddpjob_operator.api.status import (
    JobPhase as JobPhase,
)
from ddpjob_operator.api.status import (
    PodFailure as PodFailure,
)
from ddpjob_operator.api.status import (
    PodWaiting as PodWaiting,
)
from ddpjob_operator.api.status import (
    condition_true as condition_true,
)
from ddpjob_operator.api.status import (
    set_condition as set_condition,
)
from ddpjob_operator.api.template import (
    CONTAINER_FIELDS as CONTAINER_FIELDS,
)
from ddpjob_operator.api.template import (
    ENV_NAME_PATTERN as ENV_NAME_PATTERN,
)
from ddpjob_operator.api.template import (
    ENV_VAR_FIELDS as ENV_VAR_FIELDS,
)
from ddpjob_operator.api.template import (
    POD_SPEC_FIELDS as POD_SPEC_FIELDS,
)
from ddpjob_operator.api.template import (
    QUANTITY_PATTERN as QUANTITY_PATTERN,
)
from ddpjob_operator.api.template import (
    Container as Container,
)
from ddpjob_operator.api.template import (
    EnvVar as EnvVar,
)
from ddpjob_operator.api.template import (
    PodSpec as PodSpec,
)
from ddpjob_operator.api.template import (
    PodTemplate as PodTemplate,
)
from ddpjob_operator.api.template import (
    TemplateMetadata as TemplateMetadata,
)

__all__ = [
    "API_VERSION",
    "CONTAINER_FIELDS",
    "ENV_NAME_PATTERN",
    "ENV_VAR_FIELDS",
    "GROUP",
    "IMMUTABLE_WHILE_RUNNING",
    "JOB_NAME_PATTERN",
    "KIND",
    "KUEUE_API",
    "LABEL_INDEX",
    "LABEL_JOB",
    "LABEL_ROLE",
    "MAX_JOB_NAME",
    "MAX_RECENT_FAILURES",
    "PLURAL",
    "POD_FINALIZER",
    "POD_GROUP_API",
    "POD_SPEC_FIELDS",
    "QUANTITY_PATTERN",
    "SHORT_NAME",
    "SINGULAR",
    "STORE_KEY_ENV",
    "VERSION",
    "CleanPodPolicy",
    "Condition",
    "ConditionType",
    "Container",
    "DDPJob",
    "DDPJobSpec",
    "DDPJobStatus",
    "EnvVar",
    "GangScheduling",
    "IndexBackoff",
    "JobPhase",
    "NprocPerNode",
    "ObjectMeta",
    "PodBackoff",
    "PodFailure",
    "PodSpec",
    "PodTemplate",
    "PodWaiting",
    "Rendezvous",
    "RestartPolicy",
    "SecurityProfile",
    "TemplateMetadata",
    "condition_true",
    "job_selector",
    "set_condition",
]
