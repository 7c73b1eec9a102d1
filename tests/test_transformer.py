"""The Seq2Seq and Classifier models over the VARIANTS below: parity with torch.nn.Transformer
(weights copied) and with the naive model of tests/reference.py, and the degenerate equivalences
(GQA = MHA with repeated key/value heads, KV-cache decoding = full forward, padding and future
tokens change nothing they should not, RoPE ignores a shift of every position)."""

import contextlib
import dataclasses
import math
import typing

import pytest
import torch
from torch import nn

from tests.reference import naive_classifier, naive_norm, naive_seq2seq, naive_sinusoid
from xformer.config import schema as config
from xformer.config.schema import ModelConfig
from xformer.model.build import build_model, count_parameters
from xformer.model.downsample import DOWNSAMPLERS
from xformer.model.feedforward import FFNS
from xformer.model.norms import NORMS
from xformer.model.patterns import PATTERNS
from xformer.model.positional import POSITIONAL, RotaryPositional, SinusoidalPositional
from xformer.model.qkv import QKV

D, H, FF, V, PAD = 32, 4, 64, 13, 0

# Flag combinations the model-level tests run over: every value of every axis appears at least
# once, and RoPE, GQA / MQA, RMSNorm and Pre-LN also appear together.
VARIANTS = {
    "post-ln": {},
    "pre-ln-gelu": {"norm_position": "pre", "ffn": "gelu"},
    "learned-explicit": {"positional": "learned", "attention_backend": "explicit"},
    "learned-unscaled-pre-ln": {"positional": "learned", "scale_embeddings": False, "norm_position": "pre"},
    "rmsnorm": {"norm": "rmsnorm"},
    "rmsnorm-pre-ln-gqa": {"norm": "rmsnorm", "norm_position": "pre", "n_kv_heads": 2},
    "mqa-explicit": {"n_kv_heads": 1, "attention_backend": "explicit"},
    "rope": {"positional": "rope"},
    "post-ln-silu": {"ffn": "silu"},  # opus-mt's Marian
    "rope-gqa-rmsnorm-pre-ln": {"positional": "rope", "n_kv_heads": 2, "norm": "rmsnorm", "norm_position": "pre",
                                "ffn": "gelu"},
    "rope-mqa-explicit": {"positional": "rope", "n_kv_heads": 1, "attention_backend": "explicit"},
    "shared-qkv": {"qkv": "shared"},
    "no-norm-no-residual": {"norm": "none", "residual": False},
    "pre-ln-no-residual": {"norm_position": "pre", "residual": False, "qkv": "shared"},
    "no-norm-pre-ln": {"norm": "none", "norm_position": "pre"},
    "synthesizer": {"attention": "synthesizer", "max_positions": 16},
    "synthesizer-pre-ln-gqa": {"attention": "synthesizer", "max_positions": 16, "norm_position": "pre",
                               "n_kv_heads": 2},
}
# torch.nn.Transformer takes its input already embedded, so any absolute position encoding fits;
# it always has its norms and residual connections.
TORCH_EXPRESSIBLE = [name for name, overrides in VARIANTS.items() if overrides.get("positional") != "rope"
                     and overrides.get("norm") != "none" and overrides.get("residual", True)
                     and overrides.get("attention") != "synthesizer"]


def tiny(**overrides) -> ModelConfig:
    args = dict(d_model=D, n_heads=H, d_ff=FF, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                tie_embeddings="none")
    return ModelConfig(**{**args, **overrides})


def tiny_model(variant: str, **overrides):
    """A tiny model of VARIANTS[variant] in eval mode, every parameter random."""
    cfg = tiny(**{**VARIANTS[variant], **overrides})
    n_classes = 3 if cfg.arch == "classifier" else None
    model = build_model(cfg, V, n_classes=n_classes, pad_id=PAD).eval()
    randomize_(model)
    return cfg, model


def batch(lengths, max_len, vocab=V, generator=None):
    """Right-padded token ids, real tokens in 1..vocab-1."""
    tokens = torch.randint(1, vocab, (len(lengths), max_len), generator=generator)
    pad = torch.arange(max_len)[None, :] >= torch.tensor(lengths)[:, None]
    return tokens.masked_fill(pad, PAD), pad


def randomize_(model):
    """Every parameter random, biases and norm gains included: fairseq's init zeroes biases,
    which would hide a bias wired to the wrong place."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * p.std().clamp(min=0.1) + (1.0 if (p == 1).all() else 0.0))


def repeat_kv_heads(state: dict, n_heads: int, n_kv_heads: int) -> dict:
    """A GQA state_dict made MHA: each key/value head's rows repeated for the H / K query heads
    that read it (query head h reads key/value head h // (H / K))."""
    out = {}
    for name, value in state.items():
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            value = value.unflatten(0, (n_kv_heads, -1)).repeat_interleave(n_heads // n_kv_heads, 0).flatten(0, 1)
        out[name] = value
    return out


@contextlib.contextmanager
def torch_slow_path():
    """torch.nn.Transformer's layers as written in Python, not its fused inference kernel
    (which reads norm1.bias directly, and RMSNorm has none)."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def torch_transformer(cfg: ModelConfig) -> nn.Transformer:
    """torch.nn.Transformer in cfg's shape; for RMSNorm, torch.nn.RMSNorm in every norm slot."""
    ref = nn.Transformer(D, H, cfg.n_encoder_layers, cfg.n_decoder_layers, FF, dropout=0.0,
                         activation={"silu": nn.functional.silu}.get(cfg.ffn, cfg.ffn),  # torch names relu, gelu
                         layer_norm_eps=cfg.norm_eps, batch_first=True,
                         norm_first=cfg.norm_position == "pre").eval()
    if cfg.norm == "rmsnorm":
        for layer in [*ref.encoder.layers, *ref.decoder.layers]:
            for slot in ("norm1", "norm2", "norm3"):
                if hasattr(layer, slot):
                    setattr(layer, slot, nn.RMSNorm(D, eps=cfg.norm_eps))
        ref.encoder.norm, ref.decoder.norm = nn.RMSNorm(D, eps=cfg.norm_eps), nn.RMSNorm(D, eps=cfg.norm_eps)
    if cfg.norm_position == "post":  # Vaswani / fairseq Post-LN has no final norm; torch adds one
        ref.encoder.norm = None
        ref.decoder.norm = None
    return ref


def copy_into_torch_transformer(model, ref: nn.Transformer):
    """Our weights into torch.nn.Transformer (ours -> theirs, so our init stays under test)."""
    with torch.no_grad():
        for ours, theirs in zip(model.encoder.layers, ref.encoder.layers, strict=True):
            copy_attention_back(ours.self_attn, theirs.self_attn)
            copy_ffn_back(ours.ffn, theirs)
            theirs.norm1.load_state_dict(ours.self_attn_norm.state_dict())
            theirs.norm2.load_state_dict(ours.ffn_norm.state_dict())
        for ours, theirs in zip(model.decoder.layers, ref.decoder.layers, strict=True):
            copy_attention_back(ours.self_attn, theirs.self_attn)
            copy_attention_back(ours.cross_attn, theirs.multihead_attn)
            copy_ffn_back(ours.ffn, theirs)
            theirs.norm1.load_state_dict(ours.self_attn_norm.state_dict())
            theirs.norm2.load_state_dict(ours.cross_attn_norm.state_dict())
            theirs.norm3.load_state_dict(ours.ffn_norm.state_dict())
        if ref.encoder.norm is not None:
            ref.encoder.norm.load_state_dict(model.encoder.final_norm.state_dict())
            ref.decoder.norm.load_state_dict(model.decoder.final_norm.state_dict())


def copy_attention_back(ours, ref):
    """Into torch's MHA; a GQA / MQA module's key/value heads repeated for their query heads."""
    state = repeat_kv_heads({f"{name}.{p}": getattr(getattr(ours, name), p) for name in ("k_proj", "v_proj")
                             for p in ("weight", "bias")}, ours.n_heads, ours.n_kv_heads)
    ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, state["k_proj.weight"], state["v_proj.weight"]]))
    ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, state["k_proj.bias"], state["v_proj.bias"]]))
    ref.out_proj.weight.copy_(ours.out_proj.weight)
    ref.out_proj.bias.copy_(ours.out_proj.bias)


def copy_ffn_back(ours, layer):
    layer.linear1.load_state_dict(ours.fc1.state_dict())
    layer.linear2.load_state_dict(ours.fc2.state_dict())


def embedded(cfg, embed, tokens):
    """What torch.nn.Transformer takes: token embeddings, scaled, plus absolute positions."""
    x = embed.embedding.weight[tokens] * (math.sqrt(D) if cfg.scale_embeddings else 1.0)
    if cfg.positional == "learned":
        return x + embed.positional.embedding.weight[: tokens.size(1)]
    return x + naive_sinusoid(tokens.size(1), D).float()


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")  # torch's, about its Pre-LN encoder
@pytest.mark.parametrize("variant", TORCH_EXPRESSIBLE)
def test_seq2seq_equals_torch_transformer(variant):
    cfg, model = tiny_model(variant)
    ref = torch_transformer(cfg)
    copy_into_torch_transformer(model, ref)

    src, src_pad = batch([7, 4, 2], 7)
    tgt, tgt_pad = batch([6, 6, 3], 6)
    causal = ~torch.ones(6, 6, dtype=torch.bool).tril()  # torch: True = blocked
    with torch.no_grad(), torch_slow_path():
        hidden = ref(embedded(cfg, model.encoder.embed, src), embedded(cfg, model.decoder.embed, tgt),
                     tgt_mask=causal, src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad,
                     tgt_key_padding_mask=tgt_pad)
        expected = hidden @ model.output.weight.T
        logits = model(src, tgt)
    real = ~tgt_pad
    torch.testing.assert_close(logits[real], expected[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_seq2seq_equals_naive_reference(variant):
    cfg, model = tiny_model(variant)
    src, _ = batch([7, 4, 2], 7)
    tgt, _ = batch([6, 6, 3], 6)
    with torch.no_grad():
        logits = model(src, tgt)
    expected = naive_seq2seq(cfg, model.state_dict(), src, tgt, PAD)
    torch.testing.assert_close(logits.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pooling,variant", [
    ("cls", "post-ln"), ("cls", "rope"), ("cls", "rmsnorm-pre-ln-gqa"),
    ("last", "pre-ln-gelu"), ("last", "rope-gqa-rmsnorm-pre-ln"), ("last", "mqa-explicit"),
    ("mean", "learned-explicit"), ("mean", "rope-mqa-explicit"),
])
def test_classifier_equals_naive_reference(pooling, variant):
    # cls and last without RoPE take the shortcut of computing one row in the last layer
    cfg, model = tiny_model(variant, arch="classifier", pooling=pooling)
    tokens, _ = batch([6, 3, 1], 6)
    with torch.no_grad():
        logits = model(tokens)
    expected = naive_classifier(cfg, model.state_dict(), tokens, PAD)
    torch.testing.assert_close(logits.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pooling,variant", [
    ("last", "post-ln"), ("last", "learned-explicit"), ("last", "rope"), ("mean", "rmsnorm-pre-ln-gqa"),
    ("last", "synthesizer"),
])
def test_a_causal_classifier_equals_the_naive_left_to_right_reference(pooling, variant):
    # post-ln and learned positions take the one-row shortcut in the last layer, which must be causal too
    cfg, model = tiny_model(variant, arch="classifier", pooling=pooling, causal=True)
    tokens, _ = batch([6, 3, 1], 6)
    with torch.no_grad():
        logits = model(tokens)
    expected = naive_classifier(cfg, model.state_dict(), tokens, PAD)
    torch.testing.assert_close(logits.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_a_causal_classifier_never_reads_a_later_token(causal):
    """Position i's final state depends on tokens 0..i only: changing the last token of a
    causal classifier's input leaves every earlier state as it was (a bidirectional one moves)."""
    _, model = tiny_model("pre-ln-gelu", arch="classifier", pooling="last", causal=causal)
    tokens, _ = batch([6, 6], 6)
    changed = tokens.clone()
    changed[:, -1] = changed[:, -1] % (V - 1) + 1  # another real token
    pad = tokens.eq(PAD)
    with torch.no_grad():
        before, after = model.encoder(tokens, pad), model.encoder(changed, pad)
    assert not torch.allclose(before[:, -1], after[:, -1], atol=1e-4)
    assert torch.allclose(before[:, :-1], after[:, :-1], atol=1e-5) == causal


@pytest.mark.parametrize("variant", ["post-ln", "rope-gqa-rmsnorm-pre-ln"])
def test_explicit_and_sdpa_models_agree(variant):
    _, model = tiny_model(variant)
    src, _ = batch([7, 3], 7)
    tgt, _ = batch([5, 5], 5)
    with torch.no_grad():
        sdpa = model(src, tgt)
        for module in model.modules():
            if hasattr(module, "backend"):
                module.backend = "explicit"
        explicit = model(src, tgt)
    torch.testing.assert_close(explicit, sdpa, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positional", ["sinusoidal", "rope"])
@pytest.mark.parametrize("n_kv_heads", [1, 2])
def test_gqa_model_equals_mha_model_with_repeated_kv_heads(n_kv_heads, positional):
    cfg = tiny(n_kv_heads=n_kv_heads, positional=positional, norm="rmsnorm", norm_position="pre")
    gqa = build_model(cfg, V).eval()
    randomize_(gqa)
    mha = build_model(dataclasses.replace(cfg, n_kv_heads=None), V).eval()
    mha.load_state_dict(repeat_kv_heads(gqa.state_dict(), H, n_kv_heads))
    src, _ = batch([7, 4], 7)
    tgt, _ = batch([5, 5], 5)
    with torch.no_grad():
        torch.testing.assert_close(gqa(src, tgt), mha(src, tgt), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_incremental_decoding_equals_full_forward(variant):
    _, model = tiny_model(variant)
    src, _ = batch([7, 3, 5], 7)
    tgt, _ = batch([6, 6, 6], 6)
    with torch.no_grad():
        full = model(src, tgt)
        memory, memory_pad = model.encode(src)
        # one token a step (greedy and beam search), and uneven chunks: a first chunk of several
        # tokens, one token after cached ones, several tokens after cached ones
        for chunks in ([1] * 6, [2, 1, 3]):
            cache, steps, start = model.new_cache(), [], 0
            for n in chunks:
                steps.append(model.decode(tgt[:, start : start + n], memory, memory_pad, cache))
                start += n
            assert cache.length == 6
            torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_cache_reorder_matches_reordered_batch():
    model = build_model(tiny(), V).eval()
    src, _ = batch([7, 3, 5], 7)
    tgt, _ = batch([4, 4, 4], 4)
    order = torch.tensor([2, 0, 0])
    with torch.no_grad():
        memory, memory_pad = model.encode(src)
        cache = model.new_cache()
        model.decode(tgt[:, :3], memory, memory_pad, cache)
        cache.reorder(order)
        step = model.decode(tgt[order, 3:], memory[order], memory_pad[order], cache)
        expected = model(src[order], tgt[order])[:, 3:]
    torch.testing.assert_close(step, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_never_changes_real_outputs(variant):
    """Each example of a right-padded batch gets the logits it gets alone, unpadded."""
    _, model = tiny_model(variant)
    src_lengths, tgt_lengths = [7, 4, 2], [3, 6, 5]
    src, _ = batch(src_lengths, 7)
    tgt, _ = batch(tgt_lengths, 6)
    with torch.no_grad():
        together = model(src, tgt)
        for i, (s, t) in enumerate(zip(src_lengths, tgt_lengths, strict=True)):
            alone = model(src[i : i + 1, :s], tgt[i : i + 1, :t])
            torch.testing.assert_close(together[i, :t], alone[0], atol=1e-5, rtol=1e-5)


def test_kept_positions_are_the_full_logits_at_those_positions():
    _, model = tiny_model("rope-gqa-rmsnorm-pre-ln")
    src, _ = batch([7, 4], 7)
    tgt, tgt_pad = batch([6, 3], 6)
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt, keep=~tgt_pad), model(src, tgt)[~tgt_pad], atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_future_tokens_never_change_earlier_outputs(variant):
    _, model = tiny_model(variant)
    src, _ = batch([6, 6], 6)
    tgt, _ = batch([5, 5], 5)
    changed = tgt.clone()
    changed[:, 3:] = (changed[:, 3:] % (V - 1)) + 1
    assert not torch.equal(changed, tgt)
    with torch.no_grad():
        before, after = model(src, tgt), model(src, changed)
    torch.testing.assert_close(after[:, :3], before[:, :3], atol=0, rtol=0)  # exactly: nothing leaks
    if VARIANTS[variant].get("residual", True):  # without one, random attention may saturate on an earlier token
        assert not torch.allclose(after[:, 3:], before[:, 3:])


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope"])
def test_only_rope_ignores_a_shift_of_every_source_position(positional):
    """RoPE scores depend on relative positions only: left padding, which moves every real
    source token, leaves a RoPE encoder's real outputs and (cross-attention being position-free)
    the decoder's logits unchanged. Absolute positions must change them."""
    _, model = tiny_model("rmsnorm-pre-ln-gqa", positional=positional)
    src, _ = batch([5, 5], 5)
    tgt, _ = batch([4, 4], 4)
    shifted = torch.cat([torch.full((2, 3), PAD), src], dim=1)
    with torch.no_grad():
        memory, moved = model.encode(src)[0], model.encode(shifted)[0][:, 3:]
        logits, moved_logits = model(src, tgt), model(shifted, tgt)
    if positional == "rope":
        torch.testing.assert_close(moved, memory, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(moved_logits, logits, atol=1e-5, rtol=1e-5)
    else:
        assert not torch.allclose(moved_logits, logits, atol=1e-3)


@pytest.mark.parametrize("pooling,variant", [
    ("cls", "post-ln"), ("cls", "rope"), ("mean", "post-ln"), ("mean", "rope-mqa-explicit"),
    ("last", "learned-explicit"), ("last", "rope-gqa-rmsnorm-pre-ln"),
])
def test_classifier_ignores_padding(pooling, variant):
    """Each example of a right-padded batch gets the logits it gets alone, unpadded."""
    _, model = tiny_model(variant, arch="classifier", pooling=pooling)
    lengths = [6, 2, 4]
    tokens, _ = batch(lengths, 6)
    with torch.no_grad():
        together = model(tokens)
        alone = torch.cat([model(tokens[i : i + 1, :n]) for i, n in enumerate(lengths)])
    assert together.shape == (3, 3)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norms_equal_the_naive_formulas(norm):
    module = NORMS[norm](D, 1e-5)
    randomize_(module)
    x = torch.randn(3, 5, D) * 3 + 1
    bias = module.bias.detach().double() if norm == "layernorm" else None
    expected = naive_norm(x.double(), module.weight.detach().double(), bias, norm, 1e-5)
    with torch.no_grad():
        torch.testing.assert_close(module(x).double(), expected, atol=1e-5, rtol=1e-5)


def test_tied_embeddings_share_one_tensor():
    all_tied = build_model(tiny(tie_embeddings="all"), V)
    assert all_tied.encoder.embed.embedding.weight is all_tied.output.weight
    assert all_tied.decoder.embed.embedding.weight is all_tied.output.weight
    decoder_tied = build_model(tiny(tie_embeddings="decoder"), V, tgt_vocab_size=V + 2)
    assert decoder_tied.decoder.embed.embedding.weight is decoder_tied.output.weight
    assert decoder_tied.output.weight.shape == (V + 2, D)
    untied = build_model(tiny(), V)
    assert untied.output.weight is not untied.decoder.embed.embedding.weight


def test_parameter_counts_match_formula():
    def layer_params(n_attn):  # attention: 4 (D*D + D); ffn: D*FF + FF + FF*D + D; LN: 2D each
        return n_attn * 4 * (D * D + D) + (2 * D * FF + FF + D) + (n_attn + 1) * 2 * D

    body = 2 * layer_params(1) + 2 * layer_params(2)
    for tie, n_embeddings in (("all", 1), ("decoder", 2), ("none", 3)):
        counts = count_parameters(build_model(tiny(tie_embeddings=tie), V))
        assert counts == {"total": body + n_embeddings * V * D, "embedding": n_embeddings * V * D,
                          "non_embedding": body}


def test_builds_on_meta_device_without_memory():
    with torch.device("meta"):
        model = build_model(ModelConfig(), 37000)
    assert next(model.parameters()).is_meta
    assert count_parameters(model)["non_embedding"] == 44_138_496  # Vaswani base without vocab


def test_fairseq_init_scales():
    model = build_model(ModelConfig(d_model=256, n_heads=4, d_ff=1024, tie_embeddings="none"), 8000, pad_id=PAD)
    embedding = model.encoder.embed.embedding.weight
    assert embedding[PAD].abs().sum() == 0
    assert abs(embedding[1:].std().item() - 256**-0.5) < 0.002
    assert model.encoder.layers[0].ffn.fc1.bias.abs().sum() == 0
    bound = math.sqrt(6 / (256 + 1024))  # Xavier-uniform
    assert model.encoder.layers[0].ffn.fc1.weight.abs().max() <= bound


def test_sinusoid_equals_naive_formula():
    table = SinusoidalPositional(D, 50).table
    torch.testing.assert_close(table.double(), naive_sinusoid(50, D), atol=1e-5, rtol=0)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryPositional(8, 64)
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)

    def score(p, r):  # q at position p against k at position r
        return (rope.rotate(q, p) * rope.rotate(k, r)).sum(-1)

    torch.testing.assert_close(score(5, 2), score(40, 37), atol=1e-5, rtol=0)
    torch.testing.assert_close(score(0, 0), (q * k).sum(-1), atol=1e-6, rtol=0)  # position 0: no rotation
    assert not torch.allclose(score(5, 2), score(5, 3))
    norms = rope.rotate(q.expand(1, 2, 30, 8).contiguous()).norm(dim=-1)  # a rotation keeps lengths
    torch.testing.assert_close(norms, q.norm(dim=-1).expand(1, 2, 30), atol=1e-5, rtol=0)


def test_rope_rotates_pairs_by_the_naive_angles():
    rope = RotaryPositional(4, 16, base=100.0)
    x = torch.randn(1, 1, 16, 4)
    out = rope.rotate(x)
    for p in (0, 3, 15):
        for i, theta in enumerate((p * 100.0 ** 0, p * 100.0 ** -0.5)):  # pairs (0, 2), (1, 3)
            a, b = x[0, 0, p, i], x[0, 0, p, i + 2]
            cos, sin = math.cos(theta), math.sin(theta)
            expected = torch.stack([a * cos - b * sin, a * sin + b * cos])
            torch.testing.assert_close(out[0, 0, p, [i, i + 2]], expected, atol=1e-5, rtol=0)


def test_rope_classifier_shares_one_rotary_and_adds_no_parameters():
    cfg = tiny(positional="rope", arch="classifier", pooling="mean")
    model = build_model(cfg, V, n_classes=3).eval()
    assert all(layer.self_attn.rotary is model.encoder.embed.positional for layer in model.encoder.layers)
    sinusoidal = build_model(tiny(arch="classifier", pooling="mean"), V, n_classes=3)
    assert count_parameters(model)["total"] == count_parameters(sinusoidal)["total"]
    tokens = torch.randint(4, V, (2, 6))
    with torch.no_grad():
        base = model(tokens)
        reversed_order = model(tokens.flip(1))
    assert not torch.allclose(base, reversed_order)  # order matters, so positions reach the output


def test_too_long_sequence_names_max_positions():
    model = build_model(tiny(max_positions=8), V)
    with pytest.raises(ValueError, match="max_positions = 8"):
        model(torch.ones(1, 9, dtype=torch.long), torch.ones(1, 3, dtype=torch.long))


@pytest.mark.parametrize("literal,table", [
    (config.Positional, POSITIONAL), (config.Norm, NORMS), (config.FFN, FFNS),
    (config.AttentionPattern, PATTERNS), (config.Downsample, DOWNSAMPLERS), (config.QKV, QKV),
    (config.AttentionPattern, config.PATTERN_RULES),
])
def test_every_variant_word_has_an_implementation(literal, table):
    assert set(typing.get_args(literal)) == set(table)


@pytest.mark.parametrize("arch", ["seq2seq", "classifier"])
def test_shared_qkv_is_separate_projections_holding_one_matrix(arch):
    """qkv = "shared": the same outputs as the separate model whose k and v projections are
    copies of its q projection; 2 * (D^2 + D) fewer parameters per attention module."""
    n_classes = 3 if arch == "classifier" else None
    shared = build_model(tiny(arch=arch, qkv="shared"), V, n_classes=n_classes, pad_id=PAD).eval()
    randomize_(shared)
    separate = build_model(tiny(arch=arch), V, n_classes=n_classes, pad_id=PAD).eval()
    state = shared.state_dict()  # every name, the tied ones included
    separate.load_state_dict(state)
    sites = [m for m in shared.modules() if hasattr(m, "q_proj")]
    for attn in sites:
        assert attn.k_proj.weight is attn.q_proj.weight and attn.v_proj.bias is attn.q_proj.bias
    src, tgt = torch.randint(1, V, (2, 7)), torch.randint(1, V, (2, 5))
    args = (src,) if arch == "classifier" else (src, tgt)
    torch.testing.assert_close(shared(*args), separate(*args))
    saved = count_parameters(separate)["total"] - count_parameters(shared)["total"]
    assert saved == len(sites) * 2 * (D * D + D)


def test_shared_qkv_stays_one_matrix_through_training_and_a_checkpoint(tmp_path):
    from xformer.training.checkpoint import load_model_weights, read_checkpoint, save_checkpoint

    model = build_model(tiny(qkv="shared", dropout=0.1), V, pad_id=PAD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    src, tgt = torch.randint(1, V, (2, 7)), torch.randint(1, V, (2, 5))
    for _ in range(2):
        model(src, tgt).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(tmp_path / "c.safetensors", model, meta={})
    again = build_model(tiny(qkv="shared", dropout=0.1), V, pad_id=PAD, init=False)
    load_model_weights(again, read_checkpoint(tmp_path / "c.safetensors")[0])
    for a, b in zip(model.modules(), again.modules(), strict=True):
        if hasattr(a, "q_proj"):
            assert torch.equal(a.q_proj.weight, b.q_proj.weight) and b.k_proj.weight is b.q_proj.weight


def test_shared_qkv_needs_every_key_value_head_and_refuses_pruning():
    assert any("model.qkv: 'shared'" in p and "n_kv_heads" in p for p in tiny(qkv="shared", n_kv_heads=2).problems())
    pruned = tiny(qkv="shared", pruned_heads=["encoder.0.self_attn:1"])
    assert any("cannot lose heads" in p for p in pruned.problems())


BUILDER_CASES = [*VARIANTS.values(), {"positional": "alibi"}, {"positional": "relative"},
                 {"attention": "low_rank", "rank": 4, "max_positions": 16}, {"attention": "topk", "topk": 2},
                 {"attention": "local_global", "window": 2}, {"memory_tokens": 2},
                 {"downsample_every": 1, "downsample": "conv"},
                 {"pruned_heads": ["encoder.0.self_attn:1", "decoder.1.cross_attn:2"]}]


@pytest.mark.parametrize("arch", ["seq2seq", "classifier"])
def test_no_attention_or_layer_attribute_is_set_after_its_constructor(arch, monkeypatch):
    """The builders hand an attention its projections, positions, score bias, hook and key
    projection, and a layer its modules, at construction: nothing is assigned to either after
    its constructor returns except by a named transform (prune_heads here)."""
    from xformer.model.attention import MultiHeadAttention
    from xformer.model.transformer import TransformerLayer

    late, transforming = [], []
    for cls in (MultiHeadAttention, TransformerLayer):
        def init(self, *args, _init=cls.__init__, **kwargs):
            _init(self, *args, **kwargs)
            self.__dict__["_built"] = True

        def assign(self, name, value):
            if self.__dict__.get("_built") and not transforming:
                late.append(f"{type(self).__name__}.{name}")
            nn.Module.__setattr__(self, name, value)

        monkeypatch.setattr(cls, "__init__", init)
        monkeypatch.setattr(cls, "__setattr__", assign)

    def prune(self, *args, _prune=MultiHeadAttention.prune_heads, **kwargs):
        transforming.append(True)
        try:
            return _prune(self, *args, **kwargs)
        finally:
            transforming.pop()

    monkeypatch.setattr(MultiHeadAttention, "prune_heads", prune)
    built = 0
    for overrides in BUILDER_CASES:
        if arch == "classifier":
            overrides = {**overrides, "pruned_heads": [s for s in overrides.get("pruned_heads", [])
                                                        if s.startswith("encoder")]}
        model = build_model(tiny(arch=arch, **overrides), V, n_classes=3 if arch == "classifier" else None)
        built += sum(isinstance(m, (MultiHeadAttention, TransformerLayer)) for m in model.modules())
    assert built > 0 and late == []
