"""The real operator as a process, against the API emulator, with the test playing the kubelet.

``OperatorEnv`` starts :mod:`tests.emulator` in its own process, writes a kubeconfig for it, and
runs ``ddpjob operator`` as a subprocess (so it can be SIGKILLed and restarted). The test acts
as the kubelet, the scheduler and the node controllers by writing pod status through the
emulator's control handle, shaped as those components write it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import requests

from tests.emulator import EmulatorProcess

ROOT = Path(__file__).resolve().parents[2]
DDPJOB = str(Path(sys.executable).parent / "ddpjob")
JOBS = "ddpjob.io/v1alpha1/ddpjobs"
T = TypeVar("T")


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


@dataclasses.dataclass
class OperatorEnv:
    emulator: Any
    workdir: Path
    kubeconfig: Path
    process: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0
    health_port: int = 0
    starts: int = 0

    # ---- the operator process ---------------------------------------------------------------

    @property
    def url(self) -> str:
        return str(self.emulator.url)

    @property
    def control(self) -> Any:
        return self.emulator.control

    def log_path(self, start: int | None = None) -> Path:
        return self.workdir / f"operator.{self.starts if start is None else start}.log"

    def start_operator(self, *flags: str, namespaces: tuple[str, ...] = ("default",)) -> None:
        assert self.process is None or self.process.poll() is not None
        self.starts += 1
        self.metrics_port, self.health_port = free_port(), free_port()
        where = [arg for ns in namespaces for arg in ("--namespace", ns)] or ["--all-namespaces"]
        argv = [
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

    def stop_operator(self, sig: signal.Signals = signal.SIGTERM) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        code = self.process.wait(timeout=30)
        self.process = None
        return code

    def log(self, start: int | None = None) -> str:
        return self.log_path(start).read_text(errors="replace")

    # ---- the API, as a user or a test sees it -------------------------------------------

    def api(self, method: str, path: str, body: Any = None, **kw: Any) -> requests.Response:
        return requests.request(method, self.url + path, json=body, timeout=10, **kw)

    def create_job(self, name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
        manifest = job_manifest(name, namespace, **spec)
        response = self.api(
            "POST", f"/apis/ddpjob.io/v1alpha1/namespaces/{namespace}/ddpjobs", manifest
        )
        assert response.status_code == 201, response.text
        return dict(response.json())

    def job(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        found = self.control.get_object(JOBS, namespace, name)
        return dict(found) if found else None

    def status(self, name: str, namespace: str = "default") -> dict[str, Any]:
        job = self.job(name, namespace)
        return dict((job or {}).get("status") or {})

    def patch_job(self, name: str, patch: dict[str, Any], namespace: str = "default") -> None:
        response = self.api(
            "PATCH",
            f"/apis/ddpjob.io/v1alpha1/namespaces/{namespace}/ddpjobs/{name}",
            data=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert response.status_code == 200, response.text

    def scale(self, name: str, replicas: int, namespace: str = "default") -> None:
        """``kubectl scale ddpj/NAME --replicas=N``: a patch of the scale subresource."""
        response = self.api(
            "PATCH",
            f"/apis/ddpjob.io/v1alpha1/namespaces/{namespace}/ddpjobs/{name}/scale",
            data=json.dumps({"spec": {"replicas": replicas}}),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert response.status_code == 200, response.text

    def delete(self, path: str, **options: Any) -> int:
        return self.api("DELETE", path, options or None).status_code

    def pods(self, job: str, namespace: str = "default") -> list[dict[str, Any]]:
        pods = self.control.list_objects("v1/pods", namespace)
        mine = [p for p in pods if p["metadata"].get("labels", {}).get("ddpjob.io/job-name") == job]
        return sorted(mine, key=lambda p: p["metadata"]["name"])

    def pod(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        found = self.control.get_object("v1/pods", namespace, name)
        return dict(found) if found else None

    def replacement(
        self, old: dict[str, Any], what: str, timeout: float = 20.0, namespace: str = "default"
    ) -> dict[str, Any]:
        """Wait for a pod under ``old``'s name with another uid (its replacement), and return it."""
        name, uid = old["metadata"]["name"], old["metadata"]["uid"]

        def new() -> dict[str, Any] | None:
            pod = self.pod(name, namespace)
            return pod if pod is not None and pod["metadata"]["uid"] != uid else None

        return wait_for(new, what, timeout=timeout)

    def events(self, namespace: str = "default", reason: str | None = None) -> list[dict[str, Any]]:
        events = self.control.list_objects("v1/events", namespace)
        return [e for e in events if reason is None or e.get("reason") == reason]

    # ---- playing the kubelet ------------------------------------------------------------------

    def run_pods(self, job: str, namespace: str = "default") -> list[str]:
        """Schedule and start every Pending pod of the job that is not being deleted."""
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
        self, name: str, exit_code: int, reason: str = "Error", namespace: str = "default"
    ) -> None:
        """The trainer exits as the kubelet reports it: ``state.terminated`` of the container."""
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
                    "terminated": {
                        "exitCode": exit_code,
                        "reason": reason,
                        "finishedAt": now,
                    }
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

    def confirm_deletions(self, job: str, namespace: str = "default") -> None:
        """The kubelet stops the containers of deleted pods and confirms."""
        for pod in self.pods(job, namespace):
            if pod["metadata"].get("deletionTimestamp"):
                if pod.get("status", {}).get("phase") in ("Pending", "Running"):
                    self.finish_pod(pod["metadata"]["name"], 143, namespace=namespace)
                self.control.kubelet_confirm(namespace, pod["metadata"]["name"])

    def metrics(self) -> str:
        return requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text


def wait_for(
    check: Callable[[], T | bool | None], what: str, timeout: float = 20.0, every: float = 0.1
) -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return cast(T, last)
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@contextlib.contextmanager
def operator_env(tmp_path: Path, **emulator_options: Any) -> Iterator[OperatorEnv]:
    with EmulatorProcess(**emulator_options) as emulator:
        kubeconfig = emulator.write_kubeconfig(tmp_path / "kubeconfig", namespace="default")
        env = OperatorEnv(emulator=emulator, workdir=tmp_path, kubeconfig=kubeconfig)
        try:
            yield env
        finally:
            if env.process is not None and env.process.poll() is None:
                env.process.kill()
                env.process.wait(timeout=10)
