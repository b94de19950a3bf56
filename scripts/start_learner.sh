#!/usr/bin/env bash
# Start the learner once every configured rollout server is healthy (docs/ARCHITECTURE.md#launchers,
# docs/ALGORITHM.md#grpo-launchers GRPO §6.2).
#
#   scripts/start_learner.sh --config <yaml> [--gpus 6,7] [--nproc N] [--wait-timeout 120] [--wait-interval 2]
#
# --gpus   learner GPUs (CUDA_VISIBLE_DEVICES; one process per GPU); default: the YAML's train_gpus (GRPO) or all
#          visible devices in one process (stage-2 configs).
# --nproc  process count where no GPU list applies (CPU runs; gloo). For a GRPO config it replaces train_gpus by N
#          placeholder indices disjoint from server.gpus, so the §2.3 batch rules are checked for N learners.
# Flags override the YAML. This script never starts, restarts or stops a rollout server: start those with
# scripts/start_rollout_server.sh. Exit codes: 2 invalid config, 101 a server not healthy in time, otherwise the
# learner's (python -m learner, or torchrun when N > 1).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"; else PY="python"; fi

CONFIG="" GPUS_FLAG="" NPROC_FLAG="" WAIT_TIMEOUT=120 WAIT_INTERVAL=2

usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) CONFIG="${2:?--config needs a value}"; shift 2 ;;
    --gpus) GPUS_FLAG="${2:?--gpus needs a value}"; shift 2 ;;
    --nproc) NPROC_FLAG="${2:?--nproc needs a value}"; shift 2 ;;
    --wait-timeout) WAIT_TIMEOUT="${2:?--wait-timeout needs a value}"; shift 2 ;;
    --wait-interval) WAIT_INTERVAL="${2:?--wait-interval needs a value}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage; exit 2 ;;
  esac
done
[[ -n "$CONFIG" ]] || { echo "--config is required" >&2; usage; exit 2; }
[[ -f "$CONFIG" ]] || { echo "config file $CONFIG does not exist; pass an existing --config" >&2; exit 2; }
CONFIG="$(cd "$(dirname "$CONFIG")" && pwd)/$(basename "$CONFIG")"
[[ -z "$NPROC_FLAG" || "$NPROC_FLAG" =~ ^[1-9][0-9]*$ ]] || { echo "--nproc must be a positive integer" >&2; exit 2; }
[[ "$WAIT_TIMEOUT" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "--wait-timeout must be a number of seconds" >&2; exit 2; }

# Loopback traffic must never go through a proxy.
unset http_proxy https_proxy all_proxy HTTP_PROXY HTTPS_PROXY ALL_PROXY
export NO_PROXY="127.0.0.1,localhost,::1${NO_PROXY:+,$NO_PROXY}"
export no_proxy="$NO_PROXY"

# The health deadline counts from here: config resolution (python start-ups) is part of the wait budget.
start_s="$(date +%s.%N)"
cd "$REPO"
# shellcheck source=../learner/grpo/read_resolved.sh
source "$REPO/learner/grpo/read_resolved.sh"
csv_count() { local IFS=,; local -a parts; read -ra parts <<<"$1"; echo "${#parts[@]}"; }

# 1. Resolve and validate. GRPO configs go through the §2.3 resolver; stage-2 configs through RunConfig.
# Only KEY=VALUE lines are read from the resolvers (libraries may print anything else).
IS_GRPO="$("$PY" -c 'import sys; from learner.yaml_loader import load_yaml_with_extends as load
try:
    print("IS_GRPO=" + ("1" if "grpo" in load(sys.argv[1]) else "0"))
except Exception as exc:
    sys.exit(f"config error: {exc}")' "$CONFIG" | sed -n 's/^IS_GRPO=\([01]\)$/\1/p')" || exit 2
[[ -n "$IS_GRPO" ]] || exit 2

declare -A CFG=()
SERVER_URLS=() TRAIN_GPUS="" NPROC=1 TRAIN_GPUS_OVERRIDE=""
if [[ "$IS_GRPO" == 1 ]]; then
  resolve() { "$PY" -m learner.grpo.resolve --config "$CONFIG" "$@"; }
  if [[ -n "$GPUS_FLAG" ]]; then
    TRAIN_GPUS_OVERRIDE="$GPUS_FLAG"
  elif [[ -n "$NPROC_FLAG" ]]; then
    out="$(resolve)" || exit 2
    read_resolved CFG <<<"$out"
    TRAIN_GPUS_OVERRIDE="$("$PY" -c 'import sys
server = {int(g) for g in sys.argv[1].split(",") if g}
labels, g = [], 0
while len(labels) < int(sys.argv[2]):
    if g not in server:
        labels.append(str(g))
    g += 1
print(",".join(labels))' "${CFG[SERVER_GPUS]:-}" "$NPROC_FLAG")"
  fi
  ARGS=()
  [[ -n "$TRAIN_GPUS_OVERRIDE" ]] && ARGS=(--train-gpus "$TRAIN_GPUS_OVERRIDE")
  out="$(resolve "${ARGS[@]}")" || exit 2
  CFG=()
  read_resolved CFG <<<"$out"
  [[ -n "${CFG[SERVER_BASE_URL]:-}" && -n "${CFG[NPROC]:-}" ]] || { echo "config resolver gave no server/world size" >&2; exit 2; }
  SERVER_URLS=("${CFG[SERVER_BASE_URL]}")
  TRAIN_GPUS="${CFG[TRAIN_GPUS]}"
  NPROC="${CFG[NPROC]}"
  if [[ -n "$NPROC_FLAG" && "$NPROC_FLAG" != "$NPROC" ]]; then
    echo "--nproc $NPROC_FLAG disagrees with $NPROC learner GPUs ($TRAIN_GPUS); pass one of --gpus / --nproc" >&2
    exit 2
  fi
else
  out="$("$PY" -c 'import sys
from learner.config import ConfigError, load_run_config
try:
    cfg = load_run_config(sys.argv[1])
except ConfigError as exc:
    sys.exit(f"config error: {exc}")
if cfg.rollout.mode != "server":
    sys.exit(f"config error: {sys.argv[1]}: rollout.mode is {cfg.rollout.mode!r}; this launcher waits for rollout servers (mode: server); run python -m learner --config directly for colocate runs")
for entry in cfg.rollout.servers:
    print("SERVER_URL=" + entry.base_url)' "$CONFIG")" || exit 2
  while IFS= read -r line; do
    [[ "$line" =~ ^SERVER_URL=(https?://[^[:space:]]+)$ ]] && SERVER_URLS+=("${BASH_REMATCH[1]}")
  done <<<"$out"
  ((${#SERVER_URLS[@]})) || { echo "config error: $CONFIG lists no rollout.servers" >&2; exit 2; }
  if [[ -n "$GPUS_FLAG" ]]; then
    TRAIN_GPUS="$GPUS_FLAG"
    NPROC="$(csv_count "$GPUS_FLAG")"
    if [[ -n "$NPROC_FLAG" && "$NPROC_FLAG" != "$NPROC" ]]; then
      echo "--nproc $NPROC_FLAG disagrees with --gpus $GPUS_FLAG" >&2
      exit 2
    fi
  elif [[ -n "$NPROC_FLAG" ]]; then
    NPROC="$NPROC_FLAG"
  fi
fi

# 2. Health: every server must answer GET /health with 200 before the deadline (one deadline for all, counted
# from the launcher's start; every server is polled at least once).
elapsed() { awk -v s="$start_s" -v n="$(date +%s.%N)" 'BEGIN { printf "%.3f", n - s }'; }
remaining() { awk -v t="$WAIT_TIMEOUT" -v e="$(elapsed)" 'BEGIN { r = t - e; printf "%.3f", (r > 0 ? r : 0) }'; }
for url in "${SERVER_URLS[@]}"; do
  hostport="${url#*://}"; hostport="${hostport%%/*}"
  while true; do
    code="$(curl --noproxy '*' -s -o /dev/null -w '%{http_code}' --connect-timeout 2 --max-time 2 "$url/health" || true)"
    [[ "$code" == "200" ]] && break
    left="$(remaining)"
    if awk -v r="$left" 'BEGIN { exit !(r <= 0) }'; then
      echo "rollout server at $hostport ($url/health) not healthy after $WAIT_TIMEOUT s; start it with the" \
        "server-only launcher: scripts/start_rollout_server.sh --config $CONFIG" >&2
      exit 101
    fi
    sleep "$(awk -v r="$left" -v i="$WAIT_INTERVAL" 'BEGIN { print (r < i ? r : i) }')"
  done
done

# 3. Informational: each server's /health.
for url in "${SERVER_URLS[@]}"; do
  echo "rollout server $url: $(curl --noproxy '*' -s --max-time 2 "$url/health" || true)"
done

# 4. The learner, in the foreground: one process, or torchrun with one rank per GPU (or per --nproc on CPU).
# --nproc labels are placeholders, not devices: CUDA_VISIBLE_DEVICES is left alone then (it is harmless on CPU).
if [[ -n "$TRAIN_GPUS" && ( -n "$GPUS_FLAG" || -z "$NPROC_FLAG" ) ]]; then
  export CUDA_VISIBLE_DEVICES="$TRAIN_GPUS"
fi
[[ -n "$TRAIN_GPUS_OVERRIDE" ]] && export ROLLMATCH_TRAIN_GPUS="$TRAIN_GPUS_OVERRIDE"
if [[ "$NPROC" == 1 ]]; then
  CMD=("$PY" -m learner --config "$CONFIG")
else
  MASTER_PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  CMD=("$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_addr 127.0.0.1 --master_port "$MASTER_PORT"
       -m learner --config "$CONFIG")
fi
echo "starting learner (${NPROC} process(es)${CUDA_VISIBLE_DEVICES:+, CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES}): ${CMD[*]}"
exec "${CMD[@]}"
