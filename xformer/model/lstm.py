"""The recurrent baseline for long-range classification: embedding -> (bi)LSTM -> pooling -> linear.

LSTM: Hochreiter & Schmidhuber 1997. Padding is handled with packed sequences, so a pad
never enters the recurrence and a sequence gives the same output alone or in a padded batch.
`match_hidden` sizes the LSTM to a parameter budget (the Transformer's), so the two compare
at equal size.

Shapes: B batch, S sequence length, E embedding size, Hd hidden size, C classes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

LSTM_POOLING = ("last", "mean", "max")


class LSTMClassifier(nn.Module):
    """pooling "last": the final hidden state of the top layer (both directions concatenated
    when bidirectional: forward after the last real token, backward after the first);
    "mean" / "max": over the top layer's outputs at real positions."""

    def __init__(
        self, vocab_size: int, d_embed: int, hidden: int, n_layers: int, n_classes: int, *,
        bidirectional: bool = True, pooling: str = "mean", dropout: float = 0.0, pad_id: int = 0,
    ):
        super().__init__()
        if pooling not in LSTM_POOLING:
            raise ValueError(f"pooling must be one of {LSTM_POOLING}, not {pooling!r}")
        self.pad_id, self.pooling, self.bidirectional = pad_id, pooling, bidirectional
        self.embedding = nn.Embedding(vocab_size, d_embed, padding_idx=pad_id)
        self.lstm = nn.LSTM(d_embed, hidden, n_layers, batch_first=True, bidirectional=bidirectional,
                            dropout=dropout if n_layers > 1 else 0.0)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden * (2 if bidirectional else 1), n_classes)

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens: (B, S) right-padded ids -> logits (B, C)."""
        real = tokens.ne(self.pad_id)  # (B, S)
        lengths = real.sum(1).clamp(min=1)  # an all-pad row is read as one pad token, not an error
        x = self.drop(self.embedding(tokens))  # (B, S, E)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, (h, _) = self.lstm(packed)
        if self.pooling == "last":
            # h: (layers * directions, B, Hd); the top layer's are the last one or two
            pooled = torch.cat([h[-2], h[-1]], dim=-1) if self.bidirectional else h[-1]
        else:
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.size(1))  # (B, S, dirs*Hd)
            keep = real.unsqueeze(-1)
            if self.pooling == "mean":
                pooled = (out * keep).sum(1) / keep.sum(1).clamp(min=1)
            else:
                pooled = out.masked_fill(~keep, float("-inf")).amax(1)
        return self.head(self.drop(pooled))


def lstm_parameters(vocab_size: int, d_embed: int, hidden: int, n_layers: int, n_classes: int,
                    bidirectional: bool = True) -> int:
    """Closed-form parameter count of LSTMClassifier (PyTorch's LSTM has two bias vectors)."""
    dirs = 2 if bidirectional else 1
    total = vocab_size * d_embed + hidden * dirs * n_classes + n_classes
    for layer in range(n_layers):
        inputs = d_embed if layer == 0 else hidden * dirs
        total += dirs * 4 * (hidden * inputs + hidden * hidden + 2 * hidden)
    return total


def match_hidden(target: int, vocab_size: int, d_embed: int, n_layers: int, n_classes: int,
                 bidirectional: bool = True) -> int:
    """The hidden size whose LSTMClassifier parameter count is closest to `target`."""
    def count(h):
        return lstm_parameters(vocab_size, d_embed, h, n_layers, n_classes, bidirectional)

    lo, hi = 1, 1
    while count(hi) < target:
        hi *= 2
    while lo < hi:  # smallest h with count(h) >= target
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < target else (lo, mid)
    return min((max(1, lo - 1), lo), key=lambda h: abs(count(h) - target))
