"""Scores: corpus BLEU and chrF through sacreBLEU (Post 2018, arXiv:1804.08771), so numbers
compare with published ones, and accuracy / confusion matrices for classification.

Scores are returned as full floats; rounding is for whoever renders them.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def accuracy(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Fraction of predictions equal to their label."""
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions but {len(labels)} labels")
    if len(labels) == 0:
        raise ValueError("accuracy of no examples")
    return sum(int(p == y) for p, y in zip(predictions, labels, strict=True)) / len(labels)


def confusion_matrix(predictions: Sequence[int], labels: Sequence[int], n_classes: int) -> list[list[int]]:
    """counts[true class][predicted class], n_classes x n_classes."""
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions but {len(labels)} labels")
    counts = [[0] * n_classes for _ in range(n_classes)]
    for p, y in zip(predictions, labels, strict=True):
        if not (0 <= p < n_classes and 0 <= y < n_classes):
            raise ValueError(f"class ids must lie in 0..{n_classes - 1}, found prediction {p}, label {y}")
        counts[y][p] += 1
    return counts
