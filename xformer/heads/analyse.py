"""`inspect_heads`: the whole head analysis of a trained run, as `xformer inspect-heads` runs it.

    capture + statistics + roles (stats.py)  ->  importance three ways (importance.py)
      -> optional pruning curves and a physically pruned copy  ->  heads.json + PNGs + report.html

Importance and roles are measured on `split` (default: validation); the pruning curve is
measured on `prune_split` (default: the test split), so the order in which heads are removed is
never chosen on the data the cost is reported on.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from xformer.config.loading import load_run_recipe
from xformer.config.sites import heads_by_site
from xformer.errors import RunError
from xformer.events import Event, ignore
from xformer.files import atomic_write_text
from xformer.heads import importance as imp
from xformer.heads import stats
from xformer.heads.report import write_artifacts
from xformer.model.build import attention_modules, count_parameters
from xformer.results import HeadsReport
from xformer.tasks import make_task
from xformer.tasks.base import Subject, site_space
from xformer.training.checkpoint import run_checkpoint, save_checkpoint
from xformer.training.run_folder import mark_run_dir, tokenizer_digest

SPACE_FRACTIONS = [0.0, 0.25, 0.5, 0.75, 1.0]
ABLATIONS = ("zero", "mean", "rescale", "renorm")
PRUNE_ORDERS = ("one-shot", "gradient", "greedy")
IMPORTANCE_METRICS = ("loss", "bleu", "accuracy")


@dataclass
class HeadsConfig:
    """What `inspect_heads` analyses and how.

    `ablate`: a removed head outputs "zero" (Michel et al. 2019) or its "mean" output over the
    analysed examples (folded into the out_proj bias when the pruned model is saved);
    "rescale": mean-ablation plus a least-squares rescaling of each touched site's surviving
    heads (importance.least_squares; statistics from `split`), also folded into the saved model;
    "renorm": zero, with each touched site's surviving heads scaled by H / kept
    (importance.renormalised), as a model trained with DropHead (model.head_dropout) saw it.
    `prune_order`: "one-shot" (increasing ablation importance), "gradient" (increasing gradient
    importance normalised per layer: Michel et al. 2019's order) or "greedy" (re-ranked on
    `split` after every pruning step, importance.greedy_order). `prune_step`: the whole-model
    curve's spacing, as a fraction of all heads."""

    split: str | None = None  # default: the recipe's validation split
    data: str | None = None  # a JSONL file or folder with the recipe's fields instead
    n_examples: int = 500
    out: str | Path | None = None  # default: RUN/heads
    importance: Literal["loss", "bleu", "accuracy"] = "loss"
    ablate: Literal["zero", "mean", "rescale", "renorm"] = "zero"
    prune: bool = False
    prune_split: str | None = None  # default: the test split
    prune_order: Literal["one-shot", "gradient", "greedy"] = "one-shot"
    prune_step: float = 0.1
    max_drop: float = 0.5
    save_pruned: str | Path | None = None  # implies prune
    checkpoint: str | None = None  # default: the recipe's eval.checkpoint
    device: str = "auto"

    def problems(self) -> list[str]:
        out = []
        if self.ablate not in ABLATIONS:
            out.append(f"ablate: expected {', '.join(ABLATIONS)}, found {self.ablate!r}")
        if self.prune_order not in PRUNE_ORDERS:
            out.append(f"prune_order: expected {', '.join(PRUNE_ORDERS)}, found {self.prune_order!r}")
        if self.importance not in IMPORTANCE_METRICS:
            out.append(f"importance: expected {', '.join(IMPORTANCE_METRICS)}, found {self.importance!r}")
        if not 0 < self.prune_step <= 0.5:
            out.append(f"prune_step: expected a fraction of the heads in (0, 0.5], found {self.prune_step:g}")
        if self.max_drop < 0:
            out.append(f"max_drop: expected a drop >= 0, found {self.max_drop:g}")
        if self.n_examples < 1:
            out.append(f"n_examples: expected at least 1, found {self.n_examples}")
        return out


def inspect_heads(run_dir: str | Path, config: HeadsConfig | None = None, *,
                  on_event: Event | None = None) -> HeadsReport:
    """Analyse every attention head of a run; write heads.json, PNGs and report.html to
    config.out (default RUN/heads) and return what heads.json holds. Events: "start" (sites,
    heads, examples), "phase" (name, total), "advance" (done)."""
    config = config or HeadsConfig()
    problems = config.problems()
    if problems:
        raise RunError(problems)
    ablate, importance, split, data, save_pruned = (config.ablate, config.importance, config.split, config.data,
                                                    config.save_pruned)
    prune = config.prune or save_pruned is not None
    emit = on_event or ignore
    run_dir = Path(run_dir)
    out = Path(config.out) if config.out is not None else run_dir / "heads"
    if save_pruned is not None and Path(save_pruned).exists() and any(Path(save_pruned).iterdir()):
        raise RunError(f"save_pruned: {save_pruned} exists and is not empty; choose a new directory")
    started = time.perf_counter()
    recipe = load_run_recipe(run_dir)
    _refuse_unanalysable(run_dir, recipe.model)
    checkpoint = config.checkpoint or recipe.eval.checkpoint
    subject = make_task(recipe).subject(run_dir, split=split, data=data, n_examples=config.n_examples,
                                        checkpoint=checkpoint, device=config.device)
    if importance not in subject.metric_names:
        raise RunError(f"importance: a {subject.kind} run ranks heads by {' or '.join(subject.metric_names)}, "
                       f"found {importance!r}")
    sites = attention_modules(subject.model)
    emit("start", {"sites": len(sites), "heads": sum(m.n_heads for m in sites.values()),
                   "examples": sum(len(b["rows"]) for b in subject.batches)})

    emit("phase", {"name": "attention statistics", "total": len(subject.batches)})
    captured = stats.collect(subject, sites, contributions=ablate == "rescale")
    fill = captured["mean_outputs"] if ablate in ("mean", "rescale") else None
    rule = None  # survivors unchanged ("zero", "mean")
    if ablate == "rescale":
        rule = imp.least_squares(captured["contribution_cov"])
    elif ablate == "renorm":
        rule = imp.renormalised
    base, ablation, groups, raw_gradient, gradient, correlation = _importance(subject, sites, captured, fill, rule,
                                                                               config, emit)
    heads = _head_rows(sites, captured, ablation, gradient, raw_gradient)
    report = {
        "run": str(run_dir), "kind": subject.kind, "split": split or "validation", "data": data,
        "n_examples": sum(len(b["rows"]) for b in subject.batches), "importance_metric": importance,
        "ablate": ablate,
        "base_metric": base, "heads": heads, "kv_groups": groups,
        "rank_correlation": correlation, "similarity": captured["similarity"], "criteria": _criteria(),
        "syntactic": _syntactic_note(),
    }
    if prune:
        report.update(_prune(run_dir, subject, sites, ablation, gradient, fill, rule, config, checkpoint, emit))
    report["seconds"] = time.perf_counter() - started
    emit("phase", {"name": "report", "total": 1})
    report["artifacts"] = write_artifacts(out, report, captured["examples"])
    result = HeadsReport(**report)
    atomic_write_text(out / "heads.json", result.to_json())
    return result


def _prune(run_dir: Path, subject, sites, ablation, gradient, fill, rule, config: HeadsConfig, checkpoint: str,
           emit: Event) -> dict:
    """The report's "pruning" curve on the held-out split and, with save_pruned, its "pruned_model"
    (the largest step within max_drop, saved as a run; or why nothing was saved)."""
    held_out, held_out_name = subject.held_out(config.prune_split)  # loaded once: curve and saved model
    ranking = gradient if config.prune_order == "gradient" else ablation
    pruning = _pruning(subject, sites, ranking, fill, rule, config.prune_order, config.importance, held_out,
                       held_out_name, config.max_drop, prune_fractions(config.prune_step), emit)
    out = {"pruning": pruning}
    if config.save_pruned is not None and not pruning["largest_within_max_drop"]["pruned"]:
        out["pruned_model"] = {"path": None, "reason": f"no pruning step stays within max_drop "
                                                       f"{config.max_drop:g}; nothing saved"}
    elif config.save_pruned is not None:
        out["pruned_model"] = _save_pruned(run_dir, subject, sites, ablation, fill, rule, pruning, held_out,
                                           Path(config.save_pruned), checkpoint)
    return out


def _refuse_unanalysable(run_dir: Path, m) -> None:
    """Models whose heads do not attend to tokens: nothing per head to read or prune."""
    if m.arch == "lstm":
        return
    if m.attention == "low_rank":
        raise RunError(f"{run_dir}: model.attention = 'low_rank': its heads attend to learned mixtures of the "
                       "tokens, not to tokens, so head roles and maps over them mean nothing; inspect-heads "
                       "analyses models that attend to tokens")
    if m.attention == "synthesizer":
        raise RunError(f"{run_dir}: model.attention = 'synthesizer': its self-attention heads are learned tables "
                       "of positions that no input changes, with no queries or keys to gate or prune; "
                       "inspect-heads analyses dot-product attention")
    if m.downsample_every and m.downsample_every < m.n_encoder_layers:
        raise RunError(f"{run_dir}: model.downsample_every = {m.downsample_every}: the encoder's later "
                       "layers and the cross-attention attend to pooled pairs of positions, not to tokens, so "
                       "head roles and maps over them mean nothing; inspect-heads analyses models without "
                       "downsampling")


def _importance(subject: Subject, sites: dict, captured: dict, fill: dict | None, rule: imp.GateRule | None,
                config: HeadsConfig, emit: Event):
    """Each head's importance three ways (ablation, gate gradient, attention confidence) and how
    their rankings agree: (base metric, ablation, kv-group ablation, raw gradient, gradient
    normalised per layer, rank correlations)."""
    emit("phase", {"name": f"{config.ablate}-ablation ({config.importance})",
                   "total": sum(m.n_heads for m in sites.values())})
    base, ablation = imp.ablation(subject, sites, config.importance, fill, rule,
                                  on_head=lambda done, total: emit("advance", {"done": done}))
    groups = imp.group_ablation(subject, sites, config.importance, fill, rule)
    emit("phase", {"name": "gradient importance", "total": 1})
    raw_gradient = imp.gate_gradients(subject, sites)
    gradient = imp.normalise_per_layer(raw_gradient)
    confidence = {site: [h["confidence"] for h in captured["heads"][site]] for site in sites}
    flat = {name: [v for _, v in imp.flatten(values)] for name, values in
            (("ablation", ablation), ("gradient", gradient), ("confidence", confidence))}
    correlation = {f"{a}~{b}": imp.spearman(flat[a], flat[b])
                   for a, b in (("ablation", "gradient"), ("ablation", "confidence"), ("gradient", "confidence"))}
    return base, ablation, groups, raw_gradient, gradient, correlation


def _head_rows(sites: dict, captured: dict, ablation: dict, gradient: dict, raw_gradient: dict) -> list[dict]:
    """One row a head: where it is, its importances and its attention statistics."""
    return [{"site": site, "space": site_space(site), "layer": int(site.split(".")[1]), "head": h,
             "kv_group": h // (module.n_heads // module.n_kv_heads), "ablation": ablation[site][h],
             "gradient": gradient[site][h], "gradient_raw": raw_gradient[site][h], **captured["heads"][site][h]}
            for site, module in sites.items() for h in range(module.n_heads)]


def _pruning(subject: Subject, sites: dict, ranking: dict, fill: dict | None, rule: imp.GateRule | None,
             prune_order: str, importance: str, held_out, name: str, max_drop: float, fractions: list[float],
             emit: Event) -> dict:
    """Curves of the held-out metric as heads go, least important first by `ranking` (ablation
    or gradient importance, once; or greedy re-ranking on the analysis split): over the whole
    model, and within each space (encoder self, decoder self, cross)."""
    metric = subject.metric_names[-1]  # the task's quality metric (BLEU, accuracy), not the loss
    timings: list[float] = []

    def measure():
        started = time.perf_counter()
        value = subject.score(metric, held_out)
        timings.append(time.perf_counter() - started)
        return value

    spaces = sorted({site_space(s) for s in sites}, key=["encoder", "decoder", "cross"].index)
    total = len(fractions) + len(spaces) * (len(SPACE_FRACTIONS) - 1)
    emit("phase", {"name": f"pruning curve ({metric} on {name})", "total": total})
    done = 0

    def tick(*_):
        nonlocal done
        done += 1
        emit("advance", {"done": done})

    def order(values: dict, points: list[float]) -> list:  # points: the curve the order must serve
        heads = imp.one_shot_order(values)
        if prune_order != "greedy":
            return heads
        sizes = imp.round_sizes(len(heads), points)
        emit("phase", {"name": f"greedy pruning order ({importance})", "total": len(sizes)})
        found = imp.greedy_order(subject, sites, heads, importance, sizes, fill, rule,
                                 on_round=lambda done, total: emit("advance", {"done": done}))
        emit("phase", {"name": f"pruning curve ({metric} on {name})", "total": total})
        emit("advance", {"done": done})
        return found

    overall = imp.prune_curve(sites, order(ranking, fractions), measure, fractions, fill, rule, on_step=tick)
    base = overall[0]["metric"]
    by_space = {}
    for space in spaces:  # only this space's heads, least important first
        within_space = {s: v for s, v in ranking.items() if site_space(s) == space}
        space_order = order(within_space, SPACE_FRACTIONS)
        curve = imp.prune_curve(sites, space_order, measure, SPACE_FRACTIONS[1:], fill, rule, on_step=tick)
        by_space[space] = [{"fraction": 0.0, "pruned": 0, "heads": [], "metric": base}] + curve
    within = [p for p in overall if base - p["metric"] <= max_drop]
    best = max(within, key=lambda p: p["pruned"])
    n_heads = sum(m.n_heads for m in sites.values())
    return {"metric": metric, "split": name, "order": prune_order, "base": base, "max_drop": max_drop,
            "overall": overall,
            "by_space": by_space, "seconds_per_measure": float(np.mean(timings)),
            "largest_within_max_drop": {"pruned": best["pruned"], "fraction_of_heads": best["pruned"] / n_heads,
                                        "metric": best["metric"], "drop": base - best["metric"],
                                        "heads": best["heads"]}}


def prune_fractions(step: float) -> list[float]:
    """0, step, 2 step, ... below 1 (all heads gone is not a model)."""
    return [round(i * step, 9) for i in range(int(1 / step) + 2) if i * step < 1 - 1e-9]


def _save_pruned(run_dir: Path, subject: Subject, sites: dict, ablation: dict, fill: dict | None,
                 rule: imp.GateRule | None, pruning: dict, held_out, target: Path, checkpoint: str | None) -> dict:
    """A new run directory holding the model with the heads of the largest pruning step within
    max_drop removed: recipe.toml (model.pruned_heads), tokenizer/, checkpoints/<name>."""
    recipe = subject.recipe
    chosen = pruning["largest_within_max_drop"]["heads"]
    entries, kept = imp.heads_to_config(chosen, sites, ablation)
    already = heads_by_site(recipe.model.pruned_heads)
    original = []
    for entry in entries:  # indices of this (possibly already pruned) model -> original indices
        site, h = entry.rsplit(":", 1)
        alive = [i for i in range(recipe.model.n_heads) if i not in already.get(site, [])]
        original.append(f"{site}:{alive[int(h)]}")
    pruned_cfg = dataclasses.replace(recipe.model, pruned_heads=sorted(set(recipe.model.pruned_heads) | set(original)))
    name = checkpoint or recipe.eval.checkpoint  # the pruned run's only checkpoint, and its eval default
    pruned_eval = dataclasses.replace(recipe.eval, checkpoint=name)
    pruned_recipe = dataclasses.replace(recipe, model=pruned_cfg, eval=pruned_eval)
    problems = pruned_cfg.problems()
    if problems:
        raise RunError(problems[0])
    model = subject.model
    pruned = copy.deepcopy(model)
    for site, hs in heads_by_site(entries).items():
        gate = None if rule is None else rule(site, sites[site].n_heads, hs)
        attention_modules(pruned)[site].prune_heads(hs, None if fill is None else fill[site], gate)
    smaller = subject.task.build_model(init=False, model_config=pruned_cfg)  # what `xformer eval` will build
    smaller.load_state_dict(pruned.state_dict())
    target.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target / "recipe.toml", pruned_recipe.to_toml())
    shutil.copytree(run_dir / "tokenizer", target / "tokenizer", dirs_exist_ok=True)
    mark_run_dir(target)
    source = run_checkpoint(run_dir, name)
    save_checkpoint(target / "checkpoints" / f"{name}.safetensors", smaller,
                    meta={"pruned_from": str(source), "tokenizer": tokenizer_digest(target)})
    # speed: the held-out measure with the pruned model in place of the full one
    subject.model = smaller.to(subject.rt.device).eval()
    started = time.perf_counter()
    metric = subject.score(pruning["metric"], held_out)
    seconds = time.perf_counter() - started
    subject.model = model
    return {"path": str(target), "pruned_heads": pruned_cfg.pruned_heads, "kept_to_keep_sites_alive": kept,
            "parameters": count_parameters(smaller)["total"], "parameters_before": count_parameters(model)["total"],
            "metric": metric, "seconds": seconds, "seconds_before": pruning["seconds_per_measure"]}


def _criteria() -> dict:
    return {"positional": f"argmax on one relative offset (-1, 0, +1) for >= {stats.POSITIONAL_MIN:.0%} of queries",
            "rare-word": f"argmax on the sentence's rarest token (training-corpus counts) at >= "
                         f"{stats.RARE_MIN_RATIO:g}x the uniform chance rate and >= "
                         f"{stats.RARE_MIN_RATE:.0%} of queries",
            "special": f">= {stats.SPECIAL_MIN:.0%} of attention mass on BOS/EOS/CLS",
            "memory": f">= {stats.MEMORY_MIN:.0%} of attention mass on the memory slots (model.memory_tokens); "
                      "the other statistics of such heads read their token probabilities renormalised",
            "similarity": f"Jensen-Shannon (base 2) between heads of one space; average-linkage clusters "
                          f"below {stats.CLUSTER_MAX_JS}",
            "importance": "ablation: metric change with the head's output replaced by zero or by its mean output, "
                          "or by its mean output with the site's other heads rescaled by least squares to "
                          "reconstruct the site's output (Kwon et al. 2022's mask tuning in closed form), "
                          "or by zero with the site's other heads scaled by H / kept (DropHead's training view) "
                          "(ablate; larger = more important); gradient: "
                          "Michel et al. 2019 |dL/dgate| summed over batches, L2-normalised per layer; "
                          "confidence: mean max weight (Voita et al. 2019)"}


def _syntactic_note() -> str:
    if importlib.util.find_spec("spacy") is None:
        return "skipped: no dependency parser installed (pip install spacy and a model for the source language)"
    return "skipped: spaCy is installed but syntactic-head scoring is not implemented yet"


