#!/usr/bin/env bash
# Stage-1 recipes of the crowded-task model side by side, one per GPU (bench/RESULTS.md "Crowded scenes"):
# the crowded data and the random-init tiny-qwen3-vl-crowded-init once, then scripts/vlm_pretrain.py per recipe
# (ORDERING:LR:BATCH) on its own GPU for at most SECONDS of training, scored on 64 held-out images every EVERY
# steps. Every curve goes to runs/crowded_stage1/sweep.json and the best (recipe, step) by held-out F1 is
# printed with its snapshot. It compares recipes; the A/B's base is built by bench/ab_learning.py.
#
#   RECIPES="sorted:1e-3:32 random:1e-3:32" SECONDS_PER_RECIPE=420 bash bench/crowded_stage1_sweep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RECIPES=${RECIPES:-"sorted:1e-3:32 sorted:5e-4:64 random:1e-3:32 random:5e-4:64"}
BUDGET=${SECONDS_PER_RECIPE:-420}
EVERY=${EVERY:-500}
STEPS=${STEPS:-20000}
DATA=${DATA:-runs/ab/crowded-random/data}
OUTDIR=runs/crowded_stage1
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c GPU || true)
DEVICE=cuda
[ "$NGPU" -gt 0 ] || { NGPU=1; DEVICE=cpu; }
read -r -a GPUS <<<"${GPUS:-$(seq -s ' ' 0 $(( NGPU - 1 )))}"   # GPUS="2 3": only these
mkdir -p "$OUTDIR"
t0=$(date +%s)
$PY scripts/build_vlm_demo_data.py --crowded --out "$DATA" --n-train "${N_TRAIN:-4000}" --n-eval 128 &
$PY scripts/build_tiny_vlm.py --out .cache/models --preset tiny-qwen3-vl-crowded-init >/dev/null
wait
echo "[sweep] data and init ready after $(( $(date +%s) - t0 )) s"
marks=$(seq -s, "$EVERY" "$EVERY" "$STEPS")
i=0
for recipe in $RECIPES; do
  IFS=: read -r ordering lr batch <<<"$recipe"
  name="$ordering-lr$lr-b$batch"
  # OMP_NUM_THREADS: four processes with one intra-op thread per core each starve the image encoding
  CUDA_VISIBLE_DEVICES=${GPUS[$(( i % ${#GPUS[@]} ))]} OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} $PY scripts/vlm_pretrain.py --model-dir .cache/models/tiny-qwen3-vl-crowded-init \
    --data "$DATA" --out "$OUTDIR/$name" --device "$DEVICE" --fast --max-seconds "$BUDGET" --steps "$STEPS" \
    --batch "$batch" --lr "$lr" --object-ordering "$ordering" --max-new-tokens "${MAX_NEW_TOKENS:-1024}" --n-eval "${N_EVAL:-64}" \
    --eval-at "$marks" --snapshot-at "$marks" --snapshot-dir "$OUTDIR/$name.snapshots" \
    > "$OUTDIR/$name.log" 2>&1 &
  i=$(( i + 1 ))
done
fail=0
for job in $(jobs -p); do wait "$job" || fail=1; done
echo "[sweep] $i recipes done after $(( $(date +%s) - t0 )) s (failures: $fail)"
$PY - "$OUTDIR" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
sweep, best = {}, None
for info in sorted(out.glob("*/pretrain_info.json")):
    run = info.parent
    data = json.loads(info.read_text())
    sweep[run.name] = data
    for point in data["curve"]:
        if best is None or point["f1"] > best[2]["f1"]:
            best = (run, data, point)
(out / "sweep.json").write_text(json.dumps(sweep, indent=1) + "\n")
for name, data in sweep.items():
    print(f"[sweep] {name}: {data['steps']} steps in {data['train_seconds']} s;",
          " ".join(f"{p['step']}:{p['f1']}" for p in data["curve"]))
run, data, point = best
snapshot = run.with_name(run.name + ".snapshots") / f"{run.name}.step_{point['step']}.safetensors"
print(f"[sweep] best: {run.name} step {point['step']} F1 {point['f1']} ({snapshot if snapshot.exists() else run})")
EOF
