#!/usr/bin/env bash
# The CUDA check (training speed on a GPU): bf16 and fp16 (+ scaler) training on the Multi30k recipe,
# loss must fall without NaN; prints tokens/s and MFU. Under 5 minutes on one H100/H200.
# Usage: benchmarks/gpu_check.sh [path/to/multi30k]   (record the output in docs/results.md)
set -euo pipefail
cd "$(dirname "$0")/.."
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python benchmarks/gpu_check.py --data "${1:-../shared/data/multi30k}" --steps "${STEPS:-300}"
# torch.distributed on CUDA: NCCL with fp16 and its gradient scaler, one process per GPU (NCCL
# refuses two processes on one GPU, so on a one-GPU machine this is a 1-process job: the NCCL
# all-reduce path and the scaler under it, not a cross-GPU comparison). The run must end with
# "stopped by max_steps" and a falling loss in RUN/metrics.jsonl.
GPUS=$(nvidia-smi --list-gpus 2>/dev/null | wc -l || echo 1)
OUT=$(mktemp -d)/ddp
torchrun --standalone --nproc-per-node "${GPUS:-1}" -m xformer_cli train recipes/translation/multi30k_de_en.toml \
    --set "data.dataset=\"${1:-../shared/data/multi30k}\"" --set "train.accumulate_steps=${GPUS:-1}" \
    --precision fp16 --max-steps 60 --set train.valid_every=60 --out "$OUT" --device cuda --json
python -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; t=[x['loss'] for x in r if x['kind']=='train' and x['loss']]; print('ddp fp16 losses', t[0], '->', t[-1], 'skipped', sum(x.get('skipped',0) for x in r))" "$OUT/metrics.jsonl"
