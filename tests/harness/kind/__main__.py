"""``python -m tests.harness.kind build`` and ``python -m tests.harness.kind up [--nodes N]``.

``build`` builds whatever is missing (``make kind``): the Go binaries, the control plane's, the
node image and the images baked into it, in the harness's own Docker daemon (which it starts
and stops). ``up`` builds what is missing, starts the daemon and a kind cluster of N nodes,
prints ``KUBECONFIG=<absolute path>`` (it works from the machine's own namespace: the API
server is forwarded to 127.0.0.1), and stays up until SIGINT or SIGTERM; then it deletes the
cluster and stops the daemon. Run it from the repo root in the dev venv, as root:

    .venv/bin/python -m tests.harness.kind up --nodes 2
    export KUBECONFIG=...            # the printed path
    kubectl get nodes
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.harness import tools
from tests.harness.kind import docker, gobuild, images
from tests.harness.kind.cluster import ClusterError, KindCluster
from tests.harness.kube import build as kube_build


def build_all(dockerd: docker.Dockerd, *, quiet: bool = False) -> str:
    """Everything a cluster needs; returns the node image's reference."""
    started = time.monotonic()
    bins = gobuild.build(quiet=quiet)
    control_plane = kube_build.build(quiet=quiet)
    image = images.build_node_image(dockerd, bins, control_plane, quiet=quiet)
    if not quiet:
        print(f"# everything built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return image


def up(nodes: int, name: str, workdir: Path | None, keep: bool) -> int:
    directory = workdir or Path(tempfile.mkdtemp(prefix="ddpjob-kind-"))
    stop = threading.Event()

    def finish(signum: int, _: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    with docker.Dockerd() as dockerd:
        image = build_all(dockerd)
        cluster = KindCluster(
            name,
            image=image,
            nodes=nodes,
            workdir=directory,
            docker_env=dockerd.env(),
            netns=dockerd.netns,
            kind=str(gobuild.bin_dir() / "kind"),
            kubectl=str(tools.tool("kubectl")),
            marker_dir=dockerd.run_dir,
        )
        try:
            cluster.create()
            signal.signal(signal.SIGINT, finish)
            signal.signal(signal.SIGTERM, finish)
            print(f"KUBECONFIG={cluster.kubeconfig.resolve()}", flush=True)
            print(
                f"# kind cluster {name}: {nodes} nodes ready; Ctrl-C deletes it",
                file=sys.stderr,
                flush=True,
            )
            stop.wait()
        finally:
            cluster.delete()
    if not keep and workdir is None:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.kind")
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="start a kind cluster on the node image built here")
    start.add_argument("--nodes", type=int, default=2, help="nodes, the control plane's included")
    start.add_argument("--name", default="ddpjob-kind", help="the kind cluster's name")
    start.add_argument("--workdir", type=Path, help="keep the kubeconfig and config here")
    start.add_argument("--keep", action="store_true", help="keep the work directory at the end")
    sub.add_parser("build", help="build the kind CLI, the node image and every image it needs")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            with docker.Dockerd() as dockerd:
                print(build_all(dockerd))
            return 0
        if not 1 <= args.nodes <= 6:
            parser.error("--nodes must be between 1 and 6")
        return up(args.nodes, args.name, args.workdir, args.keep)
    except (gobuild.BuildError, kube_build.BuildError, docker.DockerError, ClusterError) as exc:
        print(f"tests.harness.kind: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
