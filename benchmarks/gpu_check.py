"""CUDA check: train the Multi30k recipe a few hundred steps in bf16 and in fp16 (with the
gradient scaler), check the loss falls without NaN, and print tokens/s and MFU.

    python benchmarks/gpu_check.py --data ../shared/data/multi30k [--steps 300]

MFU = achieved model FLOP/s over the GPU's dense peak for that precision. The FLOPs of a
training step are counted by torch.utils.flop_counter on a real batch (forward + backward),
so attention and the vocabulary projection are included. Peaks are the vendor's dense
(no sparsity) bf16/fp16 tensor-core numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from xformer.config.loading import load_recipe
from xformer.data.batching import BatchIterator
from xformer.data.corpus import encode_split, load_split
from xformer.data.tokenizer import PAD_ID
from xformer.tasks import make_task
from xformer.tasks.translation_tokenizer import ensure_tokenizer
from xformer.train import run
from xformer.training.losses import sequence_loss

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "4090": 165.0}
ROOT = Path(__file__).resolve().parents[1]


def flops_per_token(recipe, run_dir: Path) -> float:
    """Training FLOPs (forward + backward) per target token, counted on one real batch."""
    d = recipe.data
    tokenizer = ensure_tokenizer(recipe, run_dir)
    raw = load_split(d.dataset, d.train_split, [d.source_lang, d.target_lang], d.dataset_config or None)
    train = encode_split(raw, tokenizer, d.source_lang, d.target_lang, max_len=d.max_len)
    batch = next(BatchIterator(train, d.max_tokens, seed=1).iter_epoch(0))
    task = make_task(recipe)
    task.tokenizer = tokenizer  # sizes the model by the tokenizer actually trained
    model = task.build_model()
    keep = batch["tgt_out"].ne(PAD_ID)
    with FlopCounterMode(display=False) as counter:
        logits = model(batch["src"], batch["tgt_in"], keep=keep)
        sequence_loss(logits, batch["tgt_out"][keep], PAD_ID, 0.1).backward()
    return counter.get_total_flops() / batch["n_tgt_tokens"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--recipe", default=str(ROOT / "recipes" / "translation" / "multi30k_de_en.toml"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    print(f"GPU: {name}; torch {torch.__version__}; CUDA {torch.version.cuda}; peak {peak} TFLOP/s")
    base = ["data.dataset=" + json.dumps(args.data), f"train.max_steps={args.steps}", "train.max_time=0.0",
            f"train.valid_every={args.steps}", "train.log_every=25", "train.average_last=0"]
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        per_token = None
        for precision in ("bf16", "fp16"):
            recipe = load_recipe(args.recipe, base + [f"train.precision={precision}"])
            out = Path(tmp) / precision
            if per_token is None:
                per_token = flops_per_token(recipe, Path(tmp) / "flops")
            result = run(recipe, out, device="cuda")
            records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            losses = [r["loss"] for r in records if r["kind"] == "train"]
            tps = [r["tokens_per_s"] for r in records if r["kind"] == "train"][2:]  # skip warm-up windows
            tokens_per_s = sum(tps) / max(1, len(tps))
            mfu = tokens_per_s * per_token / (peak * 1e12) if peak else float("nan")
            ok = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 1.0
            failures += not ok
            print(json.dumps({"precision": precision, "ok": ok, "first_loss": losses[0], "last_loss": losses[-1],
                              "valid": result.best, "tokens_per_s": round(tokens_per_s),
                              "gflop_per_token": per_token / 1e9, "mfu": mfu,
                              "loop_overhead": result.loop_overhead}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
