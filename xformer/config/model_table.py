"""The [model] table of a recipe: the architecture's variant axes and ModelConfig, strict as
every table is (xformer/config/schema.py says how). One Literal a variant axis; each has a
dict of implementations next to its modules (POSITIONAL in model/positional.py, NORMS in
model/norms.py, ...), and a test checks that every word here has an entry there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from xformer.config.sites import pruned_heads_problems
from xformer.config.strict import non_negative, only_when, positive, probability

Arch = Literal["seq2seq", "classifier", "lstm"]
Positional = Literal["sinusoidal", "learned", "rope", "alibi", "relative", "none"]
NormPosition = Literal["post", "pre"]
Norm = Literal["layernorm", "rmsnorm", "none"]
FFN = Literal["relu", "gelu", "silu", "swiglu", "geglu"]
AttentionPattern = Literal["full", "sliding_window", "local_global", "strided", "topk", "low_rank", "synthesizer"]
AttentionBackend = Literal["sdpa", "explicit", "flex"]
Downsample = Literal["pool", "conv"]
QKV = Literal["separate", "shared"]
TieEmbeddings = Literal["none", "decoder", "all"]
# "cls", "mean" and "last" for the Transformer classifier; "last", "mean" and "max" for the LSTM
Pooling = Literal["cls", "mean", "last", "max"]
TRANSFORMER_POOLING = ("cls", "mean", "last")
LSTM_POOLING = ("last", "mean", "max")


# model.attention value -> its rules on a [model] table: the patterns fill it as they are imported
# (model/patterns.py, beside their classes; `import xformer` imports them first)
PATTERN_RULES: dict[str, Any] = {}


@dataclass
class ModelConfig:
    """[model]: the architecture. Defaults are Vaswani et al. 2017 base (arXiv:1706.03762)."""

    SECTION: ClassVar[str] = "model"

    arch: Arch = "seq2seq"
    d_model: int = 512
    n_heads: int = 8
    # None means n_heads (MHA); 1 is MQA (arXiv:1911.02150); in between is GQA (arXiv:2305.13245).
    n_kv_heads: int | None = None
    d_ff: int = 2048
    n_encoder_layers: int = 6
    n_decoder_layers: int = field(default=6, metadata=only_when("arch", "seq2seq"))
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    # DropHead (Zhou et al. 2020, arXiv:2004.13342): each attention head's output is dropped with
    # this probability per training example, the survivors rescaled by H / (heads kept).
    head_dropout: float = field(default=0.0, metadata=only_when("arch", "seq2seq", "classifier"))
    # where positions enter (model/positional.py): added to embeddings (sinusoidal, learned),
    # rotating q and k (rope, Su et al. 2021), a bias on the scores (alibi, Press et al. 2021;
    # relative: T5's bucketed bias, Raffel et al. 2020), or not at all (none)
    positional: Positional = "sinusoidal"
    max_positions: int = 1024
    norm_position: NormPosition = "post"
    norm: Norm = "layernorm"  # "none": no normalisation at all (an ablation)
    # each sublayer's residual connection (He et al. 2016); false: its output replaces its input
    residual: bool = field(default=True, metadata=only_when("arch", "seq2seq", "classifier"))
    norm_eps: float = 1e-5
    # relu, gelu, silu (Marian's swish), or a gated FFN, swiglu / geglu (Shazeer 2020), whose
    # d_ff is taken as given (2/3 of a plain FFN's d_ff gives it the same parameters)
    ffn: FFN = "relu"
    # which keys a query sees (model/patterns.py): full; sliding_window (|q - k| < window);
    # local_global (a window plus the first global_tokens positions, seen by and seeing all);
    # strided (|q - k| < stride or a multiple of stride, Child et al. 2019); topk (the topk
    # largest scores per query; always computed on the explicit path, whatever the backend);
    # low_rank (below); synthesizer (Tay et al. 2020's random Synthesizer: a learned table of
    # scores per head over (query, key) positions, max_positions squared, instead of q.k)
    attention: AttentionPattern = field(default="full", metadata=only_when("arch", "seq2seq", "classifier"))
    window: int = field(default=128, metadata=only_when("attention", "sliding_window", "local_global"))
    global_tokens: int = field(default=1, metadata=only_when("attention", "local_global"))
    stride: int = field(default=32, metadata=only_when("attention", "strided"))
    topk: int = field(default=32, metadata=only_when("attention", "topk"))
    # low_rank (Linformer, Wang et al. 2020): keys and values projected along the sequence to
    # `rank` learned mixtures; the encoder's self-attention only (a seq2seq decoder's stays full)
    rank: int = field(default=64, metadata=only_when("attention", "low_rank"))
    # learned key/value slots every self-attention query may attend to, ahead of the sequence's
    # keys (memory-augmented attention; x-transformers' num_mem_kv); 0: none
    memory_tokens: int = field(default=0, metadata=only_when("arch", "seq2seq", "classifier"))
    # halve the encoder sequence after every downsample_every layers (Funnel-Transformer, Dai et
    # al. 2020) by `downsample`: pool (mean of pairs) or conv (a learned stride-2 convolution);
    # 0: never (model/downsample.py)
    downsample_every: int = field(default=0, metadata=only_when("arch", "seq2seq", "classifier"))
    downsample: Downsample = field(default="pool", metadata=only_when("arch", "seq2seq", "classifier"))
    # sdpa (torch's fused kernels), explicit (written out; returns probabilities) or flex
    # (torch.nn.attention.flex_attention, compiled per shape; torch >= 2.5; model/flex.py)
    attention_backend: AttentionBackend = "sdpa"
    # q, k and v from separate projections (Vaswani et al. 2017) or from one shared matrix
    # (model/attention.py QKV); shared needs n_kv_heads = n_heads
    qkv: QKV = field(default="separate", metadata=only_when("arch", "seq2seq", "classifier"))
    scale_embeddings: bool = True
    tie_embeddings: TieEmbeddings = field(default="decoder", metadata=only_when("arch", "seq2seq"))
    # a bias on the output logits (Marian's final_logits_bias; imported models carry one)
    output_bias: bool = field(default=False, metadata=only_when("arch", "seq2seq"))
    pooling: Pooling = field(default="mean", metadata=only_when("arch", "classifier", "lstm"))
    # the Transformer classifier reads left to right: each position sees itself and the positions
    # before it, as a decoder-only language model does (Press et al. 2021's setting), pooled from
    # its last token; false: every position sees every other (an encoder, BERT)
    causal: bool = field(default=False, metadata=only_when("arch", "classifier"))
    # The LSTM baseline (arch = "lstm"): embeddings of d_model, lstm_layers layers of lstm_hidden
    # units; lstm_hidden = 0 sizes it to the parameter count of the Transformer classifier that
    # the same table describes (d_model, n_heads, d_ff, n_encoder_layers, ...).
    lstm_hidden: int = field(default=0, metadata=only_when("arch", "lstm"))
    lstm_layers: int = field(default=1, metadata=only_when("arch", "lstm"))
    bidirectional: bool = field(default=True, metadata=only_when("arch", "lstm"))
    # Heads removed by `xformer inspect-heads --save-pruned`: "SITE:HEAD" entries, SITE one of
    # encoder.<i>.self_attn, decoder.<i>.self_attn, decoder.<i>.cross_attn, HEAD the original index.
    pruned_heads: list[str] = field(default_factory=list)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def problems(self) -> list[str]:
        out = positive(self, "d_model", "n_heads", "d_ff", "n_encoder_layers", "max_positions")
        if self.arch == "seq2seq":
            out += positive(self, "n_decoder_layers")
        if self.n_kv_heads is not None and self.n_kv_heads <= 0:
            out.append(f"model.n_kv_heads: expected a positive integer, found {self.n_kv_heads}")
        out += probability(self, "dropout", "attention_dropout", "activation_dropout", "head_dropout")
        if self.norm_eps <= 0:
            out.append(f"model.norm_eps: expected a positive number, found {self.norm_eps}")
        if self.n_heads > 0 and self.d_model % self.n_heads:
            out.append(
                f"model.d_model: expected a multiple of model.n_heads = {self.n_heads}, "
                f"found {self.d_model}"
            )
        if self.n_heads > 0 and self.kv_heads > 0 and self.n_heads % self.kv_heads:
            out.append(
                f"model.n_kv_heads: expected a divisor of model.n_heads = {self.n_heads}, "
                f"found {self.kv_heads}"
            )
        if self.arch == "classifier" and self.pooling not in TRANSFORMER_POOLING:
            out.append(f"model.pooling: the Transformer classifier pools by 'cls', 'mean' or 'last', "
                       f"found {self.pooling!r}")
        if self.arch == "classifier" and self.causal:
            out += _causal_problems(self)
        if self.arch == "lstm":
            if self.pooling not in LSTM_POOLING:
                out.append(f"model.pooling: the LSTM pools by 'last', 'mean' or 'max', found {self.pooling!r}")
            out += positive(self, "lstm_layers") + non_negative(self, "lstm_hidden")
        if self.positional == "sinusoidal" and self.n_heads > 0 and self.d_model % 2:
            out.append(
                f"model.d_model: sinusoidal positions need an even d_model, found {self.d_model}"
            )
        out += pruned_heads_problems(self)
        if self.qkv == "shared" and self.arch != "lstm":
            if self.n_kv_heads is not None and self.n_kv_heads != self.n_heads:
                out.append(f"model.qkv: 'shared' projects keys and values with the query matrix, so it needs "
                           f"model.n_kv_heads = model.n_heads = {self.n_heads}, found {self.n_kv_heads}")
            if self.pruned_heads:
                out.append("model.qkv: 'shared' projections cannot lose heads (a pruned query head would take "
                           "its key and value rows); remove model.pruned_heads")
        # the attention pattern's own rules, beside its class (model/patterns.py)
        out += PATTERN_RULES[self.attention](self) if self.attention in PATTERN_RULES else []
        out += non_negative(self, "memory_tokens", "downsample_every")
        if self.attention_backend == "flex" and self.attention_dropout > 0:
            out.append(f"model.attention_dropout: flex attention has no dropout, found {self.attention_dropout}; "
                       "set it to 0 or use model.attention_backend = 'sdpa'")
        if self.positional == "rope" and self.n_heads > 0 and self.d_model % self.n_heads == 0 and self.head_dim % 2:
            out.append(
                f"model.d_model: rotary positions need an even head dimension (d_model / n_heads), "
                f"found {self.head_dim}"
            )
        return out


def _causal_problems(cfg: ModelConfig) -> list[str]:
    """What a causal classifier cannot combine with: a pooled position that sees the others."""
    out = []
    if cfg.pooling == "cls":
        out.append("model.pooling: a causal classifier's prepended CLS position would see only itself; "
                   "pool by 'last' or 'mean', found 'cls'")
    if cfg.attention == "low_rank":
        out.append("model.attention: low_rank mixes the keys along the whole sequence, later ones included, "
                   "which a causal classifier must not see; found 'low_rank'")
    if cfg.downsample_every:
        out.append(f"model.downsample_every: downsampling pools each position with the next, which a causal "
                   f"classifier must not see; set it to 0, found {cfg.downsample_every}")
    return out
