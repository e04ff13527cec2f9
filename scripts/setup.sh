#!/usr/bin/env bash
# Creates .venv and installs synth-grpo into it. Torch is installed first and pinned so that a
# machine without a GPU gets the CPU build (a bare `torch` requirement pulls a multi-GB CUDA build).
# Set TORCH_INDEX_URL (for example https://download.pytorch.org/whl/cpu) where the CPU wheel is not
# already on the machine's package index.
#
# Idempotent: a .venv installed by this script with the same pyproject.toml, setup.sh, torch version
# and extras (or a superset of the extras asked for) is left alone in about a second, so `ray up`,
# which runs this on every node each time, reinstalls nothing when nothing changed. FORCE=1 reinstalls;
# CHECK=1 only tells (exit 0: up to date, 1: an install is due).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
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
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  pip install -q "torch==${TORCH_VERSION:-2.13.0}"
else
  pip install -q "torch==${TORCH_VERSION:-2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
# DeepSpeed builds against the installed torch; build isolation would fetch another torch.
pip install -q --no-build-isolation "deepspeed>=0.16" || pip install -q "deepspeed>=0.16"
pip install -q -e ".${extras:+[$extras]}"
echo "$want $extras" > "$stamp"
