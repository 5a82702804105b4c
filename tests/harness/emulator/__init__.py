"""A Kubernetes API server emulator for testing the ddpjob operator without a cluster.

See README.md in this directory. Quick start::

    from tests.harness.emulator import EmulatorProcess

    with EmulatorProcess() as em:            # a child process on 127.0.0.1:<free port>
        em.write_kubeconfig(tmp_path / "kubeconfig")
        ...                                   # run kopf / the client against em.url
        em.control.set_pod_phase("default", "job-0", "Running")
        assert em.control.count_requests("patch", "ddpjobs") == 1
"""

from tests.harness.emulator.runner import (
    Control,
    ControlError,
    EmulatorControl,
    EmulatorHandle,
    EmulatorOptions,
    EmulatorProcess,
    EmulatorThread,
    build_emulator,
    ddpjob_crd,
    kopf_peering_crds,
    kubeconfig_dict,
    running_emulator,
)
from tests.harness.emulator.store import ApiError, Emulator, ResourceDef

__all__ = [
    "ApiError",
    "Control",
    "ControlError",
    "Emulator",
    "EmulatorControl",
    "EmulatorHandle",
    "EmulatorOptions",
    "EmulatorProcess",
    "EmulatorThread",
    "ResourceDef",
    "build_emulator",
    "ddpjob_crd",
    "kopf_peering_crds",
    "kubeconfig_dict",
    "running_emulator",
]
