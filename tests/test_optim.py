import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from xformer.config.schema import TrainConfig
from xformer.training.losses import rdrop_kl, sequence_loss
from xformer.training.optim import build_optimizer, learning_rate


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("fused", [True, False])  # the fast path and the plain one it replaces
def test_loss_and_gradient_equal_torch_cross_entropy(eps, fused):
    logits = torch.randn(6, 5, 11, dtype=torch.float64, requires_grad=True)
    target = torch.randint(1, 11, (6, 5))
    target[0, 3:] = 0
    target[4, 1:] = 0
    ours = sequence_loss(logits, target, pad_id=0, label_smoothing=eps, fused=fused)
    (g_ours,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0, label_smoothing=eps,
                          reduction="sum")
    (g_ref,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours.double(), ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-6, rtol=0)
    assert g_ours[0, 3:].abs().sum() == 0  # padding gets no gradient


def test_loss_of_bf16_logits_is_computed_in_fp32():
    logits = torch.randn(8, 50).bfloat16().requires_grad_()
    target = torch.randint(1, 50, (8,))
    loss = sequence_loss(logits, target, 0, 0.1)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("schedule", ["inverse_sqrt", "cosine", "linear", "constant"])
def test_schedules_warm_up_linearly_then_follow_their_formula(schedule):
    cfg = TrainConfig(lr=1e-3, warmup_steps=100, schedule=schedule, max_steps=1100)
    assert learning_rate(50, cfg) == pytest.approx(5e-4)
    assert learning_rate(100, cfg) == pytest.approx(1e-3)
    expected = {"inverse_sqrt": 1e-3 * math.sqrt(100 / 400),
                "cosine": 1e-3 * 0.5 * (1 + math.cos(math.pi * 300 / 1001)),
                "linear": 1e-3 * (1 - 300 / 1001),
                "constant": 1e-3}[schedule]
    assert learning_rate(400, cfg) == pytest.approx(expected)
    if schedule in ("cosine", "linear"):  # the last step still learns a little; the curve ends one step later
        assert 0 < learning_rate(1100, cfg) < (1e-8 if schedule == "cosine" else 1.1e-6)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decaying_schedules_need_a_step_horizon(schedule):
    assert TrainConfig(schedule=schedule, max_time=5.0).problems() == [
        f"train.schedule: '{schedule}' decays to 0 at train.max_steps, which must be positive, found 0"]
    assert TrainConfig(schedule=schedule, max_steps=100).problems() == []


def test_rdrop_kl_is_the_mean_of_both_kl_directions():
    torch.manual_seed(0)
    logits = torch.randn(2 * 5, 7, 11)  # two copies of 5 sequences of 7 positions, vocabulary 11
    keep = torch.rand(5, 7) > 0.3
    lp, lq = logits.log_softmax(-1).chunk(2)
    kl_pq = F.kl_div(lq, lp, log_target=True, reduction="none").sum(-1)  # KL(p || q) per position
    kl_qp = F.kl_div(lp, lq, log_target=True, reduction="none").sum(-1)
    expected = ((kl_pq + kl_qp) / 2 * keep).sum()
    torch.testing.assert_close(rdrop_kl(logits, keep), expected)
    same = torch.cat([logits[:5], logits[:5]])
    assert rdrop_kl(same).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("index_rows", [True, False])  # the CPU path (real rows) and the CUDA path (pad masked)
def test_rdrop_without_dropout_is_the_plain_loss_and_with_dropout_adds_a_positive_term(index_rows):
    from xformer.config.schema import ModelConfig
    from xformer.model.build import build_model
    from xformer.tasks.translation import translation_loss
    from xformer.training.device import resolve_runtime

    rt = resolve_runtime("cpu", "fp32")
    torch.manual_seed(0)
    src, tgt_in, tgt_out = torch.randint(4, 40, (3, 6)), torch.randint(4, 40, (3, 5)), torch.randint(4, 40, (3, 5))
    tgt_out[0, 3:] = 0  # pad
    losses = {}
    for dropout in (0.0, 0.3):
        cfg = ModelConfig(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1, dropout=dropout)
        model = build_model(cfg, 40).train()
        for alpha in (0.0, 1e-9, 5.0):  # 1e-9: the same two dropout masks as 5.0, no KL weight
            torch.manual_seed(1)
            train = TrainConfig(rdrop_alpha=alpha)
            losses[dropout, alpha] = translation_loss(model, src, tgt_in, tgt_out, rt, train, index_rows).item()
    assert losses[0.0, 5.0] == pytest.approx(losses[0.0, 0.0], rel=1e-5)  # no dropout: two equal copies
    model.eval()  # dropout 0.3 model, evaluated: the KL term must vanish, and must not when training
    kl_free = translation_loss(model, src, tgt_in, tgt_out, rt, TrainConfig(rdrop_alpha=5.0), index_rows).item()
    assert kl_free == pytest.approx(translation_loss(model, src, tgt_in, tgt_out, rt, TrainConfig(), index_rows).item(),
                                    rel=1e-5)
    assert losses[0.3, 5.0] > losses[0.3, 1e-9] + 1e-4  # two dropout masks disagree: the KL term is positive


def test_rdrop_for_a_classifier_is_the_plain_loss_without_dropout_and_adds_kl_with_it():
    from xformer.config.schema import ModelConfig, Recipe
    from xformer.model.build import build_model
    from xformer.tasks.classification import ClassificationTask
    from xformer.training.device import resolve_runtime

    rt = resolve_runtime("cpu", "fp32")
    torch.manual_seed(0)
    batch = {"tokens": torch.randint(1, 30, (4, 9)), "labels": torch.randint(0, 3, (4,))}
    losses = {}
    for dropout in (0.0, 0.3):
        cfg = ModelConfig(arch="classifier", d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, dropout=dropout,
                          pooling="mean")
        model = build_model(cfg, 30, n_classes=3).train()
        for alpha in (0.0, 1e-9, 5.0):
            recipe = Recipe(model=cfg, train=TrainConfig(rdrop_alpha=alpha))
            torch.manual_seed(1)
            losses[dropout, alpha] = ClassificationTask(recipe).loss(model, batch, rt).item()
    assert losses[0.0, 5.0] == pytest.approx(losses[0.0, 0.0], rel=1e-5)
    assert losses[0.3, 5.0] > losses[0.3, 1e-9] + 1e-4


def _naive_adam(params, grads_per_step, lrs, *, betas, eps, weight_decay, decoupled):
    """Adam / AdamW written out (Kingma & Ba 2015, Algorithm 1; Loshchilov & Hutter 2019), in float64."""
    b1, b2 = betas
    out = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(p) for p in out]
    v = [torch.zeros_like(p) for p in out]
    for t, (grads, lr) in enumerate(zip(grads_per_step, lrs, strict=True), start=1):
        for i, (p, g) in enumerate(zip(out, grads, strict=True)):
            g = g.double()
            decay = weight_decay if p.dim() >= 2 else 0.0  # matrices only
            if decoupled:
                p.mul_(1 - lr * decay)
            else:
                g = g + decay * p
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat, v_hat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            p.sub_(lr * m_hat / (v_hat.sqrt() + eps))
    return out


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
@pytest.mark.parametrize("fast_paths", [True, False])  # the fused update and the per-tensor one
def test_optimizer_step_is_adam_written_out(optimizer, fast_paths):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    cfg = TrainConfig(optimizer=optimizer, lr=1e-2, betas=[0.9, 0.98], adam_eps=1e-8, weight_decay=0.1,
                      fast_paths=fast_paths, max_steps=10)
    opt = build_optimizer(model, cfg)
    assert bool(opt.param_groups[0]["fused"]) is fast_paths
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    grads_per_step = [[torch.randn_like(p) for p in params] for _ in range(4)]
    lrs = [1e-2, 5e-3, 2e-2, 1e-3]  # the loop sets each step's rate in the groups
    for grads, lr in zip(grads_per_step, lrs, strict=True):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    want = _naive_adam(start, grads_per_step, lrs, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1,
                       decoupled=optimizer == "adamw")
    for got, ref in zip(params, want, strict=True):
        torch.testing.assert_close(got.detach().double(), ref, atol=1e-6, rtol=1e-5)


def naive_wsd(step: int, lr: float, warmup: int, start: int, end: int, floor: float, shape: str) -> float:
    """Hagele et al.'s schedule written out: warm up, hold, then cool down to the floor."""
    if step <= warmup:
        return lr * step / warmup
    if step <= start:
        return lr
    x = (step - start) / (end - start + 1)
    return floor + (lr - floor) * (1 - (x ** 0.5 if shape == "1-sqrt" else x))


@pytest.mark.parametrize("shape", ["1-sqrt", "linear"])
def test_wsd_holds_the_rate_then_cools_down_over_the_last_share_of_a_step_budget(shape):
    from xformer.training.optim import wsd_window

    cfg = TrainConfig(lr=1e-3, warmup_steps=100, schedule="wsd", max_steps=1000, decay_fraction=0.2,
                      min_lr=1e-5, decay_shape=shape)
    window = wsd_window(cfg, steps_per_epoch=77, step=0, seconds=0.0)
    assert window == (800, 1000, "max_steps")
    curve = [learning_rate(s, cfg, window[:2]) for s in range(1, 1001)]
    assert curve == pytest.approx([naive_wsd(s, 1e-3, 100, 800, 1000, 1e-5, shape) for s in range(1, 1001)])
    assert curve[799] == 1e-3 and curve[800] < 1e-3 and 1e-5 < curve[-1] < 1e-4
    assert learning_rate(900, cfg, None) == 1e-3  # no end known yet: the stable rate
    # a shorter epoch budget is the end; a time budget, from the speed measured
    assert wsd_window(TrainConfig(schedule="wsd", max_steps=1000, max_epochs=5), 100, 0, 0.0)[1:] == (500, "max_epochs")
    timed = TrainConfig(schedule="wsd", max_time=10.0, decay_fraction=0.1)
    assert wsd_window(timed, 100, 50, 60.0) is None  # not measured yet
    assert wsd_window(timed, 100, 50, 60.0, speed=(10, 20.0)) == (531, 590, "max_time")  # 1 step/s, 540 s left


def test_wsd_rules():
    assert TrainConfig(schedule="wsd", max_steps=10, decay_fraction=0.0).problems() == [
        "train.decay_fraction: expected a share of the run in (0, 1], found 0.0"]
    assert TrainConfig(schedule="wsd", max_steps=10, lr=1e-3, min_lr=1e-2).problems() == [
        "train.min_lr: expected at most train.lr = 0.001, found 0.01"]


def test_patience_ends_a_wsd_runs_stable_phase_and_never_cuts_its_cooldown_short():
    from xformer.training.distributed import Cluster
    from xformer.training.optim import WsdPlan
    from xformer.training.progress import Progress
    from xformer.training.state import limit_reached

    cfg = TrainConfig(schedule="wsd", max_steps=1000, patience=2, decay_fraction=0.2, warmup_steps=10)
    progress = Progress(step=100, bad_validations=2)
    assert limit_reached(cfg, progress, 0.0, 50) == "patience"  # the loop then cools down instead of stopping
    plan = WsdPlan(cfg, 50, progress, Cluster(), torch.device("cpu"))
    assert "cooling down to step 125" in plan.cool_down_now()
    progress.step, progress.bad_validations = 110, 5
    assert limit_reached(cfg, progress, 0.0, 50) is None and plan.window(0.0)[0] == (100, 125)
    progress.step = 125
    assert limit_reached(cfg, progress, 0.0, 50) == "patience"
