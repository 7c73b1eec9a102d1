"""Position-wise feed-forward block: Linear(D, d_ff) -> activation -> dropout -> Linear(d_ff, D)."""

import torch.nn.functional as F
from torch import Tensor, nn

# One entry per `model.activation` value. GELU: Hendrycks & Gimpel 2016, arXiv:1606.08415.
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class FeedForward(nn.Module):
    """The FFN of Vaswani et al. 2017 (arXiv:1706.03762), eq. 2, with a choice of activation."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.activation = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)  # fairseq's activation_dropout

    def forward(self, x: Tensor) -> Tensor:  # (..., D) -> (..., D)
        return self.fc2(self.dropout(self.activation(self.fc1(x))))
