"""Where a CPU training step of a translation recipe goes, and what xformer's CPU changes buy.

    python benchmarks/cpu_step.py [RECIPE] [--data ../shared/data/multi30k] [--steps 30] [--compile] [--steps-only]

glibc malloc is tuned first, as the xformer command does (xformer.allocator;
XFORMER_ALLOCATOR=system leaves it as it comes: benchmarks/allocator.py alternates the two).

Prints, each measured in this run against its own baseline (--steps-only: the first only):
  1. seconds per optimizer step of the recipe's model on its own training batches: fp32 with
     the fast paths (what `xformer train` runs), fp32 with the per-tensor Adam instead of the
     fused one, fp32 through torch.compile (with --compile), and bf16 autocast where this
     CPU multiplies bf16 natively (elsewhere it is emulated, ~30x slower, and skipped);
  2. the dropout mask: torch's F.dropout against xformer.model.dropout, forward + backward on
     one (4096, 256) activation (the recipe's batch size, d_model);
  3. attention under bf16 (native bf16 only): torch's bf16 CPU SDPA against the fp32 kernel
     xformer uses (sdpa_attention), forward + backward at the recipe's shapes;
  4. the top operators of a profiled step (bf16 where native, else fp32).
The numbers go to stdout and, as JSON, to --json (default: none).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from xformer.allocator import tune_allocator
from xformer.config.loading import load_recipe
from xformer.model.dropout import dropout, use_fast_dropout
from xformer.tasks import make_task
from xformer.training.device import cpu_bf16, resolve_runtime
from xformer.training.optim import build_optimizer


def training_step(recipe, task, precision: str, **options):
    """A fresh model and optimizer, and the trainer's step over them (train.run's inner loop)."""
    return training_parts(recipe, task, precision, **options)[2]


def training_parts(recipe, task, precision: str, *, fused_adam: bool = True, compiled: bool = False):
    """training_step's model, runtime and step (a benchmark that also validates the model)."""
    rt = resolve_runtime("cpu", precision)
    torch.manual_seed(recipe.train.seed)
    model = use_fast_dropout(task.build_model(), recipe.train.fast_paths).train()  # as train.run builds it
    # fast_paths=False changes only the optimizer here: the model's dropout is already chosen
    optimizer = build_optimizer(model, replace(recipe.train, fast_paths=recipe.train.fast_paths and fused_adam))
    forward = torch.compile(model, dynamic=True) if compiled else model  # as train.compile does

    def step(batch):
        loss = task.loss(forward, batch, rt)
        rt.backward(loss / task.units(batch))
        rt.step(optimizer, model, recipe.train.clip_norm)
        optimizer.zero_grad(set_to_none=True)

    return model, rt, step


def seconds_per_step(recipe, task, batches, precision: str, warmup: int, **options) -> float:
    step = training_step(recipe, task, precision, **options)
    for batch in batches[:warmup]:
        step(batch)
    start = time.perf_counter()
    for batch in batches[warmup:]:
        step(batch)
    return (time.perf_counter() - start) / len(batches[warmup:])


def forward_backward_ms(fn, *inputs, repeats: int = 20) -> float:
    def once():
        leaves = [x.detach().requires_grad_() for x in inputs]
        fn(*leaves).float().sum().backward()

    once()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - start) / repeats * 1e3


def attention_under_bf16(recipe, results: dict) -> None:
    b, h, t = 160, recipe.model.n_heads, 26  # a typical Multi30k batch: ~4096 tokens of ~26
    q, k, v = (torch.randn(b, h, t, recipe.model.d_model // h).bfloat16() for _ in range(3))
    results["sdpa_ms_bf16"] = forward_backward_ms(lambda *a: F.scaled_dot_product_attention(*a), q, k, v)
    results["sdpa_ms_fp32"] = forward_backward_ms(
        lambda *a: F.scaled_dot_product_attention(*(x.float() for x in a)).bfloat16(), q, k, v)
    print(f"SDPA {(b, h, t)} bf16 inputs, forward+backward: bf16 kernel {results['sdpa_ms_bf16']:.2f} ms, "
          f"fp32 kernel {results['sdpa_ms_fp32']:.2f} ms "
          f"({results['sdpa_ms_bf16'] / results['sdpa_ms_fp32']:.1f}x)", flush=True)
    print(f"bf16 step / fp32 step: {results['step_s_bf16'] / results['step_s_fp32']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/translation/multi30k_de_en.toml")
    parser.add_argument("--data", default="../shared/data/multi30k")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--compile", action="store_true", help="also time the step through torch.compile")
    parser.add_argument("--steps-only", action="store_true", help="time the training steps, nothing else")
    args = parser.parse_args()
    tune_allocator()
    native_bf16 = cpu_bf16()[0]

    # the one-best segmentation: sampling changes the batches, not the cost of a step
    recipe = load_recipe(args.recipe, [f'data.dataset="{args.data}"', "data.sampling_alpha=0"])
    task = make_task(recipe)
    task.load(lambda kind, payload: None)
    with tempfile.TemporaryDirectory() as run_dir:
        task.prepare(Path(run_dir), lambda kind, payload: None)
    batches = list(itertools.islice(task.train_batches.iter_epoch(0, skip=0), args.warmup + args.steps))
    results = {"threads": torch.get_num_threads(), "steps": args.steps, "native_bf16": native_bf16}
    variants = {"fp32": ("fp32", {}), "fp32_per_tensor_adam": ("fp32", {"fused_adam": False})}
    if args.compile:
        variants["fp32_compiled"] = ("fp32", {"compiled": True})
    if native_bf16:
        variants["bf16"] = ("bf16", {})
    for name, (precision, options) in variants.items():
        results[f"step_s_{name}"] = seconds_per_step(recipe, task, batches, precision, args.warmup, **options)
        ratio = results[f"step_s_{name}"] / results["step_s_fp32"]
        print(f"{name}: {results[f'step_s_{name}']:.3f} s/step ({ratio:.2f}x fp32 with the fast paths)", flush=True)

    if args.steps_only:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return
    x = torch.randn(4096, recipe.model.d_model)
    p = recipe.model.dropout
    results["dropout_ms_torch"] = forward_backward_ms(lambda t: F.dropout(t, p, True), x)
    results["dropout_ms_xformer"] = forward_backward_ms(lambda t: dropout(t, p, True), x)
    print(f"dropout p={p} on {tuple(x.shape)}, forward+backward: torch {results['dropout_ms_torch']:.2f} ms, "
          f"xformer {results['dropout_ms_xformer']:.2f} ms "
          f"({results['dropout_ms_torch'] / results['dropout_ms_xformer']:.1f}x)", flush=True)

    if native_bf16:
        attention_under_bf16(recipe, results)
    precision = "bf16" if native_bf16 else "fp32"
    step = training_step(recipe, task, precision)
    for batch in batches[: args.warmup]:
        step(batch)
    with torch.profiler.profile() as prof:
        for batch in batches[args.warmup: 2 * args.warmup]:
            step(batch)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
