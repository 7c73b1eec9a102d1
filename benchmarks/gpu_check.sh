#!/usr/bin/env bash
# The CUDA check (training speed on a GPU): bf16 and fp16 (+ scaler) training on the Multi30k recipe,
# loss must fall without NaN; prints tokens/s and MFU. Under 5 minutes on one H100/H200.
# Usage: benchmarks/gpu_check.sh [path/to/multi30k]   (record the output in docs/results.md)
set -euo pipefail
cd "$(dirname "$0")/.."
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python benchmarks/gpu_check.py --data "${1:-../shared/data/multi30k}" --steps "${STEPS:-300}"
