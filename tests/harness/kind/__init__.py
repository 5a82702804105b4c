"""Real kind clusters built on this machine with no container registry (issue 24).

Everything a kind cluster needs is built here from Go modules, Debian packages and the repo,
cached under ``.cache/kind`` by a hash of its inputs:

- :mod:`tests.harness.kind.gobuild`: the ``kind`` CLI, the node's binaries (kubelet, kubeadm, kubectl,
  kube-proxy at hack/kube's pin; containerd, runc, crictl, the CNI plugins at kind v0.33.0's
  versions), CoreDNS and pause;
- :mod:`tests.harness.kind.docker`: a Docker daemon in a network namespace of its own, started and
  stopped by the harness (no private address ever appears in the machine's namespace);
- :mod:`tests.harness.kind.images`: the node image (a debootstrap base with kind's base files) and every
  image kubeadm and kind start, baked into it;
- :mod:`tests.harness.kind.cluster`: ``kind create cluster`` on those, reachable from 127.0.0.1.

``python -m tests.harness.kind build`` builds what is missing; ``python -m tests.harness.kind up`` starts a
cluster and prints ``KUBECONFIG=<path>``. The design notes are in docs/testing.md.
"""
