"""Attention-head analysis: capture, statistics and roles, importance, pruning, report."""

from xformer.heads.inspect import inspect_heads

__all__ = ["inspect_heads"]
