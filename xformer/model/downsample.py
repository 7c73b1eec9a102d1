"""Hierarchical compression of the encoder sequence, one entry per `model.downsample` value
(Funnel-Transformer, Dai et al. 2020, arXiv:2006.03236): after every `downsample_every`
encoder layers the sequence is halved, so later layers, the decoder's cross-attention and the
classifier's pooling run over n / 2, n / 4, ... positions.

    pool   the mean of each pair of positions (Funnel's stride-2 mean pooling), padding left
           out of the mean
    conv   a learned stride-2 convolution over each pair (kernel 2, D -> D), padding zeroed first

Pairs start after the first `keep` positions, which pass through untouched (the classifier's
CLS vector, as Funnel keeps [CLS] out of pooling). An odd tail is paired with a padding
position. A pooled position is padding when both of its pair are, so with right padding the
real positions of a sequence stay a prefix and appending padding changes nothing.

Positions after a downsampling are renumbered 0 .. n' - 1 for patterns and for positions that
act inside attention (rope, alibi, relative): a window then spans 2^levels tokens per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def pooled_padding(pad: Tensor, keep: int = 0) -> Tensor:
    """(B, S) True at padding -> (B, keep + ceil((S - keep) / 2)): a pair is padding if both are."""
    tail = pad[:, keep:]
    if tail.size(1) % 2:
        tail = F.pad(tail, (0, 1), value=True)
    return torch.cat([pad[:, :keep], tail.view(pad.size(0), -1, 2).all(2)], dim=1)


def _pairs(x: Tensor, pad: Tensor, keep: int) -> tuple[Tensor, Tensor]:
    """x (B, S, D) past `keep`, padding zeroed and an odd tail padded: (B, S' , 2, D), and the
    real-position weights (B, S', 2, 1)."""
    tail, real = x[:, keep:], (~pad[:, keep:]).to(x.dtype)
    if tail.size(1) % 2:
        tail, real = F.pad(tail, (0, 0, 0, 1)), F.pad(real, (0, 1))
    b, s, d = tail.shape
    real = real.view(b, s // 2, 2, 1)
    return tail.view(b, s // 2, 2, d) * real, real


class MeanPool(nn.Module):
    """Funnel's mean pooling with stride 2: each pair's real positions averaged (0 for a pair of padding)."""

    def forward(self, x: Tensor, pad: Tensor, keep: int = 0) -> tuple[Tensor, Tensor]:
        pairs, real = _pairs(x, pad, keep)
        pooled = pairs.sum(2) / real.sum(2).clamp(min=1)
        return torch.cat([x[:, :keep], pooled], dim=1), pooled_padding(pad, keep)


class StridedConv(nn.Module):
    """A learned stride-2 convolution over each pair: W [x_2i; x_2i+1] + b, padding zeroed first."""

    def __init__(self, d_model: int):
        super().__init__()
        self.proj = nn.Linear(2 * d_model, d_model)

    def init_fairseq_(self) -> None:
        nn.init.xavier_uniform_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor, pad: Tensor, keep: int = 0) -> tuple[Tensor, Tensor]:
        pairs, _ = _pairs(x, pad, keep)
        pooled = self.proj(pairs.flatten(2))  # (B, S', 2D) -> (B, S', D)
        return torch.cat([x[:, :keep], pooled], dim=1), pooled_padding(pad, keep)


# One entry per `model.downsample` value: d_model -> module.
DOWNSAMPLERS = {"pool": lambda d_model: MeanPool(), "conv": StridedConv}
