"""Optimizer, learning-rate schedules and the label-smoothed loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xformer.config import TrainConfig


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam or AdamW (Loshchilov & Hutter 2019, arXiv:1711.05101) with the recipe's betas;
    weight decay skips biases, norm gains and embeddings' padding effect by decaying only
    matrices (dim >= 2), the usual practice since BERT."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps)


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """The learning rate of optimizer step `step` (1-based).

    Linear warmup from 0 to `lr` over `warmup_steps`, then
    - inverse_sqrt: lr * sqrt(warmup / step) (Vaswani et al. 2017, eq. 3; fairseq's inverse_sqrt);
    - cosine: half a cosine from lr to 0 at `max_steps` (Loshchilov & Hutter 2017, arXiv:1608.03983);
    - constant: lr.
    """
    warmup = cfg.warmup_steps
    if step <= warmup:
        return cfg.lr * step / warmup
    if cfg.schedule == "inverse_sqrt":
        return cfg.lr * math.sqrt(max(warmup, 1) / step)
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, cfg.max_steps - warmup))
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr


def sequence_loss(logits: Tensor, target: Tensor, pad_id: int, label_smoothing: float = 0.0) -> Tensor:
    """Summed token cross-entropy with label smoothing (Szegedy et al. 2016, arXiv:1512.00567),
    pad positions ignored. logits: (B, T, V) in any dtype (computed in fp32); target: (B, T)."""
    return F.cross_entropy(
        logits.float().flatten(0, 1), target.flatten(), ignore_index=pad_id,
        label_smoothing=label_smoothing, reduction="sum",
    )
