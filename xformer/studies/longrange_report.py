"""The long-range comparison's report: comparison.json, .md (tables, who wins where) and .png
(accuracy and tokens/s against length), from xformer.studies.longrange's summary."""

from __future__ import annotations

import json
from pathlib import Path

from xformer.files import atomic_write_text

MODELS = ("transformer", "lstm")  # every sweep's two; variants go between them


def write_comparison(comparison: dict, out_dir: Path) -> None:
    atomic_write_text(out_dir / "comparison.json", json.dumps(comparison, indent=2))
    atomic_write_text(out_dir / "comparison.md", comparison_markdown(comparison))
    plot_comparison(comparison, out_dir / "comparison.png")


def comparison_markdown(c: dict) -> str:
    by = {(g["model"], g["length"]): g for g in c["summary"]}
    models = c.get("models", list(MODELS))
    title = "Transformer vs LSTM" if models == list(MODELS) else "Transformer variants and an LSTM"
    lines = [f"# {c['task']}: {title} across sequence lengths", "",
             f"Budget per run: {c['budget_per_run']}; seeds {c['seeds']}; device {c['device']}. Test accuracy is "
             "the mean +- std over seeds of the checkpoint with the best validation accuracy.", ""]
    columns = [("acc %", lambda g: f"{g['accuracy_mean']:.2f} +- {g['accuracy_std']:.2f}"),
               ("params", lambda g: f"{g['parameters']:,}"), ("tok/s", lambda g: f"{g['tokens_per_s']:,.0f}"),
               ("peak MB", lambda g: f"{g['peak_memory_mb']:.0f}")]
    for heading, cell in columns:
        lines += [f"| length | {' | '.join(f'{_label(m)} {heading}' for m in models)} |",
                  "|---" * (len(models) + 1) + "|"]
        lines += [f"| {n} | {' | '.join(cell(by[(m, n)]) for m in models)} |" for n in c["lengths"]]
        lines.append("")
    lines += ["## Who wins where", ""]
    for n in c["lengths"]:
        t, s = by[("transformer", n)], by[("lstm", n)]
        acc = "Transformer" if t["accuracy_mean"] > s["accuracy_mean"] else (
            "LSTM" if s["accuracy_mean"] > t["accuracy_mean"] else "tie")
        speed = "Transformer" if t["tokens_per_s"] >= s["tokens_per_s"] else "LSTM"
        ratio = max(t["tokens_per_s"], s["tokens_per_s"]) / max(min(t["tokens_per_s"], s["tokens_per_s"]), 1e-9)
        lines.append(f"- length {n}: accuracy: {acc} ({t['accuracy_mean']:.2f} vs {s['accuracy_mean']:.2f}); "
                     f"training throughput: {speed}, {ratio:.2f}x")
        for m in models[1:-1]:
            g = by[(m, n)]
            lines.append(f"  - {m}: {g['accuracy_mean'] - t['accuracy_mean']:+.2f} accuracy points against the "
                         f"transformer, {g['tokens_per_s'] / max(t['tokens_per_s'], 1e-9):.2f}x its throughput")
    return "\n".join(lines) + "\n"


def _label(model: str) -> str:
    return {"transformer": "Transformer", "lstm": "LSTM"}.get(model, model)


def plot_comparison(c: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for model in c.get("models", list(MODELS)):
        color = {"transformer": "tab:blue", "lstm": "tab:orange"}.get(model)
        groups = [g for g in c["summary"] if g["model"] == model]
        lengths = [g["length"] for g in groups]
        ax_acc.errorbar(lengths, [g["accuracy_mean"] for g in groups], yerr=[g["accuracy_std"] for g in groups],
                        marker="o", capsize=3, color=color, label=f"{model} ({groups[0]['parameters']:,} params)")
        ax_tps.plot(lengths, [g["tokens_per_s"] for g in groups], marker="o", color=color, label=model)
    for ax in (ax_acc, ax_tps):
        ax.set_xscale("log", base=2)
        ax.set_xticks(c["lengths"], [str(n) for n in c["lengths"]])
        ax.set_xlabel("sequence length")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_acc.set_ylabel("test accuracy % (mean +- std over seeds)")
    ax_acc.set_title(f"{c['task']}: accuracy ({c['budget_per_run']} per run)")
    ax_tps.set_ylabel("training tokens/s")
    ax_tps.set_yscale("log")
    ax_tps.set_title(f"training throughput ({c['device']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
