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
# trains once (--reuse OUT/runs).
# Environment: SPECS (the subset, default "heads ffn_width depth"), SEEDS (default "[1, 2, 3]"),
# BUDGETS (steps, default "[500, 1000, 2000]"), DEVICE (default cuda), JOBS (runs at once on the
# device, default 3), SETS (extra overrides of every spec's recipe, e.g. "train.valid_every=100").
# Sized for 8 minutes of one H200 (bf16 auto): 3 specs x 3 cells x 3 seeds, the baseline shared,
# 2,000 steps of 4,096 tokens each with two cooldowns. tests/test_benchmarks.py (slow) runs it on a CPU
# at a few steps of a tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/gpu_claims.sh OUT [path/to/multi30k]}
data=${2:-}
specs=${SPECS:-heads ffn_width depth}
seeds=${SEEDS:-[1, 2, 3]}
budgets=${BUDGETS:-[500, 1000, 2000]}
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
  # the spec's recipe path is relative to the spec: point it back at this checkout's recipes
  recipe=$(python -c "import sys, tomllib; print(tomllib.load(open(sys.argv[1], 'rb'))['experiment']['recipe'])" \
           "recipes/claims/${spec}.toml")
  # the copy is the spec the subset runs: its recipe path points at this checkout, its seeds and
  # budgets are the subset's (so `xformer claims` reads the runs as the copy's own)
  python - "$out/specs/${spec}.toml" "$(cd recipes/claims && realpath "$recipe")" "$seeds" "$budgets" <<'PY'
import json, sys
from pathlib import Path
path, recipe, seeds, budgets = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
lines, out, inside = path.read_text().splitlines(), [], False
for line in lines:
    if line.startswith("["):
        inside = line.strip() == "[experiment]"
    if inside and line.startswith("recipe = "):
        line = f"recipe = {json.dumps(recipe)}"
    elif inside and line.startswith("seeds = "):
        line = f"seeds = {seeds}\nbudgets = {budgets}"
    elif inside and line.startswith(("max_steps = ", "max_time = ")):
        continue
    out.append(line)
path.write_text("\n".join(out) + "\n")
PY
  xformer experiment "$out/specs/${spec}.toml" --out "$out/runs/${spec}" --reuse "$out/runs" --device "$device" \
    --jobs "$jobs" "${sets[@]}"
done
xformer claims "$out/specs" --runs "$out/runs" --out "$out/claims.md" --records "$out/records"
echo "ledger of the subset: $out/claims.md (records in $out/records)"
