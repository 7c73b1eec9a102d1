#!/usr/bin/env bash
# The attention-head benchmark: the head analysis of a trained Multi30k de->en run
# (results: docs/results.md, "Attention heads").
#
#   benchmarks/heads.sh RUN [OUT] [PRUNE_ORDER]
#
# 1. the default analysis (500 validation sentences, loss-based ablation of every head, gradient
#    importance, report), timed: target under 5 minutes on a 2-core CPU;
# 2. pruning: heads ranked on validation, BLEU (the run's beam and length penalty) measured on
#    test at every PRUNE_STEP; the largest step within 0.5 BLEU saved with its heads removed;
# 3. `xformer eval` of the saved pruned run, which must reproduce the BLEU of step 2.
# CHECKPOINT (default averaged) picks the checkpoint; PRUNE_ORDER one-shot (default) or greedy;
# IMPORTANCE (default loss) the ablation metric that ranks heads (bleu: greedy decoding);
# N_PRUNE (default 500) the validation sentences that rank heads for pruning (1014 = all);
# PRUNE_STEP (default 0.1) the curve's spacing as a fraction of all heads; ABLATE (default zero)
# what a removed head leaves: zero, mean, rescale (mean + least-squares rescaled survivors) or
# renorm (zero, survivors scaled by H / kept: what a DropHead-trained model, model.head_dropout, saw).
set -euo pipefail
RUN=${1:?usage: benchmarks/heads.sh RUN [OUT] [PRUNE_ORDER]}
OUT=${2:-$RUN/heads}
ORDER=${3:-one-shot}
IMPORTANCE=${IMPORTANCE:-loss}
CHECKPOINT=${CHECKPOINT:-averaged}
N_PRUNE=${N_PRUNE:-500}
PRUNE_STEP=${PRUNE_STEP:-0.1}
ABLATE=${ABLATE:-zero}
if [ -e "$OUT" ]; then echo "$OUT exists; choose a new OUT" >&2; exit 2; fi
mkdir -p "$OUT"
start=$(date +%s)
xformer inspect-heads "$RUN" --checkpoint "$CHECKPOINT" --out "$OUT/analysis" | tee "$OUT/analysis.txt"
echo "default analysis: $(( $(date +%s) - start )) s wall" | tee -a "$OUT/analysis.txt"
xformer inspect-heads "$RUN" --checkpoint "$CHECKPOINT" --out "$OUT/prune" --prune --prune-order "$ORDER" \
    --importance "$IMPORTANCE" --n-examples "$N_PRUNE" --prune-step "$PRUNE_STEP" \
    --ablate "$ABLATE" \
    --save-pruned "$OUT/pruned" | tee "$OUT/prune.txt"
if [ -d "$OUT/pruned" ]; then xformer eval "$OUT/pruned" --json | tee "$OUT/pruned_eval.json"; fi
