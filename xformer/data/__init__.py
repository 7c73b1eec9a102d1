"""Data: corpora through `datasets`, sentencepiece tokenizers, token-based batching."""
