"""Token-based batching (as in fairseq, Ott et al. 2019, arXiv:1904.01038) and collation.

Batches hold a budget of padded tokens rather than a number of sentences: pairs are sorted
by length, so each batch pads little, and cut greedily so that

    B * max(S, T) <= max_tokens     S = longest source + 1 (EOS), T = longest target + 1 (BOS/EOS)

Each batch is collated into

    src     (B, S)  source pieces + EOS, right-padded
    tgt_in  (B, T)  BOS + target pieces      (decoder input)
    tgt_out (B, T)  target pieces + EOS      (what the decoder predicts)

Right padding plus the causal mask means no real target position ever sees a pad, so the
decoder needs no target padding mask (docs/DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import chain

import datasets
import numpy as np
import pyarrow.compute as pc
import torch

from xformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer
from xformer.errors import DataError


def token_batches(
    src_lens: Sequence[int] | np.ndarray, tgt_lens: Sequence[int] | np.ndarray, max_tokens: int, *,
    shuffle: bool, seed: int, epoch: int,
) -> list[list[int]]:
    """Indices of the examples in each batch, every example exactly once.

    Sorted by (source length, target length); with `shuffle`, ties are broken at random and
    the order of the batches is shuffled, both with a generator seeded from (seed, epoch), so
    an epoch is reproducible and each epoch differs. Without `shuffle`, batches come shortest
    first (good for validation). A single example longer than max_tokens gets a batch of its
    own, over budget, rather than being dropped here (encode_split's max_len drops those).
    """
    src = np.asarray(src_lens, dtype=np.int64) + 1  # + EOS
    tgt = np.asarray(tgt_lens, dtype=np.int64) + 1  # + BOS (tgt_in) or EOS (tgt_out)
    if src.shape != tgt.shape or src.ndim != 1:
        raise ValueError(f"src_lens and tgt_lens must be 1-d and equal in length, got {src.shape} and {tgt.shape}")
    rng = np.random.default_rng([seed, epoch]) if shuffle else None
    key = (src << 32) | tgt  # one int64 sorts by (src, tgt): lengths are int32 (np.lexsort is 3x slower)
    if rng is None:
        order = np.argsort(key, kind="stable")  # ties in index order
    else:  # a stable sort of a random permutation breaks ties at random
        permuted = rng.permutation(len(key))
        order = permuted[np.argsort(key[permuted], kind="stable")]
    width = np.maximum(src, tgt)[order]
    src_sorted = src[order]
    ends, start, n = [], 0, len(order)
    while start < n:
        # Every later example is at least src_sorted[start] wide (sorted by source length), so a
        # batch starting here holds at most this many; scanning only that window keeps this
        # loop per batch, not per example.
        window = width[start:start + max(1, max_tokens // src_sorted[start]) + 1]
        fits = np.arange(1, len(window) + 1) * np.maximum.accumulate(window) <= max_tokens
        size = len(window) if fits.all() else max(1, int(np.argmin(fits)))
        start += size
        ends.append(start)
    batches = [chunk.tolist() for chunk in np.split(order, ends[:-1])] if n else []
    if rng is not None:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def collate(
    examples: list[tuple[list[int], list[int]]], pad_id: int = PAD_ID, bos_id: int = BOS_ID, eos_id: int = EOS_ID,
) -> dict:
    """(source ids, target ids) pairs without BOS/EOS -> {"src" (B, S), "tgt_in" (B, T),
    "tgt_out" (B, T): LongTensors; "n_src_tokens", "n_tgt_tokens": non-pad counts (ints)}."""
    src_lens = np.fromiter((len(s) for s, _ in examples), dtype=np.int64, count=len(examples))
    tgt_lens = np.fromiter((len(t) for _, t in examples), dtype=np.int64, count=len(examples))
    src_flat = np.fromiter(chain.from_iterable(s for s, _ in examples), dtype=np.int64, count=int(src_lens.sum()))
    tgt_flat = np.fromiter(chain.from_iterable(t for _, t in examples), dtype=np.int64, count=int(tgt_lens.sum()))
    return _collate_flat(src_flat, src_lens, tgt_flat, tgt_lens, pad_id, bos_id, eos_id)


def collate_source(sources: list[list[int]], pad_id: int = PAD_ID, eos_id: int = EOS_ID) -> torch.Tensor:
    """Source ids without EOS -> src (B, S) LongTensor: pieces + EOS, right-padded (for decoding)."""
    lens = np.fromiter((len(s) for s in sources), dtype=np.int64, count=len(sources))
    flat = np.fromiter(chain.from_iterable(sources), dtype=np.int64, count=int(lens.sum()))
    return torch.from_numpy(_pad(flat, lens, pad_id=pad_id, eos_id=eos_id))


def _collate_flat(src_flat, src_lens, tgt_flat, tgt_lens, pad_id, bos_id, eos_id) -> dict:
    """collate() from concatenated ids and per-example lengths (what Arrow hands over)."""
    n = len(src_lens)
    return {
        "src": torch.from_numpy(_pad(src_flat, src_lens, pad_id=pad_id, eos_id=eos_id)),
        "tgt_in": torch.from_numpy(_pad(tgt_flat, tgt_lens, pad_id=pad_id, bos_id=bos_id)),
        "tgt_out": torch.from_numpy(_pad(tgt_flat, tgt_lens, pad_id=pad_id, eos_id=eos_id)),
        "n_src_tokens": int(src_lens.sum()) + n,
        "n_tgt_tokens": int(tgt_lens.sum()) + n,
    }


def _pad(flat: np.ndarray, lens: np.ndarray, *, pad_id: int, bos_id: int | None = None,
         eos_id: int | None = None) -> np.ndarray:
    """Concatenated sequences `flat` with lengths `lens` (B,) -> (B, W) int64, each row
    [BOS] + ids + [EOS] + pads, W = max(lens) + the specials. One vectorised scatter: the
    True cells of `cells`, read row by row, are exactly the positions of `flat` in order."""
    first = 0 if bos_id is None else 1
    width = (int(lens.max()) if len(lens) else 0) + first + (eos_id is not None)
    out = np.full((len(lens), width), pad_id, dtype=np.int64)
    column = np.arange(width)
    cells = (column >= first) & (column < first + lens[:, None])
    out[cells] = flat
    if bos_id is not None:
        out[:, 0] = bos_id
    if eos_id is not None:
        out[np.arange(len(lens)), first + lens] = eos_id
    return out


class BatchIterator:
    """Collated token batches over an encoded split (encode_split's columns src_ids, tgt_ids,
    src_len, tgt_len), one epoch at a time.

    The ids are copied once out of Arrow into two flat int32 arrays (4 bytes a piece: about
    1 GB for WMT14 en-de's 4.5M pairs), so a batch is a numpy gather and one scatter per
    side. On Multi30k that is ~0.2 ms a batch at 4096 tokens and ~0.5 ms at 16384 on one CPU
    core, where fetching rows through datasets (`dataset[indices]`) costs ~2 ms and ~7 ms.
    """

    def __init__(self, dataset: datasets.Dataset, max_tokens: int, *, seed: int, shuffle: bool = True):
        dataset = dataset.select_columns(["src_ids", "tgt_ids", "src_len", "tgt_len"])
        if dataset._indices is not None:
            # A select/filter/shuffle result reads through an indices mapping, which `[:]` turns
            # into one Arrow chunk per row (slow past a few thousand); rewrite it contiguous first.
            dataset = dataset.flatten_indices()
        table = dataset.with_format("arrow")[:]  # memory-mapped chunks, no copy
        src_lens = table.column("src_len").to_numpy().astype(np.int64)
        tgt_lens = table.column("tgt_len").to_numpy().astype(np.int64)
        self._set(_flatten(table.column("src_ids"), src_lens), src_lens,
                  _flatten(table.column("tgt_ids"), tgt_lens), tgt_lens, max_tokens, seed, shuffle)

    @classmethod
    def from_flat(cls, src: tuple[np.ndarray, np.ndarray], tgt: tuple[np.ndarray, np.ndarray], max_tokens: int,
                  *, seed: int, shuffle: bool = True) -> BatchIterator:
        """The same over ids already in memory: each side as (all ids concatenated, lengths),
        what UnigramSampler.sample returns."""
        self = cls.__new__(cls)
        (src_ids, src_lens), (tgt_ids, tgt_lens) = src, tgt
        self._set((src_ids, _starts(src_lens)), src_lens, (tgt_ids, _starts(tgt_lens)), tgt_lens,
                  max_tokens, seed, shuffle)
        return self

    def _set(self, src, src_lens, tgt, tgt_lens, max_tokens, seed, shuffle) -> None:
        self.src_lens, self.tgt_lens = src_lens, tgt_lens
        self._src_ids, self._src_starts = src
        self._tgt_ids, self._tgt_starts = tgt
        self.max_tokens, self.seed, self.shuffle = max_tokens, seed, shuffle
        self._len: int | None = None

    def batches(self, epoch: int) -> list[list[int]]:
        """The epoch's plan: dataset row indices of each batch, in order."""
        return token_batches(self.src_lens, self.tgt_lens, self.max_tokens,
                             shuffle=self.shuffle, seed=self.seed, epoch=epoch)

    def iter_epoch(self, epoch: int, skip: int = 0) -> Iterator[dict]:
        """Collated batches (see `collate`) of epoch `epoch`; `skip` leaves out the first
        batches without reading them, to resume mid-epoch exactly where a run stopped."""
        for indices in self.batches(epoch)[skip:]:
            rows = np.asarray(indices)
            src_lens, tgt_lens = self.src_lens[rows], self.tgt_lens[rows]
            yield _collate_flat(
                _gather(self._src_ids, self._src_starts[rows], src_lens), src_lens,
                _gather(self._tgt_ids, self._tgt_starts[rows], tgt_lens), tgt_lens, PAD_ID, BOS_ID, EOS_ID,
            )

    def __len__(self) -> int:
        # Ties are the only thing an epoch's seed changes inside the sort, and tied examples have
        # equal lengths, so every epoch cuts the same number of batches.
        if self._len is None:
            self._len = len(self.batches(0))
        return self._len


class SampledBatchIterator:
    """Batches of training pairs re-segmented every epoch (data.sampling_alpha: subword
    regularization, Kudo 2018, arXiv:1804.10959, or BPE-dropout, arXiv:1910.13267).

    Each epoch segments every pair afresh with data.sampling's UnigramSampler, from numpy
    generators seeded with (seed, epoch, side), then batches it as BatchIterator does: the same
    (seed, epoch) gives the same batches in any process, so a run repeats and resuming mid-epoch
    with `skip` is exact. Pairs whose sampled segmentation is empty or longer than max_len on
    either side sit out that epoch. Building the samplers reads every training text once
    (about 3 s per side for Multi30k's 29k pairs); an epoch's draw then takes ~0.15 s a side.
    """

    def __init__(self, split: datasets.Dataset, tokenizer: Tokenizer, source_lang: str, target_lang: str,
                 max_tokens: int, *, seed: int, alpha: float, nbest: int, max_len: int):
        self.samplers = [tokenizer.sampler(split[lang], side, alpha=alpha, nbest=nbest)
                         for lang, side in ((source_lang, "source"), (target_lang, "target"))]
        self.max_tokens, self.seed, self.max_len = max_tokens, seed, max_len
        self._cached: tuple[int, BatchIterator] | None = None

    def epoch(self, epoch: int) -> BatchIterator:
        """Epoch `epoch`'s sampled pairs, batched (the last one asked for is kept)."""
        if self._cached is None or self._cached[0] != epoch:
            src_ids, src_lens = self.samplers[0].sample(np.random.default_rng([self.seed, epoch, 0]))
            tgt_ids, tgt_lens = self.samplers[1].sample(np.random.default_rng([self.seed, epoch, 1]))
            kept = np.flatnonzero((src_lens > 0) & (src_lens <= self.max_len) & (tgt_lens > 0)
                                  & (tgt_lens <= self.max_len))
            if not kept.size:  # else the trainer would loop over empty epochs
                raise DataError(f"data.max_len = {self.max_len}: no training pair's sampled segmentation (epoch "
                                f"{epoch}) has 1 to max_len pieces on both sides; raise data.max_len")
            sides = [(_gather(ids, _starts(lens)[kept], lens[kept]), lens[kept])
                     for ids, lens in ((src_ids, src_lens), (tgt_ids, tgt_lens))]
            self._cached = (epoch, BatchIterator.from_flat(*sides, self.max_tokens, seed=self.seed))
        return self._cached[1]

    def iter_epoch(self, epoch: int, skip: int = 0) -> Iterator[dict]:
        """BatchIterator.iter_epoch over this epoch's sampling."""
        return self.epoch(epoch).iter_epoch(epoch, skip)

    def __len__(self) -> int:
        """Batches in the epoch last sampled (epoch 0 before any): sampled lengths, and so the
        count, change a little from epoch to epoch."""
        return len(self.epoch(self._cached[0] if self._cached else 0))


def _starts(lens: np.ndarray) -> np.ndarray:
    """Where each row starts in the concatenation of rows with lengths `lens`."""
    return np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)


def _flatten(column, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A list<int32> Arrow column -> (all ids concatenated, start of each row). Chunk by
    chunk, since one combined list array would overflow its int32 offsets past 2^31 ids."""
    ids = np.concatenate([pc.list_flatten(chunk).to_numpy() for chunk in column.chunks] or [np.zeros(0, np.int32)])
    starts = _starts(lens)
    if len(ids) != lens.sum():
        raise ValueError(f"the length columns count {lens.sum()} ids but the id column holds {len(ids)}")
    return ids, starts


def _gather(ids: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The ids of rows starting at `starts` with lengths `lens`, concatenated (no Python loop)."""
    ends = np.cumsum(lens)
    return ids[np.repeat(starts - (ends - lens), lens) + np.arange(int(ends[-1]) if len(ends) else 0)]
