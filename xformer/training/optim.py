"""Optimizer and learning-rate schedules (the losses are xformer/training/losses.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from xformer.config.schema import TrainConfig


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


def learning_rate(step: int, cfg: TrainConfig, window: tuple[int, int] | None = None) -> float:
    """The learning rate of optimizer step `step` (1-based).

    Linear warmup from 0 to `lr` over `warmup_steps`, then
    - inverse_sqrt: lr * sqrt(warmup / step) (Vaswani et al. 2017, eq. 3; fairseq's inverse_sqrt);
    - cosine: half a cosine from lr to 0 at `max_steps` (Loshchilov & Hutter 2017, arXiv:1608.03983);
    - linear: a straight line from lr to 0 at `max_steps` (fairseq's polynomial_decay with power 1;
      the best of the schedules Li et al. 2020, arXiv:1905.04753, compare under a fixed budget);
    - constant: lr;
    - wsd: lr until the cooldown `window` = (start, end) (wsd_window), then down to min_lr at
      end, by 1 - sqrt(progress) or 1 - progress; lr throughout while no window is known.
    """
    warmup = cfg.warmup_steps
    if step <= warmup:
        return cfg.lr * step / warmup
    if cfg.schedule == "inverse_sqrt":
        return cfg.lr * math.sqrt(max(warmup, 1) / step)
    if cfg.schedule == "wsd":
        if window is None or step <= window[0]:
            return cfg.lr
        start, end = window
        done = min(1.0, (step - start) / max(1, end - start + 1))  # step `end` still learns, as in cosine
        factor = 1.0 - (math.sqrt(done) if cfg.decay_shape == "1-sqrt" else done)
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor
    # cosine, linear: step max_steps still learns; the curve reaches 0 one step later
    progress = min(1.0, (step - warmup) / max(1, cfg.max_steps - warmup + 1))
    if cfg.schedule == "cosine":
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - progress)
    return cfg.lr


def wsd_window(cfg: TrainConfig, steps_per_epoch: int, step: int, seconds: float,
               speed: tuple[int, float] | None = None) -> tuple[int, int, str] | None:
    """(start, end, limit) of a wsd run's cooldown as it looks after `step` steps and `seconds`
    of its budget: the end is the earliest of max_steps, max_epochs whole epochs and, under
    max_time, the step the time runs out at, at the speed measured since `speed` = (step,
    seconds); the cooldown is its last decay_fraction. None while no end is known (a time budget
    whose speed is not measured yet). The trainer freezes the window once the cooldown starts."""
    ends = []
    if cfg.max_steps:
        ends.append((cfg.max_steps, "max_steps"))
    if cfg.max_epochs:
        ends.append((cfg.max_epochs * steps_per_epoch, "max_epochs"))
    if cfg.max_time and speed is not None and step > speed[0] and seconds > speed[1]:
        rate = (step - speed[0]) / (seconds - speed[1])
        ends.append((step + int((cfg.max_time * 60 - seconds) * rate), "max_time"))
    if not ends:
        return None
    end, limit = min(ends)
    end = max(end, step)
    return end - max(1, round(cfg.decay_fraction * end)), end, limit


LIMITS = ("max_steps", "max_epochs", "max_time", "patience")  # what a wsd cooldown can be planned for


class WsdPlan:
    """A wsd run's cooldown as training goes: re-estimated before every step until it begins
    (wsd_window), then frozen in Progress (decay_start, decay_end, decay_limit), so a resumed
    run keeps it. Under torch.distributed a time budget's window is process 0's, shared."""

    def __init__(self, cfg: TrainConfig, steps_per_epoch: int, progress, cluster, device: torch.device):
        self.cfg, self.steps_per_epoch, self.progress = cfg, steps_per_epoch, progress
        self.cluster, self.device = cluster, device
        self.speed: tuple[int, float] | None = None  # (step, seconds) this session's speed is measured from

    def measure(self, seconds: float) -> None:
        """After each step: the speed is measured from the end of the session's first one."""
        if self.speed is None:
            self.speed = (self.progress.step, seconds)

    def window(self, seconds: float) -> tuple[tuple[int, int] | None, str]:
        """(the window for the step about to be taken, progress.step; a message when its
        cooldown begins with it)."""
        p, cfg = self.progress, self.cfg
        if cfg.schedule != "wsd":
            return None, ""
        if p.decay_end:
            return (p.decay_start, p.decay_end), ""
        window = wsd_window(cfg, self.steps_per_epoch, p.step - 1, seconds, self.speed)
        if cfg.max_time and self.cluster.world > 1:  # process 0's clock decides, for every process
            shared = self.cluster.from_writer([*window[:2], LIMITS.index(window[2])] if window else [-1, -1, 0],
                                              self.device)
            window = None if shared[0] < 0 else (shared[0], shared[1], LIMITS[shared[2]])
        if window is None or p.step <= window[0]:
            return (window[:2] if window else None), ""
        p.decay_start, p.decay_end, p.decay_limit = window
        return window[:2], f"wsd: cooling down from step {window[0]} to step {window[1]} (train.{window[2]})"

    def cool_down_now(self) -> str:
        """train.patience ran out in the stable phase: the cooldown starts here, as long as
        decay_fraction of a run that ends with it."""
        p, share = self.progress, self.cfg.decay_fraction
        length = max(1, round(p.step * share / (1 - share))) if share < 1 else max(1, p.step)
        p.decay_start, p.decay_end, p.decay_limit = p.step, p.step + length, "patience"
        return f"wsd: no better validation in train.patience = {self.cfg.patience}: cooling down to step {p.decay_end}"
