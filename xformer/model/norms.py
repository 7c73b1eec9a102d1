"""Normalisation layers, one entry per `model.norm` value."""

from torch import nn


def layer_norm(d_model: int, eps: float) -> nn.Module:
    """LayerNorm (Ba et al. 2016, arXiv:1607.06450): the Vaswani et al. 2017 choice."""
    return nn.LayerNorm(d_model, eps=eps)


def rms_norm(d_model: int, eps: float) -> nn.Module:
    """RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467): rescale only, no mean, no bias."""
    return nn.RMSNorm(d_model, eps=eps)


def no_norm(d_model: int, eps: float) -> nn.Module:
    """No normalisation (model.norm = "none"): what LayerNorm's speed-up is measured against."""
    return nn.Identity()


NORMS = {"layernorm": layer_norm, "rmsnorm": rms_norm, "none": no_norm}
