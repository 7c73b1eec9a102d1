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
# then appends a line to RUNS/chain.log (spec, minutes, when). Around each experiment, the
# records of its finished runs (no checkpoints: xformer.studies.archive) are put back from
# ARCHIVE/<spec> before it (when archived from the spec and recipe as they are now) and kept
# there after it, so a spec stopped part way on one machine resumes on another without training
# again what those records hold (a measured spec's archive is put back too, where its runs are
# missing, for the specs after it that copy its cells): commit ARCHIVE/<spec> (about 0.1 MB a
# run) from the frozen copy when a machine may go; archive a spec still running with
# `python -m xformer.studies.archive_spec save SPEC RUNS/<spec> ARCHIVE/<spec>`. Run it from a frozen copy of the
# code (git archive HEAD), not the tree being edited, and copy the records back
# (docs/claims/<spec>.json) to commit them; rerunning the same command resumes a stopped
# experiment from its checkpoints.
# Environment: SPECS (default: every CPU-scale spec below), JOBS (runs at once, default 2, one
# CPU thread each), DEVICE (default cpu), SPEC_DIR (default recipes/claims), LEDGER (default
# docs/claims.md; its records beside it in claims/) and ARCHIVE (default
# benchmarks/records/ledger-runs).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:?usage: benchmarks/ledger_chain.sh RUNS [path/to/multi30k]}
data=${2:-}
# the specs at the CPU scale (multi30k_de_en_cpu.toml), the baseline's first, and three long-range specs
# at their own (4,000 steps): `xformer claims --plan --spec NAME ...` counts their runs and times
# them (docs/results.md, "The ledger's CPU scale", has the arithmetic and what is left out);
# the later specs copy cells of the earlier ones (--reuse RUNS), so the order matters;
# distillation's cells name their teacher under runs/claims, so RUNS is runs/claims for it (a teacher
# with no weights here, as on a fresh machine, is trained from its own spec first)
specs=${SPECS:-heads heads_specialise distillation heads_sweep head_dim ffn_width depth activations qkv_sharing \
  synthesizer kv_heads sparse longrange_helpers lstm_1024 layernorm_lr depth_prenorm residual_layernorm \
  prenorm_depth schedule lowrank_translation speedups}
jobs=${JOBS:-2}
device=${DEVICE:-cpu}
spec_dir=${SPEC_DIR:-recipes/claims}
ledger=${LEDGER:-docs/claims.md}
records="$(dirname "$ledger")/claims"
archive=${ARCHIVE:-benchmarks/records/ledger-runs}
sets=()
if [[ -n "$data" ]]; then
  sets+=(--set "data.dataset=\"${data}\"")
fi
mkdir -p "$runs"
for spec in $specs; do
  if python -c "import sys; from pathlib import Path; from xformer.studies.ledger import record_is_current; \
sys.exit(0 if record_is_current(Path(sys.argv[1]), Path(sys.argv[2])) else 1)" \
      "${spec_dir}/${spec}.toml" "${records}/${spec}.json"; then
    echo "${spec}: measured already (${records}/${spec}.json)"
    # its archived runs (records, no weights) back under RUNS where missing, so a later spec's
    # --reuse copies a cell they share instead of training it again (a fresh machine)
    if [[ ! -d "$runs/${spec}" && -d "${archive}/${spec}" ]]; then
      python -m xformer.studies.archive_spec restore "${spec_dir}/${spec}.toml" "${archive}/${spec}" "$runs/${spec}" \
        || true
    fi
    continue
  fi
  start=$(date +%s)
  status=0
  python -m xformer.studies.archive_spec restore "${spec_dir}/${spec}.toml" "${archive}/${spec}" "$runs/${spec}" || true
  # a teacher the spec's cells name, with no weights here (a fresh machine): trained from its own spec
  python -m xformer.studies.archive_spec teachers "${spec_dir}/${spec}.toml" "$device" \
    ${data:+"data.dataset=\"${data}\""} || true
  # the corpus only where the spec's runs read one (a generated task refuses data.dataset)
  spec_sets=()
  if python -m xformer.studies.archive_spec reads-corpus "${spec_dir}/${spec}.toml"; then
    spec_sets=("${sets[@]}")
  fi
  xformer experiment "${spec_dir}/${spec}.toml" --out "$runs/${spec}" --reuse "$runs" --device "$device" \
    --jobs "$jobs" ${spec_sets[@]+"${spec_sets[@]}"} || status=$?
  python -m xformer.studies.archive_spec save "${spec_dir}/${spec}.toml" "$runs/${spec}" "${archive}/${spec}" || true
  if (( status != 0 )); then
    # one spec's failure (a bad spec, a crash) is logged and the chain goes on; a stop signal ends it
    echo "${spec} FAILED (exit ${status}) $(date -u +%FT%TZ)" >> "$runs/chain.log"
    if (( status > 128 )); then exit "$status"; fi
    continue
  fi
  xformer claims "$spec_dir" --runs "$runs" --out "$ledger"
  echo "${spec} $(( ($(date +%s) - start) / 60 )) min this call, finished $(date -u +%FT%TZ) on $(nproc --all) cores" \
    >> "$runs/chain.log"
done
echo "chain done: $runs/chain.log"
