"""Scores: corpus BLEU and chrF through sacreBLEU (Post 2018, arXiv:1804.08771), so numbers
compare with published ones, and accuracy (a percentage, as reports give it) and confusion
matrices for classification.

Scores are returned as full floats; rounding is for whoever renders them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sacrebleu.metrics import BLEU, CHRF


def translation_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """Corpus scores of detokenized hypotheses against one reference each:

    - `bleu`: BLEU (Papineni et al. 2002), cased, sacreBLEU's default 13a tokenizer and
      'exp' smoothing; `signature` is its sacreBLEU signature string, e.g.
      `nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`;
    - `bleu_lc`: the same, lowercased;
    - `chrf`: chrF2, character 6-grams, beta 2 (Popovic 2015), and `chrf_signature`;
    - `n_sentences`.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    hypotheses, refs = list(hypotheses), [list(references)]
    bleu, bleu_lc, chrf = BLEU(), BLEU(lowercase=True), CHRF()
    scores = {
        "bleu": bleu.corpus_score(hypotheses, refs).score,
        "bleu_lc": bleu_lc.corpus_score(hypotheses, refs).score,
        "chrf": chrf.corpus_score(hypotheses, refs).score,
    }
    # sacreBLEU knows the number of references, part of the signature, only after scoring.
    scores["signature"] = str(bleu.get_signature())
    scores["chrf_signature"] = str(chrf.get_signature())
    scores["n_sentences"] = len(hypotheses)
    return scores


def accuracy(predictions: Sequence[int] | np.ndarray, labels: Sequence[int] | np.ndarray) -> float:
    """Percentage (0..100) of predictions equal to their label; 0.0 for no examples."""
    predictions, labels = _class_ids(predictions, labels)
    if labels.size == 0:
        return 0.0
    return 100.0 * int((predictions == labels).sum()) / labels.size  # correct / n, as runs have always logged it


def confusion_matrix(
    predictions: Sequence[int] | np.ndarray, labels: Sequence[int] | np.ndarray, n_classes: int,
) -> list[list[int]]:
    """counts[true label][predicted label], an n_classes x n_classes list of lists of ints."""
    predictions, labels = _class_ids(predictions, labels)
    for name, ids in (("prediction", predictions), ("label", labels)):
        outside = ids[(ids < 0) | (ids >= n_classes)]
        if outside.size:
            raise ValueError(f"class ids must lie in 0..{n_classes - 1}, found {name} {int(outside[0])}")
    counts = np.bincount(labels * n_classes + predictions, minlength=n_classes * n_classes)
    return counts.reshape(n_classes, n_classes).tolist()


def _class_ids(predictions, labels) -> tuple[np.ndarray, np.ndarray]:
    """Both as 1-d int64 arrays of one length."""
    predictions = np.asarray(predictions, dtype=np.int64).reshape(-1)
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    if predictions.size != labels.size:
        raise ValueError(f"{predictions.size} predictions but {labels.size} labels")
    return predictions, labels
