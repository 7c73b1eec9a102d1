"""Probe: can a small Transformer classifier learn associative recall at all? (issue 4)

Trains on fresh examples every step (no memorisation possible) with a plain loop, bypassing
the trainer, and prints validation accuracy; for finding a configuration that escapes the
~1/n_pairs plateau before sizing a sweep.

    OMP_NUM_THREADS=1 python benchmarks/recall_probe.py --length 16 --pairs 4 --queries 1 \
        --steps 2000 --lr 1e-3 --set n_encoder_layers=3 --set scale_embeddings=false

--set takes ModelConfig fields (TOML values). Session 2 (2026-11-29), length 16, 4 pairs, 1 query,
batch 64, d 64, 4 heads, Pre-LN, last pooling: validation accuracy ~30% after 2000 steps for
the default (lr 1e-3), scale_embeddings=false (lr 3e-3) and 3 layers (lr 3e-3) alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
import torch.nn.functional as F

from xformer.config import ModelConfig, parse_override
from xformer.data.tasks import generate_recall, recall_spec
from xformer.model.build import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--queries", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--set", action="append", default=[], help="a ModelConfig field, e.g. n_heads=2")
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = recall_spec()
    cfg = ModelConfig(arch="classifier", d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2, dropout=0.0,
                      norm_position="pre", pooling="last", max_positions=args.length + 1)
    cfg = dataclasses.replace(cfg, **{name: value for _, name, value in
                                      (parse_override(f"model.{item}") for item in args.set)})
    model = build_model(cfg, len(spec.vocab), n_classes=spec.n_classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98))
    valid = generate_recall(1000, args.length, 10**6, args.queries, n_pairs=args.pairs)
    vx, vy = torch.tensor([x for x, _ in valid]), torch.tensor([y for _, y in valid])
    started = time.time()
    for step in range(1, args.steps + 1):
        batch = generate_recall(args.batch, args.length, step, args.queries, n_pairs=args.pairs)
        x, y = torch.tensor([a for a, _ in batch]), torch.tensor([b for _, b in batch])
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % max(1, args.steps // 8) == 0:
            with torch.no_grad():
                accuracy = 100 * (model(vx).argmax(-1) == vy).float().mean().item()
            print(f"step {step}: train loss {loss.item():.3f}, valid accuracy {accuracy:.1f}% "
                  f"({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
