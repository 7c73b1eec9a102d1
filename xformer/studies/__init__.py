"""Studies made of many runs: experiments (cells x seeds, their scoring and report), the claims
ledger and its judge, the long-range sweeps, and what they share (the grid of runs, reuse of
finished runs).
"""
