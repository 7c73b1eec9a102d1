r"""Multi-head attention with grouped key/value heads, masks, cross-attention and a KV cache.

    MHA  (n_kv_heads = H)      GQA  (1 < n_kv_heads < H)   MQA  (n_kv_heads = 1)
    q: h1 h2 h3 h4             q: h1 h2 h3 h4              q: h1 h2 h3 h4
       |  |  |  |                 \  /   \  /                  \  \  /  /
    kv: k1 k2 k3 k4            kv:  k1     k2              kv:     k1

Query head h reads key/value head h // (H / K), so H = K is ordinary multi-head attention
(Vaswani et al. 2017, arXiv:1706.03762), K = 1 is multi-query attention (Shazeer 2019,
arXiv:1911.02150) and anything between is grouped-query attention (Ainslie et al. 2023,
arXiv:2305.13245).

Two paths compute the same thing and are tested to agree (model/kernels.py):
`explicit_attention`, written out so it can return the probabilities (head inspection needs
them), and PyTorch's fused `scaled_dot_product_attention`; flex is a third (model/flex.py). All
take a boolean mask (True = may attend) and an additive float score bias (ALiBi, T5's relative
bias); only the explicit path takes a score hook (top-k), so MultiHeadAttention sends a module
with one there whatever its backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from xformer.model.banded import Front
from xformer.model.cache import KVCache
from xformer.model.flex import flex_heads, runs_on
from xformer.model.kernels import drop_heads, explicit_attention, sdpa_attention
from xformer.model.patterns import PatternMask, self_attention_mask


class Projections(NamedTuple):
    """An attention's q, k and v projections (model/qkv.py): q and k None where the scores are
    content-free (the synthesizer's), k and v possibly q's own parameters (shared)."""

    q: nn.Module | None
    k: nn.Module | None
    v: nn.Module



def separate_projections(d_model: int, n_heads: int, n_kv_heads: int, bias: bool = True) -> Projections:
    """q, k and v from three matrices (Vaswani et al. 2017): model.qkv = "separate", the default."""
    head_dim = d_model // n_heads
    return Projections(nn.Linear(d_model, n_heads * head_dim, bias=bias),
                       nn.Linear(d_model, n_kv_heads * head_dim, bias=bias),
                       nn.Linear(d_model, n_kv_heads * head_dim, bias=bias))


class MultiHeadAttention(nn.Module):
    """Multi-head attention with n_kv_heads key/value heads (MHA / GQA / MQA, see module doc).

    Self-attention when `memory` is None, cross-attention over `memory` otherwise.
    """

    def __init__(
        self, d_model: int, n_heads: int, n_kv_heads: int | None = None, dropout: float = 0.0,
        backend: str = "sdpa", bias: bool = True, head_dropout: float = 0.0, memory_tokens: int = 0, *,
        projections: Projections | None = None, rotary: nn.Module | None = None,
        score_bias: nn.Module | None = None, score_hook: Callable[[Tensor], Tensor] | None = None,
        key_projection: nn.Module | None = None,
    ):
        """`projections`: the q, k and v projections (model/qkv.py builds them; q and k None for
        content-free scores); three separate nn.Linear when omitted. `rotary` rotates q and k (a
        positional encoding that acts on "qk"); `score_bias` adds bias(q_pos, k_pos) (H, T, S) to
        the scores (one that acts on "scores", or the synthesizer's table), shared across a stack;
        `score_hook` rewrites the scores (the top-k pattern); `key_projection` projects keys and
        values along the sequence (the low_rank pattern, model/lowrank.py), after which no key
        mask applies. model/build.py passes the ones a recipe asks for."""
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if d_model % n_heads or n_heads % self.n_kv_heads:
            raise ValueError(f"need d_model % n_heads == 0 and n_heads % n_kv_heads == 0, got "
                             f"{d_model=}, {n_heads=}, n_kv_heads={self.n_kv_heads}")
        self.head_dim = d_model // n_heads
        self.dropout = dropout  # SDPA's dropout_p; the explicit path applies attn_drop
        self.attn_drop = nn.Dropout(dropout)
        self.head_dropout = head_dropout
        self.backend = backend
        if projections is None:
            projections = separate_projections(d_model, n_heads, self.n_kv_heads, bias)
        if (projections.q is None) != (projections.k is None):
            raise ValueError("q and k projections come together: both modules, or both None (content-free scores)")
        self.q_proj, self.k_proj, self.v_proj = projections.q, projections.k, projections.v
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)
        # Memory tokens (x-transformers' num_mem_kv; memory-augmented attention, Sukhbaatar et al.
        # 2019, arXiv:1907.01470): learned key/value slots (K, M, Dh) every query may attend to,
        # ahead of the sequence's own keys; they have no position and never enter a KV cache.
        self.mem_k = nn.Parameter(torch.empty(self.n_kv_heads, memory_tokens, self.head_dim)) if memory_tokens else None
        self.mem_v = nn.Parameter(torch.empty(self.n_kv_heads, memory_tokens, self.head_dim)) if memory_tokens else None
        # registered after out_proj, in this order, as checkpoints name them (initialisation walks
        # the modules in registration order)
        self.rotary = rotary
        self.score_bias = score_bias
        self.bias_heads: Tensor | None = None  # the score_bias heads that are this module's (after pruning)
        self.score_hook = score_hook
        self.key_projection = key_projection
        # Head inspection (xformer/heads), through gate() and probe(): a (H,) multiplier on each
        # head's output before out_proj (0 ablates a head; a leaf with requires_grad gives Michel et
        # al.'s gate gradient), with head_fill (H, Dh) what a gated-off head outputs instead of 0
        # (its mean: mean-ablation), and a callback that receives the probabilities (B, H, T, S).
        self.head_gate: Tensor | None = None
        self.head_fill: Tensor | None = None
        self.on_probs = None

    def gate(self, gate: Tensor | None, fill: Tensor | None = None) -> None:
        """Multiply each head's output by `gate` (H,), a gated-off head putting out `fill` (H, Dh)
        instead of 0; None lifts the gate. Head inspection's one way to switch heads off."""
        self.head_gate, self.head_fill = gate, fill

    def probe(self, callback: Callable[[Tensor], None] | None) -> None:
        """Call `callback` with the probabilities (B, H, T, S) of every forward (the explicit path
        then runs); None stops. Head inspection's one way to read attention maps."""
        self.on_probs = callback

    def forward(
        self, x: Tensor, memory: Tensor | None = None, mask: Tensor | None = None,
        is_causal: bool = False, cache: KVCache | None = None, need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, D); memory: (B, S, D) or None; mask: boolean, True where attendable,
        broadcastable to (B, H, T, S); is_causal: lower-triangular mask with T == S.

        Returns (B, T, D) and, with need_weights (explicit path), probabilities (B, H, T, S).
        """
        b, t, _ = x.shape
        if self.q_proj is None:  # content-free scores (synthesizer): q.k is zero, the score_bias is all
            q = x.new_zeros(b, self.n_heads, t, self.head_dim)
        else:
            q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        past = 0 if cache is None or memory is not None else cache.length  # positions of new tokens start here
        q, k, v = self._keys_values(q, x, memory, cache, past)
        probes = need_weights or self.on_probs is not None  # the probabilities are wanted
        if self.backend == "flex" and cache is None and not probes and (self.score_hook is None or memory is not None) \
                and runs_on(q):
            bias = self._bias if self.score_bias is not None else None
            out = flex_heads(q, k, v, mask, is_causal, memory is not None, key_projection=self.key_projection,
                             mem_k=self.mem_k, mem_v=self.mem_v, bias=bias)
            return self._finish(out, b, t), None
        if isinstance(mask, PatternMask):  # a self-attention's pattern, not yet a (T, S) matrix
            if mask.banded and memory is None and cache is None and self.score_hook is None \
                    and self.key_projection is None and not probes:
                return self._finish(self._blocked(q, k, v, mask), b, t), None
            mask = mask.dense()
        if self.key_projection is not None:  # (B, K, S, Dh) -> (B, K, rank, Dh), padding zeroed first
            k, v = self.key_projection(k, v, mask)
            mask = None
        bias = None
        if self.score_bias is not None and memory is None:
            q_pos = torch.arange(past, past + t, device=q.device)
            k_pos = cache.positions() if cache is not None else torch.arange(k.size(2), device=q.device)
            bias = self._bias(q_pos, k_pos)
        if self.mem_k is not None:  # M slots in front of the keys: always visible, no bias
            k, v, mask, bias = self._with_memory_tokens(k, v, mask, is_causal, bias)
            is_causal = False
        probs = None
        explicit = need_weights or self.on_probs is not None or self.backend == "explicit"
        if explicit or (self.score_hook is not None and memory is None):  # SDPA has no score hook
            hook = self.score_hook if memory is None else None
            out, probs = explicit_attention(q, k, v, mask, is_causal, bias=bias, score_hook=hook, drop=self.attn_drop)
            if self.on_probs is not None:
                self.on_probs(probs)
        else:
            out = sdpa_attention(q, k, v, mask, is_causal, self.dropout, self.training, bias)
        return self._finish(out, b, t), probs if need_weights else None

    def _keys_values(self, q: Tensor, x: Tensor, memory: Tensor | None, cache: KVCache | None,
                     past: int) -> tuple[Tensor, Tensor, Tensor]:
        """The queries (rotated where positions are rotary) with the keys and values (B, K, S, Dh)
        they attend to: of x itself, or of the memory (cross-attention, computed once into its
        cache), the cache's earlier ones in front."""
        if memory is not None and cache is not None and cache.k is not None:
            return q, cache.k, cache.v  # cross-attention: encoder keys computed at the first step
        b = x.size(0)
        source = x if memory is None else memory
        s = source.size(1)
        if self.k_proj is None:
            k = source.new_zeros(b, self.n_kv_heads, s, self.head_dim)
        else:
            k = self.k_proj(source).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, S, Dh)
        v = self.v_proj(source).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary is not None and memory is None:
            q, k = self.rotary.rotate(q, past), self.rotary.rotate(k, past)
        if cache is not None:
            k, v = cache.append(k, v)
        return q, k, v

    def _finish(self, out: Tensor, b: int, t: int) -> Tensor:
        """Heads (B, H, T, Dh) -> (B, T, D): DropHead, the inspection gate, out_proj."""
        if self.training and self.head_dropout > 0:
            out = drop_heads(out, self.head_dropout)
        if self.head_gate is not None:
            gate = self.head_gate.to(out.dtype)[:, None, None]  # (H, 1, 1)
            out = out * gate  # (B, H, T, Dh)
            if self.head_fill is not None:
                out = out + (1 - gate) * self.head_fill.to(out.dtype)[:, None, :]  # (H, 1, Dh)
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, H*Dh)
        return self.out_proj(out)

    def _bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The position bias (H, T, S) of this module's heads for queries at q_pos, keys at k_pos."""
        bias = self.score_bias.bias(q_pos, k_pos)  # (H0, T, S) for the stack's original heads
        if self.bias_heads is not None:
            bias = bias.index_select(0, self.bias_heads.to(bias.device))
        return bias

    def _blocked(self, q: Tensor, k: Tensor, v: Tensor, mask: PatternMask) -> Tensor:
        """Self-attention through the pattern's blocked kernel (model/banded.py), with the memory
        slots and the global tokens as front columns, and the global tokens' own rows (which
        see every key) computed densely, g rows of n keys."""
        b, t = q.size(0), q.size(2)
        pattern, g = mask.pattern, min(mask.pattern.global_tokens, t)
        bias = self._bias if self.score_bias is not None else None
        fronts = []
        if self.mem_k is not None:
            m = self.mem_k.size(1)
            fronts.append(Front(self.mem_k.to(k.dtype).expand(b, -1, -1, -1),
                                self.mem_v.to(v.dtype).expand(b, -1, -1, -1),
                                torch.ones(1, 1, m, dtype=torch.bool, device=q.device),
                                None if bias is None else q.new_zeros(1, 1, m)))
        if g:
            positions = torch.arange(t, device=q.device)
            visible = torch.ones(1, t, g, dtype=torch.bool, device=q.device) if mask.pad is None \
                else ~mask.pad[:, None, :g]
            if mask.causal:
                visible = visible & (positions[None, :, None] >= positions[None, None, :g])
            fronts.append(Front(k[:, :, :g], v[:, :, :g], visible,
                                None if bias is None else bias(positions, positions[:g])))
        front = None
        if fronts:
            front = Front(torch.cat([f.k for f in fronts], 2), torch.cat([f.v for f in fronts], 2),
                          torch.cat([f.visible.expand(b, t, -1) for f in fronts], 2),
                          None if bias is None else torch.cat([f.bias.expand(q.size(1), t, -1) for f in fronts], 2))
        sdpa = None if self.backend == "explicit" else (self.dropout if self.training else 0.0)
        out = pattern.blocked(q, k, v, causal=mask.causal, key_pad=mask.pad, bias=bias, front=front,
                              drop=self.attn_drop, sdpa_dropout=sdpa)
        if not g:
            return out
        rows_mask = self_attention_mask(pattern, g, t, 0, causal=mask.causal, pad=mask.pad, device=q.device)
        rows_bias = None if bias is None else bias(torch.arange(g, device=q.device), torch.arange(t, device=q.device))
        rows = self._dense_rows(q[:, :, :g], k, v, rows_mask, rows_bias)
        return torch.cat([rows, out[:, :, g:]], dim=2)

    def _dense_rows(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, bias: Tensor | None) -> Tensor:
        """Explicit attention of a few query rows over every key (and the memory slots)."""
        if self.mem_k is not None:
            k, v, mask, bias = self._with_memory_tokens(k, v, mask, False, bias)
        return explicit_attention(q, k, v, mask, bias=bias, drop=self.attn_drop)[0]

    def _with_memory_tokens(self, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                            bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """k, v (B, K, S, Dh) -> (B, K, M + S, Dh) with the memory slots first; the mask (the
        causal one spelt out) and the bias get M visible, unbiased columns in front."""
        b, s, m = k.size(0), k.size(2), self.mem_k.size(1)
        k = torch.cat([self.mem_k.to(k.dtype).expand(b, -1, -1, -1), k], dim=2)
        v = torch.cat([self.mem_v.to(v.dtype).expand(b, -1, -1, -1), v], dim=2)
        if is_causal:  # only ever passed with T == S
            causal = torch.ones(s, s, dtype=torch.bool, device=k.device).tril()[None, None]
            mask = causal if mask is None else mask & causal
        if mask is not None:
            front = torch.ones(*mask.shape[:-1], m, dtype=torch.bool, device=mask.device)
            mask = torch.cat([front, mask], dim=-1)
        if bias is not None:
            bias = torch.cat([bias.new_zeros(*bias.shape[:-1], m), bias], dim=-1)
        return k, v, mask, bias

    def init_fairseq_(self) -> None:
        """fairseq's attention init: q/k/v Xavier-uniform with gain 1/sqrt(2) (what Xavier on
        the packed in-projection gives when q, k and v have the same size), out_proj
        Xavier-uniform, biases zero; memory slots N(0, 1), as x-transformers draws them."""
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            if proj is not None:  # a content-free attention has no q and k projections
                nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if proj is not None and proj.bias is not None:
                nn.init.zeros_(proj.bias)
        if self.mem_k is not None:
            nn.init.normal_(self.mem_k)
            nn.init.normal_(self.mem_v)

    @property
    def query_position_dependent(self) -> bool:
        """Whether a query's result depends on its position beyond q and k themselves (rotary
        queries, a position bias): then a subset of query rows cannot be computed alone with
        the rows' own positions lost."""
        return self.rotary is not None or self.score_bias is not None

    def prune_heads(self, remove: list[int], fill: Tensor | None = None, gate: Tensor | None = None) -> None:
        """Remove query heads `remove` (indices into the current heads) physically: their rows of
        q_proj and columns of out_proj go; a key/value head goes with the last query head that
        reads it. If the surviving groups are uneven, every surviving query head gets its own
        copy of its key/value head (GQA becomes MHA with the same outputs). The result equals
        `forward` with head_gate = `gate` (default: 0 on the removed heads, 1 elsewhere) and
        head_fill = `fill`: survivors' out_proj columns are scaled by their gate and, with `fill`
        (H, Dh), the constant sum_h (1 - gate_h) W_h fill[h] is folded into the out_proj bias
        (mean-ablation; with a least-squares gate, importance.rescaled_gate)."""
        keep = [h for h in range(self.n_heads) if h not in set(remove)]
        if not keep:
            raise ValueError("cannot remove every head of an attention module")
        if fill is not None and self.out_proj.bias is None:
            raise ValueError("folding a removed head's mean output needs an out_proj bias")
        with torch.no_grad():
            dh = self.head_dim
            for h in range(self.n_heads):
                g = float(gate[h]) if gate is not None else float(h in keep)
                columns = self.out_proj.weight[:, h * dh:(h + 1) * dh]
                if fill is not None:
                    self.out_proj.bias += (1 - g) * (columns @ fill[h].to(self.out_proj.bias))
                if h in keep and g != 1.0:
                    columns.mul_(g)
        group = self.n_heads // self.n_kv_heads
        kv_of = [h // group for h in keep]
        kv_keep = sorted(set(kv_of))
        per_kv = [kv_of.count(g) for g in kv_keep]
        if len(set(per_kv)) == 1:  # even groups: keep the grouped layout
            kv_rows = kv_keep
        else:
            kv_rows = kv_of
        dh = self.head_dim

        def rows(heads):
            return torch.cat([torch.arange(h * dh, (h + 1) * dh) for h in heads])

        self.q_proj = _select(self.q_proj, rows(keep), dim=0)
        self.k_proj = _select(self.k_proj, rows(kv_rows), dim=0)
        self.v_proj = _select(self.v_proj, rows(kv_rows), dim=0)
        if self.mem_k is not None:  # memory slots belong to key/value heads
            index = torch.tensor(kv_rows, device=self.mem_k.device)
            self.mem_k = nn.Parameter(self.mem_k.detach().index_select(0, index))
            self.mem_v = nn.Parameter(self.mem_v.detach().index_select(0, index))
        self.out_proj = _select(self.out_proj, rows(keep), dim=1)
        if self.score_bias is not None:  # the shared bias keeps the stack's original heads
            current = self.bias_heads if self.bias_heads is not None else torch.arange(self.n_heads)
            self.bias_heads = current[torch.tensor(keep)]
        self.n_heads, self.n_kv_heads = len(keep), len(kv_rows)
        self.head_gate = self.head_fill = None


def _select(linear: nn.Linear, index: Tensor, dim: int) -> nn.Linear:
    """A copy of `linear` keeping output features (dim 0) or input features (dim 1) `index`."""
    weight = linear.weight.detach().index_select(dim, index.to(linear.weight.device))
    out = nn.Linear(weight.size(1), weight.size(0), bias=linear.bias is not None,
                    device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
        if linear.bias is not None:
            out.bias.copy_(linear.bias if dim == 1 else linear.bias.index_select(0, index.to(weight.device)))
    return out

