#!/usr/bin/env bash
# The GPU subset of the claims ledger: named claim specs at the flagship size, each cell and seed
# trained once through the wsd schedule to the largest budget with the smaller budgets branched
# from it (experiment.budgets), scored, compared, and judged into a ledger of its own.
#
#   benchmarks/gpu_claims.sh OUT [path/to/multi30k]
#
# Everything lands in OUT (copy that one folder back from the GPU machine): OUT/runs/<spec>/ the
# experiments, OUT/records/ what the ledger keeps of them, OUT/claims.md the ledger of the subset
# (specs not in it read "not measured yet"). Rerunning the same command resumes: finished runs are
# kept, a stopped one resumes from its checkpoint, and the baseline cell shared by the specs
# trains once (--reuse OUT/runs). Each spec is copied into OUT/specs with the subset's recipe,
# seeds and budgets, and its [claim] scale saying so; the specs in recipes/claims name the CPU
# scale, so the subset takes specs whose cells are relative to the model's size (heads, layers,
# activations, Q/K/V sharing, KV heads), not ffn_width (its d_ff values are the CPU scale's).
# Environment: SPECS (the subset, default "heads activations depth"), RECIPE (default the flagship,
# recipes/translation/multi30k_de_en.toml), SEEDS (default "[1, 2, 3]"), BUDGETS (steps, default
# "[1000, 2000, 4000]": the flagship gains ~14% on validation from 1,000 to 2,000 steps and ~0.3%
# from 2,000 to 4,000, docs/results.md), DEVICE (default cuda), JOBS (runs at once on the device,
# default 3), SETS (extra overrides of every spec's recipe, e.g. "train.valid_every=100").
# Sized for one H200 session (bf16 auto): 3 specs x 3 cells x 3 seeds, the baseline shared, 4,000
# steps of 4,096 tokens each with two cooldowns (not yet timed on a GPU). tests/test_benchmarks.py
# (slow) runs it on a CPU at a few steps of a tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/gpu_claims.sh OUT [path/to/multi30k]}
data=${2:-}
specs=${SPECS:-heads activations depth}
recipe=$(realpath "${RECIPE:-recipes/translation/multi30k_de_en.toml}")
seeds=${SEEDS:-[1, 2, 3]}
budgets=${BUDGETS:-[1000, 2000, 4000]}
device=${DEVICE:-cuda}
jobs=${JOBS:-3}
sets=()
if [[ -n "$data" ]]; then
  sets+=(--set "data.dataset=\"${data}\"")
fi
for item in ${SETS:-}; do
  sets+=(--set "$item")
done
mkdir -p "$out/runs" "$out/specs"
for spec in $specs; do
  cp "recipes/claims/${spec}.toml" "$out/specs/${spec}.toml"
  # the copy is the spec the subset runs: its recipe, seeds and budgets are the subset's (so
  # `xformer claims` reads the runs as the copy's own), and its scale says so
  python - "$out/specs/${spec}.toml" "$recipe" "$seeds" "$budgets" <<'PY'
import json, sys
from pathlib import Path
path, recipe, seeds, budgets = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
lines, out, section = path.read_text().splitlines(), [], ""
for line in lines:
    if line.startswith("["):
        section = line.strip()
    if section == "[experiment]" and line.startswith("recipe = "):
        line = f"recipe = {json.dumps(recipe)}"
    elif section == "[experiment]" and line.startswith("seeds = "):
        line = f"seeds = {seeds}\nbudgets = {budgets}"
    elif section == "[experiment]" and line.startswith(("max_steps = ", "max_time = ", "budgets = ")):
        continue
    elif section == "[claim]" and line.startswith("scale = "):
        line = "scale = " + json.dumps(f"the GPU subset (benchmarks/gpu_claims.sh): {Path(recipe).name} with the "
                                       f"spec's cells, wsd budgets of {budgets} steps, seeds {seeds}")
    out.append(line)
path.write_text("\n".join(out) + "\n")
PY
  xformer experiment "$out/specs/${spec}.toml" --out "$out/runs/${spec}" --reuse "$out/runs" --device "$device" \
    --jobs "$jobs" "${sets[@]}"
done
xformer claims "$out/specs" --runs "$out/runs" --out "$out/claims.md" --records "$out/records"
echo "ledger of the subset: $out/claims.md (records in $out/records)"
