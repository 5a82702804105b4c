# ddpjob images, one Dockerfile, three targets (docs/images.md):
#
#   operator     the kopf operator: ddpjob[operator], no torch, UID 65532, ENTRYPOINT ddpjob operator
#   worker-cpu   DDPJob pods on CPU: ddpjob[worker] + CPU torch + examples/, UID 65532
#   worker-cuda  DDPJob pods on GPUs: ddpjob (--no-deps) on a CUDA PyTorch base image
#
#   docker build --target operator   -t ddpjob-operator:dev .
#   docker build --target worker-cpu -t ddpjob-worker-cpu:dev .
#   make images-offline   # no registry, no PyPI in the build: local Debian base + wheelhouse
#
# Works with the classic builder and BuildKit (no `# syntax` line, no RUN --mount: neither needs
# a registry). The classic builder runs every stage before the target, so worker-cuda, the only
# stage on another base, comes last.

# Bases. PYTHON_BASE needs python3 >= 3.11 with the venv module (python:3.11-slim-bookworm, or
# the debootstrap base that `make images-offline` imports). CUDA_BASE must bring torch 2.13
# (the agent refuses an untested torch unless DDPJOB_ALLOW_UNTESTED_TORCH=1) and python >= 3.11.
ARG PYTHON_BASE=python:3.11-slim-bookworm
ARG CUDA_BASE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime

# ---------------------------------------------------------------------------------------------
# builder: the ddpjob wheel, built once for every target.
FROM ${PYTHON_BASE} AS builder
# OFFLINE=1: pip uses only the wheelhouse in the build context (.images/wheelhouse, filled by
# scripts/images-offline.sh), never an index. OFFLINE=0: PIP_INDEX_URL (an ARG, so pip sees it).
ARG OFFLINE=0
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# The wheelhouse may be absent (online builds): the [e] glob matches nothing then, and
# constraints.txt keeps the COPY non-empty.
COPY constraints.txt .images/wheelhous[e] /wheels/
COPY pyproject.toml README.md /src/
COPY operator /src/operator
COPY worker /src/worker
RUN set -eu; \
    if [ "$OFFLINE" = 1 ]; then set -- --no-index --find-links /wheels; else set --; fi; \
    python3 -m venv /opt/build; \
    /opt/build/bin/pip wheel "$@" --no-deps --wheel-dir /dist /src; \
    ls -l /dist

# ---------------------------------------------------------------------------------------------
# operator: ddpjob[operator] in /opt/venv, copied into a clean final stage (no wheelhouse, no
# pip, no setuptools). Runs as 65532 (the Helm chart's runAsUser) and writes nothing outside
# /tmp, so readOnlyRootFilesystem: true works: bytecode is compiled at install time.
FROM ${PYTHON_BASE} AS operator-venv
ARG OFFLINE=0
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
COPY --from=builder /wheels /wheels
COPY --from=builder /dist /dist
RUN set -eu; \
    if [ "$OFFLINE" = 1 ]; then set -- --no-index --find-links /wheels; else set --; fi; \
    python3 -m venv /opt/venv; \
    whl="$(ls /dist/ddpjob-*.whl)"; \
    /opt/venv/bin/pip install "$@" "${whl}[operator]"; \
    if /opt/venv/bin/python -c "import torch" 2>/dev/null; then echo "torch in the operator" >&2; exit 1; fi; \
    /opt/venv/bin/pip uninstall --yes pip setuptools

FROM ${PYTHON_BASE} AS operator
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
RUN groupadd --gid 65532 ddpjob \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp \
       --shell /usr/sbin/nologin ddpjob
COPY --from=operator-venv /opt/venv /opt/venv
USER 65532:65532
# Flags (--namespace/--all-namespaces, --security-profile, ...) come from the Deployment's args.
ENTRYPOINT ["ddpjob", "operator"]

# ---------------------------------------------------------------------------------------------
# worker-cpu: CPU torch + ddpjob[worker] (torch only) + examples/ at /opt/ddpjob/examples.
FROM ${PYTHON_BASE} AS worker-venv
ARG OFFLINE=0
ARG PIP_INDEX_URL=https://pypi.org/simple
# The CPU wheels (torch 2.13.0+cpu and its few dependencies): no CUDA libraries.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
COPY --from=builder /wheels /wheels
COPY --from=builder /dist /dist
RUN set -eu; \
    python3 -m venv /opt/venv; \
    if [ "$OFFLINE" = 1 ]; then \
      /opt/venv/bin/pip install --no-index --find-links /wheels "torch==${TORCH_VERSION}"; \
      set -- --no-index --find-links /wheels; \
    else \
      /opt/venv/bin/pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"; \
      set --; \
    fi; \
    whl="$(ls /dist/ddpjob-*.whl)"; \
    /opt/venv/bin/pip install "$@" "${whl}[worker]"; \
    /opt/venv/bin/python -c "import torch; print('torch', torch.__version__)"; \
    if /opt/venv/bin/python -c "import kopf" 2>/dev/null; then echo "kopf in a worker" >&2; exit 1; fi

FROM ${PYTHON_BASE} AS worker-cpu
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=worker-venv /opt/venv /opt/venv
COPY examples /opt/ddpjob/examples
# A non-root user with a home (torch caches there) who owns the examples directory (train.py
# checkpoints to ./ckpt unless DDPJOB_CKPT_DIR is set) and the agent's default state directory
# (the operator mounts a volume there; `docker run` has none). /app/examples is an alias for
# manifests written against the old single image (examples/quickstart.yaml's workingDir).
RUN groupadd --gid 65532 ddpjob \
    && useradd --uid 65532 --gid 65532 --create-home --home-dir /home/ddpjob \
       --shell /bin/sh ddpjob \
    && mkdir -p /var/run/ddpjob \
    && chown -R 65532:65532 /opt/ddpjob/examples /var/run/ddpjob \
    && ln -s /opt/ddpjob /app
WORKDIR /opt/ddpjob/examples
USER 65532:65532
# No ENTRYPOINT: pods set command: [ddpjob-agent] (or torchrun).
CMD ["ddpjob-agent", "--help"]

# ---------------------------------------------------------------------------------------------
# worker-cuda: the CUDA PyTorch base already has torch (and the worker extra is torch only), so
# ddpjob goes in with --no-deps and nothing else is installed. Runs as the base's user (root in
# pytorch/pytorch): fine under securityProfile Baseline; Restricted needs runAsUser in the template.
FROM ${CUDA_BASE} AS worker-cuda
COPY --from=builder /dist /tmp/ddpjob-dist
RUN set -eu; \
    pip install --no-cache-dir --no-deps /tmp/ddpjob-dist/ddpjob-*.whl; \
    rm -rf /tmp/ddpjob-dist; \
    python -c "import torch, ddpjob_worker; print('torch', torch.__version__)"
COPY examples /opt/ddpjob/examples
WORKDIR /opt/ddpjob/examples
CMD ["ddpjob-agent", "--help"]
