#!/usr/bin/env bash
# The A/B at equal GPU-seconds on ONE GPU (bench/RESULTS.md "Images at equal GPU-seconds"): every on-policy arm
# against plain SFT on the base's own order (sft-canonical) given the same GPU-seconds, over several seeds.
#
#   SEEDS=0,1,2,3,4,5,6,7 bash bench/equal_seconds_ab_gpu.sh
#
# 1. The pricing seed (the first of SEEDS) runs every arm alone on the GPU, one after another: what each arm's
#    training step costs (`--price-seed`, bench/_ab/step_prices.py).
# 2. The other seeds run side by side, one learner process per (seed, arm): the on-policy supervised arms at
#    once (they train the shared plain-GT base steps themselves), and per seed the chain sft -> (the GRPO
#    arms | the arms that reuse rollouts | sft-canonical), which resume the sft run's checkpoint at the base
#    step. Their seconds are
#    read at the pricing seed's prices (side by side they slow each other unevenly); the control is sized
#    from those prices, so it runs beside its arms.
# 3. The summary over every seed: runs/ab/<TASK>-gpu/ab.jsonl, ab.png (F1 by step and by GPU-seconds) and,
#    with a GRPO arm, grpo.png.
#
# Knobs (environment): TASK (image-random), SEEDS, ARMS (sft,rm-reorder,rm-reorder-m4,grpo-detection-iou50,
# sft-canonical: sft and sft-canonical are always run), BACKEND (the colocated engine of the supervised arms:
# vllm or hf), GRPO_BACKEND (the GRPO arms': hf, or vllm with the supervised arms' engine keys), BASE_STEPS
# (150: plain-GT steps every arm of a seed shares), STEPS (50), EVAL_EVERY (50), EVAL_SAMPLES (128),
# VLLM_GPU_MEMORY (0.06: each colocated vLLM's share of the GPU, for runs side by side), OUT
# (runs/ab/<TASK>-gpu). Finished runs are reused: run it again after a cut-off to train only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${TASK:-image-random}
SEEDS=${SEEDS:-0,1,2,3,4,5,6,7}
ARMS=${ARMS:-sft,rm-reorder,rm-reorder-m4,grpo-detection-iou50,sft-canonical}
BACKEND=${BACKEND:-vllm}
OUT=${OUT:-runs/ab/$TASK-gpu}
PY=${PY:-python3}
price_seed=${SEEDS%%,*}
common=(--task "$TASK" --colocate --colocate-backend "$BACKEND" --base-steps "${BASE_STEPS:-150}"
        --steps "${STEPS:-50}" --eval-every "${EVAL_EVERY:-50}" --eval-samples "${EVAL_SAMPLES:-128}"
        --out "$OUT" --price-seed "$price_seed" --vllm-sleep-level 0
        --grpo-colocate-backend "${GRPO_BACKEND:-hf}")
side_by_side=(--vllm-gpu-memory "${VLLM_GPU_MEMORY:-0.06}")
arms=$(echo "sft,${ARMS},sft-canonical" | tr , '\n' | awk '!seen[$0]++' | paste -sd,)
# the arms that resume the seed's base checkpoint (GRPO, the control, rollout reuse: bench/_ab/tables.py) wait
# for the seed's sft run; the other on-policy arms train the shared base themselves, from the start
from_base=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from _ab.tables import resumes_base
print(' '.join(a for a in sys.argv[1].split(',') if resumes_base(a)))" "$arms")
supervised=$(echo "$arms" | tr , '\n' | grep -vx 'sft' | grep -vxF "$(echo "$from_base" | tr ' ' '\n')" || true)
mkdir -p "$OUT/logs"
t0=$(date +%s)
say() { echo "[equal_seconds_ab] $* ($(( $(date +%s) - t0 )) s)"; }

$PY bench/ab_learning.py "${common[@]}" --arms "$arms" --seeds "$price_seed" > "$OUT/logs/price-seed.log" 2>&1 \
  || { say "the pricing seed $price_seed failed: $OUT/logs/price-seed.log"; exit 1; }
say "seed $price_seed ran alone: $(cat "$OUT/step_prices.json")"

run() {  # arm seed: one learner process, its log in $OUT/logs
  $PY bench/ab_learning.py "${common[@]}" "${side_by_side[@]}" --arms "$1" --seeds "$2" \
    > "$OUT/logs/$1-s$2.log" 2>&1 || say "$1 seed $2 failed: $OUT/logs/$1-s$2.log"
}
for seed in $(echo "$SEEDS" | tr , ' ' | cut -d' ' -f2-); do
  [ "$seed" = "$price_seed" ] && continue
  for arm in $supervised; do run "$arm" "$seed" & done
  ( run sft "$seed"; for arm in $from_base; do run "$arm" "$seed" & done; wait ) &
done
wait
say "the side-by-side runs are done"
$PY bench/ab_learning.py --task "$TASK" --steps "${STEPS:-50}" --from-runs --price-seed "$price_seed" --out "$OUT" \
  | grep '^\[ab\]'
