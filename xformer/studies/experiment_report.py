"""What an experiment writes beside its runs: results.json, the markdown table (also the
ledger's, per claim) and a bar chart of the test metric per cell."""

from __future__ import annotations

from pathlib import Path

from xformer.files import atomic_write_text
from xformer.results import ExperimentResult
from xformer.significance import SIGNIFICANT
from xformer.training.cpuload import BUSY_OVER, busy

SPEEDS = ("train_steps_per_s", "decode_per_s")  # per run, timed on the machine that ran it
# the CPU cores other processes took while each speed was timed (xformer.training.cpuload)
OTHERS = {"train_steps_per_s": "train_others_cpu", "decode_per_s": "decode_others_cpu"}


def markdown(result: ExperimentResult) -> str:
    copies = [f"{r['cell']}-s{r['seed']}" for r in result.runs if r.get("copied_from")]
    speeds = (f"; speeds are this experiment's timings, n/a where not taken here ({', '.join(copies)}: "
              "copies by --reuse)" if copies else "")
    diverged = [f"{r['cell']}-s{r['seed']} at step {r['diverged_at']}" for r in result.runs if r.get("diverged_at")]
    if diverged:
        speeds += (f"; diverged (the loss stayed non-finite), scored as an empty output: {', '.join(diverged)}")
    crowded = [f"{r['cell']}-s{r['seed']} {what} ({r[OTHERS[speed]]:.2f} cores)" for r in result.runs
               for speed, what in zip(SPEEDS, ("training", "decoding"), strict=True) if busy(r.get(OTHERS[speed]))]
    if crowded:
        speeds += (f"; timed while other processes took more than {BUSY_OVER:g} CPU cores (speeds marked busy): "
                   f"{', '.join(crowded)}")
    bleu = result.metric == "bleu"
    per_s = "decode sentences/s | KV cache MB" if bleu else "test examples/s"
    lines = [f"test {result.metric} (mean +- std over seeds {', '.join(map(str, result.seeds))}), "
             f"{result.budget_per_run} per run; baseline {result.baseline}{speeds}", "",
             f"| cell | overrides | test {result.metric} | valid {result.metric} | vs baseline | "
             f"paired p < {SIGNIFICANT} | parameters | train steps/s | {per_s} |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if bleu else "")]
    base = next(c for c in result.cells if c["cell"] == result.baseline)
    for c in result.cells:
        valid = f"{c['valid_mean']:.2f} +- {c['valid_std']:.2f}" if c["valid_mean"] is not None else "n/a"
        diff = f"{c['difference']:+.2f}" if "difference" in c else "baseline"
        significant = f"{c['significant_seeds']} of {len(result.seeds)} seeds" if "significant_seeds" in c else ""
        lines.append(f"| {c['cell']} | {' '.join(c['sets']) or '(recipe)'} | {c['test_mean']:.2f} +- "
                     f"{c['test_std']:.2f} | {valid} | {diff} | {significant} | {c['parameters']:,} | "
                     f"{_speed(c, base, 'train_steps_per_s', result.runs)} | "
                     f"{_speed(c, base, 'decode_per_s', result.runs)} |"
                     + (f" {_speed(c, base, 'decode_cache_mb', [])} |" if bleu else ""))
    return "\n".join(lines) + "\n"


def _speed(cell: dict, base: dict, speed: str, runs: list[dict]) -> str:
    """A cell's mean speed (or cache size) and its ratio to the baseline's, e.g. "3.21 (1.08x)",
    marked busy when one of the `runs` behind either was timed beside other work."""
    mine, theirs = cell.get(f"{speed}_mean"), base.get(f"{speed}_mean")
    if mine is None:
        return "n/a"
    crowded = any(busy(r.get(OTHERS[speed])) for r in runs if r["cell"] in (cell["cell"], base["cell"])
                  and speed in OTHERS)
    return f"{mine:.3g}" + (f" ({mine / theirs:.2f}x)" if theirs else "") + (" busy" if crowded else "")


def write_results(result: ExperimentResult, out_dir: Path) -> None:
    atomic_write_text(out_dir / "results.json", result.to_json())
    atomic_write_text(out_dir / "results.md", markdown(result))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(result.cells)), 3.5))
    names = [c["cell"] for c in result.cells]
    ax.bar(names, [c["test_mean"] for c in result.cells], yerr=[c["test_std"] for c in result.cells], capsize=4,
           color=["#888" if n == result.baseline else "#3b75af" for n in names])
    ax.set_ylabel(f"test {result.metric}")
    ax.set_title(f"{len(result.seeds)} seeds, {result.budget_per_run} per run")
    fig.tight_layout()
    fig.savefig(out_dir / "results.png", dpi=110)
    plt.close(fig)
    if result.curves:
        curve_png(result.to_dict(), out_dir / "curves.png")


def curve_png(results: dict, path: Path) -> None:
    """A learning curve per cell (experiment.budgets): the mean test score over seeds at each
    budget, with a band of one standard deviation, the baseline in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.0, 3.5))
    budgets = [c["budget"] for c in results["curves"]]
    for name in [c["cell"] for c in results["cells"]]:
        at = [next(c for c in curve["cells"] if c["cell"] == name) for curve in results["curves"]]
        mean = [c["test_mean"] for c in at]
        std = [c["test_std"] for c in at]
        line, = ax.plot(budgets, mean, marker="o", label=name,
                        color="#888" if name == results["baseline"] else None)
        ax.fill_between(budgets, [m - d for m, d in zip(mean, std, strict=True)],
                        [m + d for m, d in zip(mean, std, strict=True)], color=line.get_color(), alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training steps (wsd; each budget cooled down)")
    ax.set_ylabel(f"test {results['metric']}")
    ax.set_title(f"mean and std over {len(results['seeds'])} seeds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
