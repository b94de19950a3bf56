#!/usr/bin/env bash
# Start the rollout server and wait until it is healthy (docs/ARCHITECTURE.md#launchers,
# docs/ALGORITHM.md#grpo-launchers GRPO §6.1).
#
#   scripts/start_rollout_server.sh --config <yaml> [--gpus 0,1,2] [--port N] [--host H]
#                                   [--wait-timeout 300] [--wait-interval 2] [--stop-grace 10] [--log-dir DIR]
#
# Flags override the YAML's server: section. Exit codes: 0 success (the server's own code otherwise),
# 2 invalid config, 100 port already in use, 101 not healthy in time, 102 server died before healthy.
# This script only ever signals the process group of the server it started itself.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"; else PY="python"; fi

CONFIG="" GPUS_FLAG="" PORT_FLAG="" HOST_FLAG=""
WAIT_TIMEOUT=300 WAIT_INTERVAL=2 STOP_GRACE=10 LOG_DIR="$REPO/runs/rollout_server"

usage() { sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) CONFIG="${2:?--config needs a value}"; shift 2 ;;
    --gpus) GPUS_FLAG="${2:?--gpus needs a value}"; shift 2 ;;
    --port) PORT_FLAG="${2:?--port needs a value}"; shift 2 ;;
    --host) HOST_FLAG="${2:?--host needs a value}"; shift 2 ;;
    --wait-timeout) WAIT_TIMEOUT="${2:?}"; shift 2 ;;
    --wait-interval) WAIT_INTERVAL="${2:?}"; shift 2 ;;
    --stop-grace) STOP_GRACE="${2:?}"; shift 2 ;;
    --log-dir) LOG_DIR="${2:?}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage; exit 2 ;;
  esac
done
[[ -n "$CONFIG" ]] || { echo "--config is required" >&2; usage; exit 2; }

# Loopback traffic must never go through a proxy.
unset http_proxy https_proxy all_proxy HTTP_PROXY HTTPS_PROXY ALL_PROXY
export NO_PROXY="127.0.0.1,localhost,::1${NO_PROXY:+,$NO_PROXY}"
export no_proxy="$NO_PROXY"

# 1. Resolve and validate the config; only KEY=VALUE lines of known keys are read (libraries may print).
RESOLVE_ARGS=(-m rollout_server --config "$CONFIG" --print-launch-env)
[[ -n "$PORT_FLAG" ]] && RESOLVE_ARGS+=(--port "$PORT_FLAG")
[[ -n "$HOST_FLAG" ]] && RESOLVE_ARGS+=(--host "$HOST_FLAG")
[[ -n "$GPUS_FLAG" ]] && RESOLVE_ARGS+=(--gpus "$GPUS_FLAG")
if ! RESOLVED="$(cd "$REPO" && "$PY" "${RESOLVE_ARGS[@]}")"; then
  exit 2
fi

unquote() {  # undo Python's shlex.quote: 'a'"'"'b' -> a'b
  local v="$1"
  if [[ "$v" == \'*\' ]]; then v="${v:1:${#v}-2}"; v="${v//\'\"\'\"\'/\'}"; fi
  printf '%s' "$v"
}
HOST="" PORT="" GPUS="" MODEL="" BACKEND="" DP="" TP=""
while IFS= read -r line; do
  [[ "$line" =~ ^([A-Z][A-Z0-9_]*)=(.*)$ ]] || continue
  key="${BASH_REMATCH[1]}" value="$(unquote "${BASH_REMATCH[2]}")"
  case "$key" in
    HOST) HOST="$value" ;; PORT) PORT="$value" ;; GPUS) GPUS="$value" ;; MODEL) MODEL="$value" ;;
    BACKEND) BACKEND="$value" ;; DP) DP="$value" ;; TP) TP="$value" ;;
  esac
done <<< "$RESOLVED"
[[ -n "$HOST" && "$PORT" =~ ^[0-9]+$ ]] || { echo "config resolver gave no host/port" >&2; exit 2; }

# 2. Port preflight: bind every address of host:port once; never touch whoever holds it.
preflight_rc=0
"$PY" - "$HOST" "$PORT" <<'EOF' || preflight_rc=$?
import errno, socket, sys
host, port = sys.argv[1], int(sys.argv[2])
for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                sys.exit(100)
            raise
EOF
if [[ $preflight_rc -eq 100 ]]; then
  echo "port $PORT on $HOST is already in use; choose another port or stop the job that holds it" >&2
  exit 100
elif [[ $preflight_rc -ne 0 ]]; then
  echo "port preflight for $HOST:$PORT failed (exit $preflight_rc)" >&2
  exit 2
fi

# 3. Start the server in its own process group, logging to a file.
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/$(date +%Y%m%d-%H%M%S)-port$PORT.log"
if [[ -n "$GPUS" ]]; then export CUDA_VISIBLE_DEVICES="$GPUS"; fi
SERVER_ARGS=(-m rollout_server --config "$CONFIG" --port "$PORT" --host "$HOST")
[[ -n "$GPUS" ]] && SERVER_ARGS+=(--gpus "$GPUS")
cd "$REPO"
setsid "$PY" "${SERVER_ARGS[@]}" >"$LOG" 2>&1 < /dev/null &
SERVER_PID=$!
SERVER_PGID="$(ps -o pgid= -p "$SERVER_PID" | tr -d ' ' || true)"
printf 'pid=%s\npgid=%s\n' "$SERVER_PID" "$SERVER_PGID" > "${LOG%.log}.pid"
echo "rollout server starting (pid $SERVER_PID, log $LOG)"

alive() {  # our server is running (a zombie counts as dead)
  local stat
  stat="$(ps -o stat= -p "$SERVER_PID" 2>/dev/null | tr -d ' ')" || return 1
  [[ -n "$stat" && "$stat" != Z* ]]
}

stop_server() {  # only the process group we started, and only while our pid still leads it
  local pgid
  pgid="$(ps -o pgid= -p "$SERVER_PID" 2>/dev/null | tr -d ' ')" || return 0
  [[ -n "$pgid" && "$pgid" == "$SERVER_PID" && "$pgid" == "$SERVER_PGID" ]] || return 0
  kill -TERM -- "-$pgid" 2>/dev/null || return 0
  local deadline=$((SECONDS + STOP_GRACE))
  while ((SECONDS < deadline)) && kill -0 -- "-$pgid" 2>/dev/null; do
    alive || break
    sleep 0.2
  done
  kill -0 -- "-$pgid" 2>/dev/null && kill -KILL -- "-$pgid" 2>/dev/null
  return 0
}
trap 'stop_server' EXIT
trap 'stop_server; exit 130' INT
trap 'stop_server; exit 143' TERM

# 4. Wait for /health == 200.
if [[ "$HOST" == *:* ]]; then URL_HOST="[$HOST]"; else URL_HOST="$HOST"; fi
URL="http://$URL_HOST:$PORT"
deadline=$((SECONDS + WAIT_TIMEOUT))
while true; do
  if ! alive; then
    echo "rollout server exited before becoming healthy; last log lines ($LOG):" >&2
    tail -n 40 "$LOG" >&2 || true
    wait "$SERVER_PID" 2>/dev/null || true
    exit 102
  fi
  code="$(curl --noproxy '*' -s -o /dev/null -w '%{http_code}' --connect-timeout 2 --max-time 2 "$URL/health" || true)"
  [[ "$code" == "200" ]] && break
  if ((SECONDS >= deadline)); then
    echo "rollout server at $HOST:$PORT not healthy after $WAIT_TIMEOUT s; stopping it (log: $LOG)" >&2
    stop_server
    exit 101
  fi
  sleep "$WAIT_INTERVAL"
done

# 5. Ready: report, then stay in the foreground with the server's exit code.
echo "rollout server ready at $URL"
curl --noproxy '*' -s --max-time 2 "$URL/health" && echo || true
set +e
wait "$SERVER_PID"
rc=$?
exit "$rc"
