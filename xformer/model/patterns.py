"""Attention patterns, one entry per `model.attention` value: which keys a query may see.

A pattern answers for absolute positions: `allowed(q, k)` takes query positions (T, 1) and
key positions (1, S) and returns a boolean (T, S), True where attendable, or None for every
key. Encoder, decoder and KV cache build their masks from it (`self_attention_mask`), combined
with padding and causality; a pattern that decides by score instead of position (top-k) gives
attention a `score_hook`, which only the explicit path runs (MultiHeadAttention routes to it).

    full            every key (Vaswani et al. 2017)
    sliding_window  keys fewer than `window` positions away (Longformer, Beltagy et al. 2020,
                    arXiv:2004.05150; causally: the window - 1 keys before and itself, Mistral)
    local_global    a sliding window, plus the first `global_tokens` positions, which every
                    query sees and which see every key (Longformer's global attention on
                    CLS / BOS; BigBird, Zaheer et al. 2020, arXiv:2007.14062)
    strided         keys fewer than `stride` away or a multiple of `stride` away: the strided
                    factorised pattern of Child et al. 2019 (arXiv:1904.10509) in one head
                    (the 1-D form of axial attention)
    topk            the `topk` largest scores of each query (Zhao et al. 2019, explicit sparse
                    attention, arXiv:1912.11637), the rest set to -inf before the softmax
    low_rank        `rank` learned mixtures of the keys and values (Linformer, Wang et al. 2020,
                    arXiv:2006.04768; model/lowrank.py); encoders only (a seq2seq decoder
                    keeps full attention)
    synthesizer     every key, scored by a learned table of (query, key) positions instead of
                    q.k (Synthesizer's random attention, Tay et al. 2020, arXiv:2005.00743;
                    model/synthesizer.py)

QUERY_DEPENDENT says whether a query's visible keys depend on where the query is (so the
pattern needs a mask); fast paths that compute a subset of query rows (the classifier's pooled
row) read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from xformer.config.schema import PATTERN_RULES
from xformer.config.strict import non_negative, positive
from xformer.model.banded import banded_attention, strided_attention


class Full:
    QUERY_DEPENDENT = False
    PROJECTS_KEYS = False  # whether attention sees projections of the keys instead of the keys (low_rank)
    CONTENT_FREE = False  # whether the scores ignore q.k (a learned table of positions: synthesizer)
    score_hook: Callable[[Tensor], Tensor] | None = None
    global_tokens = 0  # leading positions every query sees and that see every key


    @staticmethod
    def problems(cfg) -> list[str]:
        """What a [model] table (config.schema.ModelConfig) gets wrong for this pattern."""
        return []

    def allowed(self, q: Tensor, k: Tensor) -> Tensor | None:
        return None

    def banded(self, n: int) -> bool:
        """Whether a self-attention over n positions should run `blocked` (model/banded.py)
        instead of masking the dense (n, n) scores."""
        return False

    def blocked(self, q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
        """The pattern's own kernel, without the (T, S) matrix: banded_attention's arguments
        (`sdpa_dropout` a float: blocks through SDPA where the kernel can, with that dropout)."""
        raise NotImplementedError(f"{type(self).__name__} has no blocked kernel")

    def scored_keys(self, n: int) -> int:
        """How many scores a query row computes in a self-attention over n positions (what its
        time and memory grow with)."""
        return n


class SlidingWindow(Full):
    QUERY_DEPENDENT = True


    @staticmethod
    def problems(cfg) -> list[str]:
        return positive(cfg, "window")

    def __init__(self, window: int):
        self.window = window

    def allowed(self, q: Tensor, k: Tensor) -> Tensor:
        return (q - k).abs() < self.window

    def banded(self, n: int) -> bool:
        # a block scores ~3 windows of keys: it pays once they are well under the n keys of a row
        return n >= 4 * self.window

    def blocked(self, q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
        return banded_attention(q, k, v, self.window, exclude_below=self.global_tokens, **options)

    def scored_keys(self, n: int) -> int:
        block = min(self.window, 128)  # banded_attention's
        return block + 2 * (self.window - 1) + self.global_tokens if self.banded(n) else n


class LocalGlobal(SlidingWindow):
    @staticmethod
    def problems(cfg) -> list[str]:
        return positive(cfg, "window") + non_negative(cfg, "global_tokens")

    def __init__(self, window: int, global_tokens: int):
        super().__init__(window)
        self.global_tokens = global_tokens

    def allowed(self, q: Tensor, k: Tensor) -> Tensor:
        return super().allowed(q, k) | (k < self.global_tokens) | (q < self.global_tokens)


class Strided(Full):
    QUERY_DEPENDENT = True


    @staticmethod
    def problems(cfg) -> list[str]:
        return positive(cfg, "stride")

    def __init__(self, stride: int):
        self.stride = stride

    def allowed(self, q: Tensor, k: Tensor) -> Tensor:
        distance = (q - k).abs()
        return (distance < self.stride) | (distance % self.stride == 0)

    def banded(self, n: int) -> bool:
        return n >= 4 * self.stride

    def blocked(self, q: Tensor, k: Tensor, v: Tensor, sdpa_dropout: float | None = None, **options) -> Tensor:
        return strided_attention(q, k, v, self.stride, **options)  # written out: its columns are per query

    def scored_keys(self, n: int) -> int:
        return 3 * self.stride - 2 + -(-n // self.stride) if self.banded(n) else n


class TopK(Full):
    """Decides by score, not position: every query row on its own (QUERY_DEPENDENT stays False)."""


    @staticmethod
    def problems(cfg) -> list[str]:
        return positive(cfg, "topk")

    def __init__(self, k: int):
        self.k = k
        self.score_hook = self.keep_top

    def keep_top(self, scores: Tensor) -> Tensor:
        """scores (..., S), masked ones already -inf -> the k largest of each row kept (ties at
        the k-th value kept too), the rest -inf."""
        if self.k >= scores.size(-1):
            return scores
        kth = scores.topk(self.k, dim=-1).values[..., -1:]
        return scores.masked_fill(scores < kth, float("-inf"))


class LowRank(Full):
    """Every query sees `rank` learned mixtures of the keys (Linformer, model/lowrank.py): no
    token mask applies after the projection, so the pattern itself allows everything; the
    attention module's key_projection does the work."""

    PROJECTS_KEYS = True


    @staticmethod
    def problems(cfg) -> list[str]:
        out = positive(cfg, "rank")
        if cfg.positional in ("alibi", "relative"):
            out.append(f"model.positional: {cfg.positional!r} biases scores by key position, and a "
                       "low_rank key is a mixture of positions; use sinusoidal, learned, rope or none")
        return out

    def __init__(self, rank: int):
        self.rank = rank

    def scored_keys(self, n: int) -> int:
        return self.rank


class Synthesized(Full):
    """Every key is visible; the scores are a learned table of positions instead of q.k
    (Synthesizer's random attention, model/synthesizer.py)."""

    CONTENT_FREE = True

    @staticmethod
    def problems(cfg) -> list[str]:
        # its scores are a table of positions in the attention's score_bias, with no q or k
        clash = {"positional": cfg.positional in ("alibi", "relative", "rope"), "qkv": cfg.qkv == "shared",
                 "memory_tokens": cfg.memory_tokens > 0, "attention_backend": cfg.attention_backend == "flex",
                 "pruned_heads": bool(cfg.pruned_heads)}
        return [f"model.{key}: model.attention = 'synthesizer' scores positions from its own table, without "
                f"queries or keys; found model.{key} = {getattr(cfg, key)!r}" for key, bad in clash.items() if bad]


def make_pattern(name: str, *, window: int = 0, global_tokens: int = 0, stride: int = 0, topk: int = 0,
                 rank: int = 0) -> Full:
    """The pattern object of `model.attention` = name with its parameters."""
    return PATTERNS[name](window=window, global_tokens=global_tokens, stride=stride, topk=topk, rank=rank)


# One entry per `model.attention` value: the pattern's parameters -> a pattern object.
PATTERNS = {
    "full": lambda **_: Full(),
    "sliding_window": lambda window, **_: SlidingWindow(window),
    "local_global": lambda window, global_tokens, **_: LocalGlobal(window, global_tokens),
    "strided": lambda stride, **_: Strided(stride),
    "topk": lambda topk, **_: TopK(topk),
    "low_rank": lambda rank, **_: LowRank(rank),
    "synthesizer": lambda **_: Synthesized(),
}
# the config's own dict (config/schema.py): each pattern's rules on a [model] table, as it checks one
PATTERN_RULES.update({"full": Full.problems, "sliding_window": SlidingWindow.problems,
                      "local_global": LocalGlobal.problems, "strided": Strided.problems, "topk": TopK.problems,
                      "low_rank": LowRank.problems, "synthesizer": Synthesized.problems})


def self_attention_mask(pattern: Full, t: int, s: int, offset: int, *, causal: bool, pad: Tensor | None = None,
                        device: torch.device | None = None, key_positions: Tensor | None = None) -> Tensor | None:
    """The boolean mask (B or 1, 1, T, S) of a self-attention whose T queries sit at positions
    offset .. offset + T - 1 and whose S keys at 0 .. S - 1 (or at `key_positions` (S,), those a
    windowed KV cache holds): the pattern, causality (keys at or
    before the query) and key padding `pad` (B, S), True at padding. A query always sees
    itself, so no row is empty (a padded query far from real tokens would otherwise see
    nothing under a window, and its NaN would reach real rows through 0 * NaN). None when
    nothing is masked."""
    q = torch.arange(offset, offset + t, device=device)[:, None]
    k = (torch.arange(s, device=device) if key_positions is None else key_positions.to(device))[None, :]
    allowed = pattern.allowed(q, k)
    if causal:
        allowed = (k <= q) if allowed is None else allowed & (k <= q)
    if pad is not None:
        keep = ~pad[:, None, None, :]  # (B, 1, 1, S)
        allowed = keep if allowed is None else keep & allowed
    if allowed is None:
        return None
    allowed = allowed | (k == q)
    return allowed if allowed.dim() == 4 else allowed[None, None]


@dataclass(eq=False)
class PatternMask:
    """A self-attention's mask by its parts (the pattern over `length` positions, key padding
    `pad` (B, S) True at padding, causality), so that a kernel that never builds the (T, S)
    matrix can take it (model/banded.py); `dense()` spells it out once for every layer that
    needs the matrix (head inspection, the explicit path of a short sequence)."""

    pattern: Full
    length: int
    pad: Tensor | None = None
    causal: bool = False
    device: torch.device | None = None
    _dense: Tensor | None = field(default=None, repr=False)

    @property
    def banded(self) -> bool:
        return self.pattern.banded(self.length)

    def dense(self) -> Tensor | None:
        if self._dense is None:
            n = self.length
            self._dense = self_attention_mask(self.pattern, n, n, 0, causal=self.causal, pad=self.pad,
                                              device=self.device)
        return self._dense
