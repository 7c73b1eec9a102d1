"""Is one system better than another on the same test set, or is the gap noise? sacreBLEU's
paired bootstrap resampling (Koehn 2004, as `sacrebleu --paired-bs` runs it): both systems are
scored on the same resampled sets of sentences; the p-value is two-sided, the share of
resamples whose absolute gap, centred on the resamples' mean gap, exceeds the observed
absolute gap (with +1 smoothing); each system also gets its mean and 95% confidence interval
over the resamples.

Resampling draws with sacreBLEU's own seed (SACREBLEU_SEED, 12345 unless set), so the same
inputs give the same p-value in every process.
"""

from __future__ import annotations

from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

from xformer.errors import DataError

SAMPLES = 1000  # sacreBLEU's default for --paired-bs


def paired_bleu(hypotheses: list[str], baseline: list[str], references: list[str], *,
                samples: int = SAMPLES) -> dict:
    """Cased BLEU of both systems, the difference, and the paired bootstrap's p-value and
    95% intervals; refused when the three lists are not one test set."""
    if not (len(hypotheses) == len(baseline) == len(references)):
        raise DataError(f"paired test: {len(hypotheses)} hypotheses, {len(baseline)} baseline hypotheses and "
                        f"{len(references)} references; both systems must translate the same test set")
    test = PairedTest([("baseline", list(baseline)), ("system", list(hypotheses))], {"BLEU": BLEU()},
                      [list(references)], test_type="bs", n_samples=samples)
    signatures, results = test()
    base, system = results["BLEU"]
    # Identical outputs differ in no resample, and sacreBLEU's count (resampled gaps strictly
    # above the observed one) then gives its smallest p-value: no difference is p = 1.
    p_value = 1.0 if list(hypotheses) == list(baseline) else float(system.p_value)
    return {
        "test": "paired bootstrap resampling (sacreBLEU)", "samples": samples,
        "bleu": float(system.score), "baseline_bleu": float(base.score),
        "difference": float(system.score - base.score), "p_value": p_value,
        "mean": float(system.mean), "interval": float(system.ci),
        "baseline_mean": float(base.mean), "baseline_interval": float(base.ci),
        "signature": str(signatures["BLEU"]),
    }
