"""Benchmarks: xformer's own speed (speed.py: attention, a training step, decoding), the same
workloads in peer libraries (peers.py) and the quality peer, HF Marian trained on the same
budget (quality.py).
"""
