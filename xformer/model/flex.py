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

try:
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as _flex
except ImportError:  # torch < 2.5
    create_block_mask = _flex = None

_compiled: Callable | None = None


def unavailable() -> str | None:
    """None when flex attention can run here, else why not."""
    return None if _flex is not None else f"flex attention needs torch >= 2.5, found {torch.__version__}"


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
