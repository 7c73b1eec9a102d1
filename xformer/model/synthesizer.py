"""Synthesizer's random attention (Tay et al. 2020, arXiv:2005.00743, section 3.1.2): each
head's attention weights are a learned (L, L) table of scores, softmax(R[q, k]) over the keys
a query may see, whatever the input; the values are still the input's. It is the "attention is
a fixed learned mixing of positions" baseline that dot-product attention is compared with.

model.attention = "synthesizer": every self-attention gets its own table (the scores of its
position pairs), passed as the attention's `score_bias`, and no query or key projections (the
content score q.k is not computed: it is zero). Cross-attention keeps dot products. Tables
are max_positions x max_positions per head, so a synthesizer recipe sets model.max_positions
to its longest sequence."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class SynthesizerScores(nn.Module):
    """Learned scores R (H, L, L) of every (query position, key position) pair; `bias` is the
    score_bias interface the attention module adds to its scores."""

    ACTS_ON = "scores"

    def __init__(self, n_heads: int, max_positions: int):
        super().__init__()
        self.table = nn.Parameter(torch.empty(n_heads, max_positions, max_positions))
        self.init_fairseq_()

    def init_fairseq_(self) -> None:
        """N(0, 1): scores of the spread a dot product q.k / sqrt(Dh) has at initialisation."""
        nn.init.normal_(self.table)

    def bias(self, q: Tensor, k: Tensor) -> Tensor:
        """(H, T, S) for queries at absolute positions q (T,) and keys at k (S,)."""
        return self.table[:, q][:, :, k]
