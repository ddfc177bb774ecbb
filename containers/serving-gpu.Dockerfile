# Serving image for GPU hosts: the official vLLM OpenAI-server image plus draftline, so that
# under --software-deployment-method apptainer the rules that run vLLM (concurrency profile,
# generation, hidden states, benchmark) run in it, and `server.launcher: docker` can serve
# from it too. Build from the repository root:
#
#   docker build -f containers/serving-gpu.Dockerfile -t REGISTRY/draftline/serving-gpu:0.1.0 .
#
# BASE_IMAGE: vllm/vllm-openai:v0.32.0 (containers/images.lock: vllm-openai; its digest is
# unverified there - run `python -m draftline.serving.images resolve` first).
ARG BASE_IMAGE=docker.io/vllm/vllm-openai@sha256:0000000000000000000000000000000000000000000000000000000000000000
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# vLLM's own stack (torch, transformers, ...) stays exactly as the image has it; draftline
# adds only the packages the image lacks, at their locked versions. Snakemake runs rule
# scripts with `python`, which the image may only have as python3.
COPY containers/requirements/pipeline.txt containers/install_locked.py /tmp/lock/
RUN python3 /tmp/lock/install_locked.py /tmp/lock/pipeline.txt && rm -rf /tmp/lock
COPY pyproject.toml README.md /opt/draftline/
COPY src /opt/draftline/src
RUN python3 -m pip install --no-cache-dir --no-deps /opt/draftline \
 && python3 -c "import vllm, draftline.serving.server, datasets; print('vllm', vllm.__version__)" \
 && { command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python; }

COPY Snakefile /opt/draftline/
COPY rules /opt/draftline/rules
COPY scripts /opt/draftline/scripts
COPY report /opt/draftline/report
COPY config /opt/draftline/config
COPY envs /opt/draftline/envs
WORKDIR /opt/draftline
# The upstream entrypoint (`vllm serve`) is kept: `docker run IMAGE MODEL ...` still serves.
