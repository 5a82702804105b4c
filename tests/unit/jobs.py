"""Job manifests for the unit tests."""

from __future__ import annotations

import copy
from typing import Any

from ddpjob_operator import api
from ddpjob_operator.parse import parse_job


def manifest(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-demo", "generation": 3},
        "spec": {
            "replicas": 2,
            "minReplicas": 1,
            "maxReplicas": 4,
            "nprocPerNode": 1,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "example/train:1",
                            "command": ["ddpjob-agent"],
                            "args": ["train.py"],
                        }
                    ]
                }
            },
        },
    }
    base["spec"].update(copy.deepcopy(spec))
    return base


def job(**spec: Any) -> api.DDPJob:
    return parse_job(manifest(**spec))
