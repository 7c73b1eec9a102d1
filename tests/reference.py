"""Naive, obviously-correct maths that the model is checked against. Loops over heads and
positions on purpose: nothing here shares code with xformer."""

import math

import torch


def naive_attention(q, k, v, allowed=None):
    """q: (B, H, T, Dh); k, v: (B, K, S, Dh); allowed: (B, T, S) bool or None.
    Query head h uses kv head h // (H // K). Returns (B, H, T, Dh), probabilities (B, H, T, S)."""
    b, h, t, dh = q.shape
    kv = k.shape[1]
    out = torch.zeros_like(q)
    probs = torch.zeros(b, h, t, k.shape[2], dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // kv)
            scores = q[bi, hi] @ k[bi, g].T / math.sqrt(dh)  # (T, S)
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
