#!/usr/bin/env bash
# Everything issue 3 needs a CUDA GPU for, as one call (a lent GPU is short-lived):
#   1. benchmarks/gpu_check.sh alone on the GPU: bf16 and fp16 (+ scaler) training, tokens/s, MFU;
#   2. then, side by side on the same GPU (small models leave it mostly idle):
#      - the en->de GPU target: multi30k_en_de for MINUTES, checkpoint and lenpen picked on
#        validation, test2016 scored once;
#      - a de->en tuning sweep at the CPU run's step budget (2600 steps = 50 min on the 2-core
#        CPU), scored on validation only, to choose the configuration of the next CPU run.
#   benchmarks/gpu_session.sh [path/to/multi30k] [MINUTES]      logs go to $LOGS (default runs/gpu_session)
set -uo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data/multi30k}
minutes=${2:-4}
logs=${LOGS:-runs/gpu_session}
mkdir -p "$logs"
export OMP_NUM_THREADS=2
STEPS=${STEPS:-200} timeout 150 benchmarks/gpu_check.sh "$data" >"$logs/gpu_check.log" 2>&1
echo "gpu_check exit $?" >>"$logs/gpu_check.log"
limit=$(python3 -c "print(int($minutes * 60 + 120))")
DEVICE=cuda RUN=runs/gpu_en_de timeout "$limit" benchmarks/multi30k.sh en_de "$data" "$minutes" >"$logs/en_de.log" 2>&1 &
declare -A sweep=(
  [lr1e-3]="train.lr=1e-3"
  [lr1.5e-3]="train.lr=1.5e-3"
  [lr2e-3]="train.lr=2e-3"
  [lr1.5e-3_drop0.3]="train.lr=1.5e-3 model.dropout=0.3"
)
for name in "${!sweep[@]}"; do
  DEVICE=cuda RUN="runs/gpu_de_en_$name" SETS="${sweep[$name]}" MAX_STEPS=2600 VALID_ONLY=1 \
    timeout "$limit" benchmarks/multi30k.sh de_en "$data" "$minutes" >"$logs/de_en_$name.log" 2>&1 &
done
wait
grep -h '^{' "$logs"/*.log >"$logs/summary.jsonl"
cat "$logs/gpu_check.log" "$logs/summary.jsonl"
