#!/usr/bin/env bash
# The claims ledger at its CPU scale, spec after spec, resuming wherever it stopped.
#
#   benchmarks/ledger_chain.sh RUNS [path/to/multi30k]
#
# For each spec of the chain (SPECS, in that order), skipped when docs/claims/<spec>.json was
# measured from the spec and recipe as they are now (the sha256 each record keeps; a fresh
# checkout therefore retrains nothing that is committed):
#   xformer experiment recipes/claims/<spec>.toml --out RUNS/<spec> --reuse RUNS --jobs JOBS
#   xformer claims --runs RUNS            (refreshes docs/claims/<spec>.json and docs/claims.md)
# then appends a line to RUNS/chain.log (spec, minutes, when). Run it from a frozen copy of the
# code (git archive HEAD), not the tree being edited, and copy the records back
# (docs/claims/<spec>.json) to commit them; rerunning the same command resumes a stopped
# experiment from its checkpoints.
# Environment: SPECS (default: every CPU-scale spec below), JOBS (runs at once, default 2, one
# CPU thread each), DEVICE (default cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:?usage: benchmarks/ledger_chain.sh RUNS [path/to/multi30k]}
data=${2:-}
specs=${SPECS:-heads ffn_width depth prenorm_depth depth_prenorm residual_layernorm activations head_dim \
  qkv_sharing synthesizer kv_heads heads_sweep layernorm_lr schedule distillation}
jobs=${JOBS:-2}
device=${DEVICE:-cpu}
sets=()
if [[ -n "$data" ]]; then
  sets+=(--set "data.dataset=\"${data}\"")
fi
mkdir -p "$runs"
for spec in $specs; do
  if python -c "import sys; from pathlib import Path; from xformer.ledger import record_is_current; \
sys.exit(0 if record_is_current(Path(sys.argv[1]), Path(sys.argv[2])) else 1)" \
      "recipes/claims/${spec}.toml" "docs/claims/${spec}.json"; then
    echo "${spec}: measured already (docs/claims/${spec}.json)"
    continue
  fi
  start=$(date +%s)
  xformer experiment "recipes/claims/${spec}.toml" --out "$runs/${spec}" --reuse "$runs" --device "$device" \
    --jobs "$jobs" "${sets[@]}"
  xformer claims recipes/claims --runs "$runs" --out docs/claims.md
  echo "${spec} $(( ($(date +%s) - start) / 60 )) min, finished $(date -u +%FT%TZ) on $(nproc) cores" \
    >> "$runs/chain.log"
done
echo "chain done: $runs/chain.log"
