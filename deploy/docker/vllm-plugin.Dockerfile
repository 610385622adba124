# vLLM with omni-proxy's engine plugin: the engine registers itself with the control plane
# (VLLM_PLUGINS=omni_proxy; the OMNI_* variables of deploy/kubernetes/overlays/example say where).
# Built from the repository root, which is the context (.dockerignore lets in what the wheel needs):
#   docker build -f deploy/docker/vllm-plugin.Dockerfile -t omni-proxy-vllm:0.1.0 .
# The plugin is the small wheel of packaging/vllm-plugin (the plugin, the gRPC stubs and omni_runtime; it
# depends only on grpcio and protobuf), so none of the router's dependencies enter the engine.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# --- build: the plugin's wheel ------------------------------------------------------------------
FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . /src
RUN pip wheel --no-deps --wheel-dir /wheels /src/packaging/vllm-plugin

# --- run: vLLM's own image, its entry point unchanged ---------------------------------------------
FROM ${VLLM_IMAGE}
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python3 -m pip install --no-cache-dir /wheels/omni_proxy_vllm_plugin-*.whl
# vLLM loads every installed general plugin unless VLLM_PLUGINS lists the ones to load.
ENV VLLM_PLUGINS=omni_proxy
