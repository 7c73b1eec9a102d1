import math

import numpy as np
import pytest

from xformer.metrics import accuracy, confusion_matrix, translation_scores


def test_references_score_100_against_themselves():
    refs = ["The cat sat on the mat.", "A man rides a horse along the beach, slowly."]
    scores = translation_scores(refs, refs)
    assert scores["bleu"] == pytest.approx(100.0)
    assert scores["bleu_lc"] == pytest.approx(100.0)
    assert scores["chrf"] == pytest.approx(100.0)
    assert scores["n_sentences"] == 2


def test_short_hypothesis_pays_the_brevity_penalty():
    # Every n-gram of the hypothesis matches (precisions 4/4, 3/3, 2/2, 1/1); hypothesis 4
    # tokens, reference 8: BP = exp(1 - 8/4).
    scores = translation_scores(["a b c d"], ["a b c d e f g h"])
    assert scores["bleu"] == pytest.approx(100 * math.exp(-1))


def test_exp_smoothing_of_a_missing_4gram():
    # Precisions 3/4, 2/3, 1/2 and no 4-gram match: 'exp' smoothing gives it 1 / (2 * 1).
    # Geometric mean of (3/4, 2/3, 1/2, 1/2) = (1/8) ** (1/4); no brevity penalty.
    scores = translation_scores(["a b c d"], ["a b c e"])
    assert scores["bleu"] == pytest.approx(100 * 2**-0.75)


def test_no_shared_word_scores_zero():
    assert translation_scores(["x y z"], ["a b c"])["bleu"] == 0.0


def test_bleu_pools_counts_over_the_corpus():
    # Pooled precisions 4/6, 3/4, 2/2, 1/1 and lengths 6 vs 6: (1/2) ** (1/4), not the mean
    # of the sentence scores (100 and 0).
    scores = translation_scores(["a b c d", "x y"], ["a b c d", "p q"])
    assert scores["bleu"] == pytest.approx(100 * 0.5**0.25)


def test_case_counts_unless_lowercased():
    # Cased: "The" and "Cat" miss. Precisions 4/6, 3/5, 2/4, 1/3: product 1/15.
    scores = translation_scores(["The Cat sat on the mat"], ["the cat sat on the mat"])
    assert scores["bleu"] == pytest.approx(100 * (1 / 15) ** 0.25)
    assert scores["bleu_lc"] == pytest.approx(100.0)


def test_chrf_is_f_beta_2_over_character_ngrams():
    # "ab" vs "abcd": 1-grams P = 2/2, R = 2/4; 2-grams P = 1/1, R = 1/3; no hypothesis
    # 3-grams, so orders 1-2 average: P = 1, R = 5/12. F2 = 5PR / (4P + R) = 25/53
    # (F1 would be 10/17).
    assert translation_scores(["ab"], ["abcd"])["chrf"] == pytest.approx(100 * 25 / 53)


def test_signatures_name_the_settings():
    scores = translation_scores(["a b"], ["a b"])
    for part in ("nrefs:1", "case:mixed", "tok:13a", "smooth:exp", "version:"):
        assert part in scores["signature"]
    for part in ("nrefs:1", "case:mixed", "nc:6", "nw:0"):
        assert part in scores["chrf_signature"]


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        translation_scores(["a", "b"], ["a"])


def test_confusion_matrix_rows_are_true_labels_and_columns_predictions():
    # Asymmetric on purpose: the transpose [[1, 0], [2, 1]] would be a different answer.
    assert confusion_matrix([0, 1, 1, 1], [0, 0, 0, 1], 2) == [[1, 2], [0, 1]]
    labels = [0, 0, 1, 2, 2, 2]
    predictions = [0, 1, 1, 2, 0, 2]
    assert confusion_matrix(predictions, labels, 3) == [[1, 1, 0], [0, 1, 0], [1, 0, 2]]


def test_confusion_matrix_takes_arrays_and_returns_plain_ints():
    counts = confusion_matrix(np.array([0, 1, 1, 1]), np.array([0, 0, 0, 1], dtype=np.int32), 3)
    assert counts == [[1, 2, 0], [0, 1, 0], [0, 0, 0]]  # a class nobody predicted or has still gets its row
    assert all(type(c) is int for row in counts for c in row)  # JSON-serialisable


def test_accuracy_is_a_percentage():
    assert accuracy([0, 1, 1, 1], [0, 0, 0, 1]) == pytest.approx(50.0)
    assert accuracy(np.array([2, 2, 0]), np.array([2, 2, 0])) == 100.0
    assert accuracy([1, 0, 1], [0, 1, 0]) == 0.0
    assert type(accuracy(np.array([1]), np.array([1]))) is float


def test_no_examples_score_zero_and_count_nothing():
    assert accuracy([], []) == 0.0
    assert accuracy(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == 0.0
    assert confusion_matrix([], [], 2) == [[0, 0], [0, 0]]


def test_mismatched_lengths_and_unknown_classes_are_errors():
    with pytest.raises(ValueError, match="1 predictions but 2 labels"):
        accuracy([0], [0, 1])
    with pytest.raises(ValueError, match="1 predictions but 2 labels"):
        confusion_matrix([0], [0, 1], 2)
    with pytest.raises(ValueError, match="found prediction 3"):
        confusion_matrix([3], [0], 3)
    with pytest.raises(ValueError, match="found label -1"):
        confusion_matrix([0], [-1], 3)
