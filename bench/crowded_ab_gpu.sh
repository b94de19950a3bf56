#!/usr/bin/env bash
# The crowded-task A/B on one multi-GPU host (bench/RESULTS.md "Crowded scenes"): data and the stage-1 base once
# (bench/ab_learning.py --prepare-only: scripts/vlm_pretrain.py on GPU 0, cached in .cache/models), then one
# learner process per (seed, arm), all side by side, spread round-robin over the GPUs, then the summary over all
# runs (every run is reused) into runs/ab/<task>/ab.jsonl and ab.png.
#
#   SEEDS=0,1,2,3,4,5,6,7 ARMS=sft,rm-reorder bash bench/crowded_ab_gpu.sh
#
# Knobs (environment): TASK (crowded-random), SEEDS, ARMS, GRPO_SEEDS (the grpo-* arms' seeds; default SEEDS),
# LR (the supervised arms' learning rate), GRPO_LR (the grpo-* arms' constant rate; default 1e-4), CANONICAL_STEPS
# (sft-canonical's steps: give it the on-policy arms' GPU-seconds, e.g. 2.35 x STEPS rounded to EVAL_EVERY),
# STEPS (30), EVAL_EVERY (15), EVAL_SAMPLES (128), STAGE1_STEPS (1400), STAGE1_EVERY (200), STAGE1_EVAL_FROM (0: from
# STAGE1_EVERY on; 800 skips the snapshots that never reach the target), PREPARE_ONLY (1: stop
# after the base), RUN_TIMEOUT (seconds the side-by-side runs get; the summary then covers those that finished:
# a cut-off run is left out, and the next invocation trains it again; a `reorder` run beside 21 others
# needs ~440 s, and `ab_learning.py --from-runs --at-step N` compares cut runs at a step they all reached),
# EXPORT_BASE (a folder: the base also as crowded-base.tar.part00, 01, ... of <= 15 MiB).
# One base for many A/Bs (the stage-1 takes ~7 min and a rebuild is another model, as its kernels are not
# bitwise reproducible): `PREPARE_ONLY=1 EXPORT_BASE=$OUT bash bench/crowded_ab_gpu.sh` once, then
# `cat crowded-base.tar.part* | tar -x -C .cache/models` where the A/Bs start; a folder holding the base's
# stage1_choice.json is reused, not rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
TASK=${TASK:-crowded-random}
SEEDS=${SEEDS:-0,1,2,3,4,5,6,7}
ARMS=${ARMS:-sft,rm-reorder}
STEPS=${STEPS:-30}
EVAL_EVERY=${EVAL_EVERY:-15}
EVAL_SAMPLES=${EVAL_SAMPLES:-128}
PY=${PY:-python3}
NGPU=$(nvidia-smi -L | wc -l)
common=(--task "$TASK" --colocate --base-steps 0 --steps "$STEPS" --eval-every "$EVAL_EVERY"
        --eval-samples "$EVAL_SAMPLES" --stage1-steps "${STAGE1_STEPS:-1400}" --stage1-every "${STAGE1_EVERY:-200}"
        --stage1-eval-from "${STAGE1_EVAL_FROM:-0}"
        ${LR:+--learning-rate "$LR"} ${GRPO_LR:+--grpo-learning-rate "$GRPO_LR"}
        ${CANONICAL_STEPS:+--canonical-steps "$CANONICAL_STEPS"})
out=runs/ab/$TASK
mkdir -p "$out/logs"
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-16} $PY bench/ab_learning.py "${common[@]}" --prepare-only
echo "[crowded_ab] base ready after $(( $(date +%s) - t0 )) s: $(cat .cache/models/tiny-qwen3-vl-crowded*/stage1_choice.json | head -c 300)"
if [ -n "${EXPORT_BASE:-}" ]; then  # the base as a tar in <= 15 MiB parts (what a device call hands back)
  mkdir -p "$EXPORT_BASE"
  tar -c -C .cache/models tiny-qwen3-vl-crowded | split -b 15M -d - "$EXPORT_BASE/crowded-base.tar.part"
  ls -l "$EXPORT_BASE"/crowded-base.tar.part*
fi
[ "${PREPARE_ONLY:-0}" = 1 ] && exit 0
i=0
GRPO_SEEDS=${GRPO_SEEDS:-$SEEDS}
all_seeds=$(echo "${SEEDS},${GRPO_SEEDS}" | tr , '\n' | sort -nu | paste -sd,)
for seed in ${all_seeds//,/ }; do
  for arm in ${ARMS//,/ }; do
    seeds=$SEEDS; [[ $arm == grpo-* ]] && seeds=$GRPO_SEEDS
    [[ ",$seeds," == *",$seed,"* ]] || continue
    gpu=$(( i % NGPU )); i=$(( i + 1 ))
    CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=2 timeout "${RUN_TIMEOUT:-100000}" $PY bench/ab_learning.py "${common[@]}" \
      --seeds "$seed" --arms "$arm" > "$out/logs/$arm-s$seed.log" 2>&1 &
  done
done
fail=0
for job in $(jobs -p); do wait "$job" || fail=1; done
echo "[crowded_ab] $i runs done after $(( $(date +%s) - t0 )) s (failures: $fail)"
rm -f "$out/ab.jsonl"
$PY bench/ab_learning.py "${common[@]}" --seeds "$all_seeds" --arms "$ARMS" --summarize-only
