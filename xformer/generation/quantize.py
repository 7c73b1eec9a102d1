"""Quantized inference (`xformer eval / translate --quantize int8`): dynamic int8 quantization
of every nn.Linear (torch.ao.quantization.quantize_dynamic): weights stored as int8 with one
scale per output row, activations quantized on the fly per batch, matmuls in int8 (fbgemm on
x86 CPUs). Embeddings, norms and the attention arithmetic stay in fp32. CPU only."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from xformer.errors import RunError

QUANTIZE = ("int8",)  # the values of --quantize


def quantize_model(model: nn.Module, kind: str, device: torch.device) -> nn.Module:
    """A copy of `model` (in eval mode, on the CPU) with its Linear layers quantized to `kind`."""
    if kind not in QUANTIZE:
        raise RunError(f"quantize {kind}: expected one of {', '.join(QUANTIZE)}")
    if device.type != "cpu":
        raise RunError(f"quantize {kind}: dynamic int8 quantization runs on the CPU, found device {device}; "
                       "pass device cpu")
    with warnings.catch_warnings():  # torch 2.13 deprecates the quantized tensor types it still runs on
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.ao.quantization.quantize_dynamic(model.eval(), {nn.Linear}, dtype=torch.qint8, inplace=False)
