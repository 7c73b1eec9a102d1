"""How much each attention head matters, three ways, and what removing heads costs.

- ablation: mask one head (gate 0 on its output; or its mean output; or its mean output with the
  site's other heads rescaled by least squares, `least_squares`; or zero with the site's other
  heads scaled by H / kept, `renormalised`, as DropHead trains them), re-measure the metric;
  importance is how much worse it gets (loss up, or BLEU / accuracy down);
- gradient (Michel et al. 2019, arXiv:1905.10650, section 4.1): I_h = sum over batches of
  |dL/d xi_h| with gates xi = 1 on every head's output, then divided by the L2 norm of the
  importances of the same layer (their per-layer normalisation);
- confidence (Voita et al. 2019): the mean of the head's largest attention weight.
Rankings are compared by Spearman's rank correlation.

Pruning removes heads in order of increasing importance by masking them, in steps, and
re-measures; `heads_to_config` turns a masked set into ModelConfig.pruned_heads so that
build_model removes the heads physically (MultiHeadAttention.prune_heads).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import numpy as np
import torch

from xformer.config.sites import heads_by_site
from xformer.tasks.base import Subject

Head = tuple[str, int]  # (site, head index)
# What the surviving heads of a site are multiplied by when some go: (site, H, removed) -> (H,)
# gate, 0 on the removed heads. None everywhere below means keep_gate (survivors unchanged).
GateRule = Callable[[str, int, list[int]], torch.Tensor]


@contextmanager
def masked(sites: dict, heads: list[Head], fill: dict | None = None, rule: GateRule | None = None):
    """Within the block the given heads are ablated: their output is zero, or with `fill`
    (site -> (H, Dh) mean outputs) their mean output (mean-ablation). With a gate `rule`
    (`least_squares`, `renormalised`) the surviving heads of each touched site are also scaled
    to stand in for the removed ones."""
    removed: dict[str, list[int]] = {}
    for site, h in heads:
        removed.setdefault(site, []).append(h)
    for site, hs in removed.items():
        module = sites[site]
        device = module.q_proj.weight.device
        gate = keep_gate(module.n_heads, hs) if rule is None else rule(site, module.n_heads, hs)
        module.gate(gate.to(device), None if fill is None else fill[site].to(device))
    try:
        yield
    finally:
        for site in removed:
            sites[site].gate(None)


def keep_gate(n_heads: int, removed: list[int]) -> torch.Tensor:
    """(H,) ones, with 0 on the removed heads."""
    gate = torch.ones(n_heads)
    gate[list(removed)] = 0.0
    return gate


def least_squares(cov: dict[str, torch.Tensor]) -> GateRule:
    """The rule that rescales survivors by `rescaled_gate` from each site's contribution
    covariance (site -> (H, H), stats.collect)."""
    return lambda site, n_heads, removed: rescaled_gate(cov[site], removed)


def renormalised(site: str, n_heads: int, removed: list[int]) -> torch.Tensor:
    """Gate H / kept on the survivors, 0 on the removed: what a model trained with DropHead
    (model.head_dropout, MultiHeadAttention) saw whenever it lost these heads."""
    gate = keep_gate(n_heads, removed)
    return gate * (n_heads / max(float(gate.sum()), 1.0))


def rescaled_gate(cov: torch.Tensor, removed: list[int], ridge: float = 1e-6) -> torch.Tensor:
    """Gate (H,) that rebuilds a site from its surviving heads K after removing R: 0 on R, and on K
    the scales s minimising E||sum_h c_h - (sum_K s_k c_k + b)||^2 over s and a constant b, where
    c_h is head h's contribution to the site's output and cov their covariance (stats.collect):
    s_K = 1 + (C_KK)^-1 C_KR 1, a closed-form version of the layer-wise "mask tuning" of Kwon et
    al. 2022 (arXiv:2204.09656), with no gradient step. The best constant b is what
    mean-ablation's fill supplies: sum_R mu_r + sum_K (1 - s_k) mu_k (MultiHeadAttention.forward).
    `ridge` (relative to the mean variance of K) keeps C_KK invertible when heads are collinear."""
    n = cov.size(0)
    drop = sorted(set(removed))
    keep = [h for h in range(n) if h not in drop]
    gate = torch.zeros(n, dtype=torch.float64)
    if keep:
        c = cov.double()
        c_kk = c[keep][:, keep]
        c_kk = c_kk + ridge * max(float(c_kk.diagonal().mean()), 1e-12) * torch.eye(len(keep), dtype=torch.float64)
        target = c[keep][:, drop].sum(1) if drop else torch.zeros(len(keep), dtype=torch.float64)
        gate[keep] = 1.0 + torch.linalg.solve(c_kk, target)
    return gate.float()


def ablation(subject: Subject, sites: dict, metric: str, fill: dict | None = None, rule: GateRule | None = None,
             on_head: Callable[[int, int], None] | None = None) -> tuple[float, dict[str, list[float]]]:
    """The metric with every head, and per site the change when each head alone is ablated
    (see `masked`), signed so that larger = more important."""
    sign = 1.0 if metric == "loss" else -1.0
    base = subject.score(metric)
    total = sum(m.n_heads for m in sites.values())
    done, out = 0, {}
    for site, module in sites.items():
        deltas = []
        for h in range(module.n_heads):
            with masked(sites, [(site, h)], fill, rule):
                deltas.append(sign * (subject.score(metric) - base))
            done += 1
            if on_head:
                on_head(done, total)
        out[site] = deltas
    return base, out


def group_ablation(subject: Subject, sites: dict, metric: str, fill: dict | None = None,
                   rule: GateRule | None = None) -> dict[str, list[float]]:
    """For GQA/MQA sites: the change when all query heads of one key/value group are masked."""
    sign = 1.0 if metric == "loss" else -1.0
    base = subject.score(metric)
    out = {}
    for site, module in sites.items():
        if module.n_kv_heads == module.n_heads:
            continue
        group = module.n_heads // module.n_kv_heads
        deltas = []
        for g in range(module.n_kv_heads):
            with masked(sites, [(site, h) for h in range(g * group, (g + 1) * group)], fill, rule):
                deltas.append(sign * (subject.score(metric) - base))
        out[site] = deltas
    return out


def gate_gradients(subject: Subject, sites: dict) -> dict[str, list[float]]:
    """Sum over batches of |dL/d gate| per head (L: the batch's mean loss), before normalisation."""
    model = subject.model
    was_training = model.training
    model.eval()  # no dropout: the importance of the deterministic model
    for p in model.parameters():
        p.requires_grad_(False)
    gates = {site: torch.ones(m.n_heads, device=m.q_proj.weight.device, requires_grad=True)
             for site, m in sites.items()}
    totals = {site: torch.zeros(m.n_heads, dtype=torch.float64) for site, m in sites.items()}
    try:
        for site, module in sites.items():
            module.gate(gates[site])
        for batch in subject.batches:
            loss, n = subject.loss_sum(batch)
            grads = torch.autograd.grad(loss / max(n, 1), list(gates.values()))
            for site, g in zip(gates, grads, strict=True):
                totals[site] += g.detach().abs().double().cpu()
    finally:
        for module in sites.values():
            module.gate(None)
        for p in model.parameters():
            p.requires_grad_(True)
        model.train(was_training)
    return {site: t.tolist() for site, t in totals.items()}


def normalise_per_layer(values: dict[str, list[float]]) -> dict[str, list[float]]:
    """Michel et al.: divide each layer's (site's) importances by their L2 norm."""
    out = {}
    for site, v in values.items():
        norm = float(np.linalg.norm(v))
        out[site] = [x / norm if norm > 0 else 0.0 for x in v]
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their average rank)."""
    ra, rb = _ranks(np.asarray(a, dtype=float)), _ranks(np.asarray(b, dtype=float))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    for value in np.unique(x):  # average rank within ties
        tie = x == value
        ranks[tie] = ranks[tie].mean()
    return ranks


def flatten(values: dict[str, list[float]]) -> list[tuple[Head, float]]:
    return [((site, h), v) for site, vs in values.items() for h, v in enumerate(vs)]


def one_shot_order(importance: dict[str, list[float]]) -> list[Head]:
    """Heads in order of increasing importance, as measured once with every other head present."""
    return [head for head, _ in sorted(flatten(importance), key=lambda item: item[1])]


def greedy_order(subject: Subject, sites: dict, candidates: list[Head], metric: str, sizes: list[int],
                 fill: dict | None = None, rule: GateRule | None = None,
                 on_round: Callable[[int, int], None] | None = None) -> list[Head]:
    """Removal order found greedily: in round r, with the heads removed so far still ablated,
    every remaining candidate is ablated in turn and the sizes[r] whose removal hurts `metric`
    least go next. Re-ranking after each round accounts for heads that stand in for each other
    (which one-shot ablation, with every other head present, cannot see)."""
    sign = 1.0 if metric == "loss" else -1.0
    order: list[Head] = []
    remaining = list(candidates)
    for r, size in enumerate(sizes):
        costs = []
        for head in remaining:
            with masked(sites, order + [head], fill, rule):
                costs.append(sign * subject.score(metric))
        ranked = [head for _, head in sorted(zip(costs, remaining, strict=True), key=lambda pair: pair[0])]
        order += ranked[:size]
        remaining = ranked[size:]
        if on_round:
            on_round(r + 1, len(sizes))
    return order + remaining


def prune_curve(sites: dict, order: list[Head], measure: Callable[[], float], fractions: list[float],
                fill: dict | None = None, rule: GateRule | None = None,
                on_step: Callable[[int, int], None] | None = None) -> list[dict]:
    """Ablate the first round(fraction * len(order)) heads of `order` at each fraction and
    measure. Returns [{"fraction", "pruned", "heads", "metric"}]."""
    points = []
    for i, fraction in enumerate(fractions):
        heads = order[:round(fraction * len(order))]
        with masked(sites, heads, fill, rule):
            value = measure()
        points.append({"fraction": fraction, "pruned": len(heads), "heads": [f"{s}:{h}" for s, h in heads],
                       "metric": value})
        if on_step:
            on_step(i + 1, len(fractions))
    return points


def round_sizes(n: int, fractions: list[float]) -> list[int]:
    """How many heads each greedy round removes so that the prefixes land on the curve's points."""
    counts = [round(f * n) for f in fractions]
    return [b - a for a, b in zip([0] + counts[:-1], counts, strict=True) if b > a]


def heads_to_config(heads: list[str], sites: dict, importance: dict[str, list[float]]) -> tuple[list[str], list[str]]:
    """ModelConfig.pruned_heads for masking `heads` ("site:head"), keeping the most important
    head of a site that would otherwise lose them all. Returns (entries, sites kept alive)."""
    entries, kept = [], []
    for site, hs in heads_by_site(heads).items():
        if len(hs) >= sites[site].n_heads:
            keep = int(np.argmax(importance[site]))
            hs = [h for h in hs if h != keep]
            kept.append(f"{site}:{keep}")
        entries += [f"{site}:{h}" for h in sorted(hs)]
    return entries, kept
