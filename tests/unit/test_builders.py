"""Pure builders: exact objects, deterministic names, torch-savvy defaults, user settings win."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from ddpjob_operator import builders
from ddpjob_worker import contract

from .jobs import job


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]
    }


OWNED_BY_DEMO = {
    "namespace": "ml",
    "labels": {
        "app.kubernetes.io/name": "ddpjob",
        "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/managed-by": "ddpjob-operator",
        "ddpjob.io/job-name": "demo",
    },
    "ownerReferences": [
        {
            "apiVersion": "ddpjob.io/v1alpha1",
            "kind": "DDPJob",
            "name": "demo",
            "uid": "uid-demo",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ],
}
"""The metadata every object of the job ``demo`` carries, but its name."""


def test_service_is_headless_and_owned() -> None:
    assert builders.build_service(job()) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "demo", **OWNED_BY_DEMO},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"ddpjob.io/job-name": "demo"},
            "ports": [{"name": "rdzv", "port": 29400, "targetPort": 29400, "protocol": "TCP"}],
        },
    }


@pytest.mark.parametrize("index", [0, 1, 7])
def test_pod_identity(index: int) -> None:
    pod = builders.build_pod(job(), index)
    assert pod["metadata"]["name"] == f"demo-worker-{index}"
    assert pod["spec"]["hostname"] == f"demo-worker-{index}"
    assert pod["spec"]["subdomain"] == "demo"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["metadata"]["labels"]["ddpjob.io/replica-index"] == str(index)
    assert pod["metadata"]["labels"]["ddpjob.io/role"] == ("master" if index == 0 else "worker")
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"


def test_pods_are_deterministic() -> None:
    assert builders.build_pod(job(), 1) == builders.build_pod(job(), 1)


def test_env_contract_only_pod0_hosts_the_store() -> None:
    env0, env1 = env_of(builders.build_pod(job(), 0)), env_of(builders.build_pod(job(), 1))
    assert (
        env0["PET_RDZV_ENDPOINT"] == env1["PET_RDZV_ENDPOINT"] == "demo-worker-0.demo.ml.svc:29400"
    )
    assert env0["PET_NNODES"] == "1:4"
    assert env0["PET_NPROC_PER_NODE"] == "1"
    assert env0["PET_RDZV_BACKEND"] == "c10d"
    assert env0["PET_RDZV_ID"] == "uid-demo"
    assert env0["PET_MAX_RESTARTS"] == "3"
    assert env0["DDPJOB_RDZV_HOST"] == "1" and env1["DDPJOB_RDZV_HOST"] == "0"
    assert contract.parse_rdzv_conf(env0["PET_RDZV_CONF"]) == {
        "is_host": "true",
        "join_timeout": "600",
        "last_call_timeout": "2",
        "close_timeout": "30",
        "keep_alive_interval": "1",
        "keep_alive_max_attempt": "5",
    }
    # Our short store read timeout is for ddpjob-agent only: torch also uses read_timeout as
    # TCPStore's connect timeout, and plain torchrun on pod 1 must wait for a slow pod 0.
    assert env0["DDPJOB_STORE_READ_TIMEOUT"] == "10"
    assert contract.parse_rdzv_conf(env1["PET_RDZV_CONF"])["is_host"] == "false"
    assert env0["PET_LOCAL_ADDR"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env0["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env0["TORCH_ELASTIC_WORKER_IDENTICAL"] == "1"  # ranks without a store exchange
    assert env0["DDPJOB_GRACE_SECONDS"] == "25"


def test_every_pod_is_told_where_the_jobs_agents_answer() -> None:
    """Store failover: each pod's agent answers on the rendezvous port + 1 at its own address,
    and a newcomer asks the headless Service's name, which resolves to every pod."""
    for index in (0, 3):
        env = env_of(builders.build_pod(job(), index))
        assert env["DDPJOB_DIRECTORY_PORT"] == "29401"
        assert env["DDPJOB_RDZV_PEERS"] == "demo.ml.svc:29401"
    high = job(rendezvous={"port": 65535})
    assert env_of(builders.build_pod(high, 1))["DDPJOB_DIRECTORY_PORT"] == "65534"
    local = builders.Network(rdzv_host="127.0.0.1", rdzv_port=40000, directory_base=41000)
    env2 = env_of(builders.build_pod(job(), 2, local))
    assert env2["DDPJOB_DIRECTORY_PORT"] == "41002"
    assert env2["DDPJOB_RDZV_PEERS"] == ",".join(f"127.0.0.1:{41000 + i}" for i in range(4))


def test_user_env_wins_and_is_not_duplicated() -> None:
    container = {
        "name": "trainer",
        "image": "x",
        "env": [
            {"name": "NCCL_DEBUG", "value": "INFO"},
            {"name": "PET_MAX_RESTARTS", "value": "9"},
        ],
    }
    pod = builders.build_pod(job(template={"spec": {"containers": [container]}}), 0)
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert len(names) == len(set(names))
    assert env_of(pod)["NCCL_DEBUG"] == "INFO"
    assert env_of(pod)["PET_MAX_RESTARTS"] == "9"
    assert env_of(pod)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


# ---- the store key (agent review, finding 8) ---------------------------------------------------

STORE_KEY_FROM_SECRET = {
    "name": "DDPJOB_STORE_KEY",
    "valueFrom": {"secretKeyRef": {"name": "demo-store-key", "key": "key"}},
}


def test_the_store_key_secret_is_opaque_owned_and_holds_only_the_key() -> None:
    key = "k3y-_0123456789abcdefghijklmnopqrstuvwxyzABCD"
    assert builders.store_key_secret_name("demo") == "demo-store-key"
    assert builders.build_store_key_secret(job(), key) == {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "demo-store-key", **OWNED_BY_DEMO},
        "type": "Opaque",
        "immutable": True,
        "data": {"key": base64.b64encode(key.encode()).decode()},
    }


def test_every_pod_reads_the_store_key_from_the_jobs_secret() -> None:
    for index in (0, 1):
        env = builders.build_pod(job(), index)["spec"]["containers"][0]["env"]
        assert [e for e in env if e["name"] == "DDPJOB_STORE_KEY"] == [STORE_KEY_FROM_SECRET]
    # Only the trainer runs the agent: a sidecar gets no key.
    sidecar = {"name": "proxy", "image": "y"}
    containers = [{"name": "trainer", "image": "x"}, sidecar]
    pod = builders.build_pod(job(template={"spec": {"containers": containers}}), 0)
    assert pod["spec"]["containers"][1] == sidecar


def test_a_store_key_the_template_sets_is_kept() -> None:
    mine = {"name": "DDPJOB_STORE_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
    container = {"name": "trainer", "image": "x", "env": [mine]}
    template = {"spec": {"containers": [container]}}
    for store_key in (True, False):
        pod = builders.build_pod(job(template=template), 0, store_key=store_key)
        env = pod["spec"]["containers"][0]["env"]
        assert [e for e in env if e["name"] == "DDPJOB_STORE_KEY"] == [mine]


def test_a_pod_built_without_the_store_key_is_otherwise_the_same() -> None:
    keyed, plain = builders.build_pod(job(), 1), builders.build_pod(job(), 1, store_key=False)
    assert "DDPJOB_STORE_KEY" not in env_of(plain)
    keyed["spec"]["containers"][0]["env"].remove(STORE_KEY_FROM_SECRET)
    assert keyed == plain


@pytest.mark.parametrize(
    ("resources", "shm_size"),
    [
        ({}, "1Gi"),
        ({"limits": {"memory": "8Gi"}}, "4096Mi"),
        ({"requests": {"memory": "3G"}}, "1430Mi"),
        ({"limits": {"memory": "4Gi"}, "requests": {"memory": "1Gi"}}, "2048Mi"),
    ],
)
def test_dev_shm_is_memory_backed_and_sized_from_memory(
    resources: dict[str, Any], shm_size: str
) -> None:
    container = {"name": "trainer", "image": "x", "resources": resources}
    pod = builders.build_pod(job(template={"spec": {"containers": [container]}}), 0)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["dshm"] == {
        "name": "dshm",
        "emptyDir": {"medium": "Memory", "sizeLimit": shm_size},
    }
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["spec"]["containers"][0]["volumeMounts"]


def test_explicit_shm_size_wins() -> None:
    pod = builders.build_pod(job(shmSize="16Gi"), 0)
    assert {v["name"]: v for v in pod["spec"]["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "16Gi"


@pytest.mark.parametrize(
    ("nproc", "resources", "expected"),
    [
        ("auto", {}, "1"),
        ("auto", {"limits": {"nvidia.com/gpu": 8}}, "8"),
        (4, {"limits": {"nvidia.com/gpu": 8}}, "4"),
    ],
)
def test_nproc_per_node_auto_uses_gpus(
    nproc: Any, resources: dict[str, Any], expected: str
) -> None:
    container = {"name": "trainer", "image": "x", "resources": resources}
    spec = {"nprocPerNode": nproc, "template": {"spec": {"containers": [container]}}}
    assert env_of(builders.build_pod(job(**spec), 0))["PET_NPROC_PER_NODE"] == expected


def test_security_defaults_and_user_override() -> None:
    pod = builders.build_pod(job(), 0)
    # Baseline: what root images (pytorch/pytorch, NGC) tolerate.
    assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    trainer = pod["spec"]["containers"][0]
    assert trainer["securityContext"] == {"allowPrivilegeEscalation": False}
    template = {
        "spec": {
            "securityContext": {"runAsNonRoot": False},
            "containers": [{"name": "t", "image": "x"}],
        }
    }
    restricted = builders.build_pod(job(template=template, securityProfile="Restricted"), 0)
    assert restricted["spec"]["securityContext"]["runAsNonRoot"] is False  # the user's wins


def test_a_failed_trainer_says_why_in_its_termination_message_unless_the_template_chose() -> None:
    """The agent's last log lines reach the job's status.failures through the pod's status,
    after the pod and its log are gone."""
    built = builders.build_pod(job(), 1)["spec"]["containers"][0]
    assert built["terminationMessagePolicy"] == "FallbackToLogsOnError"
    container = {"name": "trainer", "image": "x", "terminationMessagePolicy": "File"}
    template = {"spec": {"containers": [container]}}
    built = builders.build_pod(job(template=template), 0)["spec"]["containers"][0]
    assert built["terminationMessagePolicy"] == "File"


def test_sidecars_are_kept_untouched() -> None:
    sidecar = {"name": "logs", "image": "fluent/bit:3"}
    template = {"spec": {"containers": [{"name": "trainer", "image": "x"}, sidecar]}}
    assert builders.build_pod(job(template=template), 0)["spec"]["containers"][1] == sidecar


def test_local_network_maps_everything_to_loopback() -> None:
    network = builders.Network(rdzv_host="127.0.0.1", rdzv_port=40123, state_dir="/tmp/run")
    env = env_of(builders.build_pod(job(), 1, network))
    assert env["PET_RDZV_ENDPOINT"] == "127.0.0.1:40123"
    assert env["DDPJOB_STATE_FILE"] == "/tmp/run/demo-worker-1.state.json"


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
def test_built_objects_pass_strict_kubernetes_validation(version: str) -> None:
    container = {
        "name": "trainer",
        "image": "x",
        "resources": {"limits": {"nvidia.com/gpu": 2, "memory": "16Gi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    template = {"spec": {"containers": [container], "volumes": [{"name": "data", "emptyDir": {}}]}}
    kubernetes_validate.validate(builders.build_service(job()), version, strict=True)
    for index in (0, 1):
        kubernetes_validate.validate(
            builders.build_pod(job(template=template), index), version, strict=True
        )
    restricted = job(template=template, securityProfile="Restricted")
    kubernetes_validate.validate(builders.build_pod(restricted, 0), version, strict=True)
    kubernetes_validate.validate(builders.build_network_policy(job()), version, strict=True)
    secret = builders.build_store_key_secret(job(), "k3y")
    kubernetes_validate.validate(secret, version, strict=True)


# ---- issue 14: what a real cluster needs of a pod ------------------------------------------------

UNREACHABLE = "node.kubernetes.io/unreachable"
NOT_READY = "node.kubernetes.io/not-ready"


def _lost_node(key: str, seconds: int) -> dict[str, Any]:
    return {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}


@pytest.mark.parametrize(
    ("template_tolerations", "spec", "expected"),
    [
        # Default: 30 s instead of the 300 s DefaultTolerationSeconds would add.
        ([], {}, [_lost_node(NOT_READY, 30), _lost_node(UNREACHABLE, 30)]),
        (
            [],
            {"nodeLostTolerationSeconds": 0},
            [_lost_node(NOT_READY, 0), _lost_node(UNREACHABLE, 0)],
        ),
        # The template's own toleration for a key wins; the other key still gets ours.
        (
            [_lost_node(UNREACHABLE, 600)],
            {},
            [_lost_node(UNREACHABLE, 600), _lost_node(NOT_READY, 30)],
        ),
        # A toleration without effect covers NoExecute too.
        (
            [{"key": NOT_READY, "operator": "Exists"}],
            {},
            [{"key": NOT_READY, "operator": "Exists"}, _lost_node(UNREACHABLE, 30)],
        ),
        # Tolerate everything forever: nothing of ours may shorten that.
        ([{"operator": "Exists"}], {}, [{"operator": "Exists"}]),
        # Another effect of the same key does not cover the NoExecute taint.
        (
            [{"key": UNREACHABLE, "operator": "Exists", "effect": "NoSchedule"}],
            {},
            [
                {"key": UNREACHABLE, "operator": "Exists", "effect": "NoSchedule"},
                _lost_node(NOT_READY, 30),
                _lost_node(UNREACHABLE, 30),
            ],
        ),
        # Unrelated tolerations are kept as they are.
        (
            [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            {"nodeLostTolerationSeconds": 10},
            [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                _lost_node(NOT_READY, 10),
                _lost_node(UNREACHABLE, 10),
            ],
        ),
    ],
)
def test_pods_tolerate_a_lost_node_briefly(
    template_tolerations: list[dict[str, Any]], spec: dict[str, Any], expected: list[Any]
) -> None:
    template = {
        "spec": {"tolerations": template_tolerations, "containers": [{"name": "t", "image": "x"}]}
    }
    pod = builders.build_pod(job(template=template, **spec), 0)
    assert pod["spec"]["tolerations"] == expected


@pytest.mark.parametrize(
    ("pod_spec", "dns_policy"),
    [
        ({}, None),
        ({"hostNetwork": False}, None),
        ({"hostNetwork": True}, "ClusterFirstWithHostNet"),
        ({"hostNetwork": True, "dnsPolicy": "Default"}, "Default"),  # the user's wins
    ],
)
def test_host_network_pods_still_resolve_cluster_names(
    pod_spec: dict[str, Any], dns_policy: str | None
) -> None:
    template = {"spec": {**pod_spec, "containers": [{"name": "t", "image": "x"}]}}
    assert builders.build_pod(job(template=template), 0)["spec"].get("dnsPolicy") == dns_policy


@pytest.mark.parametrize("profile", ["Baseline", "Restricted"])
@pytest.mark.parametrize(
    ("security", "escalation"),
    [
        ({}, False),
        ({"capabilities": {"add": ["NET_ADMIN"]}}, False),
        # The API server refuses allowPrivilegeEscalation: false beside these (422).
        ({"privileged": True}, None),
        ({"capabilities": {"add": ["CAP_SYS_ADMIN"]}}, None),
        ({"capabilities": {"add": ["SYS_ADMIN"]}}, None),
        ({"privileged": True, "allowPrivilegeEscalation": True}, True),  # the user's wins
    ],
)
def test_no_escalation_default_beside_privileged_or_sys_admin(
    profile: str, security: dict[str, Any], escalation: bool | None
) -> None:
    trainer = {"name": "t", "image": "x", "securityContext": security}
    init = {"name": "init", "image": "x", "securityContext": security}
    template = {"spec": {"containers": [trainer], "initContainers": [init]}}
    pod = builders.build_pod(job(template=template, securityProfile=profile), 0)
    containers = pod["spec"]["containers"][:1]
    if profile == "Restricted":
        containers += pod["spec"]["initContainers"]
    for container in containers:
        assert container["securityContext"].get("allowPrivilegeEscalation") == escalation


def test_readiness_probe_runs_the_agent_itself_with_slack() -> None:
    trainer = builders.build_pod(job(), 0)["spec"]["containers"][0]
    assert trainer["readinessProbe"] == {
        "exec": {"command": ["ddpjob-agent", "--probe"]},
        "periodSeconds": 5,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    }
    torchrun = {"name": "t", "image": "x", "command": ["torchrun"]}
    plain = builders.build_pod(job(template={"spec": {"containers": [torchrun]}}), 0)
    assert "readinessProbe" not in plain["spec"]["containers"][0]


def test_the_probe_command_works_as_the_kubelet_runs_it(tmp_path: Path) -> None:
    """The probe exec'd as built, by PATH lookup, with the container's env (its state file)."""
    from ddpjob_worker.state import Phase, StateWriter  # noqa: PLC0415

    command = builders.readiness_probe()["exec"]["command"]
    state_file = tmp_path / "state.json"
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "DDPJOB_STATE_FILE": str(state_file),
    }

    def probe() -> int:
        result = subprocess.run(command, env=env, capture_output=True, timeout=60, check=False)
        return result.returncode

    assert probe() == 3  # no state yet: not ready
    writer = StateWriter(str(state_file))
    writer.update(phase=Phase.RENDEZVOUS)
    assert probe() == 1
    writer.update(phase=Phase.RUNNING)
    assert probe() == 0
