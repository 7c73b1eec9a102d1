"""Is one system better than another on the same test set, or is the gap noise? sacreBLEU's
paired bootstrap resampling (Koehn 2004, as `sacrebleu --paired-bs` runs it): both systems are
scored on the same resampled sets of sentences; the p-value is two-sided, the share of
resamples whose absolute gap, centred on the resamples' mean gap, exceeds the observed
absolute gap (with +1 smoothing), except that no observed gap (equal BLEU) is p = 1; each
system also gets its mean and 95% confidence interval over the resamples.

Resampling draws with sacreBLEU's own seed (SACREBLEU_SEED, 12345 unless set), so the same
inputs give the same p-value in every process.

For accuracy, McNemar's exact test: only the examples the two systems disagree on count, and
under "neither is better" each such example is a fair coin (two-sided binomial p-value); the
accuracy difference gets Wald's 95% interval for paired proportions beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

from xformer.errors import DataError
from xformer.results import Result

SAMPLES = 1000  # sacreBLEU's default for --paired-bs
SIGNIFICANT = 0.05  # a paired test's p-value below this counts as a significant difference


@dataclass
class PairedBleu(Result):
    """sacreBLEU's paired bootstrap of a system against a baseline on one test set."""

    test: str  # "paired bootstrap resampling (sacreBLEU)"
    samples: int
    bleu: float  # cased BLEU of the system
    baseline_bleu: float
    difference: float  # bleu - baseline_bleu
    p_value: float
    mean: float  # the system's mean BLEU over the resamples, and half its 95% interval
    interval: float
    baseline_mean: float
    baseline_interval: float
    signature: str


@dataclass
class McNemar(Result):
    """McNemar's exact test of a classifier against a baseline on one test set."""

    test: str  # "McNemar's exact test"
    wins: int  # right where the baseline is wrong
    losses: int  # wrong where the baseline is right
    difference: float  # accuracy difference, points
    p_value: float
    difference_interval: float  # half the 95% interval of `difference`, points


def paired_bleu(hypotheses: list[str], baseline: list[str], references: list[str], *,
                samples: int = SAMPLES) -> PairedBleu:
    """Cased BLEU of both systems, the difference, and the paired bootstrap's p-value and
    95% intervals; refused when the three lists are not one test set."""
    if not (len(hypotheses) == len(baseline) == len(references)):
        raise DataError(f"paired test: {len(hypotheses)} hypotheses, {len(baseline)} baseline hypotheses and "
                        f"{len(references)} references; both systems must translate the same test set")
    test = PairedTest([("baseline", list(baseline)), ("system", list(hypotheses))], {"BLEU": BLEU()},
                      [list(references)], test_type="bs", n_samples=samples)
    signatures, results = test()
    base, system = results["BLEU"]
    # An observed gap of exactly 0 is p = 1: sacreBLEU's strict count gives ~0.5 there, and its
    # smallest p-value, 1 / (samples + 1), when every resample ties too (identical outputs, or
    # two models that get nothing right: BLEU 0 both), which would read as significant.
    tied = list(hypotheses) == list(baseline) or float(system.score) == float(base.score)
    p_value = 1.0 if tied else float(system.p_value)
    return PairedBleu(
        test="paired bootstrap resampling (sacreBLEU)", samples=samples,
        bleu=float(system.score), baseline_bleu=float(base.score),
        difference=float(system.score - base.score), p_value=p_value,
        mean=float(system.mean), interval=float(system.ci),
        baseline_mean=float(base.mean), baseline_interval=float(base.ci),
        signature=str(signatures["BLEU"]),
    )


def mcnemar(correct: list[bool], baseline: list[bool]) -> McNemar:
    """McNemar's exact test between two classifiers' per-example correctness on one test set:
    `wins` (right where the baseline is wrong), `losses` (the reverse), the accuracy
    difference in points, the two-sided p-value (1.0 when they never disagree) and the
    difference's 95% interval (Wald's for paired proportions: +- 1.96 standard errors, in
    points; an approximation that is too narrow when few examples disagree, where the exact
    p-value is the one to read)."""
    if len(correct) != len(baseline):
        raise DataError(f"paired test: {len(correct)} predictions against {len(baseline)} baseline predictions; "
                        "both systems must classify the same test set")
    wins = sum(a and not b for a, b in zip(correct, baseline, strict=True))
    losses = sum(b and not a for a, b in zip(correct, baseline, strict=True))
    n = wins + losses
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2 ** n if n else 1.0
    total = max(len(correct), 1)
    spread = math.sqrt(max(n - (wins - losses) ** 2 / total, 0.0)) / total
    return McNemar(test="McNemar's exact test", wins=wins, losses=losses,
                   difference=100.0 * (sum(correct) - sum(baseline)) / total, p_value=min(1.0, 2 * tail),
                   difference_interval=100.0 * 1.96 * spread)


def right_or_wrong(predictions: str | Path, gold: list[str]) -> list[bool]:
    """Per example, whether a predictions file (one label a line, `xformer eval`'s .pred) has
    the gold label; refused when the file is not one line per example."""
    predicted = Path(predictions).read_text(encoding="utf-8").splitlines()
    if len(predicted) != len(gold):
        raise DataError(f"{predictions}: {len(predicted)} predictions for {len(gold)} examples; "
                        "expected one label a line for every example of the test set")
    return [p == g for p, g in zip(predicted, gold, strict=True)]
