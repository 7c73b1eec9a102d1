"""Model core: attention, blocks, the Seq2Seq and Classifier models, and build_model."""

from xformer.model.attention import MultiHeadAttention, explicit_attention, sdpa_attention
from xformer.model.build import build_model, count_parameters
from xformer.model.cache import KVCache
from xformer.model.transformer import Classifier, DecoderCache, Seq2Seq

__all__ = [
    "Classifier", "DecoderCache", "KVCache", "MultiHeadAttention", "Seq2Seq",
    "build_model", "count_parameters", "explicit_attention", "sdpa_attention",
]
