"""model.qkv: where a self- or cross-attention's queries, keys and values come from. Each entry
builds the q, k and v projections that model/build.py hands to a MultiHeadAttention."""

from __future__ import annotations

from xformer.model.attention import Projections, separate_projections


def shared_projections(d_model: int, n_heads: int, n_kv_heads: int, bias: bool = True) -> Projections:
    """q = k = v from one matrix (and bias): the k and v projections hold the q projection's
    parameters, so the model holds a third of the attention input weights and every update
    moves all three at once. Needs as many key/value heads as query heads."""
    if n_kv_heads != n_heads:
        raise ValueError(f"shared q/k/v projections need n_kv_heads == n_heads, got {n_kv_heads} and {n_heads}")
    q, k, v = separate_projections(d_model, n_heads, n_kv_heads, bias)
    k.weight = v.weight = q.weight
    if bias:
        k.bias = v.bias = q.bias
    return Projections(q, k, v)


def content_free_projections(d_model: int, n_heads: int, n_kv_heads: int, bias: bool = True) -> Projections:
    """Values only: no q or k (the scores come from elsewhere, the synthesizer's table). The q and
    k matrices are still drawn and dropped, so that the random numbers after them, and with
    them every initial weight and the data order, are those of models built before this
    builder existed."""
    _, _, v = separate_projections(d_model, n_heads, n_kv_heads, bias)
    return Projections(None, None, v)


QKV = {"separate": separate_projections, "shared": shared_projections}  # model.qkv
