"""Attention-head analysis: capture, statistics and roles, importance, pruning, report."""

from xformer.heads.analyse import HeadsConfig, inspect_heads

__all__ = ["HeadsConfig", "inspect_heads"]
