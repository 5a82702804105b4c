"""Pure builders: a DDPJob in, complete Kubernetes objects (plain dicts) out. No I/O.

Names are deterministic: the headless Service is named after the job, and pod ``i`` is
``<job>-worker-<i>`` with ``hostname``/``subdomain`` set, so pod 0 (which hosts the c10d store)
is reachable at ``<job>-worker-0.<job>.<namespace>.svc`` across replacements.

What every pod gets unless the user set it already:

* the env contract (:mod:`ddpjob_worker.contract`), so ``ddpjob-agent`` and plain ``torchrun``
  join the same rendezvous;
* the job's store key (``DDPJOB_STORE_KEY``) from its own Secret, with which the agents sign
  what they write to the rendezvous store (see :func:`build_pod` for when it is left out);
* a memory-backed ``/dev/shm`` sized from the trainer's memory (DataLoader workers crash with
  the 64 MB default);
* NCCL settings that fail fast instead of hanging;
* a security context that images running as root tolerate (``spec.securityProfile``:
  ``Baseline`` by default, ``Restricted`` on request; see ``api.SecurityProfile``);
* the pod-tracking finalizer, removed once the pod's outcome is counted;
* ``restartPolicy: Never``: the agent restarts workers in place, the operator replaces pods;
* NoExecute tolerations of ``spec.nodeLostTolerationSeconds`` for a not-ready or unreachable
  node (instead of the cluster's 300 s), so a lost node's pods are evicted and replaced soon;
* ``dnsPolicy: ClusterFirstWithHostNet`` with ``hostNetwork: true``, so pod 0's name resolves;
* when the trainer runs ``ddpjob-agent``, a readiness probe through ``ddpjob-agent --probe``.
"""

from __future__ import annotations

import base64
import dataclasses
import decimal
from collections.abc import Mapping
from typing import Any

from kubernetes.utils import parse_quantity as _parse_quantity

from ddpjob_operator import api
from ddpjob_worker import contract

JSON = dict[str, Any]


def parse_quantity(value: object) -> decimal.Decimal:
    """A Kubernetes quantity ("3Gi", "500m", 8) as a Decimal (the client library's parser)."""
    parsed: decimal.Decimal = _parse_quantity(value)  # type: ignore[no-untyped-call]
    return parsed


AGENT = "ddpjob-agent"
CONTAINER_PORT_NAME = "rdzv"
SHM_VOLUME = "dshm"
STATE_VOLUME = "ddpjob-run"
DEFAULT_SHM = "1Gi"
DEFAULT_GRACE_SECONDS = 30
GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")

NCCL_DEFAULTS: Mapping[str, str] = {
    # Tear the process group down on a collective error or timeout, so the agent restarts the
    # workers instead of them hanging (trainer#2000).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # Never pick the loopback or docker bridge for inter-node traffic.
    "NCCL_SOCKET_IFNAME": "^lo,docker",
    "NCCL_DEBUG": "WARN",
}


@dataclasses.dataclass(frozen=True)
class Network:
    """Where pods find each other. The cluster default uses the headless Service's DNS.

    The local runner passes its own: every name maps to 127.0.0.1 and the port is one it
    reserved, so that several jobs run side by side.
    """

    rdzv_host: str | None = None
    rdzv_port: int | None = None
    state_dir: str | None = None
    directory_base: int | None = None
    """Local runner: pod ``i``'s agent answers on ``directory_base + i`` (every pod shares
    127.0.0.1). Cluster: every pod answers on the rendezvous port + 1 at its own address."""

    def endpoint_host(self, job: api.DDPJob) -> str:
        if self.rdzv_host is not None:
            return self.rdzv_host
        return f"{pod_name(job.name, 0)}.{service_name(job.name)}.{job.namespace}.svc"

    def port(self, job: api.DDPJob) -> int:
        return self.rdzv_port if self.rdzv_port is not None else job.spec.rendezvous.port

    def directory_port(self, job: api.DDPJob, index: int) -> int:
        """Where pod ``index``'s agent answers which store carries the job now."""
        if self.directory_base is not None:
            return self.directory_base + index
        port = self.port(job)
        return port + 1 if port < 65535 else port - 1

    def peers(self, job: api.DDPJob) -> tuple[str, ...]:
        """Where a starting agent asks for the current store: every pod of the job (the
        headless Service's name resolves to all of them, ready or not)."""
        if self.directory_base is not None:
            host = self.rdzv_host or "127.0.0.1"
            count = job.spec.effective_max
            return tuple(f"{host}:{self.directory_base + i}" for i in range(count))
        name = f"{service_name(job.name)}.{job.namespace}.svc"
        return (f"{name}:{self.directory_port(job, 0)}",)

    def state_file(self, job: api.DDPJob, index: int) -> str:
        if self.state_dir is None:
            return contract.DEFAULT_STATE_FILE
        return f"{self.state_dir}/{pod_name(job.name, index)}.state.json"


CLUSTER = Network()


def service_name(job_name: str) -> str:
    return job_name


def pod_name(job_name: str, index: int) -> str:
    return f"{job_name}-worker-{index}"


def labels(job: api.DDPJob, index: int | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "ddpjob",
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/managed-by": "ddpjob-operator",
        api.LABEL_JOB: job.name,
    }
    if index is not None:
        out[api.LABEL_INDEX] = str(index)
        out[api.LABEL_ROLE] = "master" if index == 0 else "worker"
    return out


def owner_references(job: api.DDPJob) -> list[JSON]:
    if not job.metadata.uid:
        return []
    return [
        {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "name": job.name,
            "uid": job.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def _metadata(
    job: api.DDPJob, name: str, index: int | None, extra_labels: Mapping[str, str]
) -> JSON:
    meta: JSON = {
        "name": name,
        "namespace": job.namespace,
        "labels": {**extra_labels, **labels(job, index)},
    }
    owners = owner_references(job)
    if owners:
        meta["ownerReferences"] = owners
    return meta


def build_service(job: api.DDPJob) -> JSON:
    """The headless Service that gives every pod a stable DNS name, ready or not."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, service_name(job.name), None, {}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # pod 0 must resolve before it is ready
            "selector": {api.LABEL_JOB: job.name},
            "ports": [
                {
                    "name": CONTAINER_PORT_NAME,
                    "port": job.spec.rendezvous.port,
                    "targetPort": job.spec.rendezvous.port,
                    "protocol": "TCP",
                }
            ],
        },
    }


def network_policy_name(job_name: str) -> str:
    return f"{job_name}-ddpjob"


def build_network_policy(job: api.DDPJob) -> JSON:
    """A NetworkPolicy for the job's pods: they accept anything from pods of the same job, and
    from anywhere else only the ports the template declares and the agents' directory port,
    never the rendezvous port.

    It protects the c10d TCPStore (no authentication: anyone who reaches it can join or break
    the rendezvous) and the gloo/NCCL ports, which are picked at random. The directory port
    only answers one line of JSON per connection (which store the job uses, what the agent
    does) and reads nothing: the operator asks it (``--ask-agents``).
    """
    rdzv_port = job.spec.rendezvous.port
    declared: list[JSON] = [{"port": CLUSTER.directory_port(job, 0), "protocol": "TCP"}]
    for container in job.spec.template.spec.model_dump(by_alias=True)["containers"]:
        for port in container.get("ports") or []:
            number = port.get("containerPort")
            if number is None or number == rdzv_port:
                continue
            entry = {"port": number, "protocol": port.get("protocol", "TCP")}
            if entry not in declared:
                declared.append(entry)
    same_job = {"podSelector": {"matchLabels": {api.LABEL_JOB: job.name}}}
    ingress: list[JSON] = [{"from": [same_job]}]
    if declared:
        ingress.append({"ports": declared})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(job, network_policy_name(job.name), None, {}),
        "spec": {
            "podSelector": {"matchLabels": {api.LABEL_JOB: job.name}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def pod_group_name(job_name: str) -> str:
    return job_name


def build_pod_group(job: api.DDPJob) -> JSON:
    """The job's PodGroup (``gangScheduling: Native``): the scheduler binds none of the first
    ``minCount`` = ``minReplicas`` pods that name it until it can bind them all; once they are,
    more pods (a scale up, a replacement) are placed one by one.

    Its priority is the template's (the scheduler wants a gang's pods and their group at one
    priority). ``minCount`` is the only field that may change: the operator updates it when a
    suspended job's ``minReplicas`` changed.
    """
    spec: JSON = {"schedulingPolicy": {"gang": {"minCount": job.spec.effective_min}}}
    priority_class = (job.spec.template.spec.model_extra or {}).get("priorityClassName")
    if priority_class:
        spec["priorityClassName"] = priority_class
    return {
        "apiVersion": api.POD_GROUP_API,
        "kind": "PodGroup",
        "metadata": _metadata(job, pod_group_name(job.name), None, {}),
        "spec": spec,
    }


STORE_KEY_ENTRY = "key"
"""The one entry of a job's store-key Secret."""


def store_key_secret_name(job_name: str) -> str:
    return f"{job_name}-store-key"


def build_store_key_secret(job: api.DDPJob, key: str) -> JSON:
    """The job's store key, which only the job's pods read (``DDPJOB_STORE_KEY``).

    Their agents HMAC-sign what they write to the c10d TCPStore with it, so that whoever
    reaches pod 0's store port and knows the run id (the job's uid, in every pod's env) still
    cannot steer the job. ``key`` is made by the caller (``secrets.token_urlsafe(32)`` where the
    Secret is created), never here: builders are deterministic. Immutable: the key never
    changes while the job lives, and the kubelets need not watch it.
    """
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(job, store_key_secret_name(job.name), None, {}),
        "type": "Opaque",
        "immutable": True,
        "data": {STORE_KEY_ENTRY: base64.b64encode(key.encode()).decode("ascii")},
    }


def store_key_env(job_name: str) -> JSON:
    """The trainer's ``DDPJOB_STORE_KEY``, from the job's store-key Secret (not optional: a pod
    never starts without it)."""
    ref = {"name": store_key_secret_name(job_name), "key": STORE_KEY_ENTRY}
    return {"name": api.STORE_KEY_ENV, "valueFrom": {"secretKeyRef": ref}}


def gpus_requested(container: Mapping[str, Any]) -> int:
    resources = container.get("resources") or {}
    for section in ("limits", "requests"):
        for name in GPU_RESOURCES:
            value = (resources.get(section) or {}).get(name)
            if value is not None:
                return int(parse_quantity(value))
    return 0


def nproc_per_node(spec: api.DDPJobSpec) -> int:
    if spec.nproc_per_node != "auto":
        return spec.nproc_per_node
    return max(1, gpus_requested(spec.trainer.model_dump(by_alias=True)))


def shm_size(spec: api.DDPJobSpec) -> str:
    """``spec.shmSize``, else half the trainer's memory limit (or request), else 1Gi."""
    if spec.shm_size is not None:
        return str(spec.shm_size)
    resources = spec.trainer.model_dump(by_alias=True).get("resources") or {}
    for section in ("limits", "requests"):
        memory = (resources.get(section) or {}).get("memory")
        if memory is not None:
            half = parse_quantity(memory) / 2
            return f"{int(half.to_integral_value(rounding=decimal.ROUND_FLOOR)) // 2**20}Mi"
    return DEFAULT_SHM


def agent_contract(
    job: api.DDPJob, index: int, network: Network = CLUSTER
) -> contract.AgentContract:
    spec = job.spec
    rdzv = spec.rendezvous
    grace = spec.template.spec.model_dump(by_alias=True).get(
        "terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS
    )
    return contract.AgentContract(
        job_name=job.name,
        run_id=job.metadata.uid or job.name,
        pod_index=index,
        endpoint_host=network.endpoint_host(job),
        port=network.port(job),
        min_nodes=spec.effective_min,
        max_nodes=spec.effective_max,
        nproc_per_node=nproc_per_node(spec),
        max_restarts=spec.max_restarts,
        join_timeout=rdzv.join_timeout_seconds,
        last_call_timeout=rdzv.last_call_seconds,
        close_timeout=rdzv.close_timeout_seconds,
        keep_alive_interval=rdzv.heartbeat_seconds,
        keep_alive_max_attempt=rdzv.heartbeat_miss_limit,
        # Leave the agent a few seconds of the pod's grace period to report and exit.
        grace_seconds=max(1, int(grace) - 5),
        state_file=network.state_file(job, index),
        directory_port=network.directory_port(job, index),
        peers=network.peers(job),
    )


def _env(
    user_env: list[JSON], job: api.DDPJob, index: int, network: Network, store_key: bool
) -> list[JSON]:
    """User env first and untouched; our defaults only for names the user did not set."""
    taken = {item["name"] for item in user_env}
    ours: list[JSON] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": contract.PET_LOCAL_ADDR, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    if store_key:
        ours.append(store_key_env(job.name))
    ours += [{"name": k, "value": v} for k, v in agent_env_for(job, index, network).items()]
    ours += [{"name": k, "value": v} for k, v in NCCL_DEFAULTS.items()]
    return user_env + [item for item in ours if item["name"] not in taken]


def agent_env_for(job: api.DDPJob, index: int, network: Network = CLUSTER) -> dict[str, str]:
    return contract.agent_env(agent_contract(job, index, network))


def _trainer(
    container: JSON, job: api.DDPJob, index: int, network: Network, store_key: bool
) -> JSON:
    out = dict(container)
    out["env"] = _env(list(container.get("env") or []), job, index, network, store_key)
    mounts = list(container.get("volumeMounts") or [])
    mounted = {m.get("mountPath") for m in mounts}
    if "/dev/shm" not in mounted:
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    if contract.DEFAULT_STATE_DIR not in mounted:
        mounts.append({"name": STATE_VOLUME, "mountPath": contract.DEFAULT_STATE_DIR})
    out["volumeMounts"] = mounts
    ports = list(container.get("ports") or [])
    if not any(p.get("containerPort") == job.spec.rendezvous.port for p in ports):
        ports.append(
            {
                "name": CONTAINER_PORT_NAME,
                "containerPort": job.spec.rendezvous.port,
                "protocol": "TCP",
            }
        )
    out["ports"] = ports
    # A failed trainer's last log lines become its termination message, so the job's
    # status.failures say why (the agent's own error) without the pod's log, gone with the pod.
    out.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    command = out.get("command") or []
    if "readinessProbe" not in out and command[:1] == [AGENT]:
        out["readinessProbe"] = readiness_probe()
    return out


def readiness_probe() -> JSON:
    """Ready while the agent's workers run: the agent's own entry point checks its state file.

    ``ddpjob-agent --probe`` runs where the trainer's command runs (an image need not have a
    ``python`` on PATH), never imports torch, and is given 5 s (a Python start on a busy node
    takes more than the 1 s default) and three misses before the pod reads as not ready.
    """
    return {
        "exec": {"command": [AGENT, "--probe"]},
        "periodSeconds": 5,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    }


NODE_LOST_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
"""The NoExecute taints the node lifecycle controller puts on a node that stops reporting."""


def _tolerates(toleration: Mapping[str, Any], key: str) -> bool:
    """The toleration covers ``key``'s NoExecute taint (the DefaultTolerationSeconds rule: an
    empty key is every key, an empty effect every effect)."""
    return toleration.get("key", "") in ("", key) and toleration.get("effect", "") in (
        "",
        "NoExecute",
    )


def _tolerations(user: list[JSON], spec: api.DDPJobSpec) -> list[JSON]:
    """The template's tolerations, plus short ones for a lost node unless it has its own.

    Without them the DefaultTolerationSeconds admission plugin gives every pod 300 s, so the
    pods of a lost node stay Running for five minutes before the taint manager evicts them.
    """
    ours = [
        {
            "key": key,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": spec.node_lost_toleration_seconds,
        }
        for key in NODE_LOST_TAINTS
        if not any(_tolerates(t, key) for t in user)
    ]
    return [*user, *ours]


def security_profile(
    spec: api.DDPJobSpec, default: api.SecurityProfile = api.SecurityProfile.BASELINE
) -> api.SecurityProfile:
    """``spec.securityProfile``, else the operator's default."""
    return spec.security_profile or default


def escalates_anyway(security: Mapping[str, Any]) -> bool:
    """A privileged container, or one that adds SYS_ADMIN, can always gain privileges.

    The API server refuses ``allowPrivilegeEscalation: false`` next to ``privileged: true`` or
    ``capabilities.add: [CAP_SYS_ADMIN]`` (422, ``ValidateSecurityContext``); spelled
    ``SYS_ADMIN`` it is accepted but means nothing. Either way the default is not ours to add.
    """
    added = (security.get("capabilities") or {}).get("add") or []
    return security.get("privileged") is True or bool({"SYS_ADMIN", "CAP_SYS_ADMIN"} & set(added))


def _secure_container(container: JSON, profile: api.SecurityProfile) -> JSON:
    out = dict(container)
    security = dict(out.get("securityContext") or {})
    if not escalates_anyway(security):
        security.setdefault("allowPrivilegeEscalation", False)
    if profile is api.SecurityProfile.RESTRICTED:
        security.setdefault("capabilities", {"drop": ["ALL"]})
        security.setdefault("runAsNonRoot", True)
    out["securityContext"] = security
    return out


def _secure_pod(spec: JSON, profile: api.SecurityProfile) -> None:
    security = dict(spec.get("securityContext") or {})
    security.setdefault("seccompProfile", {"type": "RuntimeDefault"})
    if profile is api.SecurityProfile.RESTRICTED:
        security.setdefault("runAsNonRoot", True)
    spec["securityContext"] = security
    if profile is not api.SecurityProfile.RESTRICTED:
        # Baseline touches only the trainer: sidecars (a mesh's init container needs
        # NET_ADMIN) are the user's business.
        spec["containers"][0] = _secure_container(spec["containers"][0], profile)
        return
    for key in ("containers", "initContainers"):
        if key in spec:
            spec[key] = [_secure_container(c, profile) for c in spec[key]]


@dataclasses.dataclass(frozen=True)
class Placement:
    """What an admission by Kueue adds to every new pod: the admitted flavors' node labels
    and tolerations, and Kueue's own labels and annotations."""

    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[JSON, ...] = ()
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)


def build_pod(
    job: api.DDPJob,
    index: int,
    network: Network = CLUSTER,
    default_profile: api.SecurityProfile = api.SecurityProfile.BASELINE,
    store_key: bool = True,
    pod_group: str | None = None,
    placement: Placement | None = None,
) -> JSON:
    """Pod ``index`` of the job, complete. Pod 0 hosts the c10d store.

    ``placement``: what Kueue's admission adds (a job with ``kueue.x-k8s.io/queue-name``). A
    flavor's node label wins over the template's ``nodeSelector`` entry of the same key: the
    quota was taken on that flavor.

    ``pod_group``: the PodGroup the pod joins (``spec.schedulingGroup``), for a job with
    ``gangScheduling: Native`` on a cluster that serves PodGroups.

    ``store_key``: the trainer gets ``DDPJOB_STORE_KEY`` from the job's store-key Secret
    (:func:`store_key_env`). The reconciler leaves it out while pods of the job built without
    it may still run (made by an operator before the key): signed and unsigned agents cannot
    form one group. A ``DDPJOB_STORE_KEY`` the template sets itself is kept either way, as is
    every env var the user sets.
    """
    template = job.spec.template
    spec: JSON = template.spec.model_dump(by_alias=True, exclude_none=True)
    containers = spec["containers"]
    trainer = _trainer(containers[0], job, index, network, store_key)
    spec["containers"] = [trainer, *containers[1:]]
    volumes = list(spec.get("volumes") or [])
    names = {v.get("name") for v in volumes}
    if SHM_VOLUME not in names:
        volumes.append(
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(job.spec)}}
        )
    if STATE_VOLUME not in names:
        volumes.append({"name": STATE_VOLUME, "emptyDir": {"sizeLimit": "16Mi"}})
    spec["volumes"] = volumes
    spec["restartPolicy"] = "Never"
    spec["hostname"] = pod_name(job.name, index)
    spec["subdomain"] = service_name(job.name)
    spec.setdefault("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
    if spec.get("hostNetwork") is True:
        # With the host's network a pod gets the node's resolv.conf unless told otherwise, and
        # pod 0's name <job>-worker-0.<job>.<ns>.svc would never resolve.
        spec.setdefault("dnsPolicy", "ClusterFirstWithHostNet")
    spec["tolerations"] = _tolerations(spec.get("tolerations") or [], job.spec)
    if pod_group is not None:
        spec["schedulingGroup"] = {"podGroupName": pod_group}
    _secure_pod(spec, security_profile(job.spec, default_profile))
    extra_labels = dict(template.metadata.labels or {})
    annotations = dict(template.metadata.annotations or {})
    if placement is not None:
        if placement.node_selector:
            spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **placement.node_selector}
        spec["tolerations"] += [t for t in placement.tolerations if t not in spec["tolerations"]]
        extra_labels.update(placement.labels)
        annotations.update(placement.annotations)
    meta = _metadata(job, pod_name(job.name, index), index, extra_labels)
    meta["finalizers"] = [api.POD_FINALIZER]
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
