"""The banded kernel (model/banded.py) against the naive sum and against dense attention under
the same pattern: every pattern that can run banded, causal or not, with padding, GQA, position
biases and memory tokens, forward and backward."""

import itertools

import pytest
import torch
from reference import naive_allowed, naive_biased_attention

from xformer.model.attention import MultiHeadAttention
from xformer.model.banded import banded_attention, strided_attention
from xformer.model.patterns import PATTERNS, PatternMask, make_pattern, self_attention_mask
from xformer.model.positional import POSITIONAL

WINDOW, GLOBAL, STRIDE = 3, 2, 3
BANDED = [name for name in PATTERNS if make_pattern(name, window=WINDOW, global_tokens=GLOBAL, stride=STRIDE, topk=4,
                                                    rank=4).banded(64)]


def test_some_patterns_run_banded():
    assert {"sliding_window", "local_global", "strided"} <= set(BANDED)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t,window,block", [(13, 3, 4), (5, 3, 2), (4, 9, 3), (16, 1, 4)])
@pytest.mark.parametrize("sdpa", [None, 0.0])
def test_the_kernel_is_the_naive_windowed_sum(causal, t, window, block, sdpa):
    torch.manual_seed(0)
    b, h, kv, dh = 2, 4, 2, 8
    q, k, v = torch.randn(b, h, t, dh, dtype=torch.float64), *torch.randn(2, b, kv, t, dh, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)

    def bias(qp, kp):
        return -slopes[:, None, None] * (qp[:, None] - kp[None, :]).abs()

    out = banded_attention(q, k, v, window, causal=causal, bias=bias, block=block, sdpa_dropout=sdpa)
    allowed = naive_allowed("sliding_window", t, t, 0, causal, window=window)
    expected = naive_biased_attention(q, k, v, allowed, bias(torch.arange(t), torch.arange(t)))
    torch.testing.assert_close(out, expected)


def positional_bias(name: str, causal: bool):
    if name == "alibi":
        return POSITIONAL["alibi"](4)
    return POSITIONAL["relative"](4, not causal, 16)


CASES = list(itertools.product(BANDED, [False, True], [4, 1], [None, "alibi", "relative"], [0, 3]))


@pytest.mark.parametrize("backend", ["explicit", "sdpa"])  # the written-out blocks, or SDPA over them
@pytest.mark.parametrize("name,causal,kv,position,memory", CASES)
def test_banded_attention_equals_dense_attention_forward_and_backward(name, causal, kv, position, memory, backend):
    torch.manual_seed(0)
    pattern = make_pattern(name, window=WINDOW, global_tokens=GLOBAL, stride=STRIDE)
    bias = positional_bias(position, causal) if position is not None else None
    attention = MultiHeadAttention(16, 4, kv, memory_tokens=memory, backend=backend, score_bias=bias).double()
    attention.init_fairseq_()
    t = 29
    pad = torch.zeros(2, t, dtype=torch.bool)
    pad[1, -6:] = True  # padded queries far from any real key see only themselves
    lazy = PatternMask(pattern, t, pad, causal)
    assert lazy.banded
    x = torch.randn(2, t, 16, dtype=torch.float64, requires_grad=True)
    banded = attention(x, mask=lazy)[0]
    grads = torch.autograd.grad(banded.square().sum(), [x, *attention.parameters()])
    attention.backend = "explicit"  # the reference: the masked dense matrix, written out
    dense = attention(x, mask=self_attention_mask(pattern, t, t, 0, causal=causal, pad=pad))[0]
    expected = torch.autograd.grad(dense.square().sum(), [x, *attention.parameters()])
    torch.testing.assert_close(banded, dense)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def test_a_pattern_mask_becomes_dense_where_the_banded_kernel_does_not_apply():
    """Head inspection needs the probabilities, so it gets the dense matrix (and the same output)."""
    torch.manual_seed(0)
    pattern = make_pattern("sliding_window", window=2)
    attention = MultiHeadAttention(8, 2, backend="explicit").double()
    x = torch.randn(1, 12, 8, dtype=torch.float64)
    lazy = PatternMask(pattern, 12)
    out, probs = attention(x, mask=lazy, need_weights=True)
    assert probs.shape == (1, 2, 12, 12) and not probs[0, 0, 0, 2:].any()
    torch.testing.assert_close(out, attention(x, mask=PatternMask(pattern, 12))[0])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t,stride", [(13, 3), (12, 4), (7, 2), (5, 1)])
def test_the_strided_kernel_is_the_naive_strided_sum(causal, t, stride):
    torch.manual_seed(0)
    b, h, kv, dh = 2, 4, 2, 8
    q, k, v = torch.randn(b, h, t, dh, dtype=torch.float64), *torch.randn(2, b, kv, t, dh, dtype=torch.float64)
    pad = torch.zeros(b, t, dtype=torch.bool)
    pad[1, -2:] = True
    out = strided_attention(q, k, v, stride, causal=causal, key_pad=pad)
    for i in range(b):
        allowed = naive_allowed("strided", t, t, 0, causal, stride=stride) & ~pad[i][None, :]
        allowed |= torch.eye(t, dtype=torch.bool)
        torch.testing.assert_close(out[i:i + 1], naive_biased_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], allowed))
