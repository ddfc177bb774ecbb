# Pipeline image: draftline and its locked requirements on the official CUDA PyTorch image.
# Every rule runs in it under --software-deployment-method apptainer (config containers.pipeline;
# the rules that run vLLM use the serving image). Build from the repository root:
#
#   docker build -f containers/pipeline.Dockerfile -t REGISTRY/draftline/pipeline:0.1.0 .
#
# BASE_IMAGE: pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime (containers/images.lock:
# pytorch-cuda). The tests build this file on a locally imported Debian base instead (no
# registry there; the orchestrator side - Snakemake, the schema, draftline - needs no torch).
ARG BASE_IMAGE=docker.io/pytorch/pytorch@sha256:db80a41f8428644cebcb3d75b0b62df334ab6c0e75785951eb25f48bfbd42407
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A venv that sees the base's packages (torch): pip never touches the base's Python, and the
# same steps work on bases whose Python is externally managed (Debian).
RUN python3 -m venv --system-site-packages /opt/draftline-venv
ENV PATH=/opt/draftline-venv/bin:$PATH

# The locked requirements first: their layer stays cached while draftline's code changes.
COPY containers/requirements/pipeline.txt containers/install_locked.py /tmp/lock/
RUN python /tmp/lock/install_locked.py /tmp/lock/pipeline.txt && rm -rf /tmp/lock
COPY pyproject.toml README.md /opt/draftline/
COPY src /opt/draftline/src
RUN pip install --no-cache-dir --no-deps /opt/draftline \
 && python -c "import draftline.core.config, draftline.serving.server, datasets, transformers" \
 && snakemake --version

# The workflow itself, so `snakemake` also runs from the image (remote nodes, CI).
COPY Snakefile /opt/draftline/
COPY rules /opt/draftline/rules
COPY scripts /opt/draftline/scripts
COPY report /opt/draftline/report
COPY config /opt/draftline/config
COPY envs /opt/draftline/envs
WORKDIR /opt/draftline
