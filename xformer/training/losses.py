"""Training losses: label-smoothed token cross-entropy and R-Drop's regulariser.

`sequence_loss` has a fast path (`fused=True`, the default): a hand-written backward in one
(N, V) buffer (_SmoothedNLL). `fused=False` is the plain reference, F.cross_entropy; a test
checks that the two agree in value and gradient, and `train.fast_paths = false` trains with
the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def sequence_loss(logits: Tensor, target: Tensor, pad_id: int, label_smoothing: float = 0.0, *,
                  fused: bool = True) -> Tensor:
    """Summed token cross-entropy with label smoothing (Szegedy et al. 2016, arXiv:1512.00567),
    pad targets ignored: (1 - eps) * nll + eps * mean over the vocabulary of -log p, the
    definition of F.cross_entropy(label_smoothing=eps). logits: (..., V) in any dtype,
    computed in fp32; target: (...). `fused`: the fast path (_SmoothedNLL); False: the plain
    F.cross_entropy it must agree with."""
    logits = logits.reshape(-1, logits.size(-1))
    target = target.reshape(-1)
    if not fused:
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32, as the fast path
        return F.cross_entropy(z, target, ignore_index=pad_id, reduction="sum", label_smoothing=label_smoothing)
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


def distillation_kl(logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0,
                    keep: Tensor | None = None) -> Tensor:
    """Word-level knowledge distillation's term (Hinton et al. 2015, arXiv:1503.02531; Kim & Rush
    2016, arXiv:1606.07947): the sum over positions (where `keep`, shaped like logits without V,
    is True) of KL(softmax(teacher / T) || softmax(student / T)) = sum_v q_v (log q_v - log p_v),
    in fp32. logits and teacher_logits: (..., V)."""
    log_q = (teacher_logits.float() / temperature).log_softmax(-1)
    log_p = (logits.float() / temperature).log_softmax(-1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    if keep is not None:
        kl = kl * keep
    return kl.sum()
