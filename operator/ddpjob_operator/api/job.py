"""The ``DDPJob`` itself: its metadata, spec and status."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from ddpjob_operator.api.base import JOB_NAME_PATTERN, MAX_JOB_NAME, Model
from ddpjob_operator.api.spec import DDPJobSpec
from ddpjob_operator.api.status import DDPJobStatus


class ObjectMeta(Model):
    """The parts of metadata ddpjob reads; the rest is ignored."""

    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Field(min_length=1, max_length=MAX_JOB_NAME, pattern=JOB_NAME_PATTERN)]
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] | None = None
    creation_timestamp: dt.datetime | None = None
    deletion_timestamp: dt.datetime | None = None


class DDPJob(Model):
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
