"""Per-head attention statistics, streamed over batches, and the head roles they imply.

Probabilities are captured from the explicit attention path (`MultiHeadAttention.probe`)
one batch at a time, folded into running sums (SiteStats) and dropped: memory stays one batch
of maps however many examples are inspected. Only the maps of a few chosen examples are kept,
for plotting.

Role criteria (also written into heads.json):
- positional (Voita et al. 2019, arXiv:1905.09418, section 4.1): the head's argmax lands on
  one fixed relative offset (-1, 0 or +1) for at least POSITIONAL_MIN (90%) of query tokens;
- rare-word (Voita et al. 2019, section 4.3): the argmax lands on the sentence's rarest token
  (fewest occurrences in the training corpus; specials excluded) at least RARE_MIN_RATIO (3x)
  as often as a uniformly random choice among the keys would, and for at least RARE_MIN_RATE
  (25%) of queries; measured where every key is visible (encoder self- and cross-attention);
- no-op / special (Clark et al. 2019, arXiv:1906.04341): at least SPECIAL_MIN (50%) of the
  mass on special tokens (BOS/EOS, the classifier's CLS slot) on average;
- memory: with memory slots (model.memory_tokens), at least MEMORY_MIN (50%) of the mass on
  the slots on average (the slots act as a no-op sink); every other statistic of such a site
  reads the token probabilities renormalised, and each head reports its mean `memory` share.
Similarity: Jensen-Shannon divergence (base 2, in [0, 1]) between two heads' distributions at
the same query, averaged over queries, for heads reading the same query x key space; clusters
by average linkage, merged while the mean divergence stays below CLUSTER_MAX_JS.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from xformer.tasks.base import SiteTokens, Subject, site_space

POSITIONAL_MIN = 0.90
OFFSETS = (-1, 0, 1)
RARE_MIN_RATIO = 3.0
RARE_MIN_RATE = 0.25
SPECIAL_MIN = 0.50
MEMORY_MIN = 0.50
CLUSTER_MAX_JS = 0.3
LN2 = float(np.log(2.0))


@contextmanager
def capture(sites: dict):
    """Within the block, every forward of the attention modules `sites` (name -> module) runs
    the explicit path and leaves its probabilities (B, H, T, S) over the tokens in the first
    yielded dict, the heads' outputs (B, T, H * Dh), the input of out_proj, in the second and,
    for a site with memory slots, each query's share of attention on the slots (B, H, T) in the
    third; its token probabilities are then renormalised (given that the head reads tokens)."""
    maps: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    memory: dict[str, torch.Tensor] = {}

    def keeper(name):
        slots = sites[name].mem_k.size(1) if sites[name].mem_k is not None else 0

        def keep(probs):
            probs = probs.detach().float()
            if slots:
                memory[name] = probs[..., :slots].sum(-1)
                probs = probs[..., slots:]
                probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-12)
            maps[name] = probs
        return keep

    def output_keeper(name):
        def keep(module, args):
            outputs[name] = args[0].detach().float()
        return keep

    hooks = []
    for name, module in sites.items():
        module.probe(keeper(name))
        hooks.append(module.out_proj.register_forward_pre_hook(output_keeper(name)))
    try:
        yield maps, outputs, memory
    finally:
        for module in sites.values():
            module.probe(None)
        for hook in hooks:
            hook.remove()


class SiteStats:
    """Running sums over the real queries of one attention site, per head."""

    def __init__(self, n_heads: int, space: str):
        self.space = space
        self.queries = 0
        self.sums = {name: torch.zeros(n_heads, dtype=torch.float64) for name in
                     ("entropy", "confidence", "special", "punct", "distance")}
        self.memory: torch.Tensor | None = None  # summed share on memory slots, sites that have them
        self.offset_hits = {o: torch.zeros(n_heads, dtype=torch.float64) for o in OFFSETS}
        self.rare_hits = torch.zeros(n_heads, dtype=torch.float64)
        self.rare_chance, self.rare_queries = 0.0, 0
        self.monotonic = torch.zeros(n_heads, dtype=torch.float64)
        self.steps = 0

    def update(self, probs: torch.Tensor, tokens: SiteTokens, special: torch.Tensor, punct: torch.Tensor,
               rarest: torch.Tensor | None, memory: torch.Tensor | None = None) -> None:
        """probs: (B, H, T, S); special, punct, rarest: (B, S) booleans over keys (rarest: None
        where keys are not all visible); memory: (B, H, T) share on memory slots, or None."""
        real_q = tokens.queries.ne(-1)  # (B, T)
        real_k = tokens.keys.ne(-1)  # (B, S)
        q = real_q[:, None, :].expand(-1, probs.size(1), -1)  # (B, H, T)
        n = int(real_q.sum())
        self.queries += n

        def add(name, per_query):  # per_query: (B, H, T)
            self.sums[name] += per_query.masked_fill(~q, 0).sum((0, 2)).double()

        add("entropy", -torch.special.xlogy(probs, probs).sum(-1) / LN2)
        if memory is not None:
            share = memory.masked_fill(~q, 0).sum((0, 2)).double()
            self.memory = share if self.memory is None else self.memory + share
        top, argmax = probs.max(-1)  # (B, H, T)
        add("confidence", top)
        add("special", (probs * special[:, None, None, :]).sum(-1))
        add("punct", (probs * punct[:, None, None, :]).sum(-1))
        t, s = probs.shape[-2:]
        i = torch.arange(t, device=probs.device)[:, None]
        j = torch.arange(s, device=probs.device)[None, :]
        if self.space == "cross":  # distance from the diagonal, in fractions of each sentence
            t_len = real_q.sum(1).clamp(min=1)[:, None, None].float()
            s_len = real_k.sum(1).clamp(min=1)[:, None, None].float()
            gap = (j[None] / s_len - i[None] / t_len).abs()  # (B, T, S)
            add("distance", (probs * gap[:, None]).sum(-1))
            moves = argmax[:, :, 1:] >= argmax[:, :, :-1]  # (B, H, T-1) no step backwards
            both = (real_q[:, 1:] & real_q[:, :-1])[:, None, :]
            self.monotonic += (moves & both).sum((0, 2)).double()
            self.steps += int(both.sum())
        else:
            add("distance", (probs * (i - j).abs()).sum(-1))
            for o in OFFSETS:
                on_offset = (argmax - torch.arange(t, device=probs.device)) == o  # (B, H, T)
                self.offset_hits[o] += (on_offset & q).sum((0, 2)).double()
        if rarest is not None:
            hit = rarest.gather(1, argmax.flatten(1)).view_as(argmax)  # (B, H, T)
            self.rare_hits += (hit & q).sum((0, 2)).double()
            chance = rarest.sum(1).float() / real_k.sum(1).clamp(min=1).float()  # (B,)
            self.rare_chance += float((chance[:, None] * real_q).sum())
            self.rare_queries += n

    def summary(self) -> list[dict]:
        """One dict per head: the means and the roles they imply."""
        n = max(self.queries, 1)
        out = []
        for h in range(len(self.sums["entropy"])):
            head = {name: float(total[h] / n) for name, total in self.sums.items()}
            roles = []
            if self.memory is not None:
                head["memory"] = float(self.memory[h] / n)
                if head["memory"] >= MEMORY_MIN:
                    roles.append("memory")
            if self.space != "cross":
                rates = {o: float(self.offset_hits[o][h] / n) for o in OFFSETS}
                head["offset_rates"] = {str(o): r for o, r in rates.items()}
                best = max(rates, key=rates.get)
                if rates[best] >= POSITIONAL_MIN:
                    roles.append(f"positional{best:+d}" if best else "positional0")
            else:
                head["monotonic"] = float(self.monotonic[h] / max(self.steps, 1))
            if self.rare_queries:
                rate = float(self.rare_hits[h] / self.rare_queries)
                chance = self.rare_chance / self.rare_queries
                head["rare_rate"], head["rare_chance"] = rate, chance
                if rate >= RARE_MIN_RATE and rate >= RARE_MIN_RATIO * chance:
                    roles.append("rare-word")
            if head["special"] >= SPECIAL_MIN:
                roles.append("special")
            head["roles"] = roles
            out.append(head)
        return out


class Similarity:
    """Mean Jensen-Shannon divergence between every two heads of one space (sites in order)."""

    def __init__(self, n_heads: int):
        self.total = torch.zeros(n_heads, n_heads, dtype=torch.float64)
        self.queries = 0

    def update(self, probs: torch.Tensor, real_q: torch.Tensor) -> None:
        """probs: (B, N, T, S) every head of the space; real_q: (B, T)."""
        n = probs.size(1)
        log_p = probs.clamp(min=1e-12).log()
        for a in range(n):
            for b in range(a + 1, n):
                m = (probs[:, a] + probs[:, b]) / 2
                log_m = m.clamp(min=1e-12).log()
                kl_a = (probs[:, a] * (log_p[:, a] - log_m)).sum(-1)  # (B, T)
                kl_b = (probs[:, b] * (log_p[:, b] - log_m)).sum(-1)
                js = 0.5 * (kl_a + kl_b)
                value = float(js.masked_fill(~real_q, 0).sum()) / LN2
                self.total[a, b] += value
                self.total[b, a] += value
        self.queries += int(real_q.sum())

    def matrix(self) -> np.ndarray:
        return (self.total / max(self.queries, 1)).numpy()


def clusters(distance: np.ndarray, threshold: float = CLUSTER_MAX_JS) -> list[list[int]]:
    """Average-linkage agglomerative clusters of a symmetric distance matrix, merging the
    closest pair while their mean distance is below `threshold`."""
    groups = [[i] for i in range(len(distance))]
    while len(groups) > 1:
        best, pair = threshold, None
        for x in range(len(groups)):
            for y in range(x + 1, len(groups)):
                d = float(distance[np.ix_(groups[x], groups[y])].mean())
                if d < best:
                    best, pair = d, (x, y)
        if pair is None:
            break
        x, y = pair
        groups[x] = sorted(groups[x] + groups.pop(y))
    return groups


def collect(subject: Subject, sites: dict, keep_examples: int = 3, contributions: bool = False) -> dict:
    """Stream every batch of `subject` through the model, capturing `sites`. Returns
    {"heads": {site: [per-head dict]}, "similarity": {space: {"sites", "js", "clusters"}},
     "examples": [{"rows": example index, site: (H, T, S) map, "queries"/"keys": token strings}],
     "mean_outputs": {site: (H, Dh) mean output of each head over real queries},
     "contribution_cov": {site: (H, H) covariance of the heads' contributions to the site's output},
     only with `contributions` (what --ablate rescale needs; an extra matmul per site and batch)}.

    A head's contribution is its output through its columns of out_proj, W_h o_h (a D-vector per
    query); entry (i, j) of contribution_cov is E[(c_i - E c_i) . (c_j - E c_j)] over real queries,
    what `importance.rescaled_gate` needs to reconstruct a site from a subset of its heads."""
    stats = {site: SiteStats(module.n_heads, site_space(site)) for site, module in sites.items()}
    by_space: dict[str, list[str]] = {}
    for site in sites:
        by_space.setdefault(site_space(site), []).append(site)
    similarity = {space: Similarity(sum(sites[s].n_heads for s in names)) for space, names in by_space.items()}
    examples: list[dict] = []
    output_sums = {site: torch.zeros(m.n_heads * m.head_dim, dtype=torch.float64) for site, m in sites.items()}
    grams = {site: torch.zeros(m.n_heads, m.n_heads, dtype=torch.float64) for site, m in sites.items()}
    was_training = subject.model.training
    subject.model.eval()
    with torch.no_grad(), capture(sites) as (maps, outputs, memory):
        for batch in subject.batches:
            subject.forward(batch)
            for site, probs in maps.items():
                tokens = subject.site_tokens(site, batch)
                real_q = tokens.queries.ne(-1).to(outputs[site].device)
                real_outputs = outputs[site][real_q]  # (N, H * Dh)
                output_sums[site] += real_outputs.sum(0).double().cpu()
                if contributions:
                    grams[site] += _contribution_gram(sites[site], real_outputs)
                key_side = subject.side(site, "key")
                special, punct, rarest = _key_masks(subject, tokens.keys, key_side, site_space(site) != "decoder")
                stats[site].update(probs, tokens, special, punct, rarest, memory.get(site))
            for space, names in by_space.items():
                tokens = subject.site_tokens(names[0], batch)
                similarity[space].update(torch.cat([maps[s] for s in names], dim=1), tokens.queries.ne(-1))
            for b, row in enumerate(batch["rows"]):
                if row < keep_examples:
                    examples.append(_example(subject, batch, b, row, maps))
    subject.model.train(was_training)
    out_similarity = {}
    for space, names in by_space.items():
        js = similarity[space].matrix()
        labels = [f"{s}:{h}" for s in names for h in range(sites[s].n_heads)]
        out_similarity[space] = {"heads": labels, "js": js.round(4).tolist(),
                                 "clusters": [[labels[i] for i in group] for group in clusters(js)]}
    means = {site: (output_sums[site] / max(stats[site].queries, 1)).float().view(m.n_heads, m.head_dim)
             for site, m in sites.items()}
    out = {"heads": {site: stats[site].summary() for site in sites}, "similarity": out_similarity,
           "examples": sorted(examples, key=lambda e: e["row"]), "mean_outputs": means}
    if contributions:
        out["contribution_cov"] = {}
        for site, m in sites.items():
            mean_contribution = _contributions(m, means[site].reshape(1, -1).double())[0]  # (H, D)
            n = max(stats[site].queries, 1)
            out["contribution_cov"][site] = (grams[site] / n - mean_contribution @ mean_contribution.T).float()
    return out


def _contributions(module, outputs: torch.Tensor) -> torch.Tensor:
    """(N, H * Dh) head outputs -> (N, H, D) contributions W_h o_h to the site's output (float64, CPU)."""
    weight = module.out_proj.weight.detach().double().cpu().view(-1, module.n_heads, module.head_dim)  # (D, H, Dh)
    per_head = outputs.double().cpu().view(-1, module.n_heads, module.head_dim)  # (N, H, Dh)
    return torch.einsum("nhk,dhk->nhd", per_head, weight)


def _contribution_gram(module, outputs: torch.Tensor) -> torch.Tensor:
    """Sum over the N queries of c_i . c_j: (H, H)."""
    c = _contributions(module, outputs)
    return torch.einsum("nhd,ngd->hg", c, c)


def _key_masks(subject: Subject, keys: torch.Tensor, side: str, all_visible: bool):
    """(special, punct, rarest) booleans (B, S) over the keys of one site."""
    special = keys.eq(-2)
    for i in subject.special_ids:
        special |= keys.eq(i)
    ids = keys.clamp(min=0).cpu()
    punct = torch.from_numpy(subject.punct[side])[ids] & keys.ge(0).cpu()
    rarest = None
    if all_visible:
        freq = torch.from_numpy(subject.frequency[side]).double()[ids]  # (B, S)
        candidate = keys.ge(0).cpu() & ~special.cpu()
        freq = freq.masked_fill(~candidate, float("inf"))
        rarest = freq.eq(freq.min(1, keepdim=True).values) & candidate
    return special.to(keys.device), punct.to(keys.device), None if rarest is None else rarest.to(keys.device)


def _example(subject: Subject, batch: dict, b: int, row: int, maps: dict) -> dict:
    out = {"row": int(row), "maps": {}, "tokens": {}}
    for site, probs in maps.items():
        tokens = subject.site_tokens(site, batch)
        q_real, k_real = tokens.queries[b].ne(-1), tokens.keys[b].ne(-1)
        out["maps"][site] = probs[b][:, q_real][:, :, k_real].cpu().numpy()
        for role, ids, side in (("queries", tokens.queries[b][q_real], subject.side(site, "query")),
                                ("keys", tokens.keys[b][k_real], subject.side(site, "key"))):
            texts = subject.token_text[side]
            out["tokens"][f"{site_space(site)}.{role}"] = ["[CLS]" if i == -2 else texts[i] for i in ids.tolist()]
    return out
