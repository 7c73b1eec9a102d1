"""model.qkv: where a self- or cross-attention's queries, keys and values come from (build_model
applies the entry to every attention module after building it)."""

from __future__ import annotations

from xformer.model.attention import MultiHeadAttention


def separate_projections(attn: MultiHeadAttention) -> None:
    """q, k and v from three matrices (Vaswani et al. 2017): nothing to tie."""


def shared_projections(attn: MultiHeadAttention) -> None:
    """q = k = v from one matrix (and bias): the k and v projections become the q projection's
    parameters, so the model holds a third of the attention input weights and every update
    moves all three at once. Needs as many key/value heads as query heads."""
    if attn.n_kv_heads != attn.n_heads:
        raise ValueError(f"shared q/k/v projections need n_kv_heads == n_heads, got {attn.n_kv_heads} and "
                         f"{attn.n_heads}")
    attn.k_proj.weight = attn.v_proj.weight = attn.q_proj.weight
    if attn.q_proj.bias is not None:
        attn.k_proj.bias = attn.v_proj.bias = attn.q_proj.bias


QKV = {"separate": separate_projections, "shared": shared_projections}  # model.qkv
