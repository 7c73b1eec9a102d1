"""Probe: can a small Transformer classifier learn associative recall at all? (For the
long-range Transformer-vs-LSTM comparison.)

Trains on fresh examples every step (no memorisation possible) with a plain loop, bypassing
the trainer, and prints validation accuracy; for finding a configuration that escapes the
~1/n_pairs plateau before sizing a sweep.

    OMP_NUM_THREADS=1 python benchmarks/recall_probe.py --length 16 --pairs 4 --queries 1 \
        --steps 2000 --lr 1e-3 --set n_encoder_layers=3 --set scale_embeddings=false

--set takes ModelConfig fields (TOML values). Measured 2026-11-29: length 16, 4 pairs, 1 query,
batch 64, d 64, 4 heads, Pre-LN, last pooling: validation accuracy ~30% after 2000 steps for
the default (lr 1e-3), scale_embeddings=false (lr 3e-3) and 3 layers (lr 3e-3) alike.

Extra options: --warmup (linear warmup steps), --decay (none | cosine | linear, to 0 at --steps),
--wd (AdamW weight decay), --eval-every, --target (stop once validation accuracy reaches it),
--flat STEP:ACC (stop at STEP if accuracy is still below ACC), --eval-lengths (zero-shot
accuracy at other lengths after training; max_positions covers them), --valid-n, --seed,
--clip (gradient-norm clipping), --max-seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import torch
import torch.nn.functional as F

from xformer.config.loading import parse_override
from xformer.config.schema import ModelConfig
from xformer.data.generators import generate_recall, recall_spec
from xformer.model.build import build_model


def tensors(data):
    return torch.tensor([x for x, _ in data]), torch.tensor([y for _, y in data])


def accuracy(model, x, y, chunk=250):
    model.eval()
    with torch.no_grad():
        right = sum((model(x[i:i + chunk]).argmax(-1) == y[i:i + chunk]).sum().item()
                    for i in range(0, len(x), chunk))
    model.train()
    return 100 * right / len(x)


class Reference(torch.nn.Module):
    """A plain torch.nn.TransformerEncoder classifier (learned positions N(0, 1), token embeddings
    N(0, 1), PyTorch's default inits, Post-LN unless norm_first), for comparison (--reference)."""

    def __init__(self, vocab, n_classes, d_model, n_heads, d_ff, layers, max_positions, dropout, norm_first):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(max_positions, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout, batch_first=True,
                                                 norm_first=norm_first)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, n_classes)

    def forward(self, x):
        h = self.embed(x) + self.pos(torch.arange(x.size(1)))
        return self.head(self.encoder(h)[:, -1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--queries", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=0, help="batch size in tokens (overrides --batch per stage)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--decay", choices=("none", "cosine", "linear"), default="none")
    parser.add_argument("--wd", type=float, default=0.01)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--valid-n", type=int, default=1000)
    parser.add_argument("--target", type=float, default=101.0)
    parser.add_argument("--flat", action="append", default=[], help="STEP:ACC, stop at STEP if below ACC")
    parser.add_argument("--eval-lengths", type=int, nargs="*", default=[])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=0.0)
    parser.add_argument("--stages", default="",
                        help="length curriculum LEN:STEPS,LEN:STEPS,... (the last stage runs to --steps); "
                             "validation is at --length")
    parser.add_argument("--reference", choices=("", "post", "pre"), default="",
                        help="train a plain nn.TransformerEncoder (same d_model/heads/d_ff/layers/dropout) instead")
    parser.add_argument("--set", action="append", default=[], help="a ModelConfig field, e.g. n_heads=2")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    spec = recall_spec()
    stages = [tuple(int(v) for v in item.split(":")) for item in args.stages.split(",") if item]
    max_len = max([args.length, *args.eval_lengths, *(n for n, _ in stages)])

    def train_length(step):
        done = 0
        for n, k in stages:
            done += k
            if step <= done:
                return n
        return args.length
    cfg = ModelConfig(arch="classifier", d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2, dropout=0.0,
                      norm_position="pre", pooling="last", max_positions=max_len + 1)
    cfg = dataclasses.replace(cfg, **{name: value for _, name, value in
                                      (parse_override(f"model.{item}") for item in args.set)})
    if args.reference:
        model = Reference(len(spec.vocab), spec.n_classes, cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.n_encoder_layers,
                          cfg.max_positions, cfg.dropout, args.reference == "pre")
    else:
        model = build_model(cfg, len(spec.vocab), n_classes=spec.n_classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.wd)

    def factor(step):
        warm = min(1.0, step / args.warmup) if args.warmup else 1.0
        if args.decay == "none":
            return warm
        frac = min(1.0, max(0.0, (step - args.warmup) / max(1, args.steps - args.warmup)))
        return warm * (0.5 * (1 + math.cos(math.pi * frac)) if args.decay == "cosine" else 1 - frac)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    flats = [tuple(float(v) for v in item.split(":")) for item in args.flat]
    vx, vy = tensors(generate_recall(args.valid_n, args.length, 10**6 + args.seed, args.queries, n_pairs=args.pairs))
    every = args.eval_every or max(1, args.steps // 8)
    started = time.time()
    train_time = 0.0
    for step in range(1, args.steps + 1):
        t0 = time.time()
        length = train_length(step)
        batch = max(1, args.tokens // length) if args.tokens else args.batch
        x, y = tensors(generate_recall(batch, length, step + 1000 * args.seed, args.queries,
                                       n_pairs=args.pairs))
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        scheduler.step()
        train_time += time.time() - t0
        if step % every == 0 or step == args.steps:
            acc = accuracy(model, vx, vy)
            print(f"step {step}: train loss {loss.item():.3f}, valid accuracy {acc:.1f}% "
                  f"({time.time() - started:.0f} s, {1000 * train_time / step:.0f} ms/step)", flush=True)
            if acc >= args.target or any(step >= s and acc < a for s, a in flats):
                break
            if args.max_seconds and time.time() - started > args.max_seconds:
                break
    for length in args.eval_lengths:
        ex, ey = tensors(generate_recall(args.valid_n, length, 2 * 10**6, args.queries, n_pairs=args.pairs))
        print(f"zero-shot length {length}: valid accuracy {accuracy(model, ex, ey):.1f}%", flush=True)


if __name__ == "__main__":
    main()
