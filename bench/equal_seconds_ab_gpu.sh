#!/usr/bin/env bash
# The A/B at equal GPU-seconds on ONE GPU (bench/RESULTS.md "Images at equal GPU-seconds"): every on-policy arm
# against plain SFT on the base's own order (sft-canonical) given that arm's GPU-seconds, over several seeds.
#
#   SEEDS=0,1,2,3,4,5,6,7 bash bench/equal_seconds_ab_gpu.sh
#
# Every on-policy arm gets a folder of its own, $OUT/<arm>, with the seed's sft run and a control sized to
# that arm's seconds: arms of different step prices never share a control (a control sized to a slower arm,
# read at a cheaper arm's seconds, would be read mid-way through a longer schedule).
# 1. The pricing seed (the first of SEEDS) runs sft, the arm and its control alone on the GPU, one arm's folder
#    after another: what each arm's training step costs (`--price-seed`, bench/_ab/step_prices.py).
# 2. The other seeds run side by side, one learner process per (arm's folder, seed, run): an on-policy
#    supervised arm at once (it trains the shared plain-GT base steps itself), and per seed the chain sft ->
#    (a GRPO arm or one that reuses rollouts | sft-canonical), which resume the sft run's checkpoint at the
#    base step. Their seconds are read at the pricing seed's prices (side by side they slow each other
#    unevenly); the control is sized from those prices, so it runs beside its arm.
# 3. Per arm, the summary over every seed: $OUT/<arm>/ab.jsonl, ab.png (F1 by step and by GPU-seconds) and,
#    for a GRPO arm, grpo.png; then every arm against its own control in one table and picture
#    (bench/ab_sweep.py: $OUT/sweep.png).
#
# Knobs (environment): TASK (image-random), SEEDS, ARMS (the on-policy arms: rm-reorder,rm-reorder-m2,
# grpo-detection-iou50; sft and sft-canonical are run in every arm's folder), BACKEND (the colocated engine of
# the supervised arms: vllm or hf), GRPO_BACKEND (the GRPO arms': hf, or vllm with the supervised arms' engine
# keys), BASE_STEPS (150: plain-GT steps every run of a seed shares), STEPS (50), EVAL_EVERY (50),
# EVAL_SAMPLES (128), VLLM_GPU_MEMORY (0.06: each colocated vLLM's share of the GPU, for runs side by side),
# OUT (runs/ab/<TASK>-gpu). Finished runs are reused: run it again after a cut-off to train only what is
# missing.
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${TASK:-image-random}
SEEDS=${SEEDS:-0,1,2,3,4,5,6,7}
ARMS=${ARMS:-rm-reorder,rm-reorder-m2,grpo-detection-iou50}
BACKEND=${BACKEND:-vllm}
OUT=${OUT:-runs/ab/$TASK-gpu}
PY=${PY:-python3}
price_seed=${SEEDS%%,*}
common=(--task "$TASK" --colocate --colocate-backend "$BACKEND" --base-steps "${BASE_STEPS:-150}"
        --steps "${STEPS:-50}" --eval-every "${EVAL_EVERY:-50}" --eval-samples "${EVAL_SAMPLES:-128}"
        --price-seed "$price_seed" --vllm-sleep-level 0 --grpo-colocate-backend "${GRPO_BACKEND:-hf}")
side_by_side=(--vllm-gpu-memory "${VLLM_GPU_MEMORY:-0.06}")
on_policy=$(echo "$ARMS" | tr , '\n' | grep -vx -e sft -e sft-canonical | awk 'NF && !seen[$0]++' || true)
[ -n "$on_policy" ] || { echo "ARMS=$ARMS names no on-policy arm to set against the controls" >&2; exit 2; }
# the arms that resume the seed's base checkpoint (GRPO, rollout reuse: bench/_ab/tables.py) wait for the
# seed's sft run, as every control does; the other on-policy arms train the shared base themselves
from_base=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from _ab.tables import resumes_base
print(' '.join(a for a in sys.argv[1].split() if resumes_base(a)))" "$on_policy")
t0=$(date +%s)
say() { echo "[equal_seconds_ab] $* ($(( $(date +%s) - t0 )) s)"; }

for arm in $on_policy; do
  mkdir -p "$OUT/$arm/logs"
  $PY bench/ab_learning.py "${common[@]}" --out "$OUT/$arm" --arms "sft,$arm,sft-canonical" \
    --seeds "$price_seed" > "$OUT/$arm/logs/price-seed.log" 2>&1 \
    || { say "the pricing seed $price_seed of $arm failed: $OUT/$arm/logs/price-seed.log"; exit 1; }
  say "seed $price_seed of $arm ran alone: $(cat "$OUT/$arm/step_prices.json")"
done

run() {  # folder run seed: one learner process, its log in $OUT/<folder>/logs
  $PY bench/ab_learning.py "${common[@]}" "${side_by_side[@]}" --out "$OUT/$1" --arms "$2" --seeds "$3" \
    > "$OUT/$1/logs/$2-s$3.log" 2>&1 || say "$2 seed $3 in $OUT/$1 failed: $OUT/$1/logs/$2-s$3.log"
}
for seed in $(echo "$SEEDS" | tr , ' ' | cut -d' ' -f2-); do
  [ "$seed" = "$price_seed" ] && continue
  for arm in $on_policy; do
    if echo " $from_base " | grep -q " $arm "; then
      ( run "$arm" sft "$seed"; run "$arm" "$arm" "$seed" & run "$arm" sft-canonical "$seed" & wait ) &
    else
      run "$arm" "$arm" "$seed" &
      ( run "$arm" sft "$seed"; run "$arm" sft-canonical "$seed" ) &
    fi
  done
done
wait
say "the side-by-side runs are done"
summaries=()
for arm in $on_policy; do
  $PY bench/ab_learning.py --task "$TASK" --steps "${STEPS:-50}" --from-runs --price-seed "$price_seed" \
    --out "$OUT/$arm" | grep '^\[ab\]' || say "no summary of $arm: $OUT/$arm"
  summaries+=(--summary "$arm=$OUT/$arm/ab.jsonl")
done
$PY bench/ab_sweep.py "${summaries[@]}" --out "$OUT/sweep.png" \
  --title "$TASK: each arm against plain SFT given its GPU-seconds" || say "no sweep picture: $OUT"
