"""Subword regularization as a pure function of a seed (Kudo 2018, arXiv:1804.10959).

sentencepiece's own sampler (`encode(..., enable_sampling=True)`) draws from absl's BitGen,
whose seeded sequences are salted with per-process entropy: the same seed gives other
segmentations in another process, so a run that samples could neither be repeated nor
resumed exactly. This module samples from the same distributions with numpy generators:

- nbest = -1 (all segmentations): P(x) proportional to P_unigram(x)^alpha over every
  segmentation x of the text, drawn by forward-filtering backward-sampling over the lattice
  of vocabulary pieces, as sentencepiece's `Lattice::Sample` does.
- nbest = k: one of the text's k best segmentations (sentencepiece's deterministic
  `nbest_encode`), with probability proportional to exp(alpha * score).

A unigram piece never spans a word boundary (pieces carry '▁' only at their start), so the
lattice of a sentence is the concatenation of its words' lattices and P^alpha factorises:
sampling every word on its own is sampling the sentence. Each distinct word's lattice is
built once; an epoch is then a few vectorised draws over all word occurrences at once
(a tenth of a second for Multi30k's 29k pairs). A word holding a character that has no piece
of its own keeps its one-best segmentation (sentencepiece would offer an unknown-piece edge).

A generated draw is the same on every machine and in every process for the same
(seed, stream): numpy's PCG64 behind `default_rng` is specified, not salted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import sentencepiece as spm

WORD_START = "\u2581"  # '▁', sentencepiece's whitespace mark


class UnigramSampler:
    """Sampled segmentations of a fixed list of texts under one sentencepiece unigram model.

    `sample(rng)` -> (ids, lens): all texts' piece ids concatenated (int32) and each text's
    piece count (int64), the layout BatchIterator keeps. The same generator state gives the
    same segmentations.
    """

    def __init__(self, model: spm.SentencePieceProcessor, texts: Sequence[str | None], *, alpha: float,
                 nbest: int = -1):
        if not 0 < alpha:
            raise ValueError(f"alpha must be positive, got {alpha}")
        if nbest != -1 and nbest < 2:
            raise ValueError(f"nbest must be -1 or at least 2, got {nbest}")
        texts = [t or "" for t in texts]
        self.n_texts = len(texts)
        self.alpha, self.nbest = alpha, nbest
        if nbest == -1:
            self._table = _WordLattices(model, texts, alpha)
        else:
            self._table = _NBestLists(model, texts, nbest, alpha)

    def sample(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return self._table.sample(rng)


class _Choices:
    """Many small categorical distributions, drawn from together.

    Distribution g owns a block of options with cumulative probabilities cum (the last one
    exactly 1). Keys g + cum increase over the whole array, so one searchsorted of g + u
    picks an option of every g at once."""

    def __init__(self, owner: np.ndarray, probs: np.ndarray, n_groups: int):
        self.last = np.full(n_groups, -1, dtype=np.int64)
        if not len(owner):  # nothing to choose (every text empty)
            self.keys = np.zeros(0)
            return
        cum = np.empty_like(probs)
        ends = np.flatnonzero(np.r_[owner[1:] != owner[:-1], True])  # last option of each block
        starts = np.r_[0, ends[:-1] + 1]
        totals = np.add.reduceat(probs, starts)
        cum[:] = np.cumsum(probs)
        cum -= np.repeat(np.r_[0.0, np.cumsum(totals)[:-1]], ends - starts + 1)
        cum /= np.repeat(totals, ends - starts + 1)
        cum[ends] = 1.0
        self.keys = owner.astype(np.float64) + cum
        self.last[owner[ends]] = ends

    def draw(self, groups: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One option index for each entry of `groups` (every group must have options)."""
        picked = np.searchsorted(self.keys, groups + rng.random(len(groups)), side="right")
        return np.minimum(picked, self.last[groups])  # g + u can round up to g + 1


class _WordLattices:
    """nbest = -1: forward-filtering backward-sampling over each distinct word's lattice.

    Nodes are positions in a word (0..n); an edge (i -> j, piece) covers word[i:j]. Forward:
    F[j] = logsumexp over edges into j of F[i] + alpha * score. Backward: from the word's end,
    take an edge into the current node with probability exp(F[i] + alpha * score - F[j])."""

    def __init__(self, model: spm.SentencePieceProcessor, texts: list[str], alpha: float):
        vocab: dict[str, tuple[int, float]] = {}
        for i in range(model.get_piece_size()):
            if not (model.is_control(i) or model.is_unknown(i) or model.is_unused(i) or model.is_byte(i)):
                vocab[model.id_to_piece(i)] = (i, model.get_score(i))
        longest = max(map(len, vocab), default=1)
        pieces = model.encode(texts, out_type=str)
        best_ids = model.encode(texts, out_type=int)
        word_index: dict[str, int] = {}
        occurrence_word, occurrence_text = [], []
        src, dst, edge_piece, edge_prob = [], [], [], []
        word_first, word_last = [], []  # global node ids of each word's start and end
        n_nodes = 0

        def add_word(word: str, best: list[int]) -> None:
            nonlocal n_nodes
            base = n_nodes
            edges = _lattice(word, vocab, longest, alpha)
            if edges is None:  # a character without a piece: keep the one-best chain
                edges = [(j, j + 1, piece, 1.0) for j, piece in enumerate(best)]
                n = len(best)
            else:
                n = len(word)
            for i, j, piece, prob in edges:
                src.append(base + i)
                dst.append(base + j)
                edge_piece.append(piece)
                edge_prob.append(prob)
            word_first.append(base)
            word_last.append(base + n)
            n_nodes += n + 1

        for t, (text_pieces, ids) in enumerate(zip(pieces, best_ids, strict=True)):
            start = 0
            for k in range(1, len(text_pieces) + 1):
                if k == len(text_pieces) or text_pieces[k].startswith(WORD_START):
                    word = "".join(text_pieces[start:k])
                    index = word_index.get(word)
                    if index is None:
                        index = word_index[word] = len(word_first)
                        add_word(word, ids[start:k])
                    occurrence_word.append(index)
                    occurrence_text.append(t)
                    start = k
        dst_arr = np.asarray(dst, dtype=np.int64)
        order = np.argsort(dst_arr, kind="stable")  # edges grouped by the node they end in
        self.src = np.asarray(src, dtype=np.int64)[order]
        self.piece = np.asarray(edge_piece, dtype=np.int32)[order]
        self.choices = _Choices(dst_arr[order], np.asarray(edge_prob, dtype=np.float64)[order], n_nodes)
        self.first = np.asarray(word_first, dtype=np.int64)[occurrence_word]
        self.last = np.asarray(word_last, dtype=np.int64)[occurrence_word]
        self.occurrence_text = np.asarray(occurrence_text, dtype=np.int64)
        self.n_texts = len(texts)

    def sample(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        node = self.last.copy()
        active = np.flatnonzero(node != self.first)
        taken_by, taken_step, taken_piece = [], [], []
        step = 0
        while active.size:  # one piece of every unfinished word per round, from its end backwards
            edge = self.choices.draw(node[active], rng)
            taken_by.append(active)
            taken_step.append(np.full(active.size, step, dtype=np.int64))
            taken_piece.append(self.piece[edge])
            node[active] = self.src[edge]
            active = active[node[active] != self.first[active]]
            step += 1
        if not taken_by:
            return np.zeros(0, np.int32), np.zeros(self.n_texts, np.int64)
        by, steps, ids = np.concatenate(taken_by), np.concatenate(taken_step), np.concatenate(taken_piece)
        order = np.lexsort((-steps, by))  # words in text order, each word's pieces front to back
        per_word = np.bincount(by, minlength=len(self.last))
        lens = np.bincount(self.occurrence_text, weights=per_word, minlength=self.n_texts).astype(np.int64)
        return ids[order].astype(np.int32), lens


def _lattice(word: str, vocab: dict[str, tuple[int, float]], longest: int,
             alpha: float) -> list[tuple[int, int, int, float]] | None:
    """Edges (i, j, piece id, backward probability) of `word`'s lattice, or None when some
    character has no piece of its own."""
    n = len(word)
    into: list[list[tuple[int, int, float]]] = [[] for _ in range(n + 1)]
    for i in range(n):
        if word[i] not in vocab:
            return None
        for j in range(i + 1, min(n, i + longest) + 1):
            hit = vocab.get(word[i:j])
            if hit is not None:
                into[j].append((i, hit[0], alpha * hit[1]))
    forward = [0.0] + [-math.inf] * n
    for j in range(1, n + 1):  # every node is reachable: single characters chain them
        terms = [forward[i] + s for i, _, s in into[j]]
        top = max(terms)
        forward[j] = top + math.log(sum(math.exp(x - top) for x in terms))
    return [(i, j, piece, math.exp(forward[i] + s - forward[j]))
            for j in range(1, n + 1) for i, piece, s in into[j]]


class _NBestLists:
    """nbest = k: each text's k best segmentations, weighted exp(alpha * score)."""

    def __init__(self, model: spm.SentencePieceProcessor, texts: list[str], nbest: int, alpha: float):
        lists = model.nbest_encode(texts, nbest_size=nbest, out_type=int)
        scores = np.array([model.get_score(i) for i in range(model.get_piece_size())], dtype=np.float64)
        scores[model.unk_id()] = scores.min() - 10.0  # sentencepiece's unigram kUnkPenalty
        candidate_lens, owner, flat = [], [], []
        for t, candidates in enumerate(lists):
            for ids in candidates or [[]]:
                candidate_lens.append(len(ids))
                owner.append(t)
                flat.extend(ids)
        self.ids = np.asarray(flat, dtype=np.int32)
        self.lens = np.asarray(candidate_lens, dtype=np.int64)
        self.starts = np.r_[0, np.cumsum(self.lens)[:-1]].astype(np.int64)
        owner_arr = np.asarray(owner, dtype=np.int64)
        starts = np.flatnonzero(np.r_[True, owner_arr[1:] != owner_arr[:-1]])
        total = np.add.reduceat(np.r_[scores[self.ids], 0.0], self.starts)  # the 0 ends a trailing empty one
        total[self.lens == 0] = 0.0
        logits = alpha * total
        best = np.maximum.reduceat(logits, starts)
        probs = np.exp(logits - np.repeat(best, np.diff(np.r_[starts, len(owner)])))
        self.choices = _Choices(owner_arr, probs, len(texts))
        self.n_texts = len(texts)

    def sample(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        picked = self.choices.draw(np.arange(self.n_texts), rng)
        lens = self.lens[picked]
        ends = np.cumsum(lens)
        positions = np.repeat(self.starts[picked] - (ends - lens), lens) + np.arange(int(ends[-1]) if len(ends) else 0)
        return self.ids[positions], lens
