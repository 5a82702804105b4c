"""``python -m tests.harness.kube up [--nodes N] [--hollow]`` and ``python -m tests.harness.kube build``.

``up`` builds what is missing, starts the control plane and N process-kubelet nodes (with
``--hollow``: N hollow nodes instead, :mod:`tests.harness.kube.hollow_nodes`, up to 16, which record pods as
running without running them), prints ``KUBECONFIG=<absolute path>`` once every node is Ready,
and stays up until SIGINT or SIGTERM; then it stops everything it started. Run it from the repo
root in the dev venv:

    .venv/bin/python -m tests.harness.kube up --nodes 3
    .venv/bin/python -m tests.harness.kube up --nodes 16 --hollow
    export KUBECONFIG=...            # the printed path
    kubectl get nodes

``build`` only builds the binaries (``make kube``).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from tests.harness.kube.build import BuildError, build
from tests.harness.kube.controlplane import MAX_HOLLOW, MAX_NODES, ControlPlane, ControlPlaneError


def up(nodes: int, workdir: Path | None, keep: bool, hollow: bool = False) -> int:
    directory = workdir or Path(tempfile.mkdtemp(prefix="ddpjob-kube-"))
    stop = threading.Event()

    def finish(signum: int, _: object) -> None:
        stop.set()

    # Until it is up, SIGINT interrupts the start (and start() stops what it started); a
    # SIGTERM kills us, and every component dies with us (PR_SET_PDEATHSIG).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    if hollow:
        cluster = ControlPlane(directory, nodes=0, hollow=nodes)
    else:
        cluster = ControlPlane(directory, nodes=nodes)
    try:
        cluster.start()
        signal.signal(signal.SIGINT, finish)
        signal.signal(signal.SIGTERM, finish)
        print(f"KUBECONFIG={cluster.kubeconfig.resolve()}", flush=True)
        print(
            f"# {nodes} {'hollow ' if hollow else ''}nodes ready; logs in {directory / 'logs'}; Ctrl-C stops everything",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(1.0):
            dead = [n for n, c in cluster.components.items() if not c.alive()]
            if dead:
                print(f"# stopped by itself: {', '.join(dead)}", file=sys.stderr, flush=True)
                stop.wait()
    finally:
        cluster.stop()
        if not keep and workdir is None:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.kube")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="start a control plane with process-kubelet nodes")
    start.add_argument("--nodes", type=int, default=3, help="process-kubelet nodes (default 3)")
    start.add_argument(
        "--hollow",
        action="store_true",
        help=f"hollow nodes instead (up to {MAX_HOLLOW}): pods are recorded as running, not run",
    )
    start.add_argument("--workdir", type=Path, help="keep certificates, data and logs here")
    start.add_argument("--keep", action="store_true", help="keep the work directory at the end")
    sub.add_parser("build", help="build etcd and the Kubernetes binaries (hack/kube)")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build())
            return 0
        most = MAX_HOLLOW if args.hollow else MAX_NODES
        if not 1 <= args.nodes <= most:
            parser.error(f"--nodes must be between 1 and {most}")
        return up(args.nodes, args.workdir, args.keep, hollow=args.hollow)
    except (BuildError, ControlPlaneError) as exc:
        print(f"tests.harness.kube: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
