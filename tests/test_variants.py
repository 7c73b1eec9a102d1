"""Attention patterns, positions that act on scores, and gated FFNs: each against its paper's
definition (tests/reference.py), in degenerate equivalences, with the KV cache, and for every
value of every axis (parametrised from the axis dicts, so a new entry is tested unasked)."""

import dataclasses
import math
import typing

import pytest
import torch
from reference import naive_alibi_slopes, naive_allowed, naive_biased_attention, naive_t5_bucket

from xformer.config import schema as config
from xformer.config.loading import recipe_from_dict
from xformer.config.schema import ModelConfig
from xformer.config.strict import section_to_dict
from xformer.errors import RecipeError
from xformer.model.attention import explicit_attention, sdpa_attention
from xformer.model.build import build_model, init_fairseq_
from xformer.model.downsample import DOWNSAMPLERS
from xformer.model.feedforward import FFNS
from xformer.model.patterns import PATTERNS, make_pattern, self_attention_mask
from xformer.model.positional import POSITIONAL, alibi_slopes, t5_bucket

V = 23
PARAMS = {"window": 3, "global_tokens": 2, "stride": 3, "topk": 4, "rank": 4}


def tiny(**changes) -> ModelConfig:
    base = dict(d_model=16, n_heads=4, d_ff=24, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                max_positions=64)
    return ModelConfig(**{**base, **changes})


def pattern_fields(name: str) -> dict:
    wanted = {"sliding_window": ("window",), "local_global": ("window", "global_tokens"), "strided": ("stride",),
              "topk": ("topk",), "low_rank": ("rank",)}.get(name, ())
    return {"attention": name, **{k: PARAMS[k] for k in wanted}}


# ---------------------------------------------------------------- masks, biases, hooks by definition


@pytest.mark.parametrize("name", ["full", "sliding_window", "local_global", "strided"])
@pytest.mark.parametrize("causal,offset", [(False, 0), (True, 0), (True, 5)])
def test_pattern_masks_are_the_papers_definitions(name, causal, offset):
    t, s = 7, offset + 7
    pattern = make_pattern(name, **PARAMS)
    mask = self_attention_mask(pattern, t, s, offset, causal=causal, pad=torch.zeros(1, s, dtype=torch.bool))
    expected = naive_allowed(name, t, s, offset, causal, **{k: PARAMS[k] for k in ("window", "global_tokens",
                                                                                  "stride")})
    assert torch.equal(mask[0, 0], expected)


def test_padding_is_masked_and_a_padded_query_still_sees_itself():
    pattern = make_pattern("sliding_window", window=2)
    pad = torch.tensor([[False, False, True, True, True, True]])
    mask = self_attention_mask(pattern, 6, 6, 0, causal=False, pad=pad)[0, 0]
    assert not mask[:2, 2:].any()  # real queries never see padding
    assert mask[5].tolist() == [False] * 5 + [True]  # far from real tokens: only itself, so no NaN


def test_alibi_slopes_follow_the_papers_sequence():
    for n in (1, 2, 4, 6, 8, 12, 16):
        torch.testing.assert_close(alibi_slopes(n).double(), torch.tensor(naive_alibi_slopes(n), dtype=torch.float64))
    assert alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_match_the_papers_function(bidirectional):
    relative = torch.arange(-300, 301)
    ours = t5_bucket(relative, bidirectional)
    assert ours.tolist() == [naive_t5_bucket(int(r), bidirectional) for r in relative]


@pytest.mark.parametrize("backend", ["explicit", "sdpa"])
@pytest.mark.parametrize("name", ["full", "sliding_window", "local_global", "strided", "topk"])
@pytest.mark.parametrize("kv", [4, 2, 1])
def test_attention_with_a_pattern_and_a_bias_is_the_naive_sum(backend, name, kv):
    torch.manual_seed(0)
    b, h, t, dh = 2, 4, 6, 8
    q, k, v = torch.randn(b, h, t, dh, dtype=torch.float64), *torch.randn(2, b, kv, t, dh, dtype=torch.float64)
    bias = torch.randn(h, t, t, dtype=torch.float64)
    pattern = make_pattern(name, **PARAMS)
    mask = self_attention_mask(pattern, t, t, 0, causal=True)
    if backend == "sdpa" and pattern.score_hook is not None:
        pytest.skip("a score hook runs on the explicit path only (MultiHeadAttention routes it there)")
    if backend == "sdpa":
        out = sdpa_attention(q, k, v, mask, bias=bias)
    else:
        out, probs = explicit_attention(q, k, v, mask, bias=bias, score_hook=pattern.score_hook)
        assert torch.allclose(probs.sum(-1), torch.ones(b, h, t, dtype=torch.float64))
    allowed = naive_allowed(name, t, t, 0, True, **{x: PARAMS[x] for x in ("window", "global_tokens", "stride")})
    expected = naive_biased_attention(q, k, v, allowed, bias, PARAMS["topk"] if name == "topk" else None)
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------- degenerate equivalences, model level


def same_weights(a, b):
    """Copy a's weights into b where the names agree (b may have a position table a lacks)."""
    b.load_state_dict(a.state_dict(), strict=False)
    return b


def logits(model, src, tgt):
    with torch.no_grad():
        return model.eval()(src, tgt)


@pytest.mark.parametrize("changes", [
    {"attention": "sliding_window", "window": 64},  # a window >= the length is full attention
    {"attention": "strided", "stride": 1},  # every distance is a multiple of 1
    {"attention": "topk", "topk": 64},  # k >= the number of keys keeps them all
    {"attention": "local_global", "window": 64, "global_tokens": 0},
])
def test_degenerate_patterns_equal_full_attention(changes):
    torch.manual_seed(0)
    src, tgt = torch.randint(4, V, (2, 9)), torch.randint(4, V, (2, 7))
    src[1, 6:] = 0
    full = build_model(tiny(), V)
    variant = same_weights(full, build_model(tiny(**changes), V))
    torch.testing.assert_close(logits(variant, src, tgt), logits(full, src, tgt))


def test_local_global_without_global_tokens_is_the_sliding_window():
    torch.manual_seed(0)
    src, tgt = torch.randint(4, V, (2, 12)), torch.randint(4, V, (2, 10))
    window = build_model(tiny(attention="sliding_window", window=3), V)
    local = same_weights(window, build_model(tiny(attention="local_global", window=3, global_tokens=0), V))
    torch.testing.assert_close(logits(local, src, tgt), logits(window, src, tgt))
    narrow = logits(window, src, tgt)
    assert not torch.allclose(narrow, logits(same_weights(window, build_model(tiny(), V)), src, tgt))


@pytest.mark.parametrize("positional", ["alibi", "relative"])
def test_a_zero_score_bias_is_no_positions_at_all(positional):
    torch.manual_seed(0)
    src, tgt = torch.randint(4, V, (2, 9)), torch.randint(4, V, (2, 7))
    none = build_model(tiny(positional="none"), V)
    biased = same_weights(none, build_model(tiny(positional=positional), V))
    with torch.no_grad():
        for module in biased.modules():
            if hasattr(module, "slopes"):
                module.slopes.zero_()
            if type(module).__name__ == "T5RelativeBias":
                module.embedding.weight.zero_()
    torch.testing.assert_close(logits(biased, src, tgt), logits(none, src, tgt))
    assert not torch.allclose(logits(build_model(tiny(positional=positional), V), src, tgt),
                              logits(none, src, tgt))


# ---------------------------------------------------------------- the KV cache, causality, padding


# low_rank is the encoder's self-attention (a seq2seq decoder's stays full), and its keys are
# mixtures of positions, which a bias by key position (alibi, relative) cannot address
AXES = [(p, a) for p in typing.get_args(config.Positional) for a in typing.get_args(config.AttentionPattern)
        if not (a == "low_rank" and p in ("alibi", "relative"))
        and not (a == "synthesizer" and p in ("alibi", "relative", "rope"))]  # its scores are its own table
CLASSIFIER_AXES = AXES


@pytest.mark.parametrize("positional,attention", AXES)
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_incremental_decoding_equals_the_full_forward(positional, attention, kv_heads):
    torch.manual_seed(0)
    model = build_model(tiny(positional=positional, n_kv_heads=kv_heads, **pattern_fields(attention)), V).eval()
    # distinct target tokens: without positions, two equal tokens tie exactly, and top-k at a tie
    # may keep either of two scores one rounding apart
    src, tgt = torch.randint(4, V, (2, 8)), torch.stack([torch.randperm(V - 4)[:9] + 4 for _ in range(2)])
    src[0, 5:] = 0
    with torch.no_grad():
        full = model(src, tgt)
        memory, pad = model.encode(src)
        cache, steps = model.new_cache(), []
        for start, end in ((0, 3), (3, 4), (4, 9)):  # several tokens, one, several
            steps.append(model.decode(tgt[:, start:end], memory, pad, cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("positional,attention", AXES)
def test_future_tokens_and_padding_never_change_earlier_real_outputs(positional, attention):
    torch.manual_seed(0)
    model = build_model(tiny(positional=positional, **pattern_fields(attention)), V).eval()
    src, tgt = torch.randint(4, V, (1, 8)), torch.randint(4, V, (1, 9))
    with torch.no_grad():
        base = model(src, tgt)
        changed = tgt.clone()
        changed[0, 6:] = torch.randint(4, V, (3,))
        assert torch.allclose(model(src, changed)[0, :6], base[0, :6], atol=1e-6)  # causal
        padded = torch.cat([src, torch.zeros(1, 4, dtype=torch.long)], dim=1)
        assert torch.allclose(model(padded, tgt), base, atol=1e-5)  # source padding is invisible


# ---------------------------------------------------------------- every axis value, end to end


EVERY_VALUE = ([("positional", p) for p in POSITIONAL] + [("ffn", f) for f in FFNS] + [("memory_tokens", 2)]
               + [("attention", a) for a in PATTERNS] + [("downsample", d) for d in DOWNSAMPLERS])


@pytest.mark.parametrize("axis,value", EVERY_VALUE)
@pytest.mark.parametrize("arch", ["seq2seq", "classifier"])
def test_every_axis_value_loads_builds_initialises_and_trains(axis, value, arch):
    fields = pattern_fields(value) if axis == "attention" else {axis: value}
    if axis == "downsample":  # after the first of the two encoder layers
        fields["downsample_every"] = 1
    pooling = {"pooling": "cls"} if arch == "classifier" else {}
    model_table = section_to_dict(tiny(arch=arch, **pooling, **fields))  # what a saved recipe holds
    data = {"max_len": 32} if arch == "seq2seq" else {"task": "recall", "max_len": 32, "n_pairs": 2, "n_queries": 1}
    recipe = recipe_from_dict({"model": model_table, "data": data, "train": {"max_steps": 1}})
    sizes = {"tgt_vocab_size": V} if arch == "seq2seq" else {"n_classes": 3}
    model = build_model(recipe.model, V, **sizes)
    with torch.no_grad():  # every parameter re-initialised by its owner: nothing keeps NaN
        for p in model.parameters():
            p.fill_(math.nan)
    init_fairseq_(model, recipe.model.d_model)
    assert not any(torch.isnan(p).any() for p in model.parameters()), axis
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    src, tgt = torch.randint(4, V, (4, 10)), torch.randint(4, V, (4, 8))
    losses = []
    for _ in range(5):
        out = model(src, tgt) if arch == "seq2seq" else model(src)
        target = tgt if arch == "seq2seq" else torch.tensor([0, 1, 2, 0])
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_a_gated_ffn_has_a_third_matrix_and_takes_d_ff_as_given():
    plain, gated = build_model(tiny(), V), build_model(tiny(ffn="swiglu"), V)
    ffn = gated.encoder.layers[0].ffn
    assert ffn.fc1.weight.shape == ffn.gate.weight.shape == (24, 16) and ffn.fc2.weight.shape == (16, 24)
    x = torch.randn(3, 16)
    expected = ffn.fc2(torch.nn.functional.silu(ffn.fc1(x)) * ffn.gate(x))
    torch.testing.assert_close(ffn(x), expected)
    assert sum(p.numel() for p in gated.parameters()) > sum(p.numel() for p in plain.parameters())


def test_old_recipes_spell_the_ffn_activation():
    recipe = recipe_from_dict({"model": {"activation": "gelu"}, "train": {"max_steps": 1}})
    assert recipe.model.ffn == "gelu"
    with pytest.raises(Exception, match="model.activation: the old name of model.ffn"):
        recipe_from_dict({"model": {"activation": "gelu", "ffn": "relu"}, "train": {"max_steps": 1}})


def test_pattern_fields_apply_only_to_their_pattern():
    with pytest.raises(Exception, match="model.window: applies only when model.attention = 'sliding_window' or "
                                        "'local_global'"):
        recipe_from_dict({"model": {"window": 8}, "train": {"max_steps": 1}})
    with pytest.raises(Exception, match="model.window: expected a positive number, found 0"):
        recipe_from_dict({"model": {"attention": "sliding_window", "window": 0}, "train": {"max_steps": 1}})


def test_head_capture_sees_the_pattern_and_pruning_keeps_the_bias_heads():
    torch.manual_seed(0)
    model = build_model(tiny(positional="alibi", **pattern_fields("sliding_window")), V).eval()
    site = model.encoder.layers[0].self_attn
    captured = []
    site.probe(captured.append)
    src, tgt = torch.randint(4, V, (1, 10)), torch.randint(4, V, (1, 4))
    with torch.no_grad():
        before = model(src, tgt)
    site.probe(None)
    probs = captured[0][0, 0]  # (S, S) of head 0
    assert torch.equal(probs > 0, naive_allowed("sliding_window", 10, 10, window=3))
    with torch.no_grad():
        site.gate(torch.tensor([1.0, 0.0, 1.0, 1.0]))
        gated = model(src, tgt)
        site.gate(None)
        site.prune_heads([1])
        assert site.bias_heads.tolist() == [0, 2, 3]  # the shared slopes of the heads that stay
        torch.testing.assert_close(model(src, tgt), gated)
    assert not torch.allclose(gated, before)


@pytest.mark.parametrize("positional,attention,pooling,causal", [
    (*axes, pooling, causal) for axes in CLASSIFIER_AXES
    for pooling, causal in [("cls", False), ("last", False), ("last", True)]
    if not (causal and axes[1] == "low_rank")  # refused: it mixes later keys in (model_table.py)
])
def test_a_pooled_classifier_reads_what_the_full_encoder_computes(positional, attention, pooling, causal):
    """The one-row last layer is a fast path: wherever a variant makes a query's result depend on
    its position or on other scores, the model must compute the whole layer instead."""
    torch.manual_seed(0)
    cfg = tiny(arch="classifier", pooling=pooling, positional=positional, causal=causal,
               **pattern_fields(attention))
    model = build_model(cfg, V, n_classes=3).eval()
    tokens = torch.randint(4, V, (2, 11))
    tokens[1, 7:] = 0
    with torch.no_grad():
        got = model(tokens)
        pad = tokens.eq(0)
        if pooling == "cls":
            pad = torch.cat([pad.new_zeros(2, 1), pad], dim=1)
            states = model.encoder(tokens, pad, prefix=model.cls)[:, 0]
        else:
            last = (~pad).sum(1) - 1
            states = model.encoder(tokens, pad)[torch.arange(2), last]
    torch.testing.assert_close(got, model.head(states), atol=1e-6, rtol=1e-5)
    # the fast path is taken wherever a query's scores depend only on which keys it sees
    takes_rows = positional not in ("rope", "alibi", "relative") and attention not in ("topk", "low_rank",
                                                                                    "synthesizer")
    assert model.encoder.computes_rows() == takes_rows


# ---------------------------------------------------------------- memory tokens


def test_memory_tokens_are_keys_and_values_every_query_sees_first():
    torch.manual_seed(0)
    from xformer.model.attention import MultiHeadAttention

    attention = MultiHeadAttention(16, 4, 2, memory_tokens=3).double().eval()
    attention.init_fairseq_()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        out, _ = attention(x, is_causal=True)
        q = attention.q_proj(x).view(2, 5, 4, 4).transpose(1, 2)
        k = attention.k_proj(x).view(2, 5, 2, 4).transpose(1, 2)
        v = attention.v_proj(x).view(2, 5, 2, 4).transpose(1, 2)
        k = torch.cat([attention.mem_k.expand(2, -1, -1, -1), k], dim=2)
        v = torch.cat([attention.mem_v.expand(2, -1, -1, -1), v], dim=2)
        allowed = torch.cat([torch.ones(5, 3, dtype=torch.bool), torch.ones(5, 5, dtype=torch.bool).tril()], dim=1)
        heads = naive_biased_attention(q, k, v, allowed)
        expected = attention.out_proj(heads.transpose(1, 2).reshape(2, 5, 16))
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("positional,attention", [("sinusoidal", "full"), ("rope", "sliding_window"),
                                                  ("alibi", "topk"), ("relative", "local_global")])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_memory_tokens_decode_incrementally_as_the_full_forward(positional, attention, kv_heads):
    torch.manual_seed(0)
    cfg = tiny(positional=positional, n_kv_heads=kv_heads, memory_tokens=2, **pattern_fields(attention))
    model = build_model(cfg, V).eval()
    src, tgt = torch.randint(4, V, (2, 8)), torch.stack([torch.randperm(V - 4)[:7] + 4 for _ in range(2)])
    with torch.no_grad():
        full = model(src, tgt)
        memory, pad = model.encode(src)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, a:b], memory, pad, cache) for a, b in ((0, 2), (2, 3), (3, 7))]
        assert cache.length == 7  # the slots never enter the cache
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
    pruned = build_model(dataclasses.replace(cfg, pruned_heads=["encoder.0.self_attn:1"]), V).eval()
    assert pruned.encoder.layers[0].self_attn.mem_k.shape[0] == 3  # the slots of the key/value heads left
    with torch.no_grad():
        assert torch.isfinite(pruned(src, tgt)).all()


@pytest.mark.parametrize("attention", ["sliding_window", "local_global"])
@pytest.mark.parametrize("positional", ["rope", "alibi", "relative"])
def test_a_windowed_decoder_cache_is_a_ring_of_constant_size(attention, positional):
    """The cache keeps the window - 1 newest keys (and the global ones), yet every step equals
    the full forward: decoder memory is constant in the number of generated tokens."""
    torch.manual_seed(0)
    model = build_model(tiny(positional=positional, **pattern_fields(attention)), V).eval()
    src = torch.randint(4, V, (2, 6))
    tgt = torch.stack([torch.randperm(V - 4)[:16] + 4 for _ in range(2)])
    with torch.no_grad():
        full = model(src, tgt)
        memory, pad = model.encode(src)
        cache, steps, held = model.new_cache(), [], []
        for i in range(16):
            steps.append(model.decode(tgt[:, i:i + 1], memory, pad, cache))
            held.append(cache.layers[0][0].k.size(2))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-4)
    bound = PARAMS["window"] + (PARAMS["global_tokens"] if attention == "local_global" else 0)
    assert max(held) == bound and held[-1] == bound and cache.length == 16



# ---------------------------------------------------------------- low rank (Linformer)


def test_low_rank_with_identity_projections_is_dense_attention():
    torch.manual_seed(0)
    n = 9
    dense = build_model(tiny(arch="classifier", pooling="mean", max_positions=n + 1), V, n_classes=3).eval()
    cfg = tiny(arch="classifier", pooling="mean", max_positions=n + 1, attention="low_rank", rank=n)
    low = same_weights(dense, build_model(cfg, V, n_classes=3)).eval()
    with torch.no_grad():
        for layer in low.encoder.layers:
            layer.self_attn.key_projection.e.copy_(torch.eye(n, n + 1))
            layer.self_attn.key_projection.f.copy_(torch.eye(n, n + 1))
    tokens = torch.randint(4, V, (2, n))
    with torch.no_grad():
        torch.testing.assert_close(low(tokens), dense(tokens))


def test_low_rank_keys_are_mixtures_of_the_real_keys_only():
    torch.manual_seed(0)
    model = build_model(tiny(arch="classifier", pooling="mean", attention="low_rank", rank=4), V, n_classes=3).eval()
    tokens = torch.randint(4, V, (1, 7))
    with torch.no_grad():
        base = model(tokens)
        padded = model(torch.cat([tokens, torch.zeros(1, 5, dtype=torch.long)], dim=1))
    torch.testing.assert_close(padded, base)  # padding is zeroed before E and F see it
    with pytest.raises(RecipeError, match="'alibi' biases scores by key position"):
        recipe_from_dict({"model": {"arch": "classifier", "attention": "low_rank", "positional": "alibi"},
                          "data": {"task": "recall", "max_len": 32, "n_pairs": 2, "n_queries": 1},
                          "train": {"max_steps": 1}})


def test_a_low_rank_seq2seq_projects_the_encoder_keys_and_decodes_with_full_attention():
    model = build_model(tiny(attention="low_rank", rank=4), V)
    encoder = [layer.self_attn.key_projection for layer in model.encoder.layers]
    decoder = [layer.self_attn.key_projection for layer in model.decoder.layers]
    assert all(p is not None for p in encoder) and decoder == [None] * len(decoder)
    assert model.decoder.pattern.__class__.__name__ == "Full"


def test_synthesizer_weights_are_a_table_of_positions_that_no_input_changes():
    """Tay et al.'s random Synthesizer: softmax(R) over the visible keys, whatever the tokens;
    the values (and so the outputs) still follow the input."""
    model = build_model(tiny(attention="synthesizer", max_positions=12), V).eval()
    attn = model.encoder.layers[0].self_attn
    assert attn.q_proj is None and attn.k_proj is None and attn.score_bias.table.shape == (4, 12, 12)
    x, y = torch.randn(2, 6, 16), torch.randn(2, 6, 16)
    with torch.no_grad():
        (out_x, probs_x), (out_y, probs_y) = attn(x, need_weights=True), attn(y, need_weights=True)
    torch.testing.assert_close(probs_x, probs_y, atol=0, rtol=0)
    torch.testing.assert_close(probs_x[0], torch.softmax(attn.score_bias.table[:, :6, :6], -1), atol=1e-6, rtol=0)
    assert not torch.allclose(out_x, out_y)
