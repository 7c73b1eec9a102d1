"""Position encodings, one entry per `model.positional` value.

Each module maps (B, T, D) embeddings to (B, T, D), adding the encoding of positions
`offset .. offset + T - 1` (offset > 0 when decoding with a KV cache). Rotary positions add
nothing there: self-attention rotates its queries and keys instead (`RotaryPositional.rotate`).
"""

import math

import torch
from torch import Tensor, nn


class SinusoidalPositional(nn.Module):
    """Fixed sinusoids of Vaswani et al. 2017 (arXiv:1706.03762), section 3.5:
    PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(p / 10000^(2i/D)), p from 0.

    (fairseq instead concatenates the sin and cos halves and starts at padding_idx + 1;
    the two are equivalent up to a permutation of features and a shift of positions.)
    """

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        position = torch.arange(max_positions, dtype=torch.float32)[:, None]
        inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_positions, d_model)
        table[:, 0::2] = torch.sin(position * inv_freq)
        table[:, 1::2] = torch.cos(position * inv_freq)
        # Not saved in checkpoints: it is a function of the config.
        self.register_buffer("table", table, persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        return x + self.table[offset : offset + x.size(1)].to(x.dtype)


class LearnedPositional(nn.Module):
    """A learned embedding per position (Gehring et al. 2017, arXiv:1705.03122; BERT).

    Initialised N(0, std^2), by default std = D^-1/2 (fairseq's); build_model passes std = 1
    when token embeddings are scaled by sqrt(D), so positions start at the scale of the tokens
    they are added to. At D^-1/2 against unit-scale tokens a 2-layer classifier never learned
    associative recall (positions 8x weaker than tokens); at matched scale it did in 1000 steps.
    """

    def __init__(self, d_model: int, max_positions: int, std: float | None = None):
        super().__init__()
        self.embedding = nn.Embedding(max_positions, d_model)
        nn.init.normal_(self.embedding.weight, mean=0.0, std=d_model**-0.5 if std is None else std)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        positions = torch.arange(offset, offset + x.size(1), device=x.device)
        return x + self.embedding(positions)


class RotaryPositional(nn.Module):
    """Rotary position embedding, RoPE (Su et al. 2021, arXiv:2104.09864).

    Feature pairs (i, i + Dh/2) of every query and key at position p are rotated by the angle
    p * base^(-2i/Dh) (the half-split pairing of GPT-NeoX and Llama), so q_p . k_r depends on
    p - r only. Embeddings pass through unchanged; build_model hands this module to every
    self-attention, which calls `rotate`. Cross-attention stays position-free.
    """

    def __init__(self, head_dim: int, max_positions: int, base: float = 10000.0):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (Dh/2,)
        angle = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq  # (P, Dh/2)
        self.register_buffer("cos", torch.cat([angle.cos(), angle.cos()], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([angle.sin(), angle.sin()], dim=-1), persistent=False)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        return x

    def rotate(self, x: Tensor, offset: int = 0) -> Tensor:
        """x: (B, H, T, Dh) queries or keys at positions offset .. offset + T - 1."""
        t, half = x.size(-2), x.size(-1) // 2
        cos = self.cos[offset : offset + t].to(x.dtype)  # (T, Dh)
        sin = self.sin[offset : offset + t].to(x.dtype)
        rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated_half * sin


POSITIONAL = {"sinusoidal": SinusoidalPositional, "learned": LearnedPositional, "rope": RotaryPositional}
