#!/usr/bin/env bash
# Everything still waiting for a CUDA GPU, as one call (a lent GPU is short-lived: 15 minutes
# of device time, start-up included). Side by side on the one GPU (the small models leave it
# mostly idle):
#   1. the long-range comparison: ListOps at Long Range Arena size
#      (recipes/longrange/listops_lra_transformer.toml, target >= 37% test) for LRA_MINUTES of
#      training, then test accuracy;
#   2. the en->de GPU target (>= 41.5 lowercased): multi30k_en_de with larger batches
#      and the linear schedule for MINUTES, checkpoint and lenpen picked on validation, test2016
#      scored once;
#   3. the classification paths under bf16 autocast, untested on CUDA so far: the recall
#      Transformer and its LSTM baseline (cuDNN's LSTM under autocast), 150 steps each.
# GPU_CHECK=1 also reruns benchmarks/gpu_check.sh first (bf16/fp16 translation; ran 2026-11-29).
#   benchmarks/gpu_session.sh [path/to/multi30k] [MINUTES] [LRA_MINUTES]    logs: $LOGS (runs/gpu_session)
# The device image has torch but may lack datasets/sacrebleu/sentencepiece: install them (or a
# carried wheelhouse, `pip install --no-index --find-links WHEELS -e .`) before calling this.
set -uo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data/multi30k}
minutes=${2:-6}
lra_minutes=${3:-7}
logs=${LOGS:-runs/gpu_session}
mkdir -p "$logs"
export OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$logs/gpu.txt" 2>&1
if [ -n "${GPU_CHECK:-}" ]; then
  STEPS=${STEPS:-200} timeout 150 benchmarks/gpu_check.sh "$data" >"$logs/gpu_check.log" 2>&1
  echo "gpu_check exit $?" >>"$logs/gpu_check.log"
fi
seconds() { python3 -c "print(int($1 * 60 + 150))"; }

(timeout "$(seconds "$lra_minutes")" xformer train recipes/longrange/listops_lra_transformer.toml --device cuda \
   --max-time "$lra_minutes" --out runs/gpu_listops_lra --overwrite \
 && xformer eval runs/gpu_listops_lra --json) >"$logs/listops_lra.log" 2>&1 &

DEVICE=cuda RUN=runs/gpu_en_de SETS='data.max_tokens=12288 model.dropout=0.3 train.schedule="linear"' \
  MAX_STEPS=${EN_DE_STEPS:-4000} timeout "$(seconds "$minutes")" \
  benchmarks/multi30k.sh en_de "$data" "$minutes" >"$logs/en_de.log" 2>&1 &

for recipe in recall_transformer recall_lstm; do
  timeout 300 xformer train "recipes/longrange/$recipe.toml" --device cuda --precision bf16 --max-steps 150 \
    --set data.curriculum_steps=[20,20,20,20,20] --set train.valid_every=50 --out "runs/gpu_$recipe" --overwrite \
    >"$logs/$recipe.log" 2>&1
  echo "$recipe exit $?" >>"$logs/$recipe.log"
done
wait
grep -h '^{' "$logs"/*.log >"$logs/summary.jsonl"
tail -n 3 "$logs"/*.log
