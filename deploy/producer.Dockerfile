# Producer image for data hosts: decoding and augmentation only, no TensorFlow.
# Build from the repository root:  docker build -f deploy/producer.Dockerfile -t stoker-producer .
# The build stage compiles the crop-window JPEG decoder (producer/images/_jpeg_crop.c) against
# libjpeg-turbo; the runtime stage keeps only the library.
FROM python:3.11-slim-bookworm AS build
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libjpeg62-turbo-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protocol/ protocol/
COPY producer/ producer/
COPY consumer/ consumer/
COPY cli/ cli/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libjpeg62-turbo \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
# /data is created owned by the runtime user so a fresh named volume mounted there is writable.
RUN pip install --no-cache-dir /wheels/*.whl "s3fs>=2023.6" \
    && python -c "import stoker.producer.images._jpeg_crop" \
    && useradd --system --uid 10001 --create-home stoker \
    && mkdir /data && chown stoker /data
USER 10001
EXPOSE 5555 9100
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9100/metrics', timeout=4)"]
ENTRYPOINT ["stoker"]
CMD ["produce", "--help"]
