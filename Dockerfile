# tuner: the fleet service by default (`tuner serve`), or a tune-all worker (see README.md, Docker).
#
#   docker build -t tuner .                                     # CUDA 13 runtime: service, tune-all
#   docker build -t tuner:devel --build-arg BASE=nvidia/cuda:13.0.1-devel-ubuntu24.04 .
#                                                               # + nvcc, for the CUTLASS candidates
#
# torch comes from PyTorch's CUDA 13.0 wheel index; the package's `cu13` extra adds cupy-cuda13x,
# nvmath-python (cuBLASLt), nvidia-cutlass and cuda-bindings. CUTLASS compiles kernels with nvcc,
# which only the devel base has: on the runtime base `tuner info` lists cutlass as
# unavailable ("nvcc not found") and every other source works.
ARG BASE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python 3.12 (Ubuntu 24.04's) in a virtual environment: the system one is externally managed
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && pip install --upgrade pip

# torch first, from the CUDA 13.0 index, so that the package's "torch" requirement is already met
RUN pip install --index-url ${TORCH_INDEX} torch

WORKDIR /opt/tuner
COPY pyproject.toml README.md ./
COPY tuner ./tuner
COPY server ./server
COPY configs ./configs
RUN pip install ".[cu13]" \
 && tuner --help > /dev/null

# Unprivileged user; caches and the service's database live under /data (mount a volume there)
RUN useradd --create-home --uid 1000 tuner \
 && mkdir -p /data \
 && chown tuner:tuner /data
USER tuner
ENV TUNER_CACHE=/data/tuner.db \
    TUNER_SERVER_DB=/data/fleet.db \
    CUTLASS_CACHE_DIR=/data/cutlass \
    TRITON_CACHE_DIR=/data/triton
VOLUME ["/data"]
EXPOSE 8000

CMD ["tuner", "serve", "--host", "0.0.0.0", "--port", "8000"]
