"""Optimizer and learning-rate schedules (the losses are xformer/losses.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from xformer.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam or AdamW (Loshchilov & Hutter 2019, arXiv:1711.05101) with the recipe's betas;
    weight decay skips biases, norm gains and embeddings' padding effect by decaying only
    matrices (dim >= 2), the usual practice since BERT.

    With train.fast_paths (the default) the update is torch's fused kernel where the
    parameters' device has one (CPU and CUDA): one pass over all tensors instead of a dozen
    elementwise ops per tensor, ~4x cheaper on a CPU; the same maths to rounding
    (tests/test_optim.py). Call it after the model is on its device."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    fused = cfg.fast_paths and fused_supported([*decay, *no_decay])
    return cls(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps, fused=fused or None)


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused Adam takes these parameters: floating point, all on CPU or CUDA."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (1-based).

    Linear warmup from 0 to `lr` over `warmup_steps`, then
    - inverse_sqrt: lr * sqrt(warmup / step) (Vaswani et al. 2017, eq. 3; fairseq's inverse_sqrt);
    - cosine: half a cosine from lr to 0 at `max_steps` (Loshchilov & Hutter 2017, arXiv:1608.03983);
    - linear: a straight line from lr to 0 at `max_steps` (fairseq's polynomial_decay with power 1;
      the best of the schedules Li et al. 2020, arXiv:1905.04753, compare under a fixed budget);
    - constant: lr.
    """
    warmup = cfg.warmup_steps
    if step <= warmup:
        return cfg.lr * step / warmup
    if cfg.schedule == "inverse_sqrt":
        return cfg.lr * math.sqrt(max(warmup, 1) / step)
    # cosine, linear: step max_steps still learns; the curve reaches 0 one step later
    progress = min(1.0, (step - warmup) / max(1, cfg.max_steps - warmup + 1))
    if cfg.schedule == "cosine":
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - progress)
    return cfg.lr
