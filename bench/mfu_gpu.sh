#!/usr/bin/env bash
# The learner-throughput runs of bench/RESULTS.md "Learner MFU" in one device call: wheels installed, then
#   1. bench_packing --gpu --vlm: padded, packed (varlen kernel) and the same packed rows through the
#      per-segment loop (the "before"), varlen-vs-loop check, profiles of one packed step each way, peak memory
#      of 8k / 16k rows with and without gradient checkpointing, then the same rows with Liger-Kernel (--liger)
#      and its profile;
#   2. the same rows with Liger and then regional torch.compile of the ViT blocks (COMPILE=vision) or of them and
#      the decoder layers (COMPILE=all), and its profile (PHASES=1 skips it).
# Output: one JSON line per record on stdout and in $OUT (or runs/mfu) as packing*.jsonl, profiler tables.
#   SMOKE=1 bash bench/mfu_gpu.sh     # the tiny model on CPU, a dry run of this script
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT:-runs/mfu}; mkdir -p "$out"
PY=${PY:-python3}
if [ -d .whl ] && [ -z "${SMOKE:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:$PWD
fi
smoke=(); [ -n "${SMOKE:-}" ] && smoke=(--smoke)
mem=(--memory-sweep 8192 16384); [ -n "${SMOKE:-}" ] && mem=(--memory-sweep 512)
date -u; nvidia-smi -L 2>/dev/null
$PY -c 'import inspect, torch, transformers; print(torch.__version__, transformers.__version__)
from torch.nn.attention.varlen import varlen_attn; print("varlen_attn", inspect.signature(varlen_attn))'
liger=(--liger); [ -n "${SMOKE:-}" ] && liger=()  # Triton kernels: CUDA only
timeout "${T1:-300}" $PY bench/bench_packing.py --gpu --vlm "${smoke[@]}" --profile --profile-table "$out/profile" "${liger[@]}" \
  "${mem[@]}" 2>"$out/packing.err" | tee "$out/packing.jsonl"
tail -3 "$out/packing.err"
if [ "${PHASES:-2}" -ge 2 ]; then
  timeout "${T2:-400}" $PY bench/bench_packing.py --gpu --vlm "${smoke[@]}" "${liger[@]}" --compile "${COMPILE:-vision}" \
    --no-compare-loop --profile --profile-table "$out/profile2" --steps "${STEPS2:-10}" 2>"$out/compile.err" \
    | tee "$out/packing_compile.jsonl"
  tail -3 "$out/compile.err"
fi
date -u
