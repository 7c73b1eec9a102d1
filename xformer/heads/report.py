"""Artifacts of `xformer inspect-heads`: a layer x head grid per space coloured by importance
with role labels, attention maps of a few examples, the pruning curves, and report.html with
every image embedded (opens offline)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

import numpy as np

SPACE_TITLES = {"encoder": "encoder self-attention", "decoder": "decoder self-attention",
                "cross": "decoder cross-attention"}
MAX_MAP_TOKENS = 48  # longer inputs are plotted on their first tokens


def write_artifacts(out: Path, report: dict, examples: list[dict]) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    files = {"grid": _grid(out / "heads_grid.png", report)}
    for example in examples:
        files[f"example_{example['row']}"] = _maps(out / f"attention_example{example['row']}.png", example)
    if "pruning" in report:
        files["pruning"] = _pruning(out / "pruning.png", report["pruning"])
    files["report"] = _html(out / "report.html", report, files)
    return {name: str(path) for name, path in files.items()}


def _grid(path: Path, report: dict) -> Path:
    import matplotlib.pyplot as plt

    spaces = [s for s in SPACE_TITLES if any(h["space"] == s for h in report["heads"])]
    fig, axes = plt.subplots(1, len(spaces), figsize=(4.6 * len(spaces), 3.8), squeeze=False)
    for ax, space in zip(axes[0], spaces, strict=True):
        heads = [h for h in report["heads"] if h["space"] == space]
        layers = sorted({h["layer"] for h in heads})
        n_heads = max(h["head"] for h in heads) + 1
        grid = np.full((len(layers), n_heads), np.nan)
        for h in heads:
            grid[layers.index(h["layer"]), h["head"]] = h["ablation"]
        image = ax.imshow(grid, cmap="viridis", aspect="auto")
        low, high = np.nanmin(grid), np.nanmax(grid)
        for h in heads:
            label = "\n".join(h["roles"]) or ""
            bright = high > low and (h["ablation"] - low) / (high - low) > 0.6  # viridis turns yellow
            ax.text(h["head"], layers.index(h["layer"]), f"{h['ablation']:.3g}\n{label}", ha="center",
                    va="center", fontsize=7, color="black" if bright else "white")
        ax.set_xticks(range(n_heads))
        ax.set_yticks(range(len(layers)), [f"layer {i}" for i in layers])
        ax.set_xlabel("head")
        ax.set_title(SPACE_TITLES[space], fontsize=10)
        fig.colorbar(image, ax=ax, fraction=0.046, label=f"ablation importance ({report['importance_metric']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _maps(path: Path, example: dict) -> Path:
    import matplotlib.pyplot as plt

    sites = list(example["maps"])
    n_heads = max(m.shape[0] for m in example["maps"].values())
    fig, axes = plt.subplots(len(sites), n_heads, figsize=(2.6 * n_heads, 2.6 * len(sites)), squeeze=False)
    for r, site in enumerate(sites):
        space = "cross" if site.endswith("cross_attn") else site.split(".")[0]
        queries = example["tokens"][f"{space}.queries"][:MAX_MAP_TOKENS]
        keys = example["tokens"][f"{space}.keys"][:MAX_MAP_TOKENS]
        maps = example["maps"][site][:, :MAX_MAP_TOKENS, :MAX_MAP_TOKENS]
        for h in range(n_heads):
            ax = axes[r, h]
            if h >= maps.shape[0]:
                ax.axis("off")
                continue
            ax.imshow(maps[h], cmap="Blues", vmin=0, vmax=1, aspect="auto")
            ax.set_title(f"{site} h{h}", fontsize=7)
            size = 5 if len(keys) <= 24 else 3
            ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=size)
            ax.set_yticks(range(len(queries)), queries, fontsize=size)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _pruning(path: Path, pruning: dict) -> Path:
    import matplotlib.pyplot as plt

    fig, (ax_all, ax_space) = plt.subplots(1, 2, figsize=(10, 3.8))
    overall = pruning["overall"]
    ax_all.plot([p["fraction"] * 100 for p in overall], [p["metric"] for p in overall], "o-")
    ax_all.axhline(pruning["base"] - pruning["max_drop"], color="grey", ls="--", lw=1,
                   label=f"base - {pruning['max_drop']:g}")
    ax_all.set_xlabel("% of all heads pruned (least important first)")
    ax_all.set_ylabel(f"{pruning['metric']} on {pruning['split']}")
    ax_all.legend(fontsize=8)
    for space, curve in pruning["by_space"].items():
        ax_space.plot([p["fraction"] * 100 for p in curve], [p["metric"] for p in curve], "o-",
                      label=SPACE_TITLES[space])
    ax_space.set_xlabel("% of the heads of one kind pruned")
    ax_space.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _html(path: Path, report: dict, images: dict[str, Path]) -> Path:
    def img(p: Path) -> str:
        data = base64.b64encode(p.read_bytes()).decode("ascii")
        return f'<img src="data:image/png;base64,{data}" style="max-width:100%">'

    rows = sorted(report["heads"], key=lambda h: -h["ablation"])
    cells = "".join(
        f"<tr><td>{html.escape(h['site'])}</td><td>{h['head']}</td><td>{h['ablation']:.4g}</td>"
        f"<td>{h['gradient']:.3f}</td><td>{h['confidence']:.3f}</td><td>{h['entropy']:.2f}</td>"
        f"<td>{h['special']:.2f}</td><td>{html.escape(', '.join(h['roles']))}</td></tr>" for h in rows)
    correlation = "".join(f"<li>{html.escape(k)}: {v:.3f}</li>" for k, v in report["rank_correlation"].items())
    criteria = "".join(f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in report["criteria"].items())
    pictures = "".join(f"<h3>{html.escape(name)}</h3>{img(p)}" for name, p in images.items())
    pruning = ""
    if "pruning" in report:
        best = report["pruning"]["largest_within_max_drop"]
        pruning = (f"<p>Pruning ({report['pruning']['metric']} on {report['pruning']['split']}, base "
                   f"{report['pruning']['base']:.2f}): {best['pruned']} heads ({best['fraction_of_heads']:.0%}) "
                   f"removed for a drop of {best['drop']:.2f}.</p>")
    title = html.escape(report["run"])
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>xformer heads: {title}</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:2px 8px;border-bottom:1px solid #ddd}}</style></head>
<body><h1>Attention heads of {html.escape(report['run'])}</h1>
<p>{report['n_examples']} examples of {html.escape(str(report['split']))}; importance by {report['importance_metric']}
(base {report['base_metric']:.4g}). Syntactic heads: {html.escape(report['syntactic'])}.</p>
<h2>Criteria</h2><ul>{criteria}</ul>
<h2>Rank correlation of importances (Spearman)</h2><ul>{correlation}</ul>{pruning}
<h2>Heads, most important first</h2><table><tr><th>site</th><th>head</th><th>ablation</th><th>gradient</th>
<th>confidence</th><th>entropy (bits)</th><th>special mass</th><th>roles</th></tr>{cells}</table>
<h2>Figures</h2>{pictures}</body></html>"""
    path.write_text(page, encoding="utf-8")
    return path
