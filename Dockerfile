# omni-proxy: one image for every process kind (controlplane, dataplane, sim, ctl, demo), with the
# `otel` extra (the data plane's --otel-endpoint spans).
#   docker build -t omni-proxy:0.1.0 .
#   docker run --rm -p 127.0.0.1:8000:8000 omni-proxy:0.1.0 dataplane --host 0.0.0.0 --controlplane cp:50051
# Only PyPI is reached at build time (the dependencies' wheels); nothing is downloaded at run time.

# --- build: wheels of omni-proxy and of every dependency --------------------------------------
FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . /src
RUN pip wheel --wheel-dir /wheels '/src[otel]'

# --- run -----------------------------------------------------------------------------------------
FROM python:3.11-slim-bookworm
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels 'omni-proxy[otel]' \
 && groupadd --system --gid 10001 omni \
 && useradd --system --uid 10001 --gid omni --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin omni
USER 10001:10001
WORKDIR /tmp
# data plane 8000; control plane gRPC 50051, session socket 50052 and HTTP (/health, /metrics) 9090
EXPOSE 8000 9090 50051 50052
ENTRYPOINT ["omni-proxy"]
CMD ["--help"]
