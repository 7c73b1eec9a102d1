"""A CPU fast path for dropout (Srivastava et al. 2014): a mask that costs a fifth of torch's.

The model's modules use plain `nn.Dropout`; `use_fast_dropout(model)` switches every one of
them to `Dropout` below, which training does when `train.fast_paths` is true (the default),
and tests check it against F.dropout's contract.

On the CPU, `torch.bernoulli_` and `F.dropout` draw one number from the generator per element,
one after another: on the de->en recipe (17 dropouts of (4096, 256) activations a step) that
was 12% of a training step. Here one 64-bit draw gives four 16-bit uniforms, and an element
is dropped when its uniform falls among the lowest k = round(p * 65536) of the 65536 values: p
is quantised to 1/65536, and survivors are scaled by 65536 / (65536 - k), so the expectation is
still exactly the input. The mask comes from the same torch generator, so seeding and the
checkpointed RNG state (exact resume) work as before. On other devices F.dropout is already a
fused kernel and is used as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_LEVELS = 1 << 16


def keep_mask(shape: torch.Size | tuple[int, ...], dropped: int, device: torch.device | str = "cpu") -> Tensor:
    """A boolean mask of `shape`, each element False with probability dropped / 65536."""
    n = math.prod(shape)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(1 << 63), (1 << 63) - 1)
    uniforms = words.view(torch.int16)[:n]  # four independent 16-bit draws per 64-bit word
    return uniforms.ge(dropped - _LEVELS // 2).view(shape)  # int16 values run from -32768


class _ScaleByMask(torch.autograd.Function):
    """x * mask * scale, saving the boolean mask (one byte an element) for backward."""

    @staticmethod
    def forward(ctx, x: Tensor, mask: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x.mul(mask).mul_(scale)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (mask,) = ctx.saved_tensors
        return grad.mul(mask).mul_(ctx.scale), None, None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """F.dropout's contract: zero with probability p (on the CPU, p to the nearest 1/65536)
    and scale the rest so that the expectation is x."""
    if not training or p == 0.0:
        return x
    dropped = round(p * _LEVELS)
    if x.device.type != "cpu" or dropped >= _LEVELS:
        return F.dropout(x, p, training)
    return _ScaleByMask.apply(x, keep_mask(x.shape, dropped, x.device), _LEVELS / (_LEVELS - dropped))


class Dropout(nn.Dropout):
    """nn.Dropout with the fast CPU mask; same constructor, no parameters or buffers."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)


def use_fast_dropout(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Switch every nn.Dropout of `model` to the fast CPU mask (enabled) or back to nn.Dropout.
    Only the class changes: no parameters, buffers or state are touched."""
    for module in model.modules():
        if type(module) is nn.Dropout and enabled:
            module.__class__ = Dropout
        elif type(module) is Dropout and not enabled:
            module.__class__ = nn.Dropout
    return model
