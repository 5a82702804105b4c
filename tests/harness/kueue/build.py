"""Build the Kueue controller, ``sigs.k8s.io/kueue/cmd/kueue``, from its Go module.

The pin lives in ``hack/kueue/go.mod`` (with its ``go.sum``), a module of its own because
Kueue pins Kubernetes 0.36.x libraries while ``hack/kube`` pins 0.37.x. Its ``tool`` line keeps
``sigs.k8s.io/kueue`` in the module through ``go mod tidy``. The version is v0.19.2: the proxy
serves it and every module of its graph (``go mod tidy`` and ``go mod verify`` pass), although
``go list -m -versions sigs.k8s.io/kueue`` lists only v0.17.0, the ``@latest`` it answers.

Everything comes from the Go module proxy; nothing else is downloaded. The binary lands in
``.cache/kueue/<kueue version>-<hash of go.mod and go.sum>/bin/kueue`` (ignored by git), so a
change of pin builds into a new directory and an unchanged one is never rebuilt; the build
itself is :func:`tests.harness.kube.build.go_build`, under :func:`tests.harness.kube.build.exclusive`. Failures
stop with one line that names the step and the fix (:class:`BuildError`); the whole ``go``
output is kept in ``build.log`` next to ``bin``.

:func:`crd_bases` and :func:`webhook_manifests` point into the extracted module: Kueue's CRDs
and its webhook configurations, as released with the pinned version.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from pathlib import Path

from tests.harness.kube import build as kube_build
from tests.harness.kube.build import BuildError

__all__ = [
    "BuildError",
    "bin_dir",
    "build",
    "built",
    "crd_bases",
    "module_dir",
    "parse_version",
    "version",
    "webhook_manifests",
]

ROOT = Path(__file__).resolve().parents[3]
MODULE = ROOT / "hack" / "kueue"
CACHE = ROOT / ".cache" / "kueue"
KUEUE = "sigs.k8s.io/kueue"
PACKAGE = f"{KUEUE}/cmd/kueue"
BINARY = "kueue"
RERUN = "python -m tests.harness.kueue build"
_REQUIRE = re.compile(r"^\s*(?:require\s+)?sigs\.k8s\.io/kueue\s+(v\d+\.\d+\.\d+\S*)", re.M)


def parse_version(go_mod: str) -> str:
    """The version of ``sigs.k8s.io/kueue`` a go.mod's text requires."""
    found = _REQUIRE.search(go_mod)
    if found is None:
        raise BuildError(
            f"{MODULE / 'go.mod'} does not require {KUEUE}; restore it from git "
            f"(or run `go get -tool {PACKAGE}@<version>` in {MODULE})"
        )
    return found.group(1)


def version() -> str:
    """The pinned Kueue version, read from hack/kueue/go.mod."""
    return parse_version((MODULE / "go.mod").read_text())


def bin_dir() -> Path:
    """Where the binary of the pinned version is (built or not)."""
    return CACHE / f"{version()}-{kube_build.module_digest(MODULE)}" / "bin"


def built() -> bool:
    return (bin_dir() / BINARY).is_file()


def _ldflags(pin: str) -> str:
    # The module zip carries no commit and the build no date: "unknown", not the placeholders.
    pkg = f"{KUEUE}/pkg/version"
    return f"-s -w -X {pkg}.GitVersion={pin} -X {pkg}.GitCommit=unknown -X {pkg}.BuildDate=unknown"


def build(*, quiet: bool = False) -> Path:
    """Build the controller if it is missing; return the directory of ``kueue``."""
    with kube_build.exclusive(CACHE / ".lock"):
        target = bin_dir()
        if built():
            return target
        pin = version()
        return kube_build.go_build(
            MODULE, (PACKAGE,), target, what=f"Kueue {pin} ({PACKAGE})", rerun=RERUN,
            ldflags=_ldflags(pin), quiet=quiet,
        )  # fmt: skip


@functools.cache
def _module_dir(module: Path, pin: str) -> Path:
    go = kube_build.find_go(f"locating {KUEUE} {pin}", RERUN)
    # `go mod download` (not `go list -m`) so that a cold module cache is filled, not empty.
    result = subprocess.run(
        [go, "mod", "download", "-json", KUEUE],
        cwd=module, capture_output=True, text=True, check=False,
        env={**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly"},
    )  # fmt: skip
    try:
        info = json.loads(result.stdout)
    except json.JSONDecodeError:
        info = {"Error": (result.stderr.strip() or "no output").splitlines()[-1]}
    if result.returncode != 0 or not info.get("Dir"):
        raise BuildError(
            f"locating {KUEUE} {pin} failed (go mod download, exit {result.returncode}): "
            f"{str(info.get('Error', '?'))[:200]}; check that the Go module proxy is reachable "
            f"(go env GOPROXY) and that {module / 'go.sum'} is the one in git"
        )
    return Path(info["Dir"])


def module_dir() -> Path:
    """The extracted ``sigs.k8s.io/kueue`` module of the pinned version (downloaded if missing);
    the same directory as ``go list -m -f {{.Dir}} sigs.k8s.io/kueue`` in hack/kueue."""
    return _module_dir(MODULE, version())


def crd_bases() -> Path:
    """The directory of Kueue's CRDs (``kueue.x-k8s.io_*.yaml``, no conversion webhooks)."""
    return module_dir() / "config" / "components" / "crd" / "bases"


def webhook_manifests() -> Path:
    """Kueue's Mutating- and ValidatingWebhookConfiguration, ``manifests.yaml``: every webhook
    of every integration, with a Service ``webhook-service`` as the client config."""
    return module_dir() / "config" / "components" / "webhook" / "manifests.yaml"
