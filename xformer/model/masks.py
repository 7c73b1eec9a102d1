"""Attention masks. Convention everywhere: a boolean mask where True means "may attend",
which is what `F.scaled_dot_product_attention` takes, broadcastable to (B, H, T, S).

(torch.nn.MultiheadAttention uses the opposite: True means "masked out". Only the tests,
which compare against it, ever flip a mask.)
"""

import torch
from torch import Tensor


def padding_mask(pad: Tensor) -> Tensor:
    """(B, S) True-at-padding -> (B, 1, 1, S) True-where-attendable."""
    return ~pad[:, None, None, :]


def causal_mask(t: int, s: int, device: torch.device | None = None) -> Tensor:
    """(1, 1, T, S): query i sits at absolute position s - t + i and sees keys 0..s - t + i.

    With a KV cache of s - t earlier positions this is the bottom-right-aligned causal mask;
    with t == s it is the usual lower triangle.
    """
    offset = s - t
    rows = torch.arange(t, device=device)[:, None] + offset
    cols = torch.arange(s, device=device)[None, :]
    return (cols <= rows)[None, None]
