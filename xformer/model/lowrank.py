"""Low-rank attention: Linformer (Wang et al. 2020, arXiv:2006.04768).

Keys and values are projected along the sequence, K' = E K and V' = F V with learned E, F of
shape (rank, n), so every query attends to `rank` mixtures of the sequence instead of its n
tokens: O(n * rank) instead of O(n^2). E and F belong to one layer and are shared by its heads
(the paper's "headwise sharing"); a sequence shorter than model.max_positions uses their first
n columns. Padded keys and values are zeroed before the projection, so padding adds nothing.

A projected key is not a token, so the pattern is for encoders and classifiers only: a causal
decoder cannot mix future keys into a query's keys (the config refuses it), and inspect-heads
has no token to name a head's attention after (it refuses such runs).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class LowRankProjection(nn.Module):
    """E and F of one attention layer: (B, K, S, Dh) keys and values -> (B, K, rank, Dh)."""

    def __init__(self, rank: int, max_positions: int):
        super().__init__()
        self.rank, self.max_positions = rank, max_positions
        self.e = nn.Parameter(torch.empty(rank, max_positions))
        self.f = nn.Parameter(torch.empty(rank, max_positions))
        self.init_fairseq_()

    def init_fairseq_(self) -> None:
        """N(0, 1/rank): a projected key starts as a random mixture of the sequence's keys at
        their own scale on average (Linformer initialises E and F likewise, Xavier-style)."""
        for p in (self.e, self.f):
            nn.init.normal_(p, std=self.rank**-0.5)

    def forward(self, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """k, v: (B, K, S, Dh); mask: the padding mask (B, 1, 1, S), True at real keys, or None.
        Returns E k and F v, (B, K, rank, Dh)."""
        s = k.size(2)
        if mask is not None:
            keep = mask[:, 0, 0, :, None][:, None].to(k.dtype)  # (B, 1, S, 1)
            k, v = k * keep, v * keep
        e, f = self.e[:, :s].to(k.dtype), self.f[:, :s].to(v.dtype)
        return e @ k, f @ v  # (rank, S) @ (B, K, S, Dh) -> (B, K, rank, Dh)
