# The image every DDPJob pod (and, later, the operator) runs. CPU torch by default; for GPUs,
# build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 or base on a CUDA image.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin ddpjob
WORKDIR /app

RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"
COPY pyproject.toml README.md constraints.txt ./
COPY operator ./operator
COPY worker ./worker
RUN pip install '.[operator,worker]' && rm -rf /root/.cache
COPY examples ./examples

# Non-root by default: DDPJob pods run with runAsNonRoot: true.
USER 1000:1000
ENTRYPOINT ["ddpjob-agent"]
