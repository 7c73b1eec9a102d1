import math

import pytest
import torch
import torch.nn.functional as F

from xformer.config import TrainConfig
from xformer.optim import learning_rate, sequence_loss


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_loss_and_gradient_equal_torch_cross_entropy(eps):
    logits = torch.randn(6, 5, 11, dtype=torch.float64, requires_grad=True)
    target = torch.randint(1, 11, (6, 5))
    target[0, 3:] = 0
    target[4, 1:] = 0
    ours = sequence_loss(logits, target, pad_id=0, label_smoothing=eps)
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
