#!/usr/bin/env bash
# Train a Multi30k recipe for a fixed wall-clock budget on this machine, pick
# the checkpoint (best or averaged) and length penalty on the VALIDATION split, then score the
# test split (test2016) once with that choice.
#
#   benchmarks/multi30k.sh [de_en|en_de] [path/to/multi30k] [minutes]
#
# Length penalties tried on validation: 0.6 to 3.0 in steps of 0.4 (2026-11-30: 1.8 won for
# de->en, 2.6 for en->de; docs/results.md).
# Environment: RUN (run directory), DEVICE (auto|cpu|cuda, for training and decoding; default
# cpu), SETS (extra recipe overrides, e.g. "train.lr=1.5e-3 model.dropout=0.3"), MAX_STEPS,
# VALID_ONLY=1 (stop after the validation table: for tuning sweeps, which must not see test),
# SKIP_TRAIN=1 (score an existing run), AVERAGES (e.g. "5": also average the newest 5 kept step
# checkpoints, `xformer average`, and let validation choose among them; needs train.average_last
# >= 5), ALLOCATOR (a malloc library to preload for training, e.g. libtcmalloc_minimal.so.4;
# default: none, so training runs as `xformer train` does for any user, on glibc malloc tuned
# by xformer.allocator; XFORMER_ALLOCATOR=system leaves glibc as it comes), LENPENS (the length penalties tried on validation, default "0.6 1.0 1.4 1.8 2.2
# 2.6 3.0").
#
# Prints one JSON line per evaluation and a final summary line; everything is also in the run
# directory (train.json, metrics.jsonl, eval/*.json). Run nothing else meanwhile: on 2 cores a
# concurrent process slows training and so lowers the score reached in the budget.
set -euo pipefail
cd "$(dirname "$0")/.."
pair=${1:-de_en}
data=${2:-../shared/data/multi30k}
minutes=${3:-50}
run=${RUN:-runs/bench_multi30k_${pair}}
device=${DEVICE:-cpu}
recipe=recipes/translation/multi30k_${pair}.toml

if [ -z "${SKIP_TRAIN:-}" ]; then
  sets=(--set "data.dataset=\"$data\"")
  for s in ${SETS:-}; do sets+=(--set "$s"); done
  if [ -n "${MAX_STEPS:-}" ]; then sets+=(--max-steps "$MAX_STEPS"); fi
  alloc=${ALLOCATOR:-}
  if [ "$alloc" = none ]; then alloc=; fi
  echo "{\"allocator\": \"${alloc:-glibc, XFORMER_ALLOCATOR=${XFORMER_ALLOCATOR:-tuned}}\"}"
  LD_PRELOAD=$alloc xformer train "$recipe" "${sets[@]}" --max-time "$minutes" --device "$device" --out "$run" --overwrite
fi
python3 - "$run" "$device" "${VALID_ONLY:-}" "${AVERAGES:-}" "${LENPENS:-0.6 1.0 1.4 1.8 2.2 2.6 3.0}" <<'PY'
import json, sys
from pathlib import Path
from xformer.training.checkpoint import average_run
from xformer.evaluate import evaluate_run
run, device, valid_only, averages = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
lenpens = [float(x) for x in sys.argv[5].split()]
candidates = ["best", "averaged"]
for n in averages:
    if not Path(f"{run}/checkpoints/averaged_last{n}.safetensors").exists():
        average_run(run, int(n))
    candidates.append(f"averaged_last{n}")
train = json.load(open(f"{run}/train.json"))
print(json.dumps({"run": run, "train_minutes": train["train_seconds"] / 60, "steps": train["steps"],
                  "epochs": train["epochs"], "loop_overhead": train["loop_overhead"], "stop": train["stop_reason"]}))
best = None
for checkpoint in candidates:
    for lenpen in lenpens:
        r = evaluate_run(run, split="validation", checkpoint=checkpoint, lenpen=lenpen, device=device)
        print(json.dumps({"run": run, "split": "validation", "checkpoint": checkpoint, "lenpen": lenpen,
                          "bleu": r.bleu, "bleu_lc": r.bleu_lc}))
        if best is None or r.bleu > best[0]:
            best = (r.bleu, checkpoint, lenpen)
if valid_only:
    sys.exit(0)
_, checkpoint, lenpen = best
r = evaluate_run(run, split="test", checkpoint=checkpoint, lenpen=lenpen, device=device)
print(json.dumps({"run": run, "split": "test", "checkpoint": checkpoint, "lenpen": lenpen, "bleu": r.bleu,
                  "bleu_lc": r.bleu_lc, "chrf": r.chrf, "signature": r.signature}))
PY
