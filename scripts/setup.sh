#!/usr/bin/env bash
# Creates .venv and installs synth-grpo into it. Torch is installed first and pinned so that a
# machine without a GPU gets the CPU build (a bare `torch` requirement pulls a multi-GB CUDA build).
# Set TORCH_INDEX_URL (for example https://download.pytorch.org/whl/cpu) where the CPU wheel is not
# already on the machine's package index.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip wheel setuptools
if python -c "import torch" 2>/dev/null; then
  :
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  pip install -q "torch==${TORCH_VERSION:-2.13.0}"
else
  pip install -q "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# DeepSpeed builds against the installed torch; build isolation would fetch another torch.
pip install -q --no-build-isolation "deepspeed>=0.16" || pip install -q "deepspeed>=0.16"
pip install -q -e ".${extras:+[$extras]}"
