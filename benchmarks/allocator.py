"""glibc malloc's defaults against xformer's tuned allocator (xformer.allocator), alternated in one run.

    python benchmarks/allocator.py [--data ../shared/data/multi30k] [--repeats 2]
        [--only bench_train,cpu_step,translate,longrange,experiment] [--flagship-steps 0] [--json FILE]
        [--arena-max N] [--variant VAR=VALUE[,VAR=VALUE...]]... [--precision fp32|bf16]

Each workload runs as a whole process, once with XFORMER_ALLOCATOR=system (glibc as it comes) and
once tuned, alternated `--repeats` times (system, tuned, system, tuned, ...) so a drift of the
machine falls on both. For each process the kernel's own accounting (wait4's rusage) gives the
minor page faults, the peak resident set and the system CPU share; the workload's own figure
(GFLOP/s, seconds per step) comes from its JSON. Printed: a table per workload and the
tuned / system ratios; --json writes every process's figures.

    bench_train   xformer bench train --device cpu --steps 10 --rounds 2 (the peers' workload)
    cpu_step      benchmarks/cpu_step.py --steps-only: the flagship recipe's own training step
    translate     xformer translate of 10,000 Multi30k training sources with a flagship-sized run
    longrange     xformer longrange, recall at 512..4,096 tokens, 20 steps a run (one process)
    experiment    xformer experiment, three flagship-sized cells of 30 steps (one process; the
                  activations claim as it was at the flagship's size)
    flagship      (--flagship-steps N > 0) xformer train of the flagship recipe for N steps, as many
                  as a 50-minute run takes on the CPU at hand (943 on a 2-core AVX2 EPYC in fp32)

--variant adds a process to each alternation: tuned, with those variables set too (the user's own
MALLOC_*_ settings win over tune_allocator's), e.g. `--variant MALLOC_TRIM_THRESHOLD_=268435456`;
a variant that starts with "system+" or "tuned+" names its base, e.g.
`--variant system+THP_MEM_ALLOC_ENABLE=1` (glibc as it comes, PyTorch's CPU tensors of 2 MiB and
more on transparent huge pages).

A flagship-sized run to translate with is trained first (60 steps) and kept in a temporary folder.
Every workload that trains does so in one precision, --precision or what `precision = "auto"` picks
on this CPU, decided once at the start, so every process of an alternation runs the same workload
(where ONEDNN_MAX_CPU_ISA is set, auto times a matmul, which other work can blur). (The
long-range sweep's recipes keep their own.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "translation" / "multi30k_de_en.toml"
XFORMER = [sys.executable, "-m", "xformer_cli"]
EXPERIMENT = """[experiment]
recipe = {recipe}
seeds = [1]
baseline = "relu"
max_steps = 30
set = ["data.max_tokens=2048", "train.warmup_steps=100", "train.valid_every=125", "train.average_last=0",
       "train.log_every=25", "eval.beam=1", 'train.precision="{precision}"']

[experiment.cells]
relu = []
gelu = ["model.ffn=gelu"]
swiglu = ["model.ffn=swiglu", "model.d_ff=683"]
"""


def measured(command: list[str], allocator: str, stdout: Path | None = None) -> dict:
    """Run `command` under XFORMER_ALLOCATOR=`allocator` (no MALLOC_*_ inherited; "tuned+arenaN":
    tuned, with glibc's MALLOC_ARENA_MAX=N too; "tuned+VAR=VALUE,...": tuned with those variables);
    the kernel's figures of the process and its children."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "THP_MEM_ALLOC_ENABLE"}
    env["XFORMER_ALLOCATOR"], _, extra = allocator.partition("+")
    if extra.startswith("arena"):
        env["MALLOC_ARENA_MAX"] = extra.removeprefix("arena")
    elif extra:
        env |= dict(item.split("=", 1) for item in extra.split(","))
    started = time.perf_counter()
    with open(stdout or os.devnull, "w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    error = process.stderr.read()
    process.stderr.close()
    if status != 0:
        raise SystemExit(f"{' '.join(command)} (XFORMER_ALLOCATOR={allocator}) failed:\n{error[-2000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    return {"wall_s": wall, "minor_faults": usage.ru_minflt, "peak_rss_mb": usage.ru_maxrss / 1024,
            "system_share": usage.ru_stime / cpu if cpu else 0.0}


def pinned_precision(args) -> str:
    """The --set that trains a workload in the one precision of this benchmark run."""
    return f"train.precision={json.dumps(args.precision)}"


def workloads(args, scratch: Path) -> dict[str, tuple[list[str], callable]]:
    """name -> (command line, reader of the workload's own figure from its stdout file)."""
    data = f"data.dataset={json.dumps(str(Path(args.data).resolve()))}"
    run = scratch / "flagship"
    sources = scratch / "sources.de"
    lines = (Path(args.data) / "train.jsonl").read_text(encoding="utf-8").splitlines()[:10_000]
    sources.write_text("\n".join(json.loads(line)["de"] for line in lines) + "\n", encoding="utf-8")

    spec = scratch / "experiment.toml"  # three flagship-sized cells (ReLU, GELU, SwiGLU), 30 steps each
    spec.write_text(EXPERIMENT.format(recipe=json.dumps(str(RECIPE)), precision=args.precision),
                    encoding="utf-8")
    pinned = pinned_precision(args)

    def gflops(stdout: Path, _: Path) -> dict:
        report = json.loads(stdout.read_text())
        return {"model_gflop_per_s": report["figures"]["model_gflop_per_s"]["median"],
                "faults_per_step": report["figures"]["minor_faults_per_step"]["median"]}

    def step_seconds(_: Path, written: Path) -> dict:
        return {k: v for k, v in json.loads(written.read_text()).items() if k.startswith("step_s_")}

    def nothing(*_: Path) -> dict:
        return {}

    return {
        "bench_train": ([*XFORMER, "bench", "train", "--device", "cpu", "--steps", "10", "--rounds", "2", "--json"],
                        gflops),
        "cpu_step": ([sys.executable, str(ROOT / "benchmarks" / "cpu_step.py"), str(RECIPE), "--data", args.data,
                      "--steps", "20", "--steps-only", "--json", "{json}"], step_seconds),
        "translate": ([*XFORMER, "translate", str(run), "--input", str(sources), "--beam", "5", "--device", "cpu"],
                      nothing),
        "longrange": ([*XFORMER, "longrange", str(ROOT / "recipes" / "longrange" / "recall_cpu_sweep.toml"),
                       "--set", "sweep.lengths=[512,1024,2048,4096]", "--set", "sweep.max_steps=20",
                       "--set", "sweep.max_time=0", "--device", "cpu", "--out", str(scratch / "longrange-{n}")],
                      nothing),
        "experiment": ([*XFORMER, "experiment", str(spec), "--set", data, "--device", "cpu",
                        "--out", str(scratch / "experiment-{n}")], nothing),
        "flagship": ([*XFORMER, "train", str(RECIPE), "--set", data, "--set", pinned, "--set", "train.max_time=0.0",
                      "--max-steps", str(args.flagship_steps), "--device", "cpu",
                      "--out", str(scratch / "flagship-{n}")], nothing),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", default="bench_train,cpu_step,translate,longrange,experiment")
    parser.add_argument("--flagship-steps", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--arena-max", type=int, default=0,
                        help="also run tuned with MALLOC_ARENA_MAX=N (a third process each alternation)")
    parser.add_argument("--variant", action="append", default=[],
                        help="also run tuned (or system+...) with these variables (VAR=VALUE,...): "
                             "a process each alternation")
    parser.add_argument("--precision", default=None,
                        help="the training precision of every workload that trains (default: what auto picks here, "
                             "decided once at the start)")
    args = parser.parse_args()
    if args.precision is None:
        from xformer.training.device import cpu_bf16

        args.precision = "bf16" if cpu_bf16()[0] else "fp32"
    print(f"workloads train in {args.precision}", flush=True)
    names = [n for n in args.only.split(",") if n] + (["flagship"] if args.flagship_steps > 0 else [])
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        jobs = workloads(args, scratch)
        if "translate" in names:
            data = f"data.dataset={json.dumps(str(Path(args.data).resolve()))}"
            measured([*XFORMER, "train", str(RECIPE), "--set", data, "--set", pinned_precision(args),
                      "--max-steps", "60", "--device", "cpu", "--out", str(scratch / "flagship")], "tuned")
        count = 0
        for name in names:
            command, read = jobs[name]
            results[name] = []
            for repeat in range(args.repeats):
                variants = [*([f"tuned+arena{args.arena_max}"] if args.arena_max else []),
                            *(v if v.startswith(("system+", "tuned+")) else f"tuned+{v}" for v in args.variant)]
                for allocator in ("system", "tuned", *variants):
                    count += 1
                    stdout, written = scratch / f"{name}-{count}.out", scratch / f"{name}-{count}.json"
                    line = [part.replace("{n}", str(count)).replace("{json}", str(written)) for part in command]
                    figures = measured(line, allocator, stdout)
                    figures |= read(stdout, written)
                    results[name].append({"allocator": allocator, "repeat": repeat + 1, **figures})
                    print(f"{name} {allocator} #{repeat + 1}: " + ", ".join(
                        f"{k} {v:,.3f}" if isinstance(v, float) else f"{k} {v:,}" for k, v in figures.items()),
                        flush=True)
    print()
    for name, rows in results.items():
        # a figure some process lacks (bf16 where the probe said it is emulated) is left out
        keys = [k for k in rows[0] if k not in ("allocator", "repeat") and all(k in r for r in rows)]
        print(f"{name}: tuned / system (medians over {args.repeats} alternations)")
        for key in keys:
            system = statistics.median(r[key] for r in rows if r["allocator"] == "system")
            for variant in sorted({r["allocator"] for r in rows} - {"system"}):
                tuned = statistics.median(r[key] for r in rows if r["allocator"] == variant)
                print(f"  {key:>20}: system {system:>12,.3f}  {variant} {tuned:>12,.3f}  ratio "
                      f"{tuned / system if system else float('nan'):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "results": results}, indent=2))


def cpu_name() -> str:
    from xformer.training.run_card import cpu_name as name

    return name()


if __name__ == "__main__":
    main()
