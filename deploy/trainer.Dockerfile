# Trainer image. CPU by default. On GPU hosts build on TensorFlow's CUDA image, which
# already holds TensorFlow, CUDA and cuDNN (pick the tag matching your driver):
#   docker build -f deploy/trainer.Dockerfile \
#     --build-arg BASE_IMAGE=tensorflow/tensorflow:2.21.0-gpu --build-arg EXTRA=train -t stoker-trainer .
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG EXTRA=train-cpu

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 TF_CPP_MIN_LOG_LEVEL=2
WORKDIR /opt/stoker
COPY pyproject.toml setup.py README.md ./
COPY protocol/ protocol/
COPY producer/ producer/
COPY consumer/ consumer/
COPY cli/ cli/
# Installs this source tree; dependency versions are bounded in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[${EXTRA}]" \
    && useradd --system --uid 10001 --create-home stoker \
    && mkdir /logs && chown stoker /logs
USER 10001
EXPOSE 9200
ENTRYPOINT ["stoker"]
CMD ["train", "--help"]
