"""Optimizer, learning-rate schedules and the label-smoothed loss."""

from __future__ import annotations

import math

import torch
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


def sequence_loss(logits: Tensor, target: Tensor, pad_id: int, label_smoothing: float = 0.0) -> Tensor:
    """Summed token cross-entropy with label smoothing (Szegedy et al. 2016, arXiv:1512.00567),
    pad targets ignored: (1 - eps) * nll + eps * mean over the vocabulary of -log p, the
    definition of F.cross_entropy(label_smoothing=eps). logits: (..., V) in any dtype,
    computed in fp32; target: (...)."""
    logits = logits.reshape(-1, logits.size(-1))
    target = target.reshape(-1)
    return _SmoothedNLL.apply(logits, target, pad_id, label_smoothing)


def rdrop_kl(logits: Tensor, keep: Tensor | None = None) -> Tensor:
    """R-Drop's regulariser (Liang et al. 2021, arXiv:2106.14448) for a batch that was run twice:
    logits (2N, ..., V), the first N and the last N rows being the same inputs under two dropout
    masks. Returns the sum over positions (where `keep`, shaped like logits[:N] without V, is
    True) of (KL(p1 || p2) + KL(p2 || p1)) / 2 = sum_v (p1 - p2)(log p1 - log p2) / 2, in fp32."""
    logp = logits.float().log_softmax(-1)
    logp1, logp2 = logp.chunk(2, dim=0)
    symmetric = ((logp1.exp() - logp2.exp()) * (logp1 - logp2)).sum(-1) / 2
    if keep is not None:
        symmetric = symmetric * keep
    return symmetric.sum()


class _SmoothedNLL(torch.autograd.Function):
    """The loss above with a hand-written backward, softmax(z) - smoothed one-hot, computed in
    place in one (N, V) buffer. Autograd through log_softmax + gather + mean allocates and
    walks several (N, V) tensors; on a CPU the loss was ~40% of the step (tests check the
    gradient against F.cross_entropy's)."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, pad_id: int, eps: float) -> Tensor:
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32
        lse = z.logsumexp(-1)  # (N,)
        keep = target.ne(pad_id)
        safe = target.masked_fill(~keep, 0)
        nll = lse - z.gather(-1, safe[:, None]).squeeze(-1)
        loss = (1.0 - eps) * nll
        if eps > 0:
            loss = loss + eps * (lse - z.mean(-1))
        ctx.save_for_backward(logits, lse, safe, keep)
        ctx.eps = eps
        return (loss * keep).sum()

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        logits, lse, safe, keep = ctx.saved_tensors
        eps, vocab = ctx.eps, logits.size(-1)
        grad = logits.to(lse.dtype).sub(lse[:, None]).exp_()  # softmax, (N, V)
        if eps > 0:
            grad.sub_(eps / vocab)
        grad.scatter_add_(-1, safe[:, None], grad.new_full((grad.size(0), 1), -(1.0 - eps)))
        grad.mul_((keep.to(grad.dtype) * grad_output)[:, None])
        return grad.to(logits.dtype), None, None, None
