"""Position-wise feed-forward blocks, one entry per `model.ffn` value.

    relu, gelu,    fc2(dropout(act(fc1 x)))                   Vaswani et al. 2017, eq. 2
    silu                                                      (silu = swish, as opus-mt's Marian)
    swiglu, geglu  fc2(dropout(act(fc1 x) * gate x))          Shazeer 2020, arXiv:2002.05202

d_ff is the hidden width as given: a gated block has three (D, d_ff) matrices where the plain
one has two, so a recipe that wants equal parameters sets d_ff to 2/3 of the plain block's
(the convention of Shazeer 2020 and Llama), the code does not.
"""

import torch.nn.functional as F
from torch import Tensor, nn


class FeedForward(nn.Module):
    """The FFN of Vaswani et al. 2017 (arXiv:1706.03762), eq. 2, with ReLU, GELU (Hendrycks &
    Gimpel 2016, arXiv:1606.08415) or SiLU, x * sigmoid(x) (Ramachandran et al. 2017's swish,
    arXiv:1710.05941; the opus-mt Marian models')."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.activation = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[activation]
        self.dropout = nn.Dropout(dropout)  # fairseq's activation_dropout

    def forward(self, x: Tensor) -> Tensor:  # (..., D) -> (..., D)
        return self.fc2(self.dropout(self.activation(self.fc1(x))))

    def init_fairseq_(self) -> None:
        """fairseq's init: both linears Xavier-uniform, biases zero."""
        for fc in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(fc.weight)
            nn.init.zeros_(fc.bias)


class GatedFeedForward(nn.Module):
    """A GLU-variant FFN (Shazeer 2020, arXiv:2002.05202): act(x W1) * (x W3), then W2; SwiGLU
    takes Swish (SiLU) as act, GeGLU GELU. No biases, as in the paper and Llama."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "silu", dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff, bias=False)
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.fc2 = nn.Linear(d_ff, d_model, bias=False)
        self.activation = {"silu": F.silu, "gelu": F.gelu}[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:  # (..., D) -> (..., D)
        return self.fc2(self.dropout(self.activation(self.fc1(x)) * self.gate(x)))

    def init_fairseq_(self) -> None:
        """Xavier-uniform for all three matrices, as fairseq initialises every FFN linear; the
        gate gets gain 1 too, so act(x W1) * (x W3) starts at the scale of the plain block's."""
        for fc in (self.fc1, self.gate, self.fc2):
            nn.init.xavier_uniform_(fc.weight)


def _plain(activation: str):
    return lambda d_model, d_ff, dropout: FeedForward(d_model, d_ff, activation, dropout)


def _gated(activation: str):
    return lambda d_model, d_ff, dropout: GatedFeedForward(d_model, d_ff, activation, dropout)


# One entry per `model.ffn` value: (d_model, d_ff, dropout) -> module.
FFNS = {"relu": _plain("relu"), "gelu": _plain("gelu"), "silu": _plain("silu"), "swiglu": _gated("silu"),
        "geglu": _gated("gelu")}
