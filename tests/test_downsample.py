"""Funnel-style downsampling of the encoder (model/downsample.py): each compression against
pairs written out by hand, the encoder against its layers run one by one with that compression
between them, padding invariance, decoding, and no downsampling layer = the plain encoder."""

import pytest
import torch
from test_variants import same_weights, tiny

from xformer.model.build import build_model
from xformer.model.downsample import DOWNSAMPLERS, MeanPool, StridedConv, pooled_padding

V = 23


def naive_pool(kind, module, x, pad, keep):
    """One sequence (S, D), pad (S,): the first `keep` rows as they are, then one row per pair
    (an odd tail paired with padding): the mean of its real rows (0 if none) for pool, W [a; b] + c
    over the pair with padding as zeros for conv."""
    rows, flags = list(x[:keep]), list(pad[:keep].tolist())
    for i in range(keep, x.size(0), 2):
        pair = [(x[j], bool(pad[j])) for j in (i, i + 1) if j < x.size(0)]
        pair += [(torch.zeros_like(x[0]), True)] * (2 - len(pair))
        if kind == "pool":
            real = [v for v, p in pair if not p]
            rows.append(torch.stack(real).mean(0) if real else torch.zeros_like(x[0]))
        else:
            a, b = (torch.zeros_like(v) if p else v for v, p in pair)
            rows.append(module.proj.weight @ torch.cat([a, b]) + module.proj.bias)
        flags.append(all(p for _, p in pair))
    return torch.stack(rows), torch.tensor(flags)


@pytest.mark.parametrize("kind", list(DOWNSAMPLERS))
@pytest.mark.parametrize("s,keep", [(8, 0), (7, 0), (8, 1), (1, 0), (2, 1)])
def test_each_compression_is_its_pairs_written_out(kind, s, keep):
    torch.manual_seed(0)
    module = DOWNSAMPLERS[kind](6).double()
    x = torch.randn(2, s, 6, dtype=torch.float64)
    pad = torch.zeros(2, s, dtype=torch.bool)
    pad[1, max(keep, s - 3):] = True
    out, out_pad = module(x, pad, keep)
    for b in range(2):
        rows, flags = naive_pool(kind, module, x[b], pad[b], keep)
        torch.testing.assert_close(out[b], rows)
        assert out_pad[b].tolist() == flags.tolist()
    assert torch.equal(out_pad, pooled_padding(pad, keep))


def test_the_convolution_is_a_stride_two_conv1d():
    torch.manual_seed(0)
    module = StridedConv(4).double()
    conv = torch.nn.Conv1d(4, 4, kernel_size=2, stride=2).double()
    with torch.no_grad():  # Linear over [x_2i; x_2i+1] = Conv1d weight (out, in, 2), taps in order
        conv.weight.copy_(module.proj.weight.view(4, 2, 4).transpose(1, 2))
        conv.bias.copy_(module.proj.bias)
    x = torch.randn(3, 10, 4, dtype=torch.float64)
    out, _ = module(x, torch.zeros(3, 10, dtype=torch.bool))
    torch.testing.assert_close(out, conv(x.transpose(1, 2)).transpose(1, 2))
    assert isinstance(DOWNSAMPLERS["pool"](4), MeanPool)


@pytest.mark.parametrize("kind", list(DOWNSAMPLERS))
def test_the_encoder_is_its_layers_with_the_compression_between_them(kind):
    torch.manual_seed(0)
    model = build_model(tiny(n_encoder_layers=3, downsample_every=1, downsample=kind), V).eval()
    encoder = model.encoder
    assert sorted(encoder.downsample) == ["0", "1"]  # after layers 0 and 1, none after the last
    src = torch.randint(4, V, (2, 11))
    src[1, 7:] = 0
    pad = src.eq(0)
    with torch.no_grad():
        x, p = encoder.embed(src), pad
        for i, layer in enumerate(encoder.layers):
            x = layer(x, ~p[:, None, None, :])
            if i < 2:
                rows = [naive_pool(kind, encoder.downsample[str(i)], x[b], p[b], 0) for b in range(2)]
                x, p = torch.stack([r for r, _ in rows]), torch.stack([f for _, f in rows])
        got = encoder(src, pad)
    torch.testing.assert_close(got, encoder.final_norm(x))
    assert got.shape[1] == 3 and torch.equal(encoder.output_padding(pad), p)  # 11 -> 6 -> 3


@pytest.mark.parametrize("arch,pooling", [("seq2seq", None), ("classifier", "cls"), ("classifier", "last"),
                                          ("classifier", "mean")])
@pytest.mark.parametrize("kind", list(DOWNSAMPLERS))
def test_appended_padding_changes_nothing_and_no_downsampling_layer_is_the_plain_model(arch, pooling, kind):
    torch.manual_seed(0)
    extra = {"arch": arch, **({"pooling": pooling} if pooling else {})}
    model = build_model(tiny(downsample_every=1, downsample=kind, **extra), V,
                        **({"n_classes": 3} if arch == "classifier" else {})).eval()
    src, tgt = torch.randint(4, V, (2, 9)), torch.randint(4, V, (2, 6))
    src[1, 6:] = 0
    padded = torch.cat([src, torch.zeros(2, 5, dtype=torch.long)], dim=1)

    def run(m, s):
        with torch.no_grad():
            return m(s, tgt) if arch == "seq2seq" else m(s)

    torch.testing.assert_close(run(model, padded), run(model, src), atol=1e-5, rtol=1e-5)
    # downsample_every >= the encoder's depth leaves no layer to downsample after: the plain model
    sizes = {"n_classes": 3} if arch == "classifier" else {}
    plain = build_model(tiny(**extra), V, **sizes).eval()
    deep = same_weights(plain, build_model(tiny(downsample_every=2, downsample=kind, **extra), V, **sizes)).eval()
    assert not len(deep.encoder.downsample)
    torch.testing.assert_close(run(deep, src), run(plain, src))
    assert not torch.allclose(run(same_weights(plain, model), src), run(plain, src))


def test_decoding_reads_the_compressed_memory():
    torch.manual_seed(0)
    model = build_model(tiny(downsample_every=1), V).eval()
    src, tgt = torch.randint(4, V, (2, 9)), torch.randint(4, V, (2, 7))
    src[0, 5:] = 0
    with torch.no_grad():
        memory, pad = model.encode(src)
        assert memory.shape[1] == pad.shape[1] == 5 and pad[0].tolist() == [False] * 3 + [True] * 2
        cache, steps = model.new_cache(), []
        for start in range(7):
            steps.append(model.decode(tgt[:, start:start + 1], memory, pad, cache))
        torch.testing.assert_close(torch.cat(steps, 1), model(src, tgt), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("changes", [
    {"attention": "sliding_window", "window": 3, "positional": "alibi", "memory_tokens": 2},
    {"attention": "local_global", "window": 3, "global_tokens": 1, "positional": "relative", "n_kv_heads": 2},
    {"attention": "strided", "stride": 2, "positional": "rope", "norm_position": "pre", "norm": "rmsnorm"},
])
@pytest.mark.parametrize("arch", ["seq2seq", "classifier"])
def test_downsampling_combines_with_patterns_positions_and_memory(changes, arch):
    torch.manual_seed(0)
    extra = {"arch": arch, "pooling": "cls"} if arch == "classifier" else {}
    model = build_model(tiny(n_encoder_layers=3, downsample_every=1, **changes, **extra), V,
                        **({"n_classes": 3} if arch == "classifier" else {})).eval()
    src, tgt = torch.randint(4, V, (2, 40)), torch.randint(4, V, (2, 6))  # 40 -> 20 -> 10: banded where it pays
    src[1, 30:] = 0
    padded = torch.cat([src, torch.zeros(2, 8, dtype=torch.long)], dim=1)
    with torch.no_grad():
        if arch == "classifier":
            torch.testing.assert_close(model(padded), model(src), atol=1e-5, rtol=1e-5)
            return
        full = model(src, tgt)
        torch.testing.assert_close(model(padded, tgt), full, atol=1e-5, rtol=1e-5)
        memory, pad = model.encode(src)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, i:i + 1], memory, pad, cache) for i in range(6)]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)
