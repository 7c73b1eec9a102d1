"""xformer's CPU dropout kernel (xformer/model/dropout.py) against a plain reference: a mask
that drops each element with probability p, survivors scaled by 1 / (1 - p) (p to the nearest
1/65536), the gradient mask * grad / (1 - p), and masks that follow the torch generator."""

import pytest
import torch
from torch import nn

from xformer.config.schema import ModelConfig
from xformer.model.build import build_model
from xformer.model.dropout import Dropout, dropout, keep_mask, use_fast_dropout


def survivor_scale(p: float) -> float:
    """1 / (1 - p) for p quantised to the nearest 1/65536."""
    return 65536 / (65536 - round(p * 65536))


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


def test_keep_mask_with_no_dropped_level_keeps_everything():
    # dropped = k drops the k lowest of the 65536 levels; an off-by-one would drop one level
    # at k = 0, about 64 of these 4M elements
    assert keep_mask((1 << 22,), 0).all()


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_dropout_zeroes_a_fraction_p_and_scales_the_rest_by_one_over_one_minus_p(p):
    x = torch.rand(1 << 18, dtype=torch.float64) + 0.5  # no zeros: a zero output was dropped
    before = x.clone()
    out = dropout(x, p)
    kept = out != 0
    n = x.numel()
    assert torch.equal(x, before)  # the input is not modified in place
    assert abs((~kept).double().mean().item() - p) < 5 * (p * (1 - p) / n) ** 0.5
    torch.testing.assert_close(out[kept], x[kept] * survivor_scale(p), rtol=1e-12, atol=0)
    assert abs(survivor_scale(p) * (1 - p) - 1) < 2**-15
    # E[dropout(x)] = x: out / x has mean 1 and variance p / (1 - p)
    assert abs((out / x).mean().item() - 1) < 5 * (p / (1 - p) / n) ** 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_keeps_the_dtype_and_shape(dtype):
    x = torch.ones(3, 5, 7, dtype=dtype)
    out = dropout(x, 0.5)
    assert out.dtype == dtype and out.shape == x.shape
    assert set(out.unique().tolist()) <= {0.0, 2.0}


def test_gradient_is_the_mask_times_the_upstream_gradient_over_one_minus_p():
    x = (torch.rand(64, 32, dtype=torch.float64) + 0.5).requires_grad_()
    upstream = torch.randn(64, 32, dtype=torch.float64)
    out = dropout(x, 0.3)
    out.backward(upstream)
    mask = (out != 0).detach()
    assert 0 < mask.sum() < mask.numel()
    torch.testing.assert_close(x.grad, mask * upstream * survivor_scale(0.3), rtol=1e-12, atol=0)


def test_backward_agrees_with_finite_differences_of_forward():
    def fixed_mask_dropout(x):  # re-seeded, so every call draws the same mask
        torch.manual_seed(4)
        return dropout(x, 0.4)

    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fixed_mask_dropout, (x,))


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
    assert Dropout(0.5).eval()(x) is x
    assert Dropout(0.0).train()(x) is x
    assert dropout(x, 0.0) is x
    assert dropout(x, 0.5, training=False) is x
    assert torch.count_nonzero(dropout(x, 1.0)) == 0


def test_the_module_in_training_is_the_function():
    x = torch.randn(8, 16)
    torch.manual_seed(5)
    from_module = Dropout(0.3).train()(x)
    torch.manual_seed(5)
    torch.testing.assert_close(from_module, dropout(x, 0.3), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["seq2seq", "classifier", "lstm"])
def test_use_fast_dropout_switches_every_dropout_of_a_built_model_and_back(arch):
    extra = {"seq2seq": {}, "classifier": {"pooling": "mean"}, "lstm": {"pooling": "mean", "lstm_hidden": 8}}[arch]
    cfg = ModelConfig(arch=arch, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                      dropout=0.1, activation_dropout=0.2, **extra)
    model = build_model(cfg, 20, n_classes=None if arch == "seq2seq" else 3).eval()
    tokens = torch.randint(1, 20, (2, 5))

    def run():
        with torch.no_grad():
            return model(tokens, tokens) if arch == "seq2seq" else model(tokens)

    plain, keys = run(), set(model.state_dict())
    rates = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    assert use_fast_dropout(model) is model
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert drops and all(type(m) is Dropout for m in drops)
    assert [m.p for m in drops] == rates and set(model.state_dict()) == keys
    torch.testing.assert_close(run(), plain, rtol=0, atol=0)  # eval mode: no dropout either way
    use_fast_dropout(model, enabled=False)
    assert all(type(m) is nn.Dropout for m in model.modules() if isinstance(m, nn.Dropout))
