#!/usr/bin/env bash
# Issue 3 benchmark: train a Multi30k recipe for a fixed wall-clock budget on this machine, pick
# the checkpoint (best or averaged) and length penalty on the VALIDATION split, then score the
# test split (test2016) once with that choice.
#
#   benchmarks/multi30k.sh [de_en|en_de] [path/to/multi30k] [minutes]
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
recipe=recipes/translation/multi30k_${pair}.toml

if [ -z "${SKIP_TRAIN:-}" ]; then
  xformer train "$recipe" --set "data.dataset=\"$data\"" --max-time "$minutes" --out "$run" --overwrite
fi
python - "$run" <<'PY'
import json, sys
from xformer.evaluate import evaluate_run
run = sys.argv[1]
train = json.load(open(f"{run}/train.json"))
print(json.dumps({"train_minutes": train["train_seconds"] / 60, "steps": train["steps"], "epochs": train["epochs"],
                  "loop_overhead": train["loop_overhead"], "stop": train["stop_reason"]}))
best = None
for checkpoint in ("best", "averaged"):
    for lenpen in (0.6, 1.0, 1.4):
        r = evaluate_run(run, split="validation", checkpoint=checkpoint, lenpen=lenpen, device="cpu")
        print(json.dumps({"split": "validation", "checkpoint": checkpoint, "lenpen": lenpen, "bleu": r["bleu"]}))
        if best is None or r["bleu"] > best[0]:
            best = (r["bleu"], checkpoint, lenpen)
_, checkpoint, lenpen = best
r = evaluate_run(run, split="test", checkpoint=checkpoint, lenpen=lenpen, device="cpu")
print(json.dumps({"split": "test", "checkpoint": checkpoint, "lenpen": lenpen, "bleu": r["bleu"],
                  "bleu_lc": r["bleu_lc"], "chrf": r["chrf"], "signature": r["signature"]}))
PY
