r"""Banded attention: a sliding window computed block by block, so time and memory grow as
n * window instead of n^2 (the dense path builds the whole (T, S) score matrix and masks it).

Queries are cut into blocks of `block` positions; a block sees the `span` keys from its first
query's window start to its last query's window end, and only those scores are computed:

    keys   0 1 2 3 4 5 6 7 8 9          window 2, block 2 (non-causal): span = 2 + 1 + 1 = 4
    q 0-1  . x x x                      x = scores computed; the band mask keeps |q - k| < 2
    q 2-3      x x x x
    q 4-5          x x x x  ...

`front` keys (memory slots, local_global's global tokens) are columns every block also scores,
ahead of its band, under one softmax with it. A score bias must be a function of k - q (ALiBi
and T5's both are), so one block's bias serves every block.

`strided_attention` does the same for the strided pattern: a band of `stride`, plus each query's
column when the positions are laid out as rows of `stride` (the keys a multiple of `stride`
away), n * (3 stride + n / stride) scores instead of n^2.

Both equal dense attention under patterns.self_attention_mask (tests/test_banded.py proves it
against the naive sum); MultiHeadAttention takes this path when the pattern says it pays
(`pattern.banded(n)`) and calls the pattern's `blocked`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class Front:
    """F key/value columns every query may see besides its band: k, v (B, K, F, Dh); `visible`
    bool broadcastable to (B, T, F); `bias` float broadcastable to (H, T, F), or None."""

    k: Tensor
    v: Tensor
    visible: Tensor
    bias: Tensor | None = None


Part = tuple[Tensor, Callable[[Tensor], Tensor]]  # scores (B, H, P, n), probabilities (B, H, P, n) -> (B, H, P, Dh)


def banded_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, *, causal: bool = False, key_pad: Tensor | None = None,
    bias: Callable[[Tensor, Tensor], Tensor] | None = None, front: Front | None = None, exclude_below: int = 0,
    drop: nn.Module | None = None, block: int | None = None, sdpa_dropout: float | None = None,
) -> Tensor:
    """Self-attention of q (B, H, T, Dh) over k, v (B, K, T, Dh) at positions 0 .. T - 1 (H a
    multiple of K), each query seeing the keys fewer than `window` positions away (causally: at
    or before it) that are not padding (`key_pad` (B, T), True at padding) and not below
    `exclude_below` (those are the front's), plus the `front` columns; a query always sees
    itself. `bias(q_pos, k_pos)` -> (H, T', S') is added to the band's scores; `drop` is applied
    to the probabilities. With `sdpa_dropout` (a float: SDPA's dropout_p) each block runs through
    F.scaled_dot_product_attention instead of the written-out softmax (1.5-2x faster on a CPU).
    Returns (B, H, T, Dh)."""
    t = q.size(2)
    block = block or max(1, min(window, 128))
    padded = math.ceil(t / block) * block
    if sdpa_dropout is not None:
        return _banded_sdpa(q, k, v, window, block, padded, causal, key_pad, bias, front, exclude_below,
                            sdpa_dropout)[:, :, :t]
    parts = [_band(q, k, v, window, block, padded, causal, key_pad, bias, exclude_below)]
    if front is not None and front.k.size(2):
        parts.insert(0, _front(q, front, padded))
    return _joint_softmax(parts, drop)[:, :, :t]


def strided_attention(
    q: Tensor, k: Tensor, v: Tensor, stride: int, *, causal: bool = False, key_pad: Tensor | None = None,
    bias: Callable[[Tensor, Tensor], Tensor] | None = None, front: Front | None = None,
    drop: nn.Module | None = None,
) -> Tensor:
    """The strided pattern (patterns.Strided) without the (T, T) matrix: each query sees the keys
    fewer than `stride` away (a band, as in banded_attention) and those a multiple of `stride`
    away (its column when the sequence is laid out as rows of `stride` positions: T / stride
    keys), and the `front` columns, under one softmax. Arguments as banded_attention's; returns
    (B, H, T, Dh)."""
    t = q.size(2)
    padded = math.ceil(t / stride) * stride
    parts = [_band(q, k, v, stride, stride, padded, causal, key_pad, bias, 0),
             _column(q, k, v, stride, padded, causal, key_pad, bias)]
    if front is not None and front.k.size(2):
        parts.insert(0, _front(q, front, padded))
    return _joint_softmax(parts, drop)[:, :, :t]


def _joint_softmax(parts: list[Part], drop: nn.Module | None) -> Tensor:
    """One softmax over every part's scores (each query row's keys are the parts' keys together),
    then each part's values weighted by its share of the probabilities, summed: (B, H, P, Dh)."""
    probs = torch.cat([scores for scores, _ in parts], dim=-1).softmax(dim=-1)
    if drop is not None:
        probs = drop(probs)
    out, start = None, 0
    for scores, weigh in parts:
        mine = weigh(probs[..., start:start + scores.size(-1)])
        out = mine if out is None else out + mine
        start += scores.size(-1)
    return out


def _band(q: Tensor, k: Tensor, v: Tensor, window: int, block: int, padded: int, causal: bool,
          key_pad: Tensor | None, bias, exclude_below: int) -> Part:
    """Blocks of `block` queries, each scoring its `span` keys; masked by the window, causality,
    padding and exclude_below, except that a query always sees itself."""
    b, h, t, dh = q.shape
    kv = k.size(1)
    group, n_blocks = h // kv, padded // block
    before, span, allowed = _band_geometry(q, window, block, padded, causal, key_pad, exclude_below)
    qb = F.pad(q, (0, 0, 0, padded - t)).view(b, kv, group, n_blocks, block, dh)
    pad_keys = (0, 0, before, padded - t + span - block - before)
    kb = F.pad(k, pad_keys).unfold(2, span, block)  # (B, K, nb, Dh, span), a view
    vb = F.pad(v, pad_keys).unfold(2, span, block).transpose(-1, -2)  # (B, K, nb, span, Dh)
    scores = (qb @ kb[:, :, None]).view(b, h, n_blocks, block, span) / math.sqrt(dh)  # (B, H, nb, c, span)
    if bias is not None:
        positions = torch.arange(block, device=q.device)
        scores = scores + bias(positions, positions[0] - before + torch.arange(span, device=q.device)
                               )[None, :, None].to(scores.dtype)  # (1, H, 1, c, span)
    scores = scores.masked_fill(~allowed[:, None], float("-inf")).view(b, h, padded, span)

    def weigh(probs: Tensor) -> Tensor:
        out = probs.reshape(b, kv, group, n_blocks, block, span) @ vb[:, :, None]  # (B, K, G, nb, c, Dh)
        return out.view(b, h, padded, dh)

    return scores, weigh


def _band_geometry(q: Tensor, window: int, block: int, padded: int, causal: bool, key_pad: Tensor | None,
                   exclude_below: int) -> tuple[int, int, Tensor]:
    """(keys before a block's first query, keys a block scores, what may be seen (B, nb, c, span)):
    the window, causality, padding and exclude_below, except that a query always sees itself."""
    b, t = q.size(0), q.size(2)
    before, after = window - 1, 0 if causal else window - 1
    span = block + before + after
    # k - q for query i of a block and its key l
    relative = torch.arange(span, device=q.device)[None, :] - before - torch.arange(block, device=q.device)[:, None]
    allowed = relative.abs() < window
    if causal:
        allowed &= relative <= 0
    real = _real_keys(key_pad, b, t, q.device)
    if exclude_below:
        real[:, :exclude_below] = False
    real = F.pad(real, (before, padded - t + after), value=False).unfold(1, span, block)  # (B, nb, span)
    return before, span, (allowed & real[:, :, None, :]) | (relative == 0)


def _banded_sdpa(q: Tensor, k: Tensor, v: Tensor, window: int, block: int, padded: int, causal: bool,
                 key_pad: Tensor | None, bias, front: Front | None, exclude_below: int, dropout: float) -> Tensor:
    """banded_attention with every block a batch entry of one SDPA call: block queries (c) against
    the front columns and their span of keys, the mask (and bias) as SDPA's attn_mask."""
    b, h, t, dh = q.shape
    kv, n_blocks = k.size(1), padded // block
    before, span, allowed = _band_geometry(q, window, block, padded, causal, key_pad, exclude_below)
    after = span - block - before
    blocks = b * n_blocks

    def keys(x: Tensor) -> Tensor:  # (B, K, T, Dh) -> (B * nb, K, F + span, Dh)
        x = F.pad(x, (0, 0, before, padded - t + after)).unfold(2, span, block)  # (B, K, nb, Dh, span)
        x = x.permute(0, 2, 1, 4, 3).reshape(blocks, kv, span, dh)
        return x

    kb, vb = keys(k), keys(v)
    mask = allowed.reshape(blocks, 1, block, span)
    scores_bias = None
    if bias is not None:
        positions = torch.arange(block, device=q.device)
        offsets = positions[0] - before + torch.arange(span, device=q.device)
        scores_bias = bias(positions, offsets)[None]  # (1, H, c, span)
    if front is not None and front.k.size(2):
        n_front = front.k.size(2)

        def per_block(x: Tensor) -> Tensor:  # (B, K, F, Dh) -> (B * nb, K, F, Dh)
            return x[:, None].expand(b, n_blocks, kv, n_front, dh).reshape(blocks, kv, n_front, dh)

        kb, vb = torch.cat([per_block(front.k), kb], dim=2), torch.cat([per_block(front.v), vb], dim=2)
        visible = _pad_rows(front.visible, padded, True).expand(b, padded, n_front)
        mask = torch.cat([visible.reshape(blocks, 1, block, n_front), mask], dim=-1)
        if scores_bias is not None:
            front_bias = _pad_rows(front.bias, padded, 0.0).expand(h, padded, n_front)
            front_bias = front_bias.reshape(h, n_blocks, block, n_front).transpose(0, 1)  # (nb, H, c, F)
            scores_bias = torch.cat([front_bias.repeat(b, 1, 1, 1), scores_bias.expand(blocks, -1, -1, -1)], -1)
    if kv != h:  # SDPA's enable_gqa needs torch >= 2.5
        kb = kb.repeat_interleave(h // kv, dim=1)
        vb = vb.repeat_interleave(h // kv, dim=1)
    if scores_bias is not None:
        mask = scores_bias.to(q.dtype).masked_fill(~mask, float("-inf"))
    qb = F.pad(q, (0, 0, 0, padded - t)).view(b, h, n_blocks, block, dh).transpose(1, 2).reshape(blocks, h, block, dh)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:  # as attention.sdpa_attention: fp32 on a CPU
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(qb.float(), kb.float(), vb.float(),
                                                 attn_mask=mask.float() if mask.is_floating_point() else mask,
                                                 dropout_p=dropout).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, dropout_p=dropout)
    return out.view(b, n_blocks, h, block, dh).transpose(1, 2).reshape(b, h, padded, dh)


def _front(q: Tensor, front: Front, padded: int) -> Part:
    b, h, t, dh = q.shape
    kv, n_front = front.k.size(1), front.k.size(2)
    qg = F.pad(q, (0, 0, 0, padded - t)).view(b, kv, h // kv, padded, dh)
    scores = (qg @ front.k[:, :, None].transpose(-1, -2)).view(b, h, padded, n_front) / math.sqrt(dh)
    if front.bias is not None:
        scores = scores + _pad_rows(front.bias, padded, 0.0)[None].to(scores.dtype)
    visible = _pad_rows(front.visible, padded, True)  # (B | 1, P, F)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))

    def weigh(probs: Tensor) -> Tensor:
        return (probs.reshape(b, kv, h // kv, padded, n_front) @ front.v[:, :, None]).view(b, h, padded, dh)

    return scores, weigh


def _column(q: Tensor, k: Tensor, v: Tensor, stride: int, padded: int, causal: bool, key_pad: Tensor | None,
            bias) -> Part:
    """The keys a nonzero multiple of `stride` away: with positions laid out as rows of `stride`,
    query (row a, column c) scores the other rows' keys of column c, (B, H, P, rows)."""
    b, h, t, dh = q.shape
    group, rows = h // k.size(1), padded // stride

    def columns(x: Tensor) -> Tensor:  # (B, *, T, Dh) -> (B, *, stride, rows, Dh): column c, row a
        x = F.pad(x, (0, 0, 0, padded - t))
        return x.view(*x.shape[:2], rows, stride, dh).transpose(2, 3)

    qc = columns(q)
    kc, vc = columns(k.repeat_interleave(group, dim=1)), columns(v.repeat_interleave(group, dim=1))
    scores = qc @ kc.transpose(-1, -2) / math.sqrt(dh)  # (B, H, stride, rows, rows)
    row = torch.arange(rows, device=q.device)
    allowed = row[:, None] != row[None, :]  # distance 0 is the band's
    if causal:
        allowed &= row[None, :] <= row[:, None]
    real = F.pad(_real_keys(key_pad, b, t, q.device), (0, padded - t), value=False).view(b, rows, stride)
    allowed = allowed[None, None] & real.transpose(1, 2)[:, :, None, :]  # (B, stride, rows, rows)
    if bias is not None:
        scores = scores + bias(row * stride, row * stride)[None, :, None].to(scores.dtype)  # (1, H, 1, rows, rows)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    scores = scores.transpose(2, 3).reshape(b, h, padded, rows)

    def weigh(probs: Tensor) -> Tensor:
        probs = probs.reshape(b, h, rows, stride, rows).transpose(2, 3)  # (B, H, stride, rows, rows)
        return (probs @ vc).transpose(2, 3).reshape(b, h, padded, dh)

    return scores, weigh


def _real_keys(key_pad: Tensor | None, b: int, t: int, device) -> Tensor:
    """(B, T) True at real (non-padding) keys, a fresh tensor."""
    return torch.ones(b, t, dtype=torch.bool, device=device) if key_pad is None else ~key_pad


def _pad_rows(x: Tensor, rows: int, value: float | bool) -> Tensor:
    """x (..., T or 1, F) -> (..., rows, F), padding the T axis with `value` (rows past T are
    discarded queries; the value only keeps them finite)."""
    if x.size(-2) == 1 or x.size(-2) == rows:
        return x
    return F.pad(x, (0, 0, 0, rows - x.size(-2)), value=value)
