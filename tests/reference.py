"""Naive, obviously-correct maths that the model is checked against. Loops over heads and
positions on purpose: nothing here shares code with xformer (no xformer import at all)."""

import math

import torch


def naive_attention(q, k, v, allowed=None, table=None):
    """q: (B, H, T, Dh); k, v: (B, K, S, Dh); allowed: (B, T, S) bool or None; table: (H, T, S)
    scores that replace q.k / sqrt(Dh) (Synthesizer's random attention), or None.
    Query head h uses kv head h // (H // K). Returns (B, H, T, Dh), probabilities (B, H, T, S)."""
    b, h, t, dh = q.shape
    kv = k.shape[1]
    out = torch.zeros_like(q)
    probs = torch.zeros(b, h, t, v.shape[2], dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // kv)
            scores = q[bi, hi] @ k[bi, g].T / math.sqrt(dh) if table is None else table[hi]  # (T, S)
            if allowed is not None:
                scores = scores.masked_fill(~allowed[bi], float("-inf"))
            p = torch.softmax(scores, dim=-1)
            probs[bi, hi] = p
            out[bi, hi] = p @ v[bi, g]
    return out, probs


def naive_sinusoid(n_positions, d_model):
    """PE[p, 2i] = sin(p / 10000^(2i/D)), PE[p, 2i+1] = cos(p / 10000^(2i/D)), element by element."""
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    for p in range(n_positions):
        for i in range(0, d_model, 2):
            angle = p / (10000 ** (i / d_model))
            table[p, i] = math.sin(angle)
            table[p, i + 1] = math.cos(angle)
    return table


def naive_norm(x, weight, bias, kind, eps):
    """LayerNorm, (x - mean) / sqrt(var + eps) * w + b, or RMSNorm, x / sqrt(mean(x^2) + eps) * w,
    over the last dimension (biased variance, as both papers define it)."""
    if kind == "rmsnorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def naive_rotate(x, base=10000.0):
    """RoPE of x: (B, H, T, Dh) at positions 0..T-1, one position and one pair at a time: features
    (i, i + Dh/2) are the complex number x_i + j x_(i + Dh/2), multiplied by exp(j p base^(-2i/Dh))."""
    t, dh = x.shape[-2], x.shape[-1]
    half = dh // 2
    out = torch.empty_like(x)
    for p in range(t):
        for i in range(half):
            angle = p * base ** (-2 * i / dh)
            z = torch.complex(x[..., p, i], x[..., p, i + half]) * complex(math.cos(angle), math.sin(angle))
            out[..., p, i], out[..., p, i + half] = z.real, z.imag
    return out


# A Transformer written from the papers, reading the weights of an xformer model by their
# state_dict names and the architecture from its ModelConfig `cfg`. Everything runs in float64.


def _linear(w, name, x):
    y = x @ w[f"{name}.weight"].T
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def _attention(w, name, cfg, x, source, allowed, rotate):
    """Multi-head attention of queries x (B, T, D) over source (B, S, D); allowed: (B, T, S)."""
    b, t, d = x.shape
    dh = d // cfg.n_heads

    def heads(y, n):  # (B, L, n * Dh) -> (B, n, L, Dh)
        return y.reshape(b, y.shape[1], n, dh).transpose(1, 2)

    v = heads(_linear(w, f"{name}.v_proj", source), cfg.kv_heads)
    if f"{name}.score_bias.table" in w:  # Synthesizer: learned scores of positions, no q or k
        table = w[f"{name}.score_bias.table"][:, :t, : source.shape[1]]
        out, _ = naive_attention(torch.zeros(b, cfg.n_heads, t, dh, dtype=x.dtype), v, v, allowed, table)
        return _linear(w, f"{name}.out_proj", out.transpose(1, 2).reshape(b, t, d))
    q = heads(_linear(w, f"{name}.q_proj", x), cfg.n_heads)
    k = heads(_linear(w, f"{name}.k_proj", source), cfg.kv_heads)
    if rotate:
        q, k = naive_rotate(q), naive_rotate(k)
    out, _ = naive_attention(q, k, v, allowed)
    return _linear(w, f"{name}.out_proj", out.transpose(1, 2).reshape(b, t, d))


def _ffn(w, name, cfg, x):
    h = _linear(w, f"{name}.fc1", x)
    if cfg.ffn == "gelu":
        h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    elif cfg.ffn == "silu":
        h = h / (1 + torch.exp(-h))
    else:
        h = h.clamp(min=0)
    return _linear(w, f"{name}.fc2", h)


def _norm(w, name, cfg, x):
    if cfg.norm == "none":
        return x
    return naive_norm(x, w[f"{name}.weight"], w.get(f"{name}.bias"), cfg.norm, cfg.norm_eps)


def _add(cfg, x, branch):
    """The residual connection, or the branch alone without one."""
    return x + branch if cfg.residual else branch


def _embed(w, name, cfg, tokens, front=None):
    """Token embeddings (times sqrt(D) when scaled), then `front` vectors (1, P, D) prepended,
    then absolute positions 0.. added (RoPE adds none here)."""
    x = w[f"{name}.embedding.weight"][tokens] * (math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0)
    if front is not None:
        x = torch.cat([front.expand(x.shape[0], -1, -1), x], dim=1)
    if cfg.positional == "sinusoidal":
        x = x + naive_sinusoid(x.shape[1], cfg.d_model)
    elif cfg.positional == "learned":
        x = x + w[f"{name}.positional.embedding.weight"][: x.shape[1]]
    return x


def _encoder(w, cfg, x, pad, causal=False):
    """x: (B, S, D) embedded, pad: (B, S) True at padding -> (B, S, D); with `causal` each
    position sees only itself and the positions before it."""
    s = x.shape[1]
    allowed = (~pad)[:, None, :].expand(-1, s, s)
    if causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).tril()
    rope = cfg.positional == "rope"
    for i in range(cfg.n_encoder_layers):
        layer = f"encoder.layers.{i}"
        if cfg.norm_position == "pre":
            h = _norm(w, f"{layer}.self_attn_norm", cfg, x)
            x = _add(cfg, x, _attention(w, f"{layer}.self_attn", cfg, h, h, allowed, rope))
            x = _add(cfg, x, _ffn(w, f"{layer}.ffn", cfg, _norm(w, f"{layer}.ffn_norm", cfg, x)))
        else:
            attended = _attention(w, f"{layer}.self_attn", cfg, x, x, allowed, rope)
            x = _norm(w, f"{layer}.self_attn_norm", cfg, _add(cfg, x, attended))
            x = _norm(w, f"{layer}.ffn_norm", cfg, _add(cfg, x, _ffn(w, f"{layer}.ffn", cfg, x)))
    return _norm(w, "encoder.final_norm", cfg, x) if cfg.norm_position == "pre" else x


def naive_seq2seq(cfg, weights, src, tgt, pad_id=0):
    """Logits (B, T, V) of an encoder-decoder with weights `weights` (a state_dict) for
    source src (B, S) and decoder input tgt (B, T), both right-padded with pad_id."""
    w = {name: value.double() for name, value in weights.items()}
    src_pad = src == pad_id
    memory = _encoder(w, cfg, _embed(w, "encoder.embed", cfg, src), src_pad)
    b, t = tgt.shape
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None].expand(b, t, t)
    cross = (~src_pad)[:, None, :].expand(b, t, src.shape[1])
    rope = cfg.positional == "rope"  # self-attention only; cross-attention is position-free
    x = _embed(w, "decoder.embed", cfg, tgt)
    for i in range(cfg.n_decoder_layers):
        layer = f"decoder.layers.{i}"
        if cfg.norm_position == "pre":
            h = _norm(w, f"{layer}.self_attn_norm", cfg, x)
            x = _add(cfg, x, _attention(w, f"{layer}.self_attn", cfg, h, h, causal, rope))
            h = _norm(w, f"{layer}.cross_attn_norm", cfg, x)
            x = _add(cfg, x, _attention(w, f"{layer}.cross_attn", cfg, h, memory, cross, False))
            x = _add(cfg, x, _ffn(w, f"{layer}.ffn", cfg, _norm(w, f"{layer}.ffn_norm", cfg, x)))
        else:
            attended = _attention(w, f"{layer}.self_attn", cfg, x, x, causal, rope)
            x = _norm(w, f"{layer}.self_attn_norm", cfg, _add(cfg, x, attended))
            attended = _attention(w, f"{layer}.cross_attn", cfg, x, memory, cross, False)
            x = _norm(w, f"{layer}.cross_attn_norm", cfg, _add(cfg, x, attended))
            x = _norm(w, f"{layer}.ffn_norm", cfg, _add(cfg, x, _ffn(w, f"{layer}.ffn", cfg, x)))
    if cfg.norm_position == "pre":
        x = _norm(w, "decoder.final_norm", cfg, x)
    return x @ w["output.weight"].T


def naive_classifier(cfg, weights, tokens, pad_id=0):
    """Logits (B, C) of an encoder classifier for right-padded tokens (B, S): pooling "cls"
    classifies the final state of a learned vector put before position 0, "mean" the mean of
    the real positions' final states, "last" the final state of the last real token. With
    cfg.causal each position attends to itself and the positions before it only."""
    w = {name: value.double() for name, value in weights.items()}
    pad = tokens == pad_id
    front = w["cls"] if cfg.pooling == "cls" else None
    if front is not None:
        pad = torch.cat([torch.zeros(pad.shape[0], 1, dtype=torch.bool), pad], dim=1)
    h = _encoder(w, cfg, _embed(w, "encoder.embed", cfg, tokens, front), pad, causal=cfg.causal)
    pooled = []
    for row, row_pad in zip(h, pad, strict=True):
        real = (~row_pad).nonzero().flatten()
        if cfg.pooling == "cls":
            pooled.append(row[0])
        elif cfg.pooling == "last":
            pooled.append(row[real.max()])
        else:
            pooled.append(row[real].mean(0))
    return _linear(w, "head", torch.stack(pooled))


# ---------------------------------------------------------------- attention variants, by definition


def naive_allowed(pattern, t, s, offset=0, causal=False, window=0, global_tokens=0, stride=0):
    """(T, S) bool: may query i (position offset + i) see key j (position j)? One pair at a time,
    from each paper's wording."""
    out = torch.zeros(t, s, dtype=torch.bool)
    for i in range(t):
        qp = offset + i
        for j in range(s):
            d = abs(qp - j)
            if pattern == "full" or pattern == "topk":
                ok = True
            elif pattern == "sliding_window":
                ok = d < window
            elif pattern == "local_global":
                ok = d < window or j < global_tokens or qp < global_tokens
            elif pattern == "strided":
                ok = d < stride or d % stride == 0
            else:
                raise ValueError(pattern)
            if causal and j > qp:
                ok = False
            out[i, j] = ok or j == qp
    return out


def naive_alibi_slopes(n):
    """Press et al. 2021: for a power of two n, start = 2^(-8/n) and slope_i = start^i; else the
    power of two below, then the odd-numbered slopes of twice that."""
    def geometric(m):
        return [2 ** (-8 * (i + 1) / m) for i in range(m)]

    c = 1
    while c * 2 <= n:
        c *= 2
    if c == n:
        return geometric(n)
    return geometric(c) + geometric(2 * c)[0::2][: n - c]


def naive_t5_bucket(relative, bidirectional, num_buckets=32, max_distance=128):
    """T5's _relative_position_bucket for one integer k - q, as the paper's code describes it."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if relative > 0:
            bucket += num_buckets
        n = abs(relative)
    else:
        n = max(-relative, 0)
    exact = num_buckets // 2
    if n < exact:
        return bucket + n
    far = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return bucket + min(far, num_buckets - 1)


def naive_biased_attention(q, k, v, allowed, bias=None, topk=None):
    """softmax over allowed keys of q.k / sqrt(Dh) + bias[h], keeping only each row's `topk`
    largest scores; q: (B, H, T, Dh), k, v: (B, K, S, Dh), allowed (T, S), bias (H, T, S)."""
    b, h, t, dh = q.shape
    kv = k.shape[1]
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // kv)
            for i in range(t):
                scores = []
                for j in range(k.shape[2]):
                    if not allowed[i, j]:
                        scores.append(float("-inf"))
                        continue
                    value = float(q[bi, hi, i] @ k[bi, g, j]) / math.sqrt(dh)
                    scores.append(value + (float(bias[hi, i, j]) if bias is not None else 0.0))
                if topk is not None and topk < len(scores):
                    kth = sorted(scores, reverse=True)[topk - 1]
                    scores = [x if x >= kth else float("-inf") for x in scores]
                p = torch.softmax(torch.tensor(scores, dtype=q.dtype), dim=0)
                out[bi, hi, i] = p @ v[bi, g]
    return out
