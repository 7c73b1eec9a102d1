"""The flex attention backend (`model.attention_backend = "flex"`): PyTorch's
`torch.nn.attention.flex_attention` (torch >= 2.5), compiled, with the pattern, causality and
padding as a block mask (blocks no query of which sees any key are skipped) and the position
bias as a score_mod, both written elementwise from the same definitions the other paths use
(`pattern.allowed`, `score_bias.bias_at`).

The kernel compiles for every new shape and every new mask or bias function (seconds to tens
of seconds on a CPU), so flex pays for fixed-length batches and long sequences; with dynamic
shapes torch 2.13's CPU code generation fails on the bias lookup. MultiHeadAttention routes what flex cannot do: a score
hook (top-k) and the probabilities (head inspection) to the explicit path; incremental decoding
with a KV cache (one query a step, where flex's blocks buy nothing) and, on a CPU, anything that
needs gradients (torch's CPU flex has no backward) to SDPA. The recipe refuses attention dropout
with flex (it has none) and training refuses flex on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from xformer.model.patterns import PatternMask

try:
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex
except ImportError:  # torch < 2.5
    create_block_mask = _flex = None

_compiled: Callable | None = None


def unavailable() -> str | None:
    """None when flex attention can run here, else why not."""
    return None if _flex is not None else f"flex attention needs torch >= 2.5, found {torch.__version__}"


def cannot_train(device_type: str) -> str | None:
    """None when a model can train with flex attention on this kind of device, else why not."""
    if unavailable():
        return unavailable()
    if device_type == "cpu":
        return ("torch's flex attention has no backward pass on a CPU; train with 'sdpa' (the same function) and "
                "evaluate with flex, or train on CUDA")
    return None


def runs_on(x: Tensor) -> bool:
    """Whether flex can compute attention over x here: anywhere without gradients, and with
    them only off the CPU."""
    return _flex is not None and (x.device.type != "cpu" or not torch.is_grad_enabled())


def flex_attention(q: Tensor, k: Tensor, v: Tensor, mask_mod: Callable | None, score_mod: Callable | None,
                   batch_dependent: bool) -> Tensor:
    """q (B, H, T, Dh), k, v (B, K, S, Dh) -> (B, H, T, Dh). mask_mod(b, h, q, kv) -> bool (None:
    every key), score_mod(score, b, h, q, kv) -> score; `batch_dependent`: whether mask_mod reads b
    (padding), so the block mask is built per sequence."""
    global _compiled
    if _flex is None:
        raise RuntimeError(unavailable())
    if _compiled is None:
        _compiled = torch.compile(_flex, dynamic=False)  # (dynamic shapes break torch 2.13's CPU codegen)
    b, h, t, _ = q.shape
    s = k.size(2)
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, b if batch_dependent else None, None, t, s, device=q.device)
    return _compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=k.size(1) != h)


def flex_heads(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | PatternMask | None, is_causal: bool, cross: bool,
               *, key_projection=None, mem_k: Tensor | None = None, mem_v: Tensor | None = None,
               bias: Callable[[Tensor, Tensor], Tensor] | None = None) -> Tensor:
    """Attention heads through flex: the mask (a pattern's, or a boolean tensor's entries),
    causality, the memory slots (M keys `mem_k`, `mem_v` in front) and the position bias
    (`bias(q_pos, k_pos)` -> (H, T, S)), each as the elementwise function flex calls.
    `key_projection`: Linformer's, applied first; `cross`: a cross-attention (no slots, no bias)."""
    if key_projection is not None:  # Linformer: every query sees the rank mixtures
        k, v = key_projection(k, v, mask.dense() if isinstance(mask, PatternMask) else mask)
        mask = None
    rules, by_batch = [], False
    if isinstance(mask, PatternMask):
        allowed, pad = mask.pattern.allowed, mask.pad
        if mask.pattern.QUERY_DEPENDENT:
            rules.append(lambda b, qi, ki: allowed(qi, ki))
        is_causal = is_causal or mask.causal
        if pad is not None:
            rules.append(lambda b, qi, ki: ~pad[b, ki])
            by_batch = True
    elif mask is not None:  # (B | 1, 1, T | 1, S) booleans
        table = mask[:, 0]
        one_b, one_t = table.size(0) == 1, table.size(1) == 1
        rules.append(lambda b, qi, ki: table[0 if one_b else b, 0 if one_t else qi, ki])
        by_batch = not one_b
    if is_causal:
        rules.append(lambda b, qi, ki: ki <= qi)
    m = 0
    if mem_k is not None and not cross:
        m = mem_k.size(1)
        k = torch.cat([mem_k.to(k.dtype).expand(q.size(0), -1, -1, -1), k], dim=2)
        v = torch.cat([mem_v.to(v.dtype).expand(q.size(0), -1, -1, -1), v], dim=2)

    def key(ki):  # a sequence key's own index, past the memory slots
        return (ki - m).clamp(min=0) if m else ki

    sees_itself = isinstance(mask, PatternMask)  # as self_attention_mask has it; not a cross-attention
    mask_mod = None
    if rules:
        def mask_mod(b, h, qi, ki):
            ok = rules[0](b, qi, key(ki))
            for rule in rules[1:]:
                ok = ok & rule(b, qi, key(ki))
            if sees_itself:
                ok = ok | (qi == key(ki))
            return ok | (ki < m) if m else ok

    score_mod = None
    if bias is not None and not cross:  # a function of k - q: one row of offsets
        t, s = q.size(2), k.size(2) - m
        offsets = bias(torch.zeros(1, dtype=torch.long, device=q.device),
                             torch.arange(-(t - 1), s, device=q.device))[:, 0]  # (H, T + S - 1)

        def score_mod(score, b, h, qi, ki):
            shifted = score + offsets[h, key(ki) - qi + t - 1].to(score.dtype)
            return torch.where(ki < m, score, shifted) if m else shifted

    return flex_attention(q, k, v, mask_mod, score_mod, by_batch)
