"""The attention kernels MultiHeadAttention runs (model/attention.py): `explicit_attention`,
written out so it can return the probabilities and take a score hook, PyTorch's fused
`scaled_dot_product_attention` behind `sdpa_attention`, tested to agree with it, and DropHead
on the heads' outputs. Both take a boolean mask (True = may attend) and an additive float
score bias (ALiBi, T5's relative bias), and grouped key/value heads (H a multiple of K).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False,
    dropout: float = 0.0, training: bool = False, bias: Tensor | None = None,
    score_hook: Callable[[Tensor], Tensor] | None = None, drop: nn.Module | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(score_hook(q k^T / sqrt(Dh) + bias, masked)) v, and the probabilities.

    q: (B, H, T, Dh); k, v: (B, K, S, Dh) with H a multiple of K; mask: boolean, True where
    attendable, broadcastable to (B, H, T, S); bias: float, broadcastable to (B, H, T, S);
    score_hook: (B, H, T, S) scores with masked ones at -inf -> scores. Returns (B, H, T, Dh)
    and (B, H, T, S). `drop`: the dropout module to apply to the probabilities (its own p and
    mode; MultiHeadAttention's, which training may switch to the fast CPU mask) instead of
    F.dropout(dropout, training). The grouped matmul never copies k and v to H heads.
    """
    b, h, t, dh = q.shape
    kv, s = k.size(1), k.size(2)
    qg = q.reshape(b, kv, h // kv, t, dh)  # (B, K, G, T, Dh)
    scores = qg @ k[:, :, None].transpose(-1, -2) / math.sqrt(dh)  # (B, K, G, T, S)
    scores = scores.view(b, h, t, s)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(t, s, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if score_hook is not None:
        scores = score_hook(scores)
    probs = scores.softmax(dim=-1)
    dropped = drop(probs) if drop is not None else F.dropout(probs, dropout, training)
    out = dropped.view(b, kv, h // kv, t, s) @ v[:, :, None]  # (B, K, G, T, Dh)
    return out.view(b, h, t, dh), probs


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, is_causal: bool = False,
    dropout: float = 0.0, training: bool = False, bias: Tensor | None = None,
) -> Tensor:
    """The same as `explicit_attention` (without a score hook) through
    `F.scaled_dot_product_attention` (flash / memory-efficient kernels where the inputs allow;
    a bias makes the mask a float one, which those kernels take as an additive mask)."""
    if bias is not None:  # one additive float mask: the bias, -inf where masked or in the future
        t, s = q.size(2), k.size(2)
        float_mask = bias.to(q.dtype)
        if is_causal:
            float_mask = float_mask.masked_fill(~torch.ones(t, s, dtype=torch.bool, device=q.device).tril(),
                                                float("-inf"))
        if mask is not None:
            float_mask = float_mask.masked_fill(~mask, float("-inf"))
        mask, is_causal = float_mask, False
    h, kv = q.size(1), k.size(1)
    if kv != h:  # (B, K, S, Dh) -> (B, H, S, Dh): a copy, as SDPA's enable_gqa needs torch >= 2.5
        b, _, s, dh = k.shape
        k = k[:, :, None].expand(b, kv, h // kv, s, dh).reshape(b, h, s, dh)
        v = v[:, :, None].expand(b, kv, h // kv, s, dh).reshape(b, h, s, dh)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        # torch's CPU flash kernel is ~7x slower backward in bf16 than in fp32 (measured on the
        # de->en recipe: 22% of a bf16-autocast step), and attention is a small share of the
        # FLOPs at these lengths: it runs in fp32 and only its output returns to bf16.
        with torch.autocast("cpu", enabled=False):
            mask = mask.float() if mask is not None and mask.is_floating_point() else mask
            return sdpa_attention(q.float(), k.float(), v.float(), mask, is_causal, dropout, training).to(q.dtype)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout if training else 0.0, is_causal=is_causal
    )


def drop_heads(out: Tensor, p: float) -> Tensor:
    """DropHead (Zhou et al. 2020, arXiv:2004.13342): zero each head's output (B, H, T, Dh) with
    probability p, independently per example, and scale an example's surviving heads by
    H / (heads kept) so that the sum over heads keeps its scale. At inference nothing is dropped."""
    b, h = out.shape[:2]
    keep = (torch.rand(b, h, 1, 1, device=out.device) >= p).to(out.dtype)  # (B, H, 1, 1)
    return out * keep * (h / keep.sum(1, keepdim=True).clamp(min=1))
