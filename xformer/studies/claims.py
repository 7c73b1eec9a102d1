"""The rule that turns an experiment's numbers into a claim's verdict (the [claim] table a spec
carries, its checks and preconditions: xformer.studies.claim_spec).

A check is judged on the seed-paired differences d_i = cell - than (the same seed's runs) of the
test metric, by their mean and its 95% t-interval across seeds: training noise, the spread from
seed to seed. Each seed's paired test on the test set (sacreBLEU's bootstrap or McNemar), test-set
noise, is shown beside it, not decided on. The interval's half-width is the smallest difference
the design can detect. A check with `metric = "decode_speed"` or `"train_speed"` compares the
runs' timed speeds instead (a claimed "3x faster" is `percent = 200`), and is inconclusive when a
run behind it was timed while other processes took more than BUSY_OVER cores
(xformer.training.cpuload); `metric = "decode_memory"` compares the decoder's KV cache at its largest,
where "better" and "worse" read as larger and smaller (a cache cut h-fold by 4 heads is `worse`,
`percent = 75`). With M the claimed margin or tolerance:

    better / worse   supported    the interval excludes 0 on the claimed side, and the mean is
                                  at least M (and at most `up_to`)
                     contradicted the whole interval on the other side of 0, or reaching 0 at
                                  most (every seed's difference exactly 0: a count that
                                  stayed put); or below M; or beyond `up_to` (a larger gap
                                  than claimed)
    not_better       supported    the mean at most 0 (the interval then holds 0 or less)
                     contradicted the interval above 0
    not_worse        supported    the whole interval above -M (a tolerated loss)
                     contradicted the whole interval below -M
    same             supported    the whole interval within [-M, M]
                     contradicted the whole interval outside it, on one side
    otherwise        inconclusive (the interval holds 0 or the margin: the seeds cannot tell)

A claim is what its checks say when they agree, and "depends" when some are supported and
others contradicted (the ledger names which).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Literal

from xformer.studies.claim_spec import METRIC_KEYS, Check, Claim, Precondition
from xformer.studies.experiment_report import OTHERS
from xformer.training.cpuload import BUSY_OVER, busy

SIZES = ("decode_memory",)  # where better / worse mean larger / smaller
# the CPU cores other processes took while a speed was timed: the experiment rows' own keys
OTHERS_KEYS = {metric: OTHERS[key] for metric, key in METRIC_KEYS.items() if key in OTHERS}


@dataclass
class Outcome:
    """One check judged: its verdict and the numbers behind it, in words."""

    check: Check
    verdict: Literal["supported", "contradicted", "inconclusive"]
    reason: str


def judge(check: Check, results: dict, reference: float = 0.0) -> Outcome:
    """Judge one check against an experiment's results.json (xformer.studies.experiment): on the
    seed-paired mean difference and its 95% t-interval across seeds (module docstring). With the
    scale's `reference` score, a check across lengths first asks that the cells it reads learned
    the task at the training length (unlearned)."""
    than = check.cell if check.than_init else check.than or results["baseline"]
    if reference and (check.length or check.than_length) and (why := unlearned((check.cell, than), results, reference)):
        return Outcome(check, "inconclusive", why)
    paired = _paired(check, results, than)
    if isinstance(paired, str):
        return Outcome(check, "inconclusive", paired)
    mine, theirs = paired
    diffs = [m - t for m, t in zip(mine, theirs, strict=True)]
    base = statistics.fmean(theirs)
    mean, half = statistics.fmean(diffs), half_width(diffs)
    said = _said(check, results, than, diffs, base, mean, half)
    verdict, why = _verdict(check, than, base, mean, mean - half, mean + half)
    return Outcome(check, verdict, f"{said}; {_in_words(check, why)}")


def _paired(check: Check, results: dict, than: str) -> tuple[list, list] | str:
    """The check's cell and what it is compared with (itself at another length, or at
    initialisation, it may be), seed by seed; or why they cannot be compared."""
    mine, theirs = (_scores(results, check.metric, length) for length in (check.length, check.than_length))
    if check.than_init:
        theirs = {(r["cell"], r["seed"]): r.get(METRIC_KEYS[check.metric] + "_init") for r in results["runs"]}
    mine, theirs = [mine[(check.cell, s)] for s in results["seeds"]], [theirs[(than, s)] for s in results["seeds"]]
    if None in mine or None in theirs:
        how = "measured" if check.metric in SIZES else "timed"
        return f"{check.metric.replace('_', ' ')} was not {how} in these runs"
    if check.metric in OTHERS_KEYS:
        crowded = [f"{r['cell']}-s{r['seed']} ({r[OTHERS_KEYS[check.metric]]:.2f} cores)" for r in results["runs"]
                   if r["cell"] in (check.cell, than) and busy(r.get(OTHERS_KEYS[check.metric]))]
        if crowded:
            return (f"{check.metric.replace('_', ' ')} was timed while other processes took more than "
                    f"{BUSY_OVER:g} CPU cores: {', '.join(crowded)}; rerun those runs alone")
    return mine, theirs


def _said(check: Check, results: dict, than: str, diffs: list[float], base: float, mean: float, half: float) -> str:
    """What was measured, in words: the differences per seed, their mean and interval, and the
    per-seed significance tests where the check reads test scores against the baseline."""
    timed = check.metric != "test"
    at_lengths = bool(check.length or check.than_length)
    p_values = _p_values(results, check.cell) if than == results["baseline"] and not timed and not at_lengths \
        else None
    beside = (f"; paired bootstrap p per seed {', '.join(f'{p:.3f}' for p in p_values)}" if p_values is not None
              and results.get("metric") == "bleu" else f"; McNemar p per seed {', '.join(f'{p:.3f}' for p in p_values)}"
              if p_values is not None else "")
    shown = ", ".join(_relative(d, base) for d in diffs)
    named = (f"{check.cell}{f' at {check.length}' if check.length else ''} - "
             f"{than}{f' at {check.than_length}' if check.than_length else ''}{' at initialisation' * check.than_init}")
    cannot = sorted({f"{r['cell']} at {n}" for r in results["runs"] for n in (r.get("cannot") or {})
                     if r["cell"] in (check.cell, than) and int(n) in (check.length, check.than_length)})
    if cannot:  # no positions that far: scored as no correct answer
        beside += f"; cannot extrapolate (scored 0): {', '.join(cannot)}"
    return (f"{named}{'' if not timed else ' ' + METRIC_KEYS[check.metric]} per seed: {shown}; "
            f"mean {mean:+.2f}, 95% t-interval [{mean - half:+.2f}, {mean + half:+.2f}] over {len(diffs)} seeds (the "
            f"smallest difference they can detect: {half:.2f}){beside}")


def _verdict(check: Check, than: str, base: float, mean: float, low: float, high: float) -> tuple[str, str]:
    """The verdict of the check's expectation on the interval [low, high] around `mean`, and why."""
    margin = check.points or base * check.percent / 100
    upper = (base * check.up_to / 100 if check.percent else check.up_to) if check.up_to else math.inf
    claimed = claimed_gap(check)
    if check.expect in ("better", "worse"):
        sign = 1 if check.expect == "better" else -1
        toward, near, far = sign * mean, min(sign * low, sign * high), max(sign * low, sign * high)
        other = "worse" if check.expect == "better" else "better"
        if near > 0 and margin <= toward <= upper:
            if not margin:
                return "supported", f"{check.expect}: the interval excludes 0"
            measured = f"{100 * toward / base:.1f}%" if check.percent else f"{toward:.2f}"
            return "supported", f"{check.expect}: the interval excludes 0, the mean {measured} (claimed {claimed})"
        if near > upper:
            return "contradicted", f"{check.expect}, but the whole interval beyond the claimed {claimed}"
        if far < 0:
            return "contradicted", f"{other}, not {check.expect}: the whole interval on the other side of 0"
        if far == 0:  # a count that stayed put in every seed (a head role): exactly no difference, no gain
            return "contradicted", f"not {check.expect}: the whole interval at 0 or on the other side"
        if margin and far < margin:
            return "contradicted", f"the whole interval short of the claimed {claimed}"
        return "inconclusive", "the interval holds 0 or the claimed margin: the seeds cannot tell"
    if check.expect == "not_better":
        if low > 0:
            return "contradicted", "better: the interval excludes 0"
        if mean <= 0:
            return "supported", "not better on average, and the interval holds 0 or less"
        return "inconclusive", "better on average, but the interval holds 0"
    if check.expect == "not_worse":
        if low >= -margin:
            below = f"{claimed} below " if margin else ""
            return "supported", f"the whole interval no worse than {below}{than}"
        if high < -margin:
            return "contradicted", (f"the whole interval more than {claimed} below {than}" if margin
                                    else f"the whole interval below {than}")
        return "inconclusive", "the interval reaches below the tolerated loss: the seeds cannot tell"
    # same, within a tolerance
    if -margin <= low and high <= margin:
        return "supported", f"the whole interval within {claimed}"
    if high < -margin or low > margin:
        return "contradicted", f"the whole interval more than {claimed} away"
    return "inconclusive", f"the interval reaches past {claimed}: the seeds cannot tell"


CONVERGED_GAIN = 1.0  # %: a converged baseline gained less than this over the last doubling of its steps
CEILING = {"accuracy": 100.0}  # or every seed ends at its metric's maximum: nothing is left to gain
REFERENCE_SHARE = 90.0  # %: and scores at least this share of the reference score for its scale
STILL_IMPROVING = "still improving"


def convergence(results: dict, cell: str, reference: float = 0.0) -> dict:
    """Whether `cell` has converged by the ledger's one rule: its validation score (mean over
    seeds, the best so far) gained less than CONVERGED_GAIN % from half its steps to all of them,
    or every seed ended at the metric's CEILING (a task learned late in one seed, at 100%
    validation accuracy in all: more steps cannot raise it), and, where the scale has a
    reference score, its test mean is at least REFERENCE_SHARE % of it.
    {"converged": bool | None (not measurable), "gain", "share", "reason"}."""
    runs = [r for r in results["runs"] if r["cell"] == cell]
    halves, ends = [], []
    for run in runs:
        curve = [(step, value) for step, value in run.get("curve") or [] if value is not None]
        if not curve:
            return {"converged": None, "gain": None, "share": None,
                    "reason": f"{cell}: no validation curve recorded (runs from before curves were kept)"}
        last = curve[-1][0]
        early = [v for step, v in curve if step <= last // 2]
        if not early:
            return {"converged": None, "gain": None, "share": None,
                    "reason": f"{cell}-s{run['seed']}: no validation by half its {last} steps"}
        lower = results.get("metric") == "loss"  # the best so far: the lowest loss, the highest score
        pick = min if lower else max
        halves.append(pick(early))
        ends.append(pick(v for _, v in curve))
    half, end = statistics.fmean(halves), statistics.fmean(ends)
    gain = 100 * (end - half) / abs(half) * (-1 if results.get("metric") == "loss" else 1) if half else math.inf
    share = reference_share(results, cell, reference)[1] if reference else None
    ceiling = CEILING.get(results.get("metric"))
    at_ceiling = ceiling is not None and gain >= CONVERGED_GAIN and all(end >= ceiling for end in ends)
    converged = (gain < CONVERGED_GAIN or at_ceiling) and (share is None or share >= REFERENCE_SHARE)
    words = f"{cell} gained {gain:.1f}% on validation over its last doubling of steps (rule: under {CONVERGED_GAIN:g}%)"
    if share is not None:
        words += f" and scores {share:.0f}% of the reference {reference:g} (rule: at least {REFERENCE_SHARE:g}%)"
    else:
        words += "; no reference score for this scale"
    if at_ceiling:
        words += f"; every seed ended at the ceiling, {ceiling:g}% validation {results['metric']}: nothing left to gain"
    return {"converged": converged, "gain": gain, "share": share, "reason": words}


# 97.5% quantiles of Student's t with 1..30 degrees of freedom; the normal's past 30
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def half_width(diffs: list[float]) -> float:
    """Half the 95% t-interval of the mean of `diffs` (seed-paired differences): the smallest
    mean difference these seeds can tell from 0 at this spread; infinite from one seed."""
    n = len(diffs)
    if n < 2:
        return math.inf
    t = T975[n - 2] if n - 1 <= len(T975) else 1.960
    return t * statistics.stdev(diffs) / math.sqrt(n)


def testable(condition: Precondition, results: dict, device: str | None, value=None) -> tuple[bool | None, str]:
    """Whether a precondition holds for these results (None: not measurable), and what was found.
    `device`: where the runs were made; `value`: the cell's recipe value at condition.key."""
    lengths = results.get("test_lengths")
    if condition.device:
        found = device or "unknown"
        return found.startswith(condition.device), f"measured on {found}"
    if lengths is None:
        return None, "the test set's lengths were not recorded"
    if condition.at_least:
        median = lengths["median_source"]
        return median >= condition.at_least, f"median test input {median:g} tokens"
    limit = lengths[condition.below]
    words = condition.below.replace("_", " ")
    return value < limit, f"{condition.key} = {value} against a {words} length of {limit:g} tokens"


def replication(claim: Claim, results: dict) -> dict | None:
    """Ours beside the published effect of claim.anchor_cell against the baseline: the
    direction replicates when our 95% interval excludes 0 on the published side; the size is
    compared as relative effects (% of the baseline)."""
    if not claim.anchor_cell:
        return None
    seeds, base = results["seeds"], results["baseline"]
    scores = {(r["cell"], r["seed"]): r["test"] for r in results["runs"]}
    diffs = [scores[(claim.anchor_cell, s)] - scores[(base, s)] for s in seeds]
    mean, half = statistics.fmean(diffs), half_width(diffs)
    base_mean = statistics.fmean(scores[(base, s)] for s in seeds)
    toward = (1 if claim.anchor_percent > 0 else -1) * mean  # along the published direction
    if toward - half > 0:
        replicated = "replicated"
    elif toward + half < 0:
        replicated = "not replicated: the other way"
    else:
        replicated = "not replicated: inside the seed noise"
    ours = 100 * mean / base_mean if base_mean else math.inf
    return {"cell": claim.anchor_cell, "replicated": replicated, "ours_percent": ours,
            "published_percent": claim.anchor_percent,
            "words": f"{claim.anchor_cell}: ours {ours:+.1f}% (95% interval {100 * (mean - half) / base_mean:+.1f}% to "
                     f"{100 * (mean + half) / base_mean:+.1f}%), published {claim.anchor_percent:+.1f}%: {replicated}"
            if base_mean else f"{claim.anchor_cell}: a baseline of 0, no relative effect: {replicated}"}


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


def unlearned(cells, results: dict, reference: float) -> str:
    """Why a comparison across lengths cannot be read: a cell whose test mean at the training
    length is under REFERENCE_SHARE % of the scale's reference never learned the task there, and
    its score at another length then says nothing about extrapolating it. "" when all did."""
    for cell in dict.fromkeys(cells):
        mean, share = reference_share(results, cell, reference)
        if share < REFERENCE_SHARE:
            return (f"{cell} did not learn the task at its training length (test mean {mean:.2f}, "
                    f"{share:.0f}% of the reference {reference:g}; rule: at least "
                    f"{REFERENCE_SHARE:g}%): its score at another length says nothing about extrapolation")
    return ""


def reference_share(results: dict, cell: str, reference: float) -> tuple[float, float]:
    """`cell`'s test mean over its seeds and the % of the scale's reference score it reaches."""
    mean = statistics.fmean(r["test"] for r in results["runs"] if r["cell"] == cell)
    return mean, 100 * mean / reference


def _scores(results: dict, metric: str, length: int) -> dict:
    """{(cell, seed): the metric} of every run, at `length` where one is given."""
    if not length:
        return {(r["cell"], r["seed"]): r.get(METRIC_KEYS[metric]) for r in results["runs"]}
    return {(r["cell"], r["seed"]): (r.get("test_at") or {}).get(str(length)) for r in results["runs"]}


def describe(check: Check, baseline: str) -> str:
    """What the check says, e.g. "gelu better than relu by 0.5% to 1%"."""
    speed = "" if check.metric == "test" else f" in {check.metric.replace('_', ' ')}"
    at, than_at = (f" at {n} tokens" if n else "" for n in (check.length, check.than_length))
    than = f"{check.cell} at initialisation" if check.than_init else check.than or baseline
    words = f"{check.cell}{at}{speed} {_in_words(check, check.expect.replace('_', ' '))} than {than}{than_at}"
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


def _relative(d: float, base: float) -> str:
    return f"{d:+.2f} ({100 * d / base:+.1f}%)" if base else f"{d:+.2f}"
