"""The test harness: what the tiers and the benchmarks start, drive and look at. One module per
concern; benchmarks import these, never a test file.

* :mod:`tests.harness.agents`: local agent "nodes" (``ddpjob-agent`` or stock torchrun on
  127.0.0.1, each optionally in a network namespace of its own) and their training logs.
* :mod:`tests.harness.hollow_agents`: hollow agents, the real agent's membership core many to a
  process, with stand-in workers that never import torch (the scale benchmarks).
* :mod:`tests.harness.netns`: network namespaces and links the tests make and cut.
* :mod:`tests.harness.kube`: the real control plane (etcd, kube-apiserver, kube-controller-manager,
  kube-scheduler built from Go modules), process kubelets, the cluster DNS, and hollow nodes
  (:mod:`tests.harness.kube.hollow_nodes`).
* :mod:`tests.harness.kueue`: Kueue's controller, built from its Go module, on that control plane.
* :mod:`tests.harness.kind`: the offline kind (node image, images, the harness's Docker daemon).
* :mod:`tests.harness.emulator`: the API emulator, for what a real server will not do on demand.
* :mod:`tests.harness.operator_env`: one operator scenario on the emulator or the real control
  plane, written once.
* :mod:`tests.harness.kubectl`: kubectl and helm on a cluster; :mod:`tests.harness.podlogs`: a
  job's trainer logs and the every-step-once check; :mod:`tests.harness.tools`: the dev extra's
  kubectl and helm.
* ``snap_train.py``: the training-state toy that the agent tests and ``bench_zero_loss`` run.
"""
