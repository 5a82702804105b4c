"""``python -m tests.harness.kueue build``: build the Kueue controller if it is missing and print the
directory of ``kueue``; ``python -m tests.harness.kueue crds`` prints the directory of its CRDs;
``python -m tests.harness.kueue up [--nodes N]`` starts the real control plane (with the DDPJob CRD)
and Kueue on it (:mod:`tests.harness.kueue.process`), prints ``KUBECONFIG=<path>`` once Kueue is ready
and stays up until SIGINT or SIGTERM.

Run it from the repo root in the dev venv; next to a test run, lower its priority:

    nice -n 19 .venv/bin/python -m tests.harness.kueue build
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from tests.harness.kube.controlplane import ControlPlane, ControlPlaneError
from tests.harness.kueue import build
from tests.harness.kueue.process import Kueue, KueueError, install_crds


def up(nodes: int, workdir: Path | None) -> int:
    from tests.harness.kube.fixtures import install_crd  # noqa: PLC0415 (imports pytest)

    directory = workdir or Path(tempfile.mkdtemp(prefix="ddpjob-kueue-"))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))

    def crds(cluster: ControlPlane) -> None:
        install_crd(cluster)
        install_crds(cluster)

    cluster = ControlPlane(directory, nodes=nodes, before_controllers=crds)
    try:
        cluster.start()
        with Kueue(cluster) as kueue:
            signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
            signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
            print(f"KUBECONFIG={cluster.kubeconfig.resolve()}", flush=True)
            print(
                f"# Kueue ready in {kueue.started_seconds:.1f}s; logs in {directory / 'logs'}; "
                "Ctrl-C stops everything",
                file=sys.stderr,
                flush=True,
            )
            while not stop.wait(1.0):
                if not kueue.alive():
                    print(f"# Kueue exited; see {kueue.log_path}", file=sys.stderr, flush=True)
                    stop.wait()
    finally:
        cluster.stop()
        if workdir is None:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.kueue")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build sigs.k8s.io/kueue/cmd/kueue (hack/kueue)")
    sub.add_parser("crds", help="print the directory of Kueue's CRD bases")
    start = sub.add_parser("up", help="start the real control plane and Kueue on it")
    start.add_argument("--nodes", type=int, default=3, help="process-kubelet nodes (default 3)")
    start.add_argument("--workdir", type=Path, help="keep certificates, data and logs here")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build.build())
        elif args.command == "crds":
            print(build.crd_bases())
        else:
            return up(args.nodes, args.workdir)
    except (build.BuildError, ControlPlaneError, KueueError) as exc:
        print(f"tests.harness.kueue: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
