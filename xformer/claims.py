"""A claim about Transformers and the rule that turns an experiment's numbers into a verdict.

A spec in recipes/claims/ carries, beside its [experiment], the claim it tests:

    [claim]
    number = 5
    says = "GELU adds 0.5-1% over ReLU; SwiGLU beats both at equal parameters."
    scale = "a 7.6M-parameter Multi30k model at 250 steps; the claim is about WMT-sized models"

    [[claim.checks]]            # what the claim predicts, one comparison each
    cell = "gelu"
    expect = "better"           # than `than` (default: the baseline cell)
    percent = 0.5               # by at least this share of `than`'s score (or `points`)

A claim xformer cannot measure yet has a [claim] table with `blocked` (what is missing) and no
[experiment].

A check is judged on the per-seed differences d_i = cell - than on the test metric and, where
`than` is the baseline, on each seed's paired test (sacreBLEU's bootstrap or McNemar). A check
with `metric = "decode_speed"` or `"train_speed"` compares the runs' timed speeds instead (a
claimed "3x faster" is `percent = 200`), with no significance test, and is inconclusive when a run
behind it was timed while other processes took more than BUSY_OVER cores (xformer.cpuload);
`metric = "decode_memory"` compares the decoder's KV cache at its largest, where "better" and
"worse" read as larger and smaller (a cache cut h-fold by 4 heads is `worse`, `percent = 75`):

    better / worse   supported    every seed in the claimed direction, significant where tested,
                                  and the mean at least the claimed margin (and at most `up_to`)
                     contradicted every seed the other way, significant where tested; or every
                                  seed short of the claimed margin, and the mean short of it by
                                  more than twice its standard error; or every seed beyond
                                  `up_to`, significant where tested (a larger gap than claimed)
    not_better       supported    no seed significantly better and the mean not above zero
                     contradicted every seed better, significant where tested
    not_worse        supported    every seed above `than` less the margin (a tolerated loss)
                     contradicted every seed below it, significant where tested
    same             supported    every seed within the tolerance
                     contradicted every seed outside it on one side, significant where tested
    otherwise        inconclusive (the seeds disagree, or the gap is inside the noise)

A claim is what its checks say when they agree, and "depends" when some are supported and
others contradicted (the ledger names which).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal

from xformer.cpuload import BUSY_OVER, busy
from xformer.experiment_report import OTHERS
from xformer.significance import SIGNIFICANT
from xformer.strict import did_you_mean, section_from_dict

Expect = Literal["better", "worse", "not_better", "not_worse", "same"]
Metric = Literal["test", "train_speed", "decode_speed", "decode_memory"]
METRIC_KEYS = {"test": "test", "train_speed": "train_steps_per_s", "decode_speed": "decode_per_s",
               "decode_memory": "decode_cache_mb"}  # in results.json
SIZES = ("decode_memory",)  # where better / worse mean larger / smaller
# the CPU cores other processes took while a speed was timed: the experiment rows' own keys
OTHERS_KEYS = {metric: OTHERS[key] for metric, key in METRIC_KEYS.items() if key in OTHERS}


@dataclass
class Check:
    cell: str = ""
    expect: Expect = "better"
    than: str = ""  # "" is the experiment's baseline cell
    percent: float = 0.0  # the claimed margin (better / worse) or tolerance (same), in % of `than`
    points: float = 0.0  # the same in the metric's own units (BLEU points, accuracy points)
    up_to: float = 0.0  # better / worse: the claimed gap's upper end, in the unit of percent or points; 0: none
    metric: Metric = "test"  # the test score, or a speed: training steps a second, test sentences decoded
    # (or test examples classified) a second


@dataclass
class Claim:
    number: int = 0
    says: str = ""  # the claim as it circulates
    source: str = ""  # where the wording comes from, when it has one
    scale: str = ""  # why this measurement may not transfer (model size, budget, data)
    blocked: str = ""  # what xformer lacks to measure it; "" when the spec has an [experiment]


@dataclass
class Outcome:
    """One check judged: its verdict and the numbers behind it, in words."""

    check: Check
    verdict: Literal["supported", "contradicted", "inconclusive"]
    reason: str


def claim_from_table(table: dict, cells: list[str] | None, where: str,
                     baseline: str = "") -> tuple[Claim, list[Check], list[str]]:
    """The [claim] table, its checks, and every problem found (`cells` None: no [experiment];
    `baseline`: the experiment's baseline cell)."""
    problems: list[str] = []
    table = dict(table)
    raws = table.pop("checks", [])
    if not isinstance(raws, list):
        problems.append(f"claim.checks: expected [[claim.checks]] tables, found {raws!r}")
        raws = []
    claim, typed = section_from_dict(Claim, "claim", table, problems)
    checks = []
    if typed:
        if claim.number <= 0:
            problems.append(f"claim.number: expected the claim's positive number in the ledger, found {claim.number}")
        if not claim.says.strip():
            problems.append("claim.says: expected the claim as it circulates, found nothing")
        if cells is None and not claim.blocked:
            problems.append("claim.blocked: a claim without an [experiment] must say what xformer lacks to measure it")
        if cells is not None and claim.blocked:
            problems.append("claim.blocked: this spec has an [experiment]; remove blocked")
        if cells is not None and not raws:
            problems.append("claim.checks: expected at least one [[claim.checks]] comparison of two cells")
        for i, raw in enumerate(raws):
            name = f"claim.checks[{i}]"
            if not isinstance(raw, dict):
                problems.append(f"{name}: expected a table (cell, expect, than, percent or points), found {raw!r}")
                continue
            check, ok = section_from_dict(Check, name, raw, problems)
            if ok:
                problems += _check_problems(check, cells or [], name)
                if check.cell == (check.than or baseline):
                    problems.append(f"{name}: compares {check.cell!r} with itself; name another cell in `than`")
            checks.append(check)
    return claim, checks, [f"{where}: {p}" for p in problems]


def _check_problems(check: Check, cells: list[str], name: str) -> list[str]:
    out = []
    for key in ("cell", "than"):
        value = getattr(check, key)
        if (value or key == "cell") and value not in cells:
            out.append(f"{name}.{key}: expected one of the cells ({', '.join(cells)}), found {value!r}"
                       f"{did_you_mean(value, cells)}")
    if check.percent < 0 or check.points < 0:
        out.append(f"{name}: expected a margin of zero or more, found percent {check.percent:g}, "
                   f"points {check.points:g}")
    if check.percent and check.points:
        out.append(f"{name}: expected percent or points, not both")
    if check.expect == "same" and not (check.percent or check.points):
        out.append(f"{name}.percent: 'same' needs a tolerance (percent or points)")
    if check.expect == "not_better" and (check.percent or check.points):
        out.append(f"{name}: 'not_better' takes no margin")
    if check.up_to:
        if check.expect not in ("better", "worse") or not (check.percent or check.points):
            out.append(f"{name}.up_to: the upper end of a claimed gap: for 'better' or 'worse' with percent or points")
        elif check.up_to < (check.percent or check.points):
            out.append(f"{name}.up_to: expected at least the margin {check.percent or check.points:g}, "
                       f"found {check.up_to:g}")
    return out


def judge(check: Check, results: dict) -> Outcome:
    """Judge one check against an experiment's results.json (xformer.experiment)."""
    than = check.than or results["baseline"]
    scores = {(r["cell"], r["seed"]): r.get(METRIC_KEYS[check.metric]) for r in results["runs"]}
    seeds = results["seeds"]
    if any(scores[(c, s)] is None for c in (check.cell, than) for s in seeds):
        how = "measured" if check.metric in SIZES else "timed"
        return Outcome(check, "inconclusive", f"{check.metric.replace('_', ' ')} was not {how} in these runs")
    if check.metric in OTHERS_KEYS:
        crowded = [f"{r['cell']}-s{r['seed']} ({r[OTHERS_KEYS[check.metric]]:.2f} cores)" for r in results["runs"]
                   if r["cell"] in (check.cell, than) and busy(r.get(OTHERS_KEYS[check.metric]))]
        if crowded:
            return Outcome(check, "inconclusive", f"{check.metric.replace('_', ' ')} was timed while other processes "
                                                  f"took more than {BUSY_OVER:g} CPU cores: {', '.join(crowded)}; "
                                                  "rerun those runs alone")
    diffs = [scores[(check.cell, s)] - scores[(than, s)] for s in seeds]
    base = statistics.fmean(scores[(than, s)] for s in seeds)
    margin = check.points or base * check.percent / 100
    upper = (base * check.up_to / 100 if check.percent else check.up_to) if check.up_to else math.inf
    claimed = claimed_gap(check)
    timed = check.metric != "test"
    p_values = _p_values(results, check.cell) if than == results["baseline"] and not timed else None
    tested = (f" (paired p {', '.join(f'{p:.3f}' for p in p_values)})" if p_values is not None
              else f" ({'measured' if check.metric in SIZES else 'timed'}; no significance test)" if timed
              else " (no paired test: neither cell is the baseline)" if than != results["baseline"] else "")
    significant = p_values is None or all(p < SIGNIFICANT for p in p_values)
    shown = ", ".join(_relative(d, base) for d in diffs)
    said = f"{check.cell} - {than}{'' if not timed else ' ' + METRIC_KEYS[check.metric]} per seed: {shown}{tested}"
    mean = statistics.fmean(diffs)

    def out(verdict, why):
        return Outcome(check, verdict, f"{said}; {_in_words(check, why)}")

    if check.expect in ("better", "worse"):
        sign = 1 if check.expect == "better" else -1
        toward = [sign * d for d in diffs]
        other = "worse" if check.expect == "better" else "better"
        if all(t > 0 for t in toward) and significant and margin <= sign * mean <= upper:
            if not margin:
                return out("supported", f"{check.expect} in every seed")
            measured = f"{100 * sign * mean / base:.1f}%" if check.percent else f"{sign * mean:.2f}"
            return out("supported", f"{check.expect} in every seed, by {measured} on average (claimed {claimed})")
        if all(t > upper for t in toward) and significant:
            return out("contradicted", f"{check.expect} in every seed, but by more than the claimed {claimed}")
        if all(t < 0 for t in toward) and significant:
            return out("contradicted", f"{other} in every seed, not {check.expect}")
        if margin and all(t < margin for t in toward) and sign * mean + 2 * _stderr(diffs) < margin:
            return out("contradicted", f"short of the claimed {claimed} in every seed, and by more than twice "
                                       "the standard error of the mean difference")
        return out("inconclusive", "the seeds disagree or the gap is within the noise")
    if check.expect == "not_better":
        better = [d > 0 and (p_values is None or p_values[i] < SIGNIFICANT) for i, d in enumerate(diffs)]
        if all(better):
            return out("contradicted", "better in every seed")
        if not any(better) and mean <= 0:
            return out("supported", "not better in any seed")
        return out("inconclusive", "the seeds disagree or the gap is within the noise")
    if check.expect == "not_worse":
        if all(d >= -margin for d in diffs):
            below = f"{claimed} below " if margin else ""
            return out("supported", f"no worse than {below}{than} in every seed")
        if significant and all(d < -margin for d in diffs):
            return out("contradicted", f"more than {claimed} below {than} in every seed" if margin
                       else f"below {than} in every seed")
        return out("inconclusive", "the seeds disagree or the gap is within the noise")
    # same, within a tolerance
    if all(abs(d) <= margin for d in diffs):
        return out("supported", f"within {claimed} in every seed")
    if significant and (all(d < -margin for d in diffs) or all(d > margin for d in diffs)):
        return out("contradicted", f"more than {claimed} apart in every seed")
    return out("inconclusive", f"not within {claimed} in every seed, nor consistently outside it")


def _in_words(check: Check, text: str) -> str:
    """A size (memory) is larger or smaller, not better or worse."""
    if check.metric not in SIZES:
        return text
    return text.replace("better", "larger").replace("worse", "smaller")


def claimed_gap(check: Check) -> str:
    """The check's margin in words: "0.5%", "1", "15% to 20%"; "0" without one."""
    unit = "%" if check.percent else ""
    text = f"{check.percent or check.points:g}{unit}"
    return text + (f" to {check.up_to:g}{unit}" if check.up_to else "")


def describe(check: Check, baseline: str) -> str:
    """What the check says, e.g. "gelu better than relu by 0.5% to 1%"."""
    speed = "" if check.metric == "test" else f" in {check.metric.replace('_', ' ')}"
    words = f"{check.cell}{speed} {_in_words(check, check.expect.replace('_', ' '))} than {check.than or baseline}"
    if not (check.percent or check.points):
        return words
    how = {"same": "within", "not_worse": "allowing"}.get(check.expect, "by")
    return f"{words} {how} {claimed_gap(check)}"


def verdict(outcomes: list[Outcome]) -> str:
    """The claim's verdict: its checks' when they agree; "depends" when some are supported and
    some contradicted; contradicted when some are contradicted and the rest inconclusive (a
    claim's parts hold together: "faster at under 1% loss" is false when the loss is 5%);
    inconclusive otherwise."""
    found = {o.verdict for o in outcomes}
    if len(found) == 1:
        return found.pop()
    if {"supported", "contradicted"} <= found:
        return "depends"
    return "contradicted" if "contradicted" in found else "inconclusive"


def _p_values(results: dict, cell: str) -> list[float] | None:
    entry = next(c for c in results["cells"] if c["cell"] == cell)
    if "paired" not in entry:  # the baseline against itself
        return None
    return [p["p_value"] for p in entry["paired"]]


def _stderr(values: list[float]) -> float:
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("inf")


def _relative(d: float, base: float) -> str:
    return f"{d:+.2f} ({100 * d / base:+.1f}%)" if base else f"{d:+.2f}"
