"""Position encodings, one entry per `model.positional` value. Each declares where it acts
(ACTS_ON), and build_model hands it to every self-attention it acts in:

    "embeddings"  added to the token embeddings: forward((B, T, D), offset) -> (B, T, D)
                  (sinusoidal, learned)
    "qk"          rotates every self-attention's queries and keys: rotate((B, H, T, Dh), offset)
                  (rope)
    "scores"      an additive bias on every self-attention's scores: bias(q, k) -> (H, T, S) for
                  query positions q (T,) and key positions k (S,), a function of k - q only,
                  which the blocked kernels and flex rely on (alibi, relative)
    None          no position information at all (none)

Positions of new queries start at `offset` (> 0 when decoding with a KV cache); keys of a
self-attention are positions 0 .. s - 1. Cross-attention is position-free.
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

    ACTS_ON = "embeddings"

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

    ACTS_ON = "embeddings"

    def __init__(self, d_model: int, max_positions: int, std: float | None = None):
        super().__init__()
        self.embedding = nn.Embedding(max_positions, d_model)
        self.std = d_model**-0.5 if std is None else std
        self.init_fairseq_()

    def init_fairseq_(self) -> None:
        nn.init.normal_(self.embedding.weight, mean=0.0, std=self.std)

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

    ACTS_ON = "qk"

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


class NoPositional(nn.Module):
    """No position information (NoPE): attention is then permutation-equivariant in the
    encoder; a causal decoder can still infer positions from its mask (Haviv et al. 2022,
    arXiv:2203.16634)."""

    ACTS_ON = None

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        return x


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi's head slopes (Press et al. 2021, arXiv:2108.12409, section 3): for n a power of
    two the geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8); otherwise the slopes of the
    nearest smaller power of two c, followed by every other slope of 2c, as the paper's code does."""
    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    c = 2 ** math.floor(math.log2(n_heads))
    slopes = powers(c) if c == n_heads else powers(c) + powers(2 * c)[0::2][: n_heads - c]
    return torch.tensor(slopes)


class ALiBiBias(nn.Module):
    """ALiBi (Press et al. 2021, arXiv:2108.12409): no position embeddings; head h adds
    -m_h * |q - k| to its scores, m_h from `alibi_slopes`. The paper's model is causal, where
    |q - k| = q - k for every visible key; an encoder uses the same distance in both directions
    (the symmetric form of bidirectional ALiBi)."""

    ACTS_ON = "scores"

    def __init__(self, n_heads: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_heads), persistent=False)  # (H,)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        return x

    def bias(self, q: Tensor, k: Tensor) -> Tensor:
        """(H, T, S) for queries at absolute positions q (T,) and keys at k (S,)."""
        return -self.slopes[:, None, None] * (q[:, None] - k[None, :]).abs()


def t5_bucket(relative: Tensor, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """T5's bucket of a relative position k - q (Raffel et al. 2020, arXiv:1910.10683, section
    2.1): half the buckets (all of them causally, where only k <= q is seen) cover exact
    distances 0 .. n/2 - 1, the rest distances up to max_distance on a log scale, and every
    distance beyond shares the last bucket; bidirectionally, keys after the query get their
    own half of the buckets."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = num_buckets // 2
    far = exact + (torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (num_buckets - exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


class T5RelativeBias(nn.Module):
    """T5's relative position bias (Raffel et al. 2020, arXiv:1910.10683): a learned scalar
    per (head, bucket of k - q) added to the scores, shared by every layer of a stack; buckets
    from `t5_bucket` (32 buckets, max distance 128; bidirectional in the encoder, causal in
    the decoder). It is Shaw et al. 2018's relative positions (arXiv:1803.02155) reduced to a
    scalar per head and clipped distance, with log-spaced buckets instead of a hard clip."""

    ACTS_ON = "scores"

    def __init__(self, n_heads: int, bidirectional: bool, d_model: int, num_buckets: int = 32,
                 max_distance: int = 128):
        super().__init__()
        self.bidirectional, self.num_buckets, self.max_distance = bidirectional, num_buckets, max_distance
        self.embedding = nn.Embedding(num_buckets, n_heads)
        self.d_model = d_model
        self.init_fairseq_()

    def init_fairseq_(self) -> None:
        """N(0, D^-1/2), as T5 initialises it."""
        nn.init.normal_(self.embedding.weight, mean=0.0, std=self.d_model**-0.5)

    def forward(self, x: Tensor, offset: int = 0) -> Tensor:
        return x

    def bias(self, q: Tensor, k: Tensor) -> Tensor:
        """(H, T, S) for queries at absolute positions q (T,) and keys at k (S,)."""
        buckets = t5_bucket(k[None, :] - q[:, None], self.bidirectional, self.num_buckets,
                            self.max_distance)  # (T, S)
        return self.embedding(buckets).permute(2, 0, 1)  # (H, T, S)


# One entry per `model.positional` value (build_model passes each its own arguments).
POSITIONAL = {"sinusoidal": SinusoidalPositional, "learned": LearnedPositional, "rope": RotaryPositional,
              "alibi": ALiBiBias, "relative": T5RelativeBias, "none": NoPositional}
