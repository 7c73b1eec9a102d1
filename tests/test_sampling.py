"""Subword sampling (xformer.data.sampling): the distribution sentencepiece defines, drawn
reproducibly in any process."""

import math
import subprocess
import sys
from collections import Counter
from itertools import accumulate

import numpy as np
import pytest

from xformer.data.corpus import load_split
from xformer.data.tokenizer import Tokenizer, train_tokenizer

SENTENCE = "Ein Hund rennt."
_TRAINED: dict = {}


@pytest.fixture
def tokenizer(shared_dir, tmp_path_factory) -> Tokenizer:
    """A joint 500-piece unigram model of 2000 Multi30k pairs, trained once."""
    if "joint" not in _TRAINED:
        rows = load_split(str(shared_dir / "data" / "multi30k"), "train", ["de", "en"]).select(range(2000))
        _TRAINED["rows"] = rows
        _TRAINED["joint"] = train_tokenizer(rows, "de", "en", tmp_path_factory.mktemp("spm"), joint=True,
                                            model_type="unigram", vocab_size=500, character_coverage=1.0,
                                            byte_fallback=False)
    return _TRAINED["joint"]


def rows_of(ids: np.ndarray, lens: np.ndarray) -> list[tuple[int, ...]]:
    ends = list(accumulate(lens.tolist()))
    return [tuple(ids[end - n:end].tolist()) for end, n in zip(ends, lens.tolist(), strict=True)]


def exact_distribution(tokenizer: Tokenizer, text: str, alpha: float) -> dict[tuple[int, ...], float]:
    """Every segmentation of the normalised text into vocabulary pieces, enumerated, with
    probability proportional to exp(alpha * sum of piece scores)."""
    model = tokenizer._model("source")
    vocab = {model.id_to_piece(i): (i, model.get_score(i)) for i in range(model.get_piece_size())
             if not (model.is_control(i) or model.is_unknown(i))}
    normalised = "".join(tokenizer.pieces([text], "source")[0])

    def segmentations(rest: str):
        if not rest:
            yield (), 0.0
        for end in range(1, len(rest) + 1):
            if rest[:end] in vocab:
                piece, score = vocab[rest[:end]]
                for tail, tail_score in segmentations(rest[end:]):
                    yield (piece, *tail), score + tail_score

    weights = {ids: math.exp(alpha * score) for ids, score in segmentations(normalised)}
    total = sum(weights.values())
    return {ids: w / total for ids, w in weights.items()}


def total_variation(counts: Counter, exact: dict) -> float:
    n = sum(counts.values())
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


def test_samples_follow_the_unigram_lattice_distribution(tokenizer):
    """FFBS over per-word lattices gives the distribution over whole-sentence segmentations
    that naive enumeration gives, and that sentencepiece's own sampler draws from."""
    alpha, n = 0.1, 20000
    exact = exact_distribution(tokenizer, SENTENCE, alpha)
    assert len(exact) > 20  # enough segmentations for the comparison to mean something
    ids, lens = tokenizer.sampler([SENTENCE] * n, "source", alpha=alpha).sample(np.random.default_rng(1))
    ours = Counter(rows_of(ids, lens))
    model = tokenizer._model("source")
    theirs = Counter(map(tuple, model.encode([SENTENCE] * n, out_type=int, enable_sampling=True, alpha=alpha,
                                             nbest_size=-1)))
    assert total_variation(ours, exact) < 0.04
    assert total_variation(theirs, exact) < 0.04
    # a wrong alpha is visibly another distribution
    assert total_variation(ours, exact_distribution(tokenizer, SENTENCE, 0.2)) > 0.2


def test_nbest_samples_are_the_k_best_weighted_by_their_scores(tokenizer):
    model = tokenizer._model("source")
    alpha, k, n = 0.5, 4, 20000
    candidates = [tuple(c) for c in model.nbest_encode(SENTENCE, nbest_size=k, out_type=int)]
    weights = [math.exp(alpha * sum(model.get_score(i) for i in c)) for c in candidates]
    exact = {c: w / sum(weights) for c, w in zip(candidates, weights, strict=True)}
    ids, lens = tokenizer.sampler([SENTENCE] * n, "source", alpha=alpha, nbest=k).sample(np.random.default_rng(2))
    drawn = Counter(rows_of(ids, lens))
    assert set(drawn) <= set(candidates)
    assert total_variation(drawn, exact) < 0.02


def test_a_sample_decodes_to_the_text_and_a_sharp_alpha_gives_the_one_best(tokenizer):
    texts = list(_TRAINED["rows"]["de"][:500]) + ["", "Ein Hund ☃ läuft.", "  zwei   Leerzeichen  "]
    best = tokenizer.encode(texts, "source")
    sampler = tokenizer.sampler(texts, "source", alpha=0.2)
    sampled = rows_of(*sampler.sample(np.random.default_rng(0)))
    assert tokenizer.decode(sampled, "source") == tokenizer.decode(best, "source")
    assert sum(s != tuple(b) for s, b in zip(sampled, best, strict=True)) > 250  # most were re-segmented
    assert sampled[-3] == () and 1 in sampled[-2]  # the snowman has no piece: one-best, with unk
    sharp = rows_of(*tokenizer.sampler(texts, "source", alpha=1e4).sample(np.random.default_rng(0)))
    assert sharp == [tuple(b) for b in best]
    for nbest in (-1, 4):  # nothing to segment at all
        ids, lens = tokenizer.sampler(["", ""], "source", alpha=0.2, nbest=nbest).sample(np.random.default_rng(0))
        assert ids.size == 0 and lens.tolist() == [0, 0]


SCRIPT = """
import hashlib, sys
import numpy as np
from xformer.data.tokenizer import Tokenizer
tok = Tokenizer.load(sys.argv[1], "de", "en")
texts = open(sys.argv[2], encoding="utf-8").read().splitlines()
for nbest in (-1, 8):
    ids, lens = tok.sampler(texts, "source", alpha=0.3, nbest=nbest).sample(np.random.default_rng([7, 3, 0]))
    print(hashlib.sha256(ids.tobytes() + lens.tobytes()).hexdigest())
"""


def test_the_same_seed_samples_the_same_pieces_in_another_process(tokenizer, tmp_path):
    """sentencepiece's sampler salts its seed per process; ours must not."""
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(_TRAINED["rows"]["de"][:1000]), encoding="utf-8")
    directory = str(tokenizer.files[0].parent)
    runs = [subprocess.run([sys.executable, "-c", SCRIPT, directory, str(texts)], capture_output=True, text=True,
                           check=True).stdout for _ in range(2)]
    assert runs[0] == runs[1] and len(set(runs[0].split())) == 2
