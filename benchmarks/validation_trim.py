"""What the heap trim around each validation costs the training steps after it.

    python benchmarks/validation_trim.py [--data ../shared/data/multi30k] [--cycles 4] [--steps 30]

The trainer hands the tuned heap's free pages back to the OS before and after each validation
(allocator.release() in training.state.validate_and_save), so a training step's retained pages and
the decoder's are never resident together. This measures, in three fresh processes, one after the
other: the flagship recipe's step time on the same training batches, cycle after cycle, with a
validation and the two trims between cycles ("trim", what `xformer train` does), with the
validation alone ("no-trim"), and with neither ("none"); and each process's peak RSS. glibc malloc
is tuned first, as the xformer command does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "translation" / "multi30k_de_en.toml"
MODES = ("trim", "no-trim", "none")


def measure(mode: str, data: str, cycles: int, steps: int) -> dict:
    """In this process: seconds a step over the same `steps` batches, after each cycle's validation."""
    from xformer.allocator import release, tune_allocator

    tune_allocator()  # before the first tensor
    from cpu_step import training_parts  # the trainer's step, as benchmarks/cpu_step.py times it

    from xformer.config.loading import load_recipe
    from xformer.events import ignore
    from xformer.tasks import make_task

    recipe = load_recipe(RECIPE, [f"data.dataset={json.dumps(data)}", "train.max_time=0", "train.max_steps=300",
                                  'train.regularisation="recipe"', "model.dropout=0.2"])
    task = make_task(recipe)
    task.load(ignore)
    with tempfile.TemporaryDirectory() as run_dir:  # the tokenizer, read into the task
        task.prepare(Path(run_dir), ignore)
    model, rt, step = training_parts(recipe, task, "auto")
    batches = list(itertools.islice(task.train_batches.iter_epoch(0), steps))

    def train() -> float:
        model.train()
        began = time.perf_counter()
        for batch in batches:
            step(batch)
        return (time.perf_counter() - began) / len(batches)

    train()  # warm-up
    seconds, valid = [], []
    for _ in range(cycles):
        seconds.append(train())
        began = time.perf_counter()
        if mode == "trim":
            release()
        if mode != "none":
            task.validate(model, rt)
        if mode == "trim":
            release()
        valid.append(time.perf_counter() - began)
    seconds.append(train())
    return {"mode": mode, "precision": rt.precision, "step_seconds": seconds, "validation_seconds": valid,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    parser.add_argument("--cycles", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one process's part
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(measure(args.mode, args.data, args.cycles, args.steps)))
        return
    rows = []
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--data", args.data, "--cycles",
                              str(args.cycles), "--steps", str(args.steps)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[-1]["step_seconds"][-1]
    print(f"{'mode':8} {'s a step, cycle by cycle':44} {'last / none':>11} {'peak RSS MB':>12}")
    for row in rows:
        cycles = " ".join(f"{s:.3f}" for s in row["step_seconds"])
        print(f"{row['mode']:8} {cycles:44} {row['step_seconds'][-1] / base:11.3f} {row['peak_rss_mb']:12.0f}")


if __name__ == "__main__":
    main()
