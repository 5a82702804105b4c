"""The real Kueue controller on the real control plane (:mod:`tests.harness.kueue`): the harness
itself, before ddpjob creates any Workload.

Workloads are created here by hand as a job integration would create them, with quota for
one: Kueue admits the first, keeps the second pending until the first is Finished (set on
``/status`` as Kueue's ``workloadfinish.Finish`` sets it: a server-side apply of the
condition), and its webhooks refuse what they should. A Workload owned by a DDPJob (an
external framework in Kueue's configuration) is admitted the same way.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ddpjob_operator import builders
from ddpjob_operator.parse import parse_job
from tests.harness.kube.fixtures import KubeTest, wait_for
from tests.harness.kueue.fixtures import MakeQueues, Queues
from tests.harness.kueue.process import GROUP, VERSION, Kueue

pytestmark = pytest.mark.slow
JSON = dict[str, Any]


def workload(name: str, queue: str, *, owner: JSON | None = None, count: int = 2) -> JSON:
    meta: JSON = {"name": name}
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Workload",
        "metadata": meta,
        "spec": {
            "queueName": queue,
            "podSets": [
                {
                    "name": "workers",
                    "count": count,
                    "template": {
                        "spec": {
                            "restartPolicy": "Never",
                            "containers": [
                                {
                                    "name": "trainer",
                                    "image": "busybox",
                                    "resources": {"requests": {"cpu": "2"}},
                                }
                            ],
                        }
                    },
                }
            ],
        },
    }


def condition(obj: JSON | None, kind: str) -> JSON | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def is_true(obj: JSON | None, kind: str) -> bool:
    cond = condition(obj, kind)
    return cond is not None and cond.get("status") == "True"


class Workloads:
    def __init__(self, kube: KubeTest, kueue: Kueue, queues: Queues) -> None:
        self.kube, self.kueue, self.queues = kube, kueue, queues

    def path(self, name: str = "") -> str:
        return self.kueue.path("workloads", name, self.kube.namespace)

    def create(self, name: str, **kwargs: Any) -> JSON:
        return self.kube.api.create(self.path(), workload(name, self.queues.local_queue, **kwargs))

    def get(self, name: str) -> JSON | None:
        return self.kube.get(self.path(name))

    def admitted(self, name: str) -> JSON | None:
        wl = self.get(name)
        ok = is_true(wl, "QuotaReserved") and is_true(wl, "Admitted")
        return wl if ok else None

    def finish(self, name: str) -> JSON:
        """``Finished=True`` (reason Succeeded) on /status: a server-side apply of the one
        condition, as ``workloadfinish.Finish`` does with Kueue's default gates
        (``WorkloadRequestUseMergePatch`` off)."""
        wl = self.get(name)
        assert wl is not None
        patch = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Workload",
            "metadata": {"name": name, "namespace": self.kube.namespace},
            "status": {
                "conditions": [
                    {
                        "type": "Finished",
                        "status": "True",
                        "reason": "Succeeded",
                        "message": "the job succeeded",
                        "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "observedGeneration": wl["metadata"]["generation"],
                    }
                ]
            },
        }
        return self.kube.api.request(
            "PATCH",
            self.path(name) + "/status",
            patch,
            params={"fieldManager": "ddpjob-tests-job", "force": "true"},
            content_type="application/apply-patch+yaml",
        )


def cq_usage(kube: KubeTest, kueue: Kueue, queues: Queues) -> JSON:
    cq = kube.api.get(kueue.path("clusterqueues", queues.cluster_queue))
    return dict(cq.get("status") or {})


def cpu_reserved(status: JSON) -> str | None:
    for flavor in status.get("flavorsReservation") or []:
        for resource in flavor.get("resources") or []:
            if resource.get("name") == "cpu":
                return str(resource.get("total"))
    return None


def test_kueue_admits_queues_and_validates(
    kube: KubeTest, kueue: Kueue, kueue_queues: MakeQueues
) -> None:
    assert kueue.alive()
    assert not Path("/etc/kueue").exists(), "Kueue's mount namespace leaked into the machine"
    assert "ddpjob-kueue" not in Path("/proc/self/mountinfo").read_text()
    assert kueue.component is not None
    pid = kueue.component.process.pid  # unshare exec'd sh, which exec'd Kueue: one process,
    assert Path(f"/proc/{pid}/exe").resolve().name == "kueue"  # so PDEATHSIG still holds
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    assert {"validating/vworkload.kb.io", "mutating/mworkload.kb.io"} <= set(kueue.webhooks)
    assert not [w for w in kueue.webhooks if "pod" in w or "job" in w], kueue.webhooks

    queues = kueue_queues(kube.namespace, {"cpu": 4})
    wls = Workloads(kube, kueue, queues)
    wait_for(
        lambda: is_true(kube.get(kueue.path("clusterqueues", queues.cluster_queue)), "Active"),
        "the ClusterQueue Active",
    )

    wls.create("first")
    first = wait_for(lambda: wls.admitted("first"), "the first Workload admitted", timeout=30)
    assignment = first["status"]["admission"]["podSetAssignments"][0]
    assert first["status"]["admission"]["clusterQueue"] == queues.cluster_queue
    assert assignment["name"] == "workers"
    assert assignment["count"] == 2
    assert assignment["flavors"] == {"cpu": queues.flavor}
    assert assignment["resourceUsage"]["cpu"] == "4"

    wls.create("second")
    pending = wait_for(
        lambda: (
            (c := condition(wls.get("second"), "QuotaReserved")) and c["status"] == "False" and c
        ),
        "the second Workload evaluated (QuotaReserved=False)",
    )
    time.sleep(3)  # and it stays pending
    second = wls.get("second")
    assert condition(second, "QuotaReserved")["status"] == "False", second  # type: ignore[index]
    assert not is_true(second, "Admitted")
    assert cpu_reserved(cq_usage(kube, kueue, queues)) == "4"

    wls.finish("first")
    second = wait_for(lambda: wls.admitted("second"), "the second Workload admitted", timeout=30)
    assert second["status"]["admission"]["podSetAssignments"][0]["count"] == 2
    finished = wls.get("first")
    assert is_true(finished, "Finished")

    # The CRD and Kueue's webhook refuse invalid Workloads (v1beta2 makes podSets optional
    # and allows count 0: both are taken, and only recorded here).
    refusals = {}
    empty = workload("empty-podsets", queues.local_queue)
    empty["spec"]["podSets"] = []
    missing = workload("no-podsets", queues.local_queue)
    del missing["spec"]["podSets"]
    negative = workload("negative-cpu", queues.local_queue)
    negative["spec"]["podSets"][0]["template"]["spec"]["containers"][0]["resources"] = {
        "requests": {"cpu": "-1"}
    }
    for name, body in {
        "empty-podsets": empty,
        "count-minus-1": workload("count-minus-1", queues.local_queue, count=-1),
        "negative-cpu": negative,
        "no-podsets": missing,
        "count-0": workload("count-0", queues.local_queue, count=0),
    }.items():
        answer = kube.request("POST", wls.path(), body)
        refusals[name] = {"code": answer.status_code, "message": answer.json().get("message")}
    assert refusals["empty-podsets"]["code"] == 422, refusals
    assert "should have at least 1 items" in refusals["empty-podsets"]["message"]
    assert refusals["count-minus-1"]["code"] == 422, refusals
    assert refusals["negative-cpu"]["code"] == 403, refusals
    assert 'admission webhook "vworkload.kb.io" denied' in refusals["negative-cpu"]["message"]

    _record(
        "harness",
        {
            "start_seconds": round(kueue.started_seconds, 1),
            "webhooks": kueue.webhooks,
            "first": _summary(finished),
            "second": _summary(second),
            "pending_second_condition": pending,
            "refusals": refusals,
        },
    )


def test_ddpjob_owned_workload(kube: KubeTest, kueue: Kueue, kueue_queues: MakeQueues) -> None:
    queues = kueue_queues(kube.namespace, {"cpu": 4})
    wls = Workloads(kube, kueue, queues)
    job = kube.api.create(
        f"/apis/ddpjob.io/v1alpha1/namespaces/{kube.namespace}/ddpjobs",
        {
            "apiVersion": "ddpjob.io/v1alpha1",
            "kind": "DDPJob",
            "metadata": {
                "name": "trainer",
                "labels": {"kueue.x-k8s.io/queue-name": queues.local_queue},
            },
            "spec": {
                "replicas": 2,
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "trainer",
                                "image": "busybox",
                                "command": ["ddpjob-agent"],
                                "args": ["train.py"],
                                "resources": {"requests": {"cpu": "2"}},
                            }
                        ]
                    }
                },
            },
        },
    )
    # The owner reference ddpjob puts on every object of a job.
    [owner] = builders.owner_references(parse_job(job))
    name = f"ddpjob-trainer-{uuid.uuid4().hex[:5]}"
    created = wls.create(name, owner=owner)
    admitted = wait_for(lambda: wls.admitted(name), "the DDPJob's Workload admitted", timeout=30)
    assignment = admitted["status"]["admission"]["podSetAssignments"][0]
    assert assignment["count"] == 2
    assert assignment["flavors"] == {"cpu": queues.flavor}
    usage = wait_for(
        lambda: (s := cq_usage(kube, kueue, queues)) and cpu_reserved(s) == "4" and s,
        "the ClusterQueue's reservation of 4 cpu",
    )
    time.sleep(2)  # anything Kueue adds after admission
    later = wls.get(name)
    assert later is not None
    # Kueue adds nothing to a Workload it did not create: no finalizer, label or annotation
    # (the job integration, ddpjob here, owns the finalizer kueue.x-k8s.io/resource-in-use).
    assert _meta(later) == _meta(created), (_meta(created), _meta(later))
    assert usage["admittedWorkloads"] == 1
    assert usage["reservingWorkloads"] == 1

    job_after = kube.api.get(
        f"/apis/ddpjob.io/v1alpha1/namespaces/{kube.namespace}/ddpjobs/trainer"
    )
    wls.finish(name)
    released = wait_for(
        lambda: (s := cq_usage(kube, kueue, queues)) and cpu_reserved(s) == "0" and s,
        "the ClusterQueue's reservation back to 0 cpu",
    )
    finished = wls.get(name)
    assert is_true(finished, "Finished")
    assert released["admittedWorkloads"] == 0
    # The garbage collector takes the Workload with its DDPJob (it learns the Workload kind,
    # installed after it started, within 30 s).
    kube.api.delete(f"/apis/ddpjob.io/v1alpha1/namespaces/{kube.namespace}/ddpjobs/trainer")
    began = time.monotonic()
    wait_for(lambda: wls.get(name) is None, "the Workload collected with its DDPJob", timeout=60)
    collected_after = time.monotonic() - began
    log = kueue.log_path.read_text(errors="replace")
    mentions = [line[:300] for line in log.splitlines() if "ddpjob" in line.lower()]
    _record(
        "ddpjob_owned",
        {
            "created_metadata": _meta(created),
            "admitted_metadata": _meta(later),
            "admitted": _summary(later),
            "cluster_queue_status": usage,
            "cluster_queue_after_finish": released,
            "finished": _summary(finished),
            "finished_metadata": _meta(finished or {}),
            "collected_after_seconds": round(collected_after, 1),
            "kueue_log_mentions": mentions[:10],
            "job_after": _meta(job_after),
        },
    )


def _meta(obj: JSON) -> JSON:
    meta = obj.get("metadata") or {}
    return {k: meta.get(k) for k in ("labels", "annotations", "finalizers", "ownerReferences")}


def _summary(obj: JSON | None) -> JSON:
    status = (obj or {}).get("status") or {}
    return {
        "conditions": [
            {k: c.get(k) for k in ("type", "status", "reason")}
            for c in status.get("conditions") or []
        ],
        "admission": status.get("admission"),
    }


def _record(key: str, value: JSON) -> None:
    """What Kueue did, for whoever reads the run (``pytest -s``), not an assertion."""
    print(f"kueue-harness {key}: {json.dumps(value, indent=1, sort_keys=True)}")
