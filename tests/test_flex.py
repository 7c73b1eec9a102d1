"""The flex attention backend (model/flex.py) against the explicit path: patterns as block
masks, position biases as score mods, memory slots, GQA, padding; and where it cannot run
(a CPU with gradients) the routing and the refusal to train."""

import pytest
import torch
from test_variants import pattern_fields, same_weights, tiny
from typer.testing import CliRunner

from xformer.model.attention import MultiHeadAttention
from xformer.model.build import build_model
from xformer.model.flex import unavailable
from xformer.model.masks import padding_mask
from xformer.model.patterns import PatternMask, make_pattern, self_attention_mask
from xformer.model.positional import POSITIONAL

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@pytest.mark.parametrize("name,causal,kv,position,memory", [
    ("sliding_window", False, 2, "alibi", 0), ("local_global", True, 4, "relative", 3), ("full", False, 1, None, 2),
    ("strided", True, 2, None, 0),
])
def test_flex_equals_the_explicit_path(name, causal, kv, position, memory):
    torch.manual_seed(0)
    pattern = make_pattern(name, window=3, global_tokens=2, stride=3)
    bias = {"alibi": lambda: POSITIONAL["alibi"](4), "relative": lambda: POSITIONAL["relative"](4, not causal, 16),
            None: lambda: None}[position]()
    attention = MultiHeadAttention(16, 4, kv, memory_tokens=memory, backend="flex", score_bias=bias)
    attention.init_fairseq_()
    t = 29
    pad = torch.zeros(2, t, dtype=torch.bool)
    pad[1, -5:] = True
    x = torch.randn(2, t, 16)
    lazy = PatternMask(pattern, t, pad, causal) if pattern.QUERY_DEPENDENT else padding_mask(pad)
    dense = self_attention_mask(pattern, t, t, 0, causal=causal, pad=pad) if pattern.QUERY_DEPENDENT else lazy
    plain_causal = causal and not pattern.QUERY_DEPENDENT
    with torch.no_grad():
        got = attention(x, mask=lazy, is_causal=plain_causal)[0]
        attention.backend = "explicit"
        expected = attention(x, mask=dense, is_causal=plain_causal)[0]
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_a_flex_model_translates_as_the_sdpa_model_and_routes_gradients_on_a_cpu():
    torch.manual_seed(0)
    sdpa = build_model(tiny(positional="alibi", **pattern_fields("sliding_window")), 23).eval()
    flex = same_weights(sdpa, build_model(tiny(positional="alibi", attention_backend="flex",
                                               **pattern_fields("sliding_window")), 23)).eval()
    src, tgt = torch.randint(4, 23, (2, 9)), torch.randint(4, 23, (2, 7))
    src[1, 6:] = 0
    with torch.no_grad():
        torch.testing.assert_close(flex(src, tgt), sdpa(src, tgt), atol=2e-6, rtol=1e-5)
    loss = flex(src, tgt).square().mean()  # with gradients on a CPU: routed to SDPA, so it trains there too
    loss.backward()
    assert all(p.grad is not None for p in flex.parameters() if p.requires_grad)


def test_training_with_flex_on_a_cpu_is_refused_with_the_reason(tmp_path):
    from xformer_cli.main import app

    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\narch = "classifier"\nd_model = 16\nn_heads = 2\nd_ff = 16\nn_encoder_layers = 1\n'
                      'attention_backend = "flex"\npooling = "last"\n'
                      '[data]\ntask = "recall"\nmax_len = 16\nn_pairs = 2\nn_queries = 1\nn_train = 50\n'
                      'n_valid = 10\nn_test = 10\n[train]\nmax_steps = 1\n')
    result = CliRunner().invoke(app, ["train", str(recipe), "--out", str(tmp_path / "run"), "--device", "cpu"])
    assert result.exit_code == 2 and "flex attention has no backward pass on a CPU" in result.output
    assert not (tmp_path / "run").exists()
