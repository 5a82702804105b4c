"""The real operator as a process, against the API emulator or the real control plane.

Every scenario of ``test_operator.py`` is written once against :class:`OperatorEnv` and runs
on the backends it can run on:

* :class:`EmulatorEnv`: :mod:`tests.harness.emulator` in its own process; the test plays the kubelet,
  the scheduler and the node controllers by writing pod status through the emulator's control
  handle, shaped as those components write it. It alone can inject 500s, 409 storms and
  watch drops.
* :class:`RealEnv`: the session's real control plane (:mod:`tests.harness.kube`), a namespace of its
  own, the operator authenticated with a token the API server issued to the Helm chart's
  ServiceAccount, and the process kubelets running every pod as a real process: a stand-in
  trainer (:mod:`tests.harness.kube.fakepod`) that exits with the code the test asks for, or is
  OOM-killed by the kernel.

Either way ``ddpjob operator`` runs as a subprocess, so it can be SIGKILLed and restarted.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

from tests.harness.emulator import EmulatorProcess
from tests.harness.kube import network
from tests.harness.kube.fixtures import (
    OPERATOR_ACCOUNT,
    OPERATOR_NAMESPACE,
    KubeTest,
    OperatorRun,
    wait_for,
)

__all__ = [
    "EmulatorEnv",
    "OperatorEnv",
    "RealEnv",
    "free_port",
    "operator_env",
    "real_env",
    "wait_for",
]

ROOT = Path(__file__).resolve().parents[2]
DDPJOB = str(Path(sys.executable).parent / "ddpjob")
JOBS = "ddpjob.io/v1alpha1/ddpjobs"
FAKE_TRAINER_IMAGE = "ddpjob/fake-trainer:test"
JSON = dict[str, Any]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def job_manifest(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "replicas": 2,
        "minReplicas": 1,
        "maxReplicas": 4,
        "nprocPerNode": 1,
        # A charged failure's replacement comes after 1 s (2 s for the next), not 10 s: the
        # back-off itself is tested in test_real_backoff.py and tests/unit/test_pod_backoff.py.
        "podBackoff": {"initialDelaySeconds": 1, "maxDelaySeconds": 2},
        "template": {
            "spec": {
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": "trainer",
                        "image": "ddpjob/worker-cpu:test",
                        "command": ["ddpjob-agent"],
                        "args": ["/opt/ddpjob/examples/train.py"],
                    }
                ],
            }
        },
    }
    base.update(spec)
    return {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": base,
    }


def _object_path(resource: str, namespace: str | None, name: str | None = None) -> str:
    """``v1/pods`` or ``networking.k8s.io/v1/networkpolicies`` as a REST path."""
    *group_version, plural = resource.split("/")
    prefix = "/api/v1" if group_version == ["v1"] else "/apis/" + "/".join(group_version)
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    return f"{path}/{name}" if name else path


@dataclasses.dataclass
class OperatorEnv:
    """What every backend offers a scenario: the operator process and the API as a user sees
    it, plus the kubelet's part (:meth:`run_pods`, :meth:`finish_pod`, ...)."""

    workdir: Path
    kubeconfig: Path
    namespace: str = "default"
    process: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0
    health_port: int = 0
    starts: int = 0
    backend: str = "emulator"
    prefix: tuple[str, ...] = ()
    """What the operator's command runs under (``nsenter`` into a cluster's network)."""
    runs: list[OperatorRun] = dataclasses.field(default_factory=list)
    """Every operator process started, stopped and checked after the test (:meth:`finish`)."""
    expected_failures: list[str] = dataclasses.field(default_factory=list)
    """What the test makes go wrong in the operator on purpose (:meth:`expect_failures`)."""

    # ---- the operator process ---------------------------------------------------------------

    def log_path(self, start: int | None = None) -> Path:
        return self.workdir / f"operator.{self.starts if start is None else start}.log"

    def start_operator(self, *flags: str, namespaces: tuple[str, ...] | None = None) -> None:
        assert self.process is None or self.process.poll() is not None
        self.starts += 1
        self.metrics_port, self.health_port = free_port(), free_port()
        served = (self.namespace,) if namespaces is None else namespaces
        where = [arg for ns in served for arg in ("--namespace", ns)] or ["--all-namespaces"]
        argv = [
            *self.prefix,
            DDPJOB,
            "operator",
            *where,
            "--metrics-port",
            str(self.metrics_port),
            "--health-port",
            str(self.health_port),
            *flags,
        ]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        log = self.log_path().open("wb")
        self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        run = OperatorRun(self.process, self.log_path(), self.expected_failures)
        self.runs.append(run)
        self.started(run)

    def started(self, run: OperatorRun) -> None:
        """A hook for backends that stop and check the operators elsewhere."""

    def stop_operator(self, sig: signal.Signals = signal.SIGTERM) -> int:
        assert self.process is not None
        for run in self.runs:
            if run.process is self.process:
                run.stopped_by_test = True
        self.process.send_signal(sig)
        code = self.process.wait(timeout=30)
        self.process = None
        return code

    def expect_failures(self, *patterns: str) -> None:
        """Regular expressions for what the test makes go wrong in the operator on purpose
        (an injected API error, a refused create): the operator's log lines, or its exit, that
        :meth:`finish` would report otherwise."""
        self.expected_failures.extend(patterns)

    def finish(self) -> list[str]:
        """Stop every operator the test started, and say what went wrong in any of them: a
        traceback or failure in its log, or an exit that is not clean
        (:meth:`~tests.harness.kube.fixtures.OperatorRun.stop`)."""
        problems: list[str] = []
        for run in self.runs:
            problems += run.stop()
        return problems

    def log(self, start: int | None = None) -> str:
        return self.log_path(start).read_text(errors="replace")

    def metrics(self) -> str:
        return requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    # ---- the API, as a user or a test sees it -------------------------------------------

    def api(self, method: str, path: str, body: Any = None, **kw: Any) -> requests.Response:
        raise NotImplementedError

    def ns(self, namespace: str | None) -> str:
        return self.namespace if namespace is None else namespace

    def manifest(self, name: str, namespace: str, **spec: Any) -> JSON:
        return job_manifest(name, namespace, **spec)

    def create_job(self, name: str, namespace: str | None = None, **spec: Any) -> JSON:
        namespace = self.ns(namespace)
        response = self.api(
            "POST",
            f"/apis/ddpjob.io/v1alpha1/namespaces/{namespace}/ddpjobs",
            self.manifest(name, namespace, **spec),
        )
        assert response.status_code == 201, response.text
        return dict(response.json())

    def create_raw(self, manifest: JSON) -> requests.Response:
        namespace = manifest["metadata"].setdefault("namespace", self.namespace)
        return self.api(
            "POST", f"/apis/ddpjob.io/v1alpha1/namespaces/{namespace}/ddpjobs", manifest
        )

    def job(self, name: str, namespace: str | None = None) -> JSON | None:
        return self.get_object(JOBS, self.ns(namespace), name)

    def status(self, name: str, namespace: str | None = None) -> JSON:
        job = self.job(name, namespace)
        return dict((job or {}).get("status") or {})

    def patch_job(self, name: str, patch: JSON, namespace: str | None = None) -> None:
        response = self.try_patch_job(name, patch, namespace)
        assert response.status_code == 200, response.text

    def try_patch_job(
        self, name: str, patch: JSON, namespace: str | None = None
    ) -> requests.Response:
        """A merge patch of the job, as ``kubectl patch --type=merge``; the answer as it is."""
        return self.api(
            "PATCH",
            f"/apis/ddpjob.io/v1alpha1/namespaces/{self.ns(namespace)}/ddpjobs/{name}",
            data=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )

    def scale(self, name: str, replicas: int, namespace: str | None = None) -> None:
        """``kubectl scale ddpj/NAME --replicas=N``: a patch of the scale subresource."""
        response = self.api(
            "PATCH",
            f"/apis/ddpjob.io/v1alpha1/namespaces/{self.ns(namespace)}/ddpjobs/{name}/scale",
            data=json.dumps({"spec": {"replicas": replicas}}),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert response.status_code == 200, response.text

    def delete(self, path: str, **options: Any) -> int:
        return self.api("DELETE", path, options or None).status_code

    def delete_pod(self, name: str, namespace: str | None = None, **options: Any) -> int:
        return self.delete(f"/api/v1/namespaces/{self.ns(namespace)}/pods/{name}", **options)

    def delete_job(self, name: str, namespace: str | None = None) -> int:
        return self.delete(
            f"/apis/ddpjob.io/v1alpha1/namespaces/{self.ns(namespace)}/ddpjobs/{name}"
        )

    def get_object(self, resource: str, namespace: str | None, name: str) -> JSON | None:
        raise NotImplementedError

    def list_objects(self, resource: str, namespace: str | None) -> list[JSON]:
        raise NotImplementedError

    def pods(self, job: str, namespace: str | None = None) -> list[JSON]:
        pods = self.list_objects("v1/pods", self.ns(namespace))
        mine = [p for p in pods if p["metadata"].get("labels", {}).get("ddpjob.io/job-name") == job]
        return sorted(mine, key=lambda p: p["metadata"]["name"])

    def pod(self, name: str, namespace: str | None = None) -> JSON | None:
        return self.get_object("v1/pods", self.ns(namespace), name)

    def replacement(
        self, old: JSON, what: str, timeout: float = 20.0, namespace: str | None = None
    ) -> JSON:
        """Wait for a pod under ``old``'s name with another uid (its replacement), and return it."""
        name, uid = old["metadata"]["name"], old["metadata"]["uid"]

        def new() -> JSON | None:
            pod = self.pod(name, namespace)
            return pod if pod is not None and pod["metadata"]["uid"] != uid else None

        return wait_for(new, what, timeout=timeout)

    def events(self, namespace: str | None = None, reason: str | None = None) -> list[JSON]:
        events = self.list_objects("v1/events", self.ns(namespace))
        return [e for e in events if reason is None or e.get("reason") == reason]

    # ---- the kubelet's part ---------------------------------------------------------------

    def run_pods(self, job: str, namespace: str | None = None) -> list[str]:
        """Every Pending pod of the job that is not being deleted runs (and is ready)."""
        raise NotImplementedError

    def finish_pod(
        self, name: str, exit_code: int, reason: str = "Error", namespace: str | None = None
    ) -> None:
        """The trainer exits with ``exit_code`` (``reason`` OOMKilled: the kernel kills it)."""
        raise NotImplementedError

    def confirm_deletions(self, job: str, namespace: str | None = None) -> None:
        """The kubelet stops the containers of deleted pods and confirms."""
        raise NotImplementedError

    def mark_disruption(self, name: str, reason: str, namespace: str | None = None) -> None:
        """A controller's ``DisruptionTarget`` condition on a running pod (before it deletes
        the pod, as the scheduler's preemption and the taint eviction controller do)."""
        raise NotImplementedError

    def pod_creations(self, namespace: str | None = None) -> int:
        """Successful pod creations (201) the API server saw in the namespace."""
        raise NotImplementedError

    def add_namespace(self, name: str) -> str:
        """A namespace for the test (its real name: unique on a shared cluster)."""
        return name

    def create_peering(self, name: str) -> None:
        """kopf's peering object ``name`` in the namespace, as the chart makes it."""
        peering = {
            "apiVersion": "kopf.dev/v1",
            "kind": "KopfPeering",
            "metadata": {"name": name, "namespace": self.namespace},
        }
        response = self.api(
            "POST", f"/apis/kopf.dev/v1/namespaces/{self.namespace}/kopfpeerings", peering
        )
        assert response.status_code == 201, response.text


# ---- the emulator ----------------------------------------------------------------------------


@dataclasses.dataclass
class EmulatorEnv(OperatorEnv):
    emulator: Any = None

    @property
    def url(self) -> str:
        return str(self.emulator.url)

    @property
    def control(self) -> Any:
        return self.emulator.control

    def api(self, method: str, path: str, body: Any = None, **kw: Any) -> requests.Response:
        return requests.request(method, self.url + path, json=body, timeout=10, **kw)

    def get_object(self, resource: str, namespace: str | None, name: str) -> JSON | None:
        found = self.control.get_object(resource, namespace, name)
        return dict(found) if found else None

    def list_objects(self, resource: str, namespace: str | None) -> list[JSON]:
        return list(self.control.list_objects(resource, namespace))

    def run_pods(self, job: str, namespace: str | None = None) -> list[str]:
        namespace = self.ns(namespace)
        started = []
        for pod in self.pods(job, namespace):
            meta = pod["metadata"]
            if meta.get("deletionTimestamp") or pod.get("status", {}).get("phase") != "Pending":
                continue
            node = pod["spec"].get("nodeName") or f"node-{meta['name']}"
            self.control.schedule_pod(namespace, meta["name"], node_name=node)
            self.control.set_pod_phase(
                namespace,
                meta["name"],
                "Running",
                conditions=[{"type": "Ready", "status": "True"}],
            )
            started.append(meta["name"])
        return started

    def finish_pod(
        self, name: str, exit_code: int, reason: str = "Error", namespace: str | None = None
    ) -> None:
        namespace = self.ns(namespace)
        phase = "Succeeded" if exit_code == 0 else "Failed"
        pod = self.pod(name, namespace) or {}
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        statuses = [
            {
                "name": container["name"],
                "image": container.get("image", ""),
                "ready": False,
                "restartCount": 0,
                "state": {
                    "terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": now}
                },
            }
            for container in pod.get("spec", {}).get("containers", [])
        ]
        self.control.set_pod_phase(
            namespace,
            name,
            phase,
            container_statuses=sorted(statuses, key=lambda c: c["name"]),
            conditions=[{"type": "Ready", "status": "False"}],
        )

    def confirm_deletions(self, job: str, namespace: str | None = None) -> None:
        namespace = self.ns(namespace)
        for pod in self.pods(job, namespace):
            if pod["metadata"].get("deletionTimestamp"):
                if pod.get("status", {}).get("phase") in ("Pending", "Running"):
                    self.finish_pod(pod["metadata"]["name"], 143, namespace=namespace)
                self.control.kubelet_confirm(namespace, pod["metadata"]["name"])

    def mark_disruption(self, name: str, reason: str, namespace: str | None = None) -> None:
        self.control.set_pod_phase(
            self.ns(namespace),
            name,
            "Running",
            conditions=[
                {"type": "Ready", "status": "True"},
                {"type": "DisruptionTarget", "status": "True", "reason": reason},
            ],
        )

    def pod_creations(self, namespace: str | None = None) -> int:
        return int(self.control.count_requests("create", "pods", status=201))


@contextlib.contextmanager
def operator_env(tmp_path: Path, **emulator_options: Any) -> Iterator[EmulatorEnv]:
    with EmulatorProcess(**emulator_options) as emulator:
        kubeconfig = emulator.write_kubeconfig(tmp_path / "kubeconfig", namespace="default")
        env = EmulatorEnv(workdir=tmp_path, kubeconfig=kubeconfig, emulator=emulator)
        try:
            yield env
        except BaseException as exc:
            for problem in env.finish():  # the test failed already: only say so
                exc.add_note(problem)
            raise
        problems = env.finish()
        assert not problems, "\n".join(problems)


# ---- the real control plane ----------------------------------------------------------------


@dataclasses.dataclass
class RealEnv(OperatorEnv):
    kube: KubeTest | None = None
    fake_trainer: bool = True
    """Replace the template's trainer with :mod:`tests.harness.kube.fakepod` (scenarios that drive pod
    exits); False runs what the manifest says (real training)."""

    @property
    def k(self) -> KubeTest:
        assert self.kube is not None
        return self.kube

    @property
    def fakepod_dir(self) -> Path:
        return self.k.cluster.fakepod_dir

    def started(self, run: OperatorRun) -> None:
        self.k.operators.append(run)  # stopped and checked by the kube fixture

    def in_cluster_network(self) -> None:
        """Run the operator in the cluster's network (its hub namespace, where the pods'
        addresses are), against the ``kubernetes`` Service's address as an operator pod would:
        then ``--ask-agents`` reaches the agents. Call before :meth:`start_operator`."""
        text = self.kubeconfig.read_text()
        server = re.search(r"server: (\S+)", text)
        assert server is not None, text
        inside = self.kubeconfig.with_name(f"{self.kubeconfig.stem}.hub.kubeconfig")
        service = f"https://{network.API_SERVICE_IP}:{network.API_SERVICE_PORT}"
        inside.write_text(text.replace(server[1], service))
        self.kubeconfig = inside
        self.prefix = ("nsenter", f"--net={self.k.cluster.hub}", "--")

    def api(self, method: str, path: str, body: Any = None, **kw: Any) -> requests.Response:
        return self.k.request(method, path, body, **kw)

    def get_object(self, resource: str, namespace: str | None, name: str) -> JSON | None:
        return self.k.get(_object_path(resource, namespace, name))

    def list_objects(self, resource: str, namespace: str | None) -> list[JSON]:
        found = self.k.get(_object_path(resource, namespace)) or {}
        return list(found.get("items") or [])

    def manifest(self, name: str, namespace: str, **spec: Any) -> JSON:
        manifest = job_manifest(name, namespace, **spec)
        if self.fake_trainer:
            template = copy.deepcopy(manifest["spec"]["template"])
            trainer = template["spec"]["containers"][0]
            for key in ("command", "args"):
                trainer.pop(key, None)
            trainer["image"] = FAKE_TRAINER_IMAGE
            env = [e for e in trainer.get("env") or [] if e["name"] != "POD_UID"]
            env.append(
                {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}
            )
            trainer["env"] = env
            limits = trainer.setdefault("resources", {}).setdefault("limits", {})
            limits.setdefault("memory", "256Mi")
            manifest["spec"]["template"] = template
        return manifest

    def run_pods(self, job: str, namespace: str | None = None, timeout: float = 60.0) -> list[str]:
        namespace = self.ns(namespace)

        def all_ready() -> list[str] | None:
            live = [
                p for p in self.pods(job, namespace) if not p["metadata"].get("deletionTimestamp")
            ]
            terminal = ("Succeeded", "Failed")
            waiting = [p for p in live if p.get("status", {}).get("phase") not in terminal]
            ready = [
                p["metadata"]["name"]
                for p in waiting
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in p.get("status", {}).get("conditions") or []
                )
            ]
            return ready if waiting and len(ready) == len(waiting) else None

        return wait_for(all_ready, f"every live pod of {job} running and ready", timeout=timeout)

    def finish_pod(
        self, name: str, exit_code: int, reason: str = "Error", namespace: str | None = None
    ) -> None:
        pod = self.pod(name, namespace)
        assert pod is not None, f"no pod {name}"
        uid = pod["metadata"]["uid"]
        self.fakepod_dir.mkdir(parents=True, exist_ok=True)
        order = "oom" if reason == "OOMKilled" else str(exit_code)
        tmp = self.fakepod_dir / f".{uid}"
        tmp.write_text(order)
        tmp.rename(self.fakepod_dir / uid)

        def terminated() -> JSON | None:
            current = self.pod(name, namespace)
            if current is None or current["metadata"]["uid"] != uid:
                return {"gone": True}
            for status in current.get("status", {}).get("containerStatuses") or []:
                if status["name"] == "trainer" and "terminated" in (status.get("state") or {}):
                    return dict(status["state"]["terminated"])
            return None

        ended = wait_for(terminated, f"{name}'s trainer to exit ({order})", timeout=60)
        if "gone" not in ended:
            assert (ended.get("exitCode"), ended.get("reason")) == (exit_code, reason), ended
            return
        # Deleted before its status could be read here: by the operator, which read it first.
        # A failed pod is replaced, and its exit recorded in the job's failures; a pod that
        # succeeded is deleted only by the cleanup of a job that succeeded.
        job = str(pod["metadata"]["labels"]["ddpjob.io/job-name"])
        status = self.status(job, namespace)
        failures = status.get("failures") or []
        recorded = [(f.get("exitCode"), f.get("reason")) for f in failures if f.get("uid") == uid]
        said = "OOMKilled" if reason == "OOMKilled" else f"ExitCode({exit_code})"
        expected = [] if exit_code == 0 else [(exit_code, said)]
        assert recorded == expected and (exit_code != 0 or status.get("phase") == "Succeeded"), (
            f"{name} ({uid}) was gone before its exit ({exit_code}) could be checked, and the "
            f"job does not say it: phase {status.get('phase')}, failures {failures}"
        )

    def confirm_deletions(self, job: str, namespace: str | None = None) -> None:
        """The process kubelet does it by itself."""

    def mark_disruption(self, name: str, reason: str, namespace: str | None = None) -> None:
        pod = self.pod(name, namespace)
        assert pod is not None
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        condition = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": reason,
            "message": f"marked by the test as {reason}",
            "lastTransitionTime": now,
        }
        self.k.api.patch(
            f"/api/v1/namespaces/{self.ns(namespace)}/pods/{name}/status",
            {"metadata": {"uid": pod["metadata"]["uid"]}, "status": {"conditions": [condition]}},
        )

    def create_peering(self, name: str) -> None:
        self.k.namespaced_rbac()  # the chart's namespaced peering rules and CRD
        super().create_peering(name)

    def add_namespace(self, name: str) -> str:
        unique = f"{self.namespace[:40]}-{name}"
        self.k.create_namespace(unique)
        self.k.namespaces.append(unique)
        return unique

    def pod_creations(self, namespace: str | None = None) -> int:
        return sum(codes.count(201) for codes in self.pod_create_answers(namespace).values())

    def pod_create_answers(self, namespace: str | None = None) -> dict[str, list[int]]:
        """The status codes the API server's audit log gives the operator's pod creates in the
        namespace, by pod name, in order. A create whose client died mid-request is logged
        504 ("context canceled") even when the server went on to store the pod."""
        user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"
        answers: dict[str, list[int]] = {}
        for entry in self.k.cluster.audit(since=self.k.audit_offset):
            ref = entry.get("objectRef") or {}
            if (
                entry.get("verb") == "create"
                and ref.get("resource") == "pods"
                and not ref.get("subresource")
                and ref.get("namespace") == self.ns(namespace)
                and (entry.get("user") or {}).get("username") == user
            ):
                code = int((entry.get("responseStatus") or {}).get("code", 0))
                answers.setdefault(str(ref.get("name", "")), []).append(code)
        return answers


def real_env(kube: KubeTest, workdir: Path, *, fake_trainer: bool = True) -> RealEnv:
    kubeconfig = kube.operator_kubeconfig(workdir / "operator.kubeconfig")
    return RealEnv(
        workdir=workdir,
        kubeconfig=kubeconfig,
        namespace=kube.namespace,
        backend="real",
        kube=kube,
        fake_trainer=fake_trainer,
    )
