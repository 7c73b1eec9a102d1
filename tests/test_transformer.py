import math
import typing

import pytest
import torch
from torch import nn

from tests.reference import naive_sinusoid
from xformer import config
from xformer.config import ModelConfig
from xformer.model.build import build_model, count_parameters
from xformer.model.feedforward import ACTIVATIONS
from xformer.model.norms import NORMS
from xformer.model.positional import POSITIONAL, RotaryPositional, SinusoidalPositional

D, H, FF, V, PAD = 32, 4, 64, 13, 0


def tiny(**overrides) -> ModelConfig:
    args = dict(d_model=D, n_heads=H, d_ff=FF, n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                tie_embeddings="none")
    return ModelConfig(**{**args, **overrides})


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
    ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
    ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
    ref.out_proj.weight.copy_(ours.out_proj.weight)
    ref.out_proj.bias.copy_(ours.out_proj.bias)


def copy_ffn_back(ours, layer):
    layer.linear1.load_state_dict(ours.fc1.state_dict())
    layer.linear2.load_state_dict(ours.fc2.state_dict())


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
@pytest.mark.parametrize("norm_position,activation", [("post", "relu"), ("pre", "gelu")])
def test_seq2seq_equals_torch_transformer(backend, norm_position, activation):
    cfg = tiny(attention_backend=backend, norm_position=norm_position, activation=activation)
    model = build_model(cfg, V, pad_id=PAD).eval()
    randomize_(model)
    ref = nn.Transformer(D, H, 2, 2, FF, dropout=0.0, activation=activation, batch_first=True,
                         norm_first=norm_position == "pre").eval()
    if norm_position == "post":  # Vaswani / fairseq Post-LN has no final norm; torch adds one
        ref.encoder.norm = None
        ref.decoder.norm = None
    copy_into_torch_transformer(model, ref)

    src, src_pad = batch([7, 4, 2], 7)
    tgt, tgt_pad = batch([6, 6, 3], 6)
    table = naive_sinusoid(8, D).float()
    src_x = model.encoder.embed.embedding.weight[src] * math.sqrt(D) + table[:7]
    tgt_x = model.decoder.embed.embedding.weight[tgt] * math.sqrt(D) + table[:6]
    causal = ~torch.ones(6, 6, dtype=torch.bool).tril()  # torch: True = blocked
    with torch.no_grad():
        hidden = ref(src_x, tgt_x, tgt_mask=causal, src_key_padding_mask=src_pad,
                     memory_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad)
        expected = hidden @ model.output.weight.T
        logits = model(src, tgt)
    real = ~tgt_pad
    torch.testing.assert_close(logits[real], expected[real], atol=1e-5, rtol=0)


def test_explicit_and_sdpa_models_agree():
    model = build_model(tiny(n_kv_heads=2), V).eval()
    src, _ = batch([7, 3], 7)
    tgt, _ = batch([5, 5], 5)
    sdpa = model(src, tgt)
    for module in model.modules():
        if hasattr(module, "backend"):
            module.backend = "explicit"
    torch.testing.assert_close(model(src, tgt), sdpa, atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 1, "norm_position": "pre"},
                                       {"positional": "learned", "norm": "rmsnorm", "n_kv_heads": 2},
                                       {"positional": "rope", "n_kv_heads": 2}])
def test_incremental_decoding_equals_full_forward(overrides):
    model = build_model(tiny(**overrides), V).eval()
    src, _ = batch([7, 3, 5], 7)
    tgt, _ = batch([6, 6, 6], 6)
    with torch.no_grad():
        full = model(src, tgt)
        memory, memory_pad = model.encode(src)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, t : t + 1], memory, memory_pad, cache) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


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


def test_padding_never_changes_real_outputs():
    model = build_model(tiny(), V).eval()
    src, _ = batch([5], 5)
    tgt, _ = batch([4], 4)
    with torch.no_grad():
        alone = model(src, tgt)
        padded_src = torch.cat([src, torch.full((1, 3), PAD)], dim=1)
        padded_tgt = torch.cat([tgt, torch.full((1, 2), PAD)], dim=1)
        padded = model(padded_src, padded_tgt)
    torch.testing.assert_close(padded[:, :4], alone, atol=1e-5, rtol=0)


def test_future_tokens_never_change_earlier_outputs():
    model = build_model(tiny(), V).eval()
    src, _ = batch([6, 6], 6)
    tgt, _ = batch([5, 5], 5)
    changed = tgt.clone()
    changed[:, 3:] = (changed[:, 3:] % (V - 1)) + 1
    assert not torch.equal(changed, tgt)
    with torch.no_grad():
        before, after = model(src, tgt), model(src, changed)
    torch.testing.assert_close(after[:, :3], before[:, :3], atol=0, rtol=0)
    assert not torch.allclose(after[:, 3:], before[:, 3:])


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_classifier_ignores_padding(pooling):
    model = build_model(tiny(arch="classifier", pooling=pooling), V, n_classes=3).eval()
    tokens, _ = batch([6], 6)
    with torch.no_grad():
        alone = model(tokens)
        padded = model(torch.cat([tokens, torch.full((1, 4), PAD)], dim=1))
    assert alone.shape == (1, 3)
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)


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
    (config.Positional, POSITIONAL), (config.Norm, NORMS), (config.Activation, ACTIVATIONS),
])
def test_every_variant_word_has_an_implementation(literal, table):
    assert set(typing.get_args(literal)) == set(table)
