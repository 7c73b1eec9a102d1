"""build_model: the one bridge from a ModelConfig to modules, and parameter counting."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from xformer.config.schema import ModelConfig
from xformer.config.sites import heads_by_site
from xformer.model.attention import MultiHeadAttention
from xformer.model.downsample import DOWNSAMPLERS
from xformer.model.feedforward import FFNS
from xformer.model.lowrank import LowRankProjection
from xformer.model.lstm import LSTMClassifier, match_hidden
from xformer.model.norms import NORMS
from xformer.model.patterns import make_pattern
from xformer.model.positional import POSITIONAL
from xformer.model.qkv import QKV, content_free_projections
from xformer.model.synthesizer import SynthesizerScores
from xformer.model.transformer import (
    Classifier,
    Decoder,
    Embedder,
    Encoder,
    Seq2Seq,
    TransformerLayer,
)


def build_model(
    cfg: ModelConfig, vocab_size: int, *, tgt_vocab_size: int | None = None,
    n_classes: int | None = None, pad_id: int = 0, init: bool = True,
) -> Seq2Seq | Classifier | LSTMClassifier:
    """A Seq2Seq (`cfg.arch == "seq2seq"`; `vocab_size` is the source vocabulary and
    `tgt_vocab_size` the target one, the same when omitted), a Classifier or an
    LSTMClassifier over `n_classes` classes. `init=False` skips the fairseq initialisation
    (the weights are about to be loaded anyway)."""
    if cfg.arch == "lstm":
        if n_classes is None:
            raise ValueError("an LSTM classifier needs n_classes")
        hidden = cfg.lstm_hidden or matched_lstm_hidden(cfg, vocab_size, n_classes)
        return LSTMClassifier(vocab_size, cfg.d_model, hidden, cfg.lstm_layers, n_classes,
                              bidirectional=cfg.bidirectional, pooling=cfg.pooling, dropout=cfg.dropout,
                              pad_id=pad_id)

    pattern = make_pattern(cfg.attention, window=cfg.window, global_tokens=cfg.global_tokens, stride=cfg.stride,
                           topk=cfg.topk, rank=cfg.rank)
    src_embedding = nn.Embedding(vocab_size, cfg.d_model, padding_idx=pad_id)
    src_position = _positional(cfg, True)
    encoder_layers = [transformer_layer(cfg, position=src_position, pattern=pattern)
                      for _ in range(cfg.n_encoder_layers)]
    every = cfg.downsample_every
    downsample = {i: DOWNSAMPLERS[cfg.downsample](cfg.d_model) for i in range(cfg.n_encoder_layers - 1)
                  if every and (i + 1) % every == 0}  # between layers: none after the last
    encoder = Encoder(_embedder(cfg, src_embedding, src_position), encoder_layers, _final_norm(cfg), pattern,
                      downsample, causal=cfg.arch == "classifier" and cfg.causal)

    if cfg.arch == "classifier":
        if n_classes is None:
            raise ValueError("a classifier needs n_classes")
        model = Classifier(encoder, n_classes, cfg.pooling, pad_id, cfg.dropout)
    else:
        model = _seq2seq(cfg, encoder, src_embedding, pattern, vocab_size, tgt_vocab_size, pad_id)
    sites = attention_modules(model)
    if init:
        init_fairseq_(model, cfg.d_model)
    for site, heads in heads_by_site(cfg.pruned_heads).items():
        sites[site].prune_heads(heads)
    return model


def _seq2seq(cfg: ModelConfig, encoder: Encoder, src_embedding: nn.Embedding, pattern, vocab_size: int,
             tgt_vocab_size: int | None, pad_id: int) -> Seq2Seq:
    """The encoder with a decoder and an output layer, embeddings tied as cfg.tie_embeddings says."""
    tgt_vocab_size = vocab_size if tgt_vocab_size is None else tgt_vocab_size
    if cfg.tie_embeddings == "all":
        if tgt_vocab_size != vocab_size:
            raise ValueError("tie_embeddings = 'all' needs one joint vocabulary")
        tgt_embedding = src_embedding
    else:
        tgt_embedding = nn.Embedding(tgt_vocab_size, cfg.d_model, padding_idx=pad_id)
    # low_rank mixes keys along the sequence, which a causal decoder cannot do (a query would see
    # the future): in a seq2seq model it is the encoder's self-attention, the decoder's is full
    own = make_pattern("full") if pattern.PROJECTS_KEYS else pattern
    tgt_position = _positional(cfg, False)
    decoder_layers = [transformer_layer(cfg, position=tgt_position, pattern=own, cross=True)
                      for _ in range(cfg.n_decoder_layers)]
    decoder = Decoder(_embedder(cfg, tgt_embedding, tgt_position), decoder_layers, _final_norm(cfg), own)
    output = nn.Linear(cfg.d_model, tgt_vocab_size, bias=cfg.output_bias)
    if cfg.tie_embeddings != "none":
        output.weight = tgt_embedding.weight  # weight tying, Press & Wolf 2017, arXiv:1608.05859
    return Seq2Seq(encoder, decoder, output, pad_id)


def _final_norm(cfg: ModelConfig) -> nn.Module | None:
    """The norm after a Pre-LN stack's last layer; none after a Post-LN one."""
    return NORMS[cfg.norm](cfg.d_model, cfg.norm_eps) if cfg.norm_position == "pre" else None


def _positional(cfg: ModelConfig, bidirectional: bool) -> nn.Module:
    """The positions a stack's tokens carry (`bidirectional`: an encoder's, for T5's buckets)."""
    if cfg.positional == "learned":  # at the scale of the (possibly sqrt(D)-scaled) tokens
        std = 1.0 if cfg.scale_embeddings else cfg.d_model**-0.5
        return POSITIONAL["learned"](cfg.d_model, cfg.max_positions, std=std)
    if cfg.positional == "rope":
        return POSITIONAL["rope"](cfg.head_dim, cfg.max_positions)
    if cfg.positional == "alibi":
        return POSITIONAL["alibi"](cfg.n_heads)
    if cfg.positional == "relative":  # T5: bidirectional buckets in the encoder, causal in the decoder
        return POSITIONAL["relative"](cfg.n_heads, bidirectional, cfg.d_model)
    if cfg.positional == "none":
        return POSITIONAL["none"]()
    return POSITIONAL[cfg.positional](cfg.d_model, cfg.max_positions)


def _embedder(cfg: ModelConfig, embedding: nn.Embedding, position: nn.Module) -> Embedder:
    return Embedder(embedding, position, cfg.max_positions, cfg.dropout, cfg.scale_embeddings)


def transformer_layer(cfg: ModelConfig, *, position: nn.Module, pattern, cross: bool = False) -> TransformerLayer:
    """One layer of a stack whose tokens carry `position` and whose self-attention follows
    `pattern`, with a cross-attention (a decoder's layer) when `cross`; its modules built in the
    order checkpoints name them."""
    norm = NORMS[cfg.norm]
    self_attn = self_attention(cfg, position, pattern)
    self_attn_norm = norm(cfg.d_model, cfg.norm_eps)
    cross_attn = attention(cfg, QKV[cfg.qkv]) if cross else None
    cross_attn_norm = norm(cfg.d_model, cfg.norm_eps) if cross else None
    return TransformerLayer(self_attn, FFNS[cfg.ffn](cfg.d_model, cfg.d_ff, cfg.activation_dropout),
                            self_attn_norm=self_attn_norm, cross_attn=cross_attn, cross_attn_norm=cross_attn_norm,
                            ffn_norm=norm(cfg.d_model, cfg.norm_eps), dropout=cfg.dropout,
                            norm_position=cfg.norm_position, residual=cfg.residual)


def self_attention(cfg: ModelConfig, position: nn.Module, pattern) -> MultiHeadAttention:
    """A stack's self-attention: a positional encoding that acts inside attention (rotary q and k,
    or a score bias shared by the stack), the pattern's score hook, and what the pattern brings
    of its own: low_rank's key projection (each layer its own E and F), the synthesizer's table
    of scores (each layer its own) in place of q.k."""
    rotary = position if position.ACTS_ON == "qk" else None
    score_bias = position if position.ACTS_ON == "scores" else None
    key_projection = LowRankProjection(cfg.rank, cfg.max_positions) if pattern.PROJECTS_KEYS else None
    projections = QKV[cfg.qkv]
    if pattern.CONTENT_FREE:
        score_bias = SynthesizerScores(cfg.n_heads, cfg.max_positions)
        projections = content_free_projections
    return attention(cfg, projections, memory_tokens=cfg.memory_tokens, rotary=rotary, score_bias=score_bias,
                     score_hook=pattern.score_hook, key_projection=key_projection)


def attention(cfg: ModelConfig, projections, *, memory_tokens: int = 0, **parts) -> MultiHeadAttention:
    """A MultiHeadAttention of the recipe's heads, dropouts and backend, with q, k and v from
    `projections` (a model/qkv.py builder) and `parts` (rotary, score_bias, score_hook,
    key_projection) passed as they are."""
    return MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.attention_dropout, cfg.attention_backend,
                              head_dropout=cfg.head_dropout, memory_tokens=memory_tokens,
                              projections=projections(cfg.d_model, cfg.n_heads, cfg.kv_heads), **parts)


def attention_modules(model: nn.Module) -> dict[str, MultiHeadAttention]:
    """The attention modules of a Seq2Seq or Classifier by site name (sites.attention_sites
    order): encoder.<i>.self_attn, decoder.<i>.self_attn, decoder.<i>.cross_attn."""
    encoder = model.encoder
    out = {f"encoder.{i}.self_attn": layer.self_attn for i, layer in enumerate(encoder.layers)}
    if isinstance(model, Seq2Seq):
        for i, layer in enumerate(model.decoder.layers):
            out[f"decoder.{i}.self_attn"] = layer.self_attn
            out[f"decoder.{i}.cross_attn"] = layer.cross_attn
    return out


def matched_lstm_hidden(cfg: ModelConfig, vocab_size: int, n_classes: int) -> int:
    """The LSTM hidden size whose classifier has about as many parameters as the Transformer
    classifier `cfg` describes (same vocabulary, classes and d_model; mean pooling)."""
    reference = dataclasses.replace(cfg, arch="classifier", pooling="mean")
    with torch.device("meta"):
        transformer = build_model(reference, vocab_size, n_classes=n_classes, init=False)
    target = count_parameters(transformer)["total"]
    return match_hidden(target, vocab_size, cfg.d_model, cfg.lstm_layers, n_classes, cfg.bidirectional)


def init_fairseq_(model: nn.Module, d_model: int) -> None:
    """fairseq's Transformer initialisation (fairseq/models/transformer):

    - token embeddings and an untied output projection ~ N(0, D^-1/2), padding row zero
      (the sqrt(D) embedding scale then brings embeddings to unit variance);
    - attention q/k/v projections Xavier-uniform with gain 1/sqrt(2) (fairseq does this when
      q, k and v have the same size, equivalent to Xavier on the packed in-projection), the
      attention output projection and both FFN linears Xavier-uniform; every bias zero;
    - norms at weight 1, bias 0 (their default); modules with their own `init_fairseq_`
      (feed-forward blocks, learned positions, T5's bias table) initialise themselves, so a
      new module's weights are never left at torch's defaults by a name this function misses.
    """
    for module in model.modules():
        if hasattr(module, "init_fairseq_"):  # attention, FFNs, positions: modules that initialise themselves
            module.init_fairseq_()
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            module.reset_parameters()  # weight 1, bias 0
        elif isinstance(module, Embedder):
            nn.init.normal_(module.embedding.weight, mean=0.0, std=d_model**-0.5)
            if module.embedding.padding_idx is not None:
                nn.init.zeros_(module.embedding.weight[module.embedding.padding_idx])
    if isinstance(model, Seq2Seq) and model.output.weight is not model.decoder.embed.embedding.weight:
        nn.init.normal_(model.output.weight, mean=0.0, std=d_model**-0.5)
    if isinstance(model, Seq2Seq) and model.output.bias is not None:
        nn.init.zeros_(model.output.bias)
    if isinstance(model, Classifier):
        nn.init.xavier_uniform_(model.head.weight)
        nn.init.zeros_(model.head.bias)
        if model.cls is not None:
            nn.init.normal_(model.cls, mean=0.0, std=d_model**-0.5)


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts, each shared tensor once: `total`, `embedding` (token embeddings,
    an untied output projection and learned position tables, i.e. what Kaplan et al. 2020,
    arXiv:2001.08361, leave out of N) and `non_embedding` (the rest)."""
    embedding_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            embedding_ids.add(id(module.weight))
    if isinstance(model, Seq2Seq):
        embedding_ids.add(id(model.output.weight))
    seen, total, embedding = set(), 0, 0
    for p in model.parameters():  # parameters() already yields a shared tensor once
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if id(p) in embedding_ids:
            embedding += p.numel()
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding}
