"""The Kueue controller (``sigs.k8s.io/kueue/cmd/kueue``), built from its Go module."""
