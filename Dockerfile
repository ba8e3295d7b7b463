# syntax=docker/dockerfile:1
# The Outrider image: the `outrider` command, Ray (with the dashboard that KubeRay's
# RayJob and probes need) and the shipped demo models in /app/models.
#
#   docker build --build-arg VARIANT=cpu  -t ghcr.io/outrider-project/outrider:0.1.0-cpu .
#   docker build --build-arg VARIANT=cuda -t ghcr.io/outrider-project/outrider:0.1.0-cuda .
#
# VARIANT=cpu installs torch's CPU wheel (download.pytorch.org/whl/cpu, ~200 MB).
# VARIANT=cuda installs the default PyPI wheel, which brings the CUDA runtime, cuBLAS,
# cuDNN and NCCL as nvidia-* wheels: the node only needs the NVIDIA driver (the device
# plugin/container toolkit mounts it), so both variants share python:3.11-slim rather
# than an nvidia/cuda base that would ship a second copy of the CUDA libraries.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- the project as a wheel (no source tree in the final image: Ray puts the driver's
# working directory on its workers' sys.path, where a source checkout would shadow the
# installed package, whose outrider.router etc. live in other source folders) ---
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY outrider/ outrider/
COPY draft_worker/ draft_worker/
COPY target_worker/ target_worker/
COPY router/ router/
COPY cluster/ cluster/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- the image ---
FROM ${PYTHON_IMAGE}

ARG VARIANT=cpu
# Which role the image runs: all (every role; the Ray cluster image), router (torch-free,
# no Ray: the router Deployment), worker (target and draft replicas), client (the SDK and
# `outrider generate`). Each installs the wheel with that extra of pyproject.toml.
ARG ROLE=all
# Must equal pyproject.toml's torch pin (tests/deploy checks it).
ARG TORCH_VERSION=2.13.0
# Must equal pyproject.toml's ray pin; [default] adds the dashboard and job server that
# RayJob submission and KubeRay's health probes use.
ARG RAY_VERSION=2.60.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OUTRIDER_MODELS_DIR=/app/models

# wget: KubeRay's readiness/liveness probes of Ray pods call it. libjemalloc2: the router
# runs on it (outrider/allocator.py). cuda: a C compiler, with which Triton builds the
# launcher of the GPU's attention kernel on first use (engine/kernels/triton_paged.py).
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget libjemalloc2 \
 && if [ "${VARIANT}" = cuda ]; then apt-get install -y --no-install-recommends gcc libc6-dev; fi \
 && rm -rf /var/lib/apt/lists/*

# torch first, alone and pinned, so nothing later can pull another build (roles that
# need it only).
RUN case "$VARIANT" in \
      cpu)  index="--index-url https://download.pytorch.org/whl/cpu" ;; \
      cuda) index="" ;; \
      *)    echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac \
 && case "${ROLE:-all}" in router|client) echo "no torch in a ${ROLE} image" ;; \
      *) pip install $index "torch==${TORCH_VERSION}" ;; esac

# The project with its pinned dependencies (pyproject.toml), torch already satisfied.
COPY --from=wheel /wheels /tmp/wheels
RUN case "$ROLE" in all|cluster) ray="ray[default]==${RAY_VERSION}" ;; *) ray="" ;; esac \
 && pip install "$(ls /tmp/wheels/*.whl)[${ROLE}]" $ray \
 && rm -rf /tmp/wheels

# The demo pair: /app/models/demo-target and /app/models/demo-draft.
WORKDIR /app
COPY models/ /app/models/

RUN useradd --uid 10001 --user-group --create-home --shell /bin/bash outrider
USER 10001:10001

ENTRYPOINT ["outrider"]
CMD ["--help"]
