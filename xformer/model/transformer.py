"""Transformer blocks and the two models built from them: an encoder-decoder (Seq2Seq) for
translation and an encoder Classifier. Vaswani et al. 2017, arXiv:1706.03762.

    Post-LN (Vaswani et al., fairseq default)     Pre-LN (Xiong et al. 2020, arXiv:2002.04745)
      x -> attn -> + -> norm -> ffn -> + -> norm    x -> norm -> attn -> + -> norm -> ffn -> +
      '------------'    '------------'              '--------------------'  '-------------------'
                                                    ... and one final norm after the last layer

Modules take plain arguments; `build.build_model` is the one place that reads a config.
Shapes: B batch, S source length, T target length, D d_model, V vocabulary, C classes.
Padding masks are (B, S) booleans, True at padding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from xformer.model.attention import MultiHeadAttention
from xformer.model.cache import KVCache
from xformer.model.downsample import pooled_padding
from xformer.model.masks import causal_mask, padding_mask
from xformer.model.patterns import Full, PatternMask, self_attention_mask


class TransformerLayer(nn.Module):
    """Self-attention, cross-attention over the encoder output (a decoder's layer, when
    `cross_attn` is given) and feed-forward, each in a residual branch with its norm before it
    (Pre-LN) or after it (Post-LN). Built from its modules (model/build.py); the norms default to
    identities."""

    def __init__(
        self, self_attn: MultiHeadAttention, ffn: nn.Module, *, self_attn_norm: nn.Module | None = None,
        cross_attn: MultiHeadAttention | None = None, cross_attn_norm: nn.Module | None = None,
        ffn_norm: nn.Module | None = None, dropout: float = 0.0, norm_position: str = "post", residual: bool = True,
    ):
        super().__init__()
        self.norm_position = norm_position
        self.residual = residual  # False: each sublayer's output replaces its input (no skip connection)
        # registered in this order, as checkpoints name them: self_attn, self_attn_norm, cross_attn,
        # cross_attn_norm, ffn, ffn_norm
        self.self_attn = self_attn
        self.self_attn_norm = self_attn_norm if self_attn_norm is not None else nn.Identity()
        self.cross_attn = cross_attn
        self.cross_attn_norm = None if cross_attn is None else cross_attn_norm if cross_attn_norm is not None \
            else nn.Identity()
        self.ffn = ffn
        self.ffn_norm = ffn_norm if ffn_norm is not None else nn.Identity()
        self.drop = nn.Dropout(dropout)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, *, is_causal: bool = False, memory: Tensor | None = None,
        memory_mask: Tensor | None = None, cache: tuple[KVCache, KVCache] | None = None, rows: Tensor | None = None,
    ) -> Tensor:
        """x: (B, T, D); `mask` and `is_causal` the self-attention's; `memory` (B, S, D) the encoder
        output the cross-attention reads, under `memory_mask`; `cache` a decoder layer's (self,
        cross) KV caches. With `rows` (B,) only those positions' outputs, (B, 1, D): the queries
        are the rows, keys and values every position (what a classifier pooling one position needs
        from its last layer). Not with rotary positions (their queries rotate by position)."""
        self_cache, cross_cache = cache if cache is not None else (None, None)
        on = self.residual

        def self_attn(queries, keys=None):
            return self.self_attn(queries, memory=keys, mask=mask, is_causal=is_causal, cache=self_cache)[0]

        def cross_attn(h):
            return self.cross_attn(h, memory, mask=memory_mask, cache=cross_cache)[0]

        if self.norm_position == "pre":
            h, keys = self.self_attn_norm(x), None
            if rows is not None:
                x, h, keys = _rows(x, rows), _rows(h, rows), h
            x = skip(x, self.drop(self_attn(h, keys)), on)
            if self.cross_attn is not None:
                x = skip(x, self.drop(cross_attn(self.cross_attn_norm(x))), on)
            x = skip(x, self.drop(self.ffn(self.ffn_norm(x))), on)
        else:  # post-LN, Vaswani et al. 2017
            queries = x if rows is None else _rows(x, rows)
            x = self.self_attn_norm(skip(queries, self.drop(self_attn(queries, None if rows is None else x)), on))
            if self.cross_attn is not None:
                x = self.cross_attn_norm(skip(x, self.drop(cross_attn(x)), on))
            x = self.ffn_norm(skip(x, self.drop(self.ffn(x)), on))
        return x


def skip(x: Tensor, branch: Tensor, residual: bool) -> Tensor:
    """A sublayer's output with its residual connection (He et al. 2016, arXiv:1512.03385), or
    alone when `residual` is off (model.residual = false)."""
    return x + branch if residual else branch


def _rows(x: Tensor, rows: Tensor) -> Tensor:
    """x[b, rows[b]] for every b: (B, S, D) -> (B, 1, D)."""
    return x[torch.arange(x.size(0), device=x.device), rows].unsqueeze(1)


class Embedder(nn.Module):
    """Token embedding * sqrt(D) (Vaswani et al. 2017, section 3.4) + positions, then dropout.

    The sqrt(D) scale matters with fairseq's init, where embeddings are N(0, D^-1/2): it
    brings them to unit scale, the same as the sinusoids they are added to.
    """

    def __init__(self, embedding: nn.Embedding, positional: nn.Module, max_positions: int,
                 dropout: float = 0.0, scale: bool = True):
        super().__init__()
        self.embedding = embedding  # may be shared with another Embedder or the output layer
        self.positional = positional
        self.max_positions = max_positions
        self.scale = math.sqrt(embedding.embedding_dim) if scale else 1.0
        self.drop = nn.Dropout(dropout)

    def forward(self, tokens: Tensor, offset: int = 0, prefix: Tensor | None = None) -> Tensor:
        """tokens: (B, T) -> (B, T, D), or (B, P + T, D) after `prefix` vectors (1, P, D)."""
        x = self.embedding(tokens) * self.scale
        if prefix is not None:
            x = torch.cat([prefix.expand(x.size(0), -1, -1), x], dim=1)
        if offset + x.size(1) > self.max_positions:
            raise ValueError(f"a sequence of {offset + x.size(1)} positions is longer than "
                             f"model.max_positions = {self.max_positions}")
        return self.drop(self.positional(x, offset))


class Encoder(nn.Module):
    """Embedder, a stack of TransformerLayers, and a final norm for Pre-LN; `pattern` (patterns.py)
    says which keys each query sees; `downsample` maps a layer index to the module that halves
    the sequence after that layer (model/downsample.py, Funnel-Transformer); `causal` lets a
    position see only itself and earlier ones (a causal classifier, model.causal)."""

    def __init__(self, embed: Embedder, layers: list[TransformerLayer], final_norm: nn.Module | None = None,
                 pattern: Full | None = None, downsample: dict[int, nn.Module] | None = None,
                 causal: bool = False):
        super().__init__()
        self.causal = causal
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm if final_norm is not None else nn.Identity()
        self.pattern = pattern or Full()
        self.downsample = nn.ModuleDict({str(i): m for i, m in (downsample or {}).items()})

    def output_padding(self, pad: Tensor, keep: int = 0) -> Tensor:
        """The padding (B, S') of what forward returns for input padding `pad` (B, S), the first
        `keep` positions (a prefix) never pooled: `pad` itself without downsampling."""
        for _ in self.downsample:
            pad = pooled_padding(pad, keep)
        return pad

    def computes_rows(self) -> bool:
        """Whether the last layer may compute a few query rows alone (the classifier's pooled
        row): not when a query's scores depend on its position beyond which keys it sees
        (rotary, a bias), nor with a score hook (top-k), nor while attention maps are captured
        (S x S). A pattern gives the rows their own mask (rows_mask)."""
        if not len(self.layers):
            return False
        attention = self.layers[-1].self_attn
        flex_slots = attention.backend == "flex" and attention.mem_k is not None  # flex reads rows as cross
        return not (attention.query_position_dependent or attention.score_hook is not None
                    or attention.on_probs is not None or attention.key_projection is not None or flex_slots)

    def rows_mask(self, rows: Tensor, pad: Tensor) -> Tensor:
        """(B, 1, 1, S): what the query at position rows[b] of each sequence sees (the pattern,
        causality, padding, and always itself)."""
        q = rows[:, None, None]  # (B, 1, 1)
        k = torch.arange(pad.size(1), device=pad.device)[None, None, :]  # (1, 1, S)
        allowed = self.pattern.allowed(q, k)
        keep = ~pad[:, None, :] & (k <= q) if self.causal else ~pad[:, None, :]
        allowed = keep if allowed is None else allowed & keep
        return (allowed | (k == q))[:, None]

    def forward(self, tokens: Tensor, pad: Tensor, prefix: Tensor | None = None, rows: Tensor | None = None) -> Tensor:
        """tokens, pad: (B, S) -> (B, S, D) (or (B, P + S, D) with a prefix; `pad` then
        covers the prefix too). With `rows` (B,): the last layer computes only position
        rows[b] of each sequence, -> (B, D)."""
        x = self.embed(tokens, prefix=prefix)
        keep = 0 if prefix is None else prefix.size(1)
        mask = self._mask(pad, x)
        for i, layer in enumerate(self.layers):
            last = i == len(self.layers) - 1
            if last and rows is not None and (self.pattern.QUERY_DEPENDENT or self.causal):
                mask = self.rows_mask(rows, pad)
            x = layer(x, mask, rows=rows if last else None)
            if str(i) in self.downsample:
                x, pad = self.downsample[str(i)](x, pad, keep)
                mask = self._mask(pad, x)
        x = self.final_norm(x)
        return x if rows is None else x[:, 0]

    def _mask(self, pad: Tensor, x: Tensor) -> Tensor | PatternMask:
        """One mask for every layer at this length: padding (B, 1, 1, S), or the pattern (and
        causality) with it, spelt out (B, 1, S, S) only by a layer that needs the matrix."""
        if not self.pattern.QUERY_DEPENDENT and not self.causal:
            return padding_mask(pad)
        return PatternMask(self.pattern, x.size(1), pad, causal=self.causal, device=x.device)


class DecoderCache:
    """Per-layer (self, cross) KV caches of a Decoder, for incremental decoding; with `window`
    the self-attention caches are rings of the window, with `capacity` preallocated buffers
    of that many positions (KVCache)."""

    def __init__(self, n_layers: int, window: int | None = None, keep_first: int = 0, capacity: int | None = None):
        self.layers = [(KVCache(window, keep_first, capacity), KVCache()) for _ in range(n_layers)]

    @property
    def length(self) -> int:
        """Target positions decoded so far."""
        return self.layers[0][0].length

    @property
    def nbytes(self) -> int:
        """Bytes every layer's self- and cross-attention keys and values hold."""
        return sum(own.nbytes + cross.nbytes for own, cross in self.layers)

    def reorder(self, index: Tensor, cross: Tensor | None | bool = True) -> None:
        """Keep batch rows `index` (B',), as beam search does after each step. The cross-attention
        caches follow `index` (cross=True), the rows `cross` (a tensor), or stay (None): beams
        of one sentence share its encoder keys, so reordering within sentences leaves them be."""
        for self_cache, cross_cache in self.layers:
            self_cache.reorder(index)
            if cross is True:
                cross_cache.reorder(index)
            elif cross is not None and cross is not False:
                cross_cache.reorder(cross)


class Decoder(nn.Module):
    """Embedder, a stack of TransformerLayers with cross-attention, and a final norm for Pre-LN;
    `pattern` (patterns.py) restricts the causal self-attention further."""

    def __init__(self, embed: Embedder, layers: list[TransformerLayer], final_norm: nn.Module | None = None,
                 pattern: Full | None = None):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.final_norm = final_norm if final_norm is not None else nn.Identity()
        self.pattern = pattern or Full()

    def forward(self, tokens: Tensor, memory: Tensor, memory_pad: Tensor,
                cache: DecoderCache | None = None) -> Tensor:
        """tokens: (B, T) target prefix (only the new positions when `cache` holds earlier
        ones); memory: (B, S, D); memory_pad: (B, S). Returns (B, T, D).

        Target padding needs no mask: with right padding and a causal mask no real position
        ever sees a pad position.
        """
        past = 0 if cache is None else cache.length
        t = tokens.size(1)
        x = self.embed(tokens, offset=past)
        if self.pattern.QUERY_DEPENDENT and cache is None:  # the whole target: the pattern, causal
            self_mask, is_causal = PatternMask(self.pattern, t, None, causal=True, device=tokens.device), False
        elif self.pattern.QUERY_DEPENDENT:  # the pattern's causal mask over the keys the caches will hold
            keys = None if cache is None else cache.layers[0][0].positions_after(t, tokens.device)
            s = past + t if keys is None else keys.numel()
            self_mask = self_attention_mask(self.pattern, t, s, past, causal=True, device=tokens.device,
                                            key_positions=keys)
            is_causal = False
        elif past == 0:
            self_mask, is_causal = None, True
        elif t == 1:
            self_mask, is_causal = None, False  # one new token sees every cached one
        else:
            self_mask, is_causal = causal_mask(t, past + t, tokens.device), False
        memory_mask = padding_mask(memory_pad)
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache.layers[i]
            x = layer(x, self_mask, is_causal=is_causal, memory=memory, memory_mask=memory_mask, cache=layer_cache)
        return self.final_norm(x)


class Seq2Seq(nn.Module):
    """Encoder-decoder for translation: p(y_t | y_<t, x)."""

    def __init__(self, encoder: Encoder, decoder: Decoder, output: nn.Linear, pad_id: int):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.output = output  # (V, D) weight, possibly the decoder embedding's
        self.pad_id = pad_id

    def encode(self, src: Tensor) -> tuple[Tensor, Tensor]:
        """src: (B, S) token ids -> memory (B, S, D) and its padding mask (B, S)."""
        pad = src.eq(self.pad_id)
        return self.encoder(src, pad), self.encoder.output_padding(pad)

    def decode(self, tgt: Tensor, memory: Tensor, memory_pad: Tensor,
               cache: DecoderCache | None = None) -> Tensor:
        """tgt: (B, T) -> logits (B, T, V)."""
        return self.output(self.decoder(tgt, memory, memory_pad, cache))

    def new_cache(self, capacity: int | None = None) -> DecoderCache:
        """Caches for incremental decoding; a windowed decoder's hold only what its window sees,
        the others preallocate `capacity` positions when given (the longest output expected)."""
        window = getattr(self.decoder.pattern, "window", None)
        return DecoderCache(len(self.decoder.layers), window, self.decoder.pattern.global_tokens, capacity)

    def forward(self, src: Tensor, tgt: Tensor, keep: Tensor | None = None) -> Tensor:
        """src: (B, S), tgt: (B, T) decoder input (BOS + target[:-1]) -> logits (B, T, V).

        With `keep` (B, T) boolean, only the kept positions are projected to the vocabulary:
        logits (N, V) for the N True entries in row-major order. Training passes the non-pad
        targets, skipping the largest matmul of the model for padding."""
        memory, memory_pad = self.encode(src)
        hidden = self.decoder(tgt, memory, memory_pad)  # (B, T, D)
        if keep is not None:
            hidden = hidden[keep]  # (N, D)
        return self.output(hidden)


class Classifier(nn.Module):
    """Encoder + pooling + linear head, for sequence classification.

    pooling "cls": a learned vector is prepended to every sequence (BERT's [CLS], Devlin et
    al. 2018, arXiv:1810.04805, without spending a vocabulary entry) and its final state is
    classified; "mean": the mean of the final states of the non-pad positions; "last": the final
    state of the last non-pad token (what a task asking about its last token needs, e.g. recall).
    """

    def __init__(self, encoder: Encoder, n_classes: int, pooling: str, pad_id: int, dropout: float = 0.0):
        super().__init__()
        d_model = encoder.embed.embedding.embedding_dim
        self.encoder = encoder
        self.pooling = pooling
        self.pad_id = pad_id
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model)) if pooling == "cls" else None
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d_model, n_classes)

    def _last_row_only(self) -> bool:
        """Whether the last layer may compute the pooled position (cls or last) alone (the same
        result, ~S times less work in that layer): Encoder.computes_rows."""
        return self.encoder.computes_rows()

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens: (B, S) -> logits (B, C)."""
        pad = tokens.eq(self.pad_id)
        if self.pooling == "cls":
            pad = torch.cat([pad.new_zeros(pad.size(0), 1), pad], dim=1)
            if self._last_row_only():
                pooled = self.encoder(tokens, pad, prefix=self.cls, rows=pad.new_zeros(pad.size(0), dtype=torch.long))
            else:
                pooled = self.encoder(tokens, pad, prefix=self.cls)[:, 0]  # (B, D)
        elif self.pooling == "last":  # the final state of the last real token (right padding)
            last = (~self.encoder.output_padding(pad)).sum(1).clamp(min=1) - 1  # (B,) after any downsampling
            if self._last_row_only():
                pooled = self.encoder(tokens, pad, rows=last)  # (B, D)
            else:
                h = self.encoder(tokens, pad)  # (B, S, D)
                pooled = h[torch.arange(h.size(0), device=h.device), last]
        else:  # mean over real positions
            h = self.encoder(tokens, pad)  # (B, S', D)
            keep = (~self.encoder.output_padding(pad)).unsqueeze(-1).to(h.dtype)
            pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.head(self.drop(pooled))
