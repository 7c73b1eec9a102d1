"""A claim's table in a spec: what it says, where it comes from, and the checks that test it.

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
[experiment]. How a check becomes a verdict: xformer.studies.claims.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from xformer.config.strict import did_you_mean, section_from_dict

Expect = Literal["better", "worse", "not_better", "not_worse", "same"]
Metric = Literal["test", "train_speed", "decode_speed", "decode_memory", "positional_heads", "rare_word_heads",
                 "special_heads"]
Length = Literal["", "median_source", "max_source"]
METRIC_KEYS = {"test": "test", "train_speed": "train_steps_per_s", "decode_speed": "decode_per_s",
               "decode_memory": "decode_cache_mb", "positional_heads": "positional_heads",
               "rare_word_heads": "rare_word_heads", "special_heads": "special_heads"}  # in results.json
# heads with a role (experiment.inspect_heads; xformer.heads.roles): what training put there, so a
# verdict on them, as on the test score, waits for a converged baseline
ROLE_METRICS = ("positional_heads", "rare_word_heads", "special_heads")


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
    length: int = 0  # the cell's test score at this length (experiment.lengths) instead of the training one
    than_length: int = 0  # the same for `than`; a cell may then be compared with itself at another length
    # a head-role count against the same runs' heads at initialisation (the chance level)
    than_init: bool = False


@dataclass
class Precondition:
    """When a claim is testable here; one of `below`, `at_least`, `device`."""

    what: str = ""  # the condition in words, e.g. "rank 64 below the sources it compresses"
    cell: str = ""  # with `below`: the cell whose recipe value `key` is tested
    key: str = ""  # "section.name", e.g. "model.low_rank"
    below: Length = ""  # the value must be under this length of the test set's inputs (tokens)
    at_least: float = 0.0  # the test set's median input length must be at least this many tokens
    device: str = ""  # "cuda": the runs must have been made on a CUDA device


@dataclass
class Claim:
    number: int = 0
    says: str = ""  # the claim as it circulates
    source: str = ""  # where the wording comes from, when it has one
    scale: str = ""  # why this measurement may not transfer (model size, budget, data)
    blocked: str = ""  # what xformer lacks to measure it; "" when the spec has an [experiment]
    looked: str = ""  # what a second look at a flagged result found (the ledger prints it beside the flag)
    # the published number beside ours: paper, table, setting and numbers, or "none: why"
    anchor: str = ""
    anchor_cell: str = ""  # the cell whose published effect against the baseline anchor_percent gives
    anchor_percent: float = 0.0  # that effect, signed, in % of the baseline's published score
    # [[claim.preconditions]]: when the claim is testable here (filled by claim_from_table)
    preconditions: list[Precondition] = field(default_factory=list)


def claim_from_table(table: dict, cells: list[str] | None, where: str,
                     baseline: str = "") -> tuple[Claim, list[Check], list[str]]:
    """The [claim] table, its checks, and every problem found (`cells` None: no [experiment];
    `baseline`: the experiment's baseline cell)."""
    problems: list[str] = []
    table = dict(table)
    raws = table.pop("checks", [])
    conditions = table.pop("preconditions", [])
    if not isinstance(raws, list):
        problems.append(f"claim.checks: expected [[claim.checks]] tables, found {raws!r}")
        raws = []
    claim, typed = section_from_dict(Claim, "claim", table, problems)
    checks = []
    if typed:
        problems += _claim_problems(claim, cells, has_checks=bool(raws))
        checks = [check for i, raw in enumerate(raws) if (check := _check(raw, f"claim.checks[{i}]", cells, baseline,
                                                                          problems)) is not None]
        problems += _anchor_problems(claim, cells)
        if not isinstance(conditions, list):
            problems.append(f"claim.preconditions: expected [[claim.preconditions]] tables, found {conditions!r}")
            conditions = []
        claim.preconditions = [condition for i, raw in enumerate(conditions)
                               if (condition := _precondition(raw, f"claim.preconditions[{i}]", cells,
                                                              problems)) is not None]
    return claim, checks, [f"{where}: {p}" for p in problems]


def _claim_problems(claim: Claim, cells: list[str] | None, *, has_checks: bool) -> list[str]:
    """What is wrong with the [claim] table's own fields, its anchor aside."""
    problems = []
    if claim.number <= 0:
        problems.append(f"claim.number: expected the claim's positive number in the ledger, found {claim.number}")
    if not claim.says.strip():
        problems.append("claim.says: expected the claim as it circulates, found nothing")
    if cells is None and not claim.blocked:
        problems.append("claim.blocked: a claim without an [experiment] must say what xformer lacks to measure it")
    if cells is not None and claim.blocked:
        problems.append("claim.blocked: this spec has an [experiment]; remove blocked")
    if cells is not None and not has_checks:
        problems.append("claim.checks: expected at least one [[claim.checks]] comparison of two cells")
    return problems


def _anchor_problems(claim: Claim, cells: list[str] | None) -> list[str]:
    """What is wrong with the claim's anchor: the published number it is read against."""
    problems = []
    if cells is not None and not claim.anchor.strip():
        problems.append("claim.anchor: expected the published number beside ours (paper, table, setting, "
                        "numbers), or \"none: why\"")
    if claim.anchor_cell and claim.anchor_cell not in (cells or []):
        problems.append(f"claim.anchor_cell: expected one of the cells, found {claim.anchor_cell!r}"
                        f"{did_you_mean(claim.anchor_cell, cells or [])}")
    if claim.anchor_cell and not claim.anchor_percent:
        problems.append("claim.anchor_percent: expected the published effect of anchor_cell, in % of the "
                        "baseline's score, found 0")
    return problems


def _check(raw, name: str, cells: list[str] | None, baseline: str, problems: list[str]) -> Check | None:
    """One [[claim.checks]] table typed (None when it is no table), its problems added to `problems`."""
    if not isinstance(raw, dict):
        problems.append(f"{name}: expected a table (cell, expect, than, percent or points), found {raw!r}")
        return None
    check, ok = section_from_dict(Check, name, raw, problems)
    if ok:
        problems += _check_problems(check, cells or [], name)
        if check.than_init and (check.metric not in ROLE_METRICS or check.than):
            problems.append(f"{name}: than_init compares a head-role count ({', '.join(ROLE_METRICS)}) "
                            "with the same cell at initialisation; name no `than`")
        elif check.cell == (check.than or baseline) and check.length == check.than_length and not check.than_init:
            problems.append(f"{name}: compares {check.cell!r} with itself; name another cell in `than`, or "
                            "another length (length, than_length)")
        if (check.length or check.than_length) and check.metric != "test":
            problems.append(f"{name}: length and than_length compare test scores (metric = \"test\")")
    return check


def _precondition(raw, name: str, cells: list[str] | None, problems: list[str]) -> Precondition | None:
    """One [[claim.preconditions]] table typed (None when it cannot be), its problems added."""
    condition, ok = section_from_dict(Precondition, name, raw if isinstance(raw, dict) else {}, problems)
    if not ok:
        return None
    kinds = [k for k in ("below", "at_least", "device") if getattr(condition, k)]
    if len(kinds) != 1:
        problems.append(f"{name}: expected one of below, at_least, device, found {kinds or 'none'}")
    if not condition.what.strip():
        problems.append(f"{name}.what: expected the condition in words")
    if condition.below and (condition.cell not in (cells or []) or condition.key.count(".") != 1):
        problems.append(f"{name}: `below` tests a recipe value: expected cell (one of the cells) and key "
                        f"(section.name), found cell {condition.cell!r}, key {condition.key!r}")
    return condition


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
