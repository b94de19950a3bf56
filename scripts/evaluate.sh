#!/usr/bin/env bash
# Evaluate a detector: `python -m learner.evaluate` in the project's environment, flags passed through.
#   scripts/evaluate.sh --config configs/demo_vlm_cpu.yaml --model runs/demo_vlm/model --out runs/demo_vlm/eval
#   scripts/evaluate.sh --config configs/demo_vlm_cpu.yaml --server http://127.0.0.1:8000 --out runs/eval_server
# Exit codes: 0 done, 2 bad input (nothing written), 1 anything else (docs/RUNBOOK.md "Evaluating a detector").
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$REPO/.venv/bin/python}"
cd "$REPO"
# Loopback servers must not go through a proxy.
exec env -u http_proxy -u https_proxy -u HTTP_PROXY -u HTTPS_PROXY -u ALL_PROXY -u all_proxy \
  PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m learner.evaluate "$@"
