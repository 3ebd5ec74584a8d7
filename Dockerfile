# The pdserve image: the router, the workers, the controller and every Ray node of the Helm
# chart (helm/pdserve) run it. CPU by default; for CUDA pass the torch wheels for your CUDA
# (they bring the CUDA runtime; the node brings the driver):
#   docker build -t pdserve:0.1.0 .
#   docker build -t pdserve:0.1.0-cu128 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# or a CUDA base image that has Python 3.11+ as python3: --build-arg BASE_IMAGE=...
# Every other package is held to the version in requirements.lock (the versions the test suite
# passed with); the image installs no test tools.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# ray[default]: the dashboard agent, whose health endpoints the chart's probes ask
ARG RAY_SPEC=ray[default]==2.60.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0

# a C compiler: CPU workers build their decode attention kernel for the node's own CPU at
# start-up (-march=native; without one they log a warning and take the slower torch path)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"

# The repository root is the package (pyproject.toml maps it to `pdserve`).
COPY . /tmp/pdserve
RUN python3 -m pip install --constraint /tmp/pdserve/requirements.lock "/tmp/pdserve" "${RAY_SPEC}" \
    && rm -rf /tmp/pdserve

RUN useradd --uid 1000 --user-group --create-home --shell /bin/bash pdserve
USER 1000:1000
WORKDIR /home/pdserve
ENTRYPOINT ["pdserve"]
CMD ["serve", "--help"]
