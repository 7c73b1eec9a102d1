import pytest
import torch
from torch import nn

from tests.reference import naive_attention
from xformer.model.attention import MultiHeadAttention, explicit_attention, sdpa_attention
from xformer.model.cache import KVCache
from xformer.model.masks import causal_mask, padding_mask

B, T, S, D, H = 3, 5, 7, 16, 4


def random_pad(b, s, lengths):
    return torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None]  # True at padding


@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
def test_explicit_and_sdpa_equal_naive(n_kv, masking):
    q = torch.randn(B, H, T, 8, dtype=torch.float64)
    k = torch.randn(B, n_kv, T, 8, dtype=torch.float64)
    v = torch.randn(B, n_kv, T, 8, dtype=torch.float64)
    mask, is_causal, allowed = None, False, None
    if masking == "padding":
        pad = random_pad(B, T, [5, 3, 1])
        mask = padding_mask(pad)
        allowed = (~pad)[:, None, :].expand(B, T, T)
    elif masking == "causal":
        is_causal = True
        allowed = torch.ones(T, T, dtype=torch.bool).tril()[None].expand(B, T, T)
    expected, expected_probs = naive_attention(q, k, v, allowed)
    out, probs = explicit_attention(q, k, v, mask, is_causal)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(probs, expected_probs, atol=1e-10, rtol=0)
    torch.testing.assert_close(sdpa_attention(q, k, v, mask, is_causal), expected, atol=1e-10, rtol=0)


def copy_from_torch(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        wq, wk, wv = ref.in_proj_weight.chunk(3)
        bq, bk, bv = ref.in_proj_bias.chunk(3)
        for proj, w, b in ((ours.q_proj, wq, bq), (ours.k_proj, wk, bk), (ours.v_proj, wv, bv)):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        ours.out_proj.bias.copy_(ref.out_proj.bias)


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
@pytest.mark.parametrize("kind", ["self", "self+padding", "self+causal", "self+padding+causal", "cross+padding"])
def test_multihead_attention_equals_torch(backend, kind):
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    ours = MultiHeadAttention(D, H, backend=backend).eval()
    copy_from_torch(ours, ref)
    x = torch.randn(B, T, D)
    memory = torch.randn(B, S, D) if kind.startswith("cross") else None
    src = x if memory is None else memory
    s = src.size(1)
    pad = random_pad(B, s, [s, s - 2, 2])
    use_pad, causal = "padding" in kind, "causal" in kind
    mask = None
    if use_pad:
        mask = padding_mask(pad)
    if causal:
        mask = causal_mask(T, s) if mask is None else mask & causal_mask(T, s)
    expected, expected_probs = ref(
        x, src, src, key_padding_mask=pad if use_pad else None,
        attn_mask=~torch.ones(T, s, dtype=torch.bool).tril() if causal else None,  # True = blocked
        average_attn_weights=False,
    )
    out, probs = ours(x, memory, mask=mask, need_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(probs, expected_probs, atol=1e-5, rtol=0)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """GQA with K kv heads is MHA whose query heads in a group share one k/v projection."""
    gqa = MultiHeadAttention(D, H, n_kv_heads=2).eval()
    mha = MultiHeadAttention(D, H).eval()
    dh = D // H
    with torch.no_grad():
        for name in ("q_proj", "out_proj"):
            getattr(mha, name).load_state_dict(getattr(gqa, name).state_dict())
        for name in ("k_proj", "v_proj"):
            w = getattr(gqa, name).weight.view(2, dh, D)  # (K, Dh, D)
            b = getattr(gqa, name).bias.view(2, dh)
            getattr(mha, name).weight.copy_(w.repeat_interleave(2, dim=0).reshape(D, D))
            getattr(mha, name).bias.copy_(b.repeat_interleave(2, dim=0).reshape(D))
    x = torch.randn(B, T, D)
    torch.testing.assert_close(gqa(x, is_causal=True)[0], mha(x, is_causal=True)[0], atol=1e-6, rtol=0)


def test_mqa_and_gqa_have_fewer_kv_parameters():
    sizes = {k: MultiHeadAttention(D, H, n_kv_heads=k).k_proj.weight.numel() for k in (4, 2, 1)}
    assert sizes == {4: D * D, 2: D * D // 2, 1: D * D // 4}


def test_self_attention_cache_equals_full_causal():
    attn = MultiHeadAttention(D, H, n_kv_heads=2).eval()
    x = torch.randn(B, T, D)
    full, _ = attn(x, is_causal=True)
    cache = KVCache()
    steps = [attn(x[:, t : t + 1], cache=cache)[0] for t in range(T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-6, rtol=0)
    assert cache.length == T


def test_cache_with_several_new_tokens_uses_offset_causal_mask():
    attn = MultiHeadAttention(D, H).eval()
    x = torch.randn(B, T, D)
    full, _ = attn(x, is_causal=True)
    cache = KVCache()
    first, _ = attn(x[:, :2], cache=cache, is_causal=True)
    rest, _ = attn(x[:, 2:], cache=cache, mask=causal_mask(T - 2, T))
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-6, rtol=0)


def test_cross_attention_cache_is_computed_once():
    attn = MultiHeadAttention(D, H).eval()
    x, memory = torch.randn(B, T, D), torch.randn(B, S, D)
    cache = KVCache()
    first, _ = attn(x, memory, cache=cache)
    k_before = cache.k
    second, _ = attn(x, memory * 0, cache=cache)  # memory is ignored once cached
    assert cache.k is k_before
    torch.testing.assert_close(first, second)


def test_cache_reorder_follows_index():
    cache = KVCache()
    k = torch.arange(3.0).view(3, 1, 1, 1)
    cache.append(k, k)
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.k.flatten().tolist() == [2.0, 2.0, 0.0]


def test_attention_dropout_only_in_training():
    attn = MultiHeadAttention(D, H, dropout=0.5, backend="explicit")
    x = torch.randn(B, T, D)
    attn.eval()
    torch.testing.assert_close(attn(x)[0], attn(x)[0])
    attn.train()
    assert not torch.allclose(attn(x)[0], attn(x)[0])


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
def test_head_dropout_drops_whole_heads_per_example_and_rescales_the_rest(backend):
    torch.manual_seed(0)
    p, n = 0.25, 2000
    attn = MultiHeadAttention(D, H, head_dropout=p, backend=backend)
    with torch.no_grad():  # out_proj = identity: the output is the concatenation of the heads
        attn.out_proj.weight.copy_(torch.eye(D))
        attn.out_proj.bias.zero_()
    x = torch.randn(n, 2, D)
    attn.eval()
    full = attn(x)[0].view(n, 2, H, D // H)
    attn.train()
    dropped = attn(x)[0].view(n, 2, H, D // H)
    kept = dropped.abs().amax(dim=(1, 3)) > 0  # (n, H): which heads survived in each example
    scale = H / kept.sum(1).clamp(min=1)  # (n,)
    expected = full * kept[:, None, :, None] * scale[:, None, None, None]
    torch.testing.assert_close(dropped, expected)
    assert abs((~kept).float().mean().item() - p) < 0.02
    assert kept.any(0).all() and (~kept).any(0).all()  # every head is dropped in some examples only


def test_sdpa_in_bf16_on_the_cpu_runs_in_fp32_and_returns_bf16():
    # torch's bf16 CPU flash kernel is slow backward; attention runs in fp32 and its output is
    # rounded to bf16 once, so it is within half a bf16 ulp (2^-8 relative) of the exact result,
    # where attention computed in bf16 misses it by several percent
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, T, 8).bfloat16().requires_grad_() for _ in range(3))
    pad = random_pad(B, T, [5, 3, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sdpa_attention(q, k, v, padding_mask(pad))
    expected, _ = naive_attention(q.double(), k.double(), v.double(), (~pad)[:, None, :].expand(B, T, T))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected.detach(), rtol=2**-8 * 1.01, atol=1e-6)
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (q, k, v))
