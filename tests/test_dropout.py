import pytest
import torch
import torch.nn.functional as F
from torch import nn

from xformer.config import ModelConfig
from xformer.model.build import build_model
from xformer.model.dropout import Dropout, dropout, keep_mask


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_keep_mask_keeps_each_element_with_probability_one_minus_p(p):
    torch.manual_seed(0)
    n = 1 << 20
    mask = keep_mask((n,), round(p * 65536))
    # each of the four 16-bit lanes of a 64-bit draw, and the sign lane in particular
    for lane in mask.view(-1, 4).unbind(1):
        assert abs(lane.float().mean().item() - (1 - p)) < 5 / (n / 4) ** 0.5
    # neighbours are independent: P(both kept) = (1 - p)^2
    both = (mask[:-1] & mask[1:]).float().mean().item()
    assert abs(both - (1 - p) ** 2) < 5 / n**0.5


def test_dropout_zeroes_or_scales_and_keeps_the_expectation():
    torch.manual_seed(0)
    x = torch.rand(512, 256, dtype=torch.float64) + 0.5
    out = dropout(x, 0.2)
    kept = out != 0
    scale = 65536 / (65536 - round(0.2 * 65536))
    torch.testing.assert_close(out[kept], x[kept] * scale, rtol=1e-12, atol=0)
    mean = torch.stack([dropout(x, 0.2) for _ in range(200)]).mean(0)
    assert abs((mean / x).mean().item() - 1) < 1e-3  # E[dropout(x)] = x


def test_gradient_is_the_mask_times_the_scale_like_f_dropout():
    x = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(1)
    out = dropout(x, 0.3)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, (out / x).detach(), rtol=1e-12, atol=0)
    # F.dropout's gradient has the same form: d out / d x = out / x elementwise
    y = x.detach().clone().requires_grad_()
    ref = F.dropout(y, 0.3, True)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(y.grad, (ref / y).detach(), rtol=1e-12, atol=0)


def test_the_mask_follows_the_torch_generator():
    x = torch.ones(1000)
    torch.manual_seed(3)
    first = dropout(x, 0.2)
    state = torch.get_rng_state()
    second = dropout(x, 0.2)
    torch.set_rng_state(state)
    torch.testing.assert_close(dropout(x, 0.2), second, rtol=0, atol=0)  # resume from saved RNG
    torch.manual_seed(3)
    torch.testing.assert_close(dropout(x, 0.2), first, rtol=0, atol=0)
    assert not torch.equal(first, second)


def test_identity_in_eval_mode_at_p_zero_and_all_dropped_at_p_one():
    x = torch.randn(8, 16)
    module = Dropout(0.5).eval()
    assert module(x) is x
    assert dropout(x, 0.0) is x
    assert torch.count_nonzero(dropout(x, 1.0)) == 0


@pytest.mark.parametrize("arch", ["seq2seq", "classifier", "lstm"])
def test_every_dropout_of_a_built_model_is_the_fast_one(arch):
    extra = {"pooling": "mean"} if arch != "seq2seq" else {}
    cfg = ModelConfig(arch=arch, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                      dropout=0.1, activation_dropout=0.1, **extra)
    model = build_model(cfg, 20, n_classes=None if arch == "seq2seq" else 3)
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert drops and all(type(m) is Dropout for m in drops)
