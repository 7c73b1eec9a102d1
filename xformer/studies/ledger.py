"""The claims ledger: docs/claims.md, generated from the claim specs and their experiments.

    specs     recipes/claims/*.toml: a [claim] table each (xformer/studies/claim_spec.py), with the
              [experiment] that measures it or `blocked` saying what xformer lacks
    runs      RUNS/<spec name>/results.json, written by `xformer experiment`
    records   RECORDS/<spec name>.json: what the ledger last read from a run folder (the results
              without local paths, the hardware, the date), so the ledger regenerates on a
              checkout that never ran the experiment; a run folder, when present, replaces it

`build_ledger` judges every measured claim (claims.judge), writes the records and the markdown,
and returns the ledger's rows.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from xformer.config.loading import read_toml
from xformer.errors import RecipeError, RunError
from xformer.files import atomic_write_text
from xformer.results import Ledger
from xformer.studies.claim_spec import ROLE_METRICS, Claim, claim_from_table
from xformer.studies.claims import (
    CONVERGED_GAIN,
    convergence,
    describe,
    judge,
    replication,
    testable,
    verdict,
)
from xformer.studies.experiment import Experiment, load_experiment
from xformer.studies.experiment_report import curve_png
from xformer.studies.ledger_page import ledger_markdown
from xformer.studies.sittings import wall_time
from xformer.studies.versions import changed_since, version_of

LOCAL = ("hypotheses", "predictions", "run_dir")  # run fields that are paths on the machine that ran it


def read_spec(path: Path) -> tuple[Claim, Experiment | None]:
    """A claim spec: its claim and, unless it is blocked, its experiment (every check against
    the experiment's cells)."""
    raw = read_toml(path, "claim")
    if not isinstance(raw.get("claim"), dict):
        raise RecipeError(f"{path}: no [claim] table; a spec in the ledger states the claim it tests")
    if "experiment" in raw:
        experiment = load_experiment(path)
        return experiment.claim, experiment
    unknown = [f"{path}: {k}: unknown table" for k in raw if k != "claim"]
    claim, _, problems = claim_from_table(raw["claim"], None, str(path))
    if problems or unknown:
        raise RecipeError(unknown + problems)
    return claim, None


def record_from_run(folder: Path, spec: Path, experiment: Experiment) -> dict | None:
    """What the ledger keeps of an experiment folder: None when it holds no results yet; a
    RunError when the folder ran other cells, seeds or budget than `experiment` (the spec's)."""
    results = folder / "results.json"
    if not results.is_file():
        return None
    pinned = folder / "experiment.json"
    differences = None  # not recorded: a folder from before experiment.json pinned the recipe
    if pinned.is_file():
        ran, c = json.loads(pinned.read_text()), experiment.config
        if "recipe" in ran:
            differences = recipe_differences(ran["recipe"], experiment.recipe(c.baseline, c.seeds[0]).to_dict())
        wanted = {"cells": experiment.cells, "seeds": c.seeds, "max_steps": c.max_steps, "max_time": c.max_time,
                  "budgets": c.budgets, "lengths": c.lengths}
        ran.setdefault("budgets", [])  # folders from before curves
        ran.setdefault("lengths", [])
        differ = [f"{key} {ran.get(key)!r} (the spec: {value!r})" for key, value in wanted.items()
                  if ran.get(key) != json.loads(json.dumps(value))]
        if differ:
            raise RunError(f"{folder}: ran with other settings than {spec}: {'; '.join(differ)}; the ledger "
                           "reports the spec as written (run it into another --out)")
    data = json.loads(results.read_text())
    first = folder / "runs" / f"{data['runs'][0]['cell']}-s{data['runs'][0]['seed']}" / "train.json"
    card = json.loads(first.read_text())["card"] if first.is_file() else {}
    data["runs"] = [{k: v for k, v in r.items() if k not in LOCAL} for r in data["runs"]]
    for curve in data.get("curves") or []:
        curve["runs"] = [{k: v for k, v in r.items() if k not in LOCAL} for r in curve["runs"]]
    data["source"] = spec.as_posix()
    when = datetime.fromtimestamp(results.stat().st_mtime, tz=timezone.utc).date().isoformat()
    return {"spec": spec.as_posix(), "measured": when, **measured_from(spec, experiment),
            "hardware": {"cpu": card.get("cpu"), "device": card.get("device"), "precision": card.get("precision"),
                         "torch": card.get("versions", {}).get("torch")},
            "train_minutes": round(sum(r["train_seconds"] for r in data["runs"]) / 60, 1),
            "wall": wall_time(folder),
            "differences": differences, "results": data}


def measured_from(spec: Path, experiment: Experiment) -> dict[str, str]:
    """The digests of the spec and of the recipe it names, as a record keeps them
    (studies/versions.py): a chain that resumes on another machine retrains a spec only when
    either's values have changed since (benchmarks/ledger_chain.sh)."""
    return version_of(spec, spec.parent / experiment.config.recipe)


def stale_record(spec: Path, experiment: Experiment, record: dict) -> str | None:
    """Why a kept record is of an earlier version of `spec` (None when it is of this one): its
    spec or recipe digest differs, or, for a record from before digests were kept, it ran other
    cells or seeds. A stale record stays on disk but is not judged."""
    if "spec_sha256" in record:
        changed = changed_since(record, measured_from(spec, experiment))
        return f"the {' and the '.join(changed)} changed since" if changed else None
    results = record["results"]
    ran = {"seeds": results.get("seeds"), "cells": sorted(c["cell"] for c in results.get("cells", []))}
    wanted = {"seeds": experiment.config.seeds, "cells": sorted(experiment.cells)}
    differ = [f"{key} {ran[key]} where the spec has {wanted[key]}" for key in ran if ran[key] != wanted[key]]
    return "it ran " + "; ".join(differ) if differ else None


def record_is_current(spec: Path, record: Path) -> bool:
    """Whether `record` was measured from `spec` and its recipe as they are now."""
    if not record.is_file():
        return False
    _, experiment = read_spec(spec)
    kept = json.loads(record.read_text())
    return experiment is not None and "spec_sha256" in kept and not changed_since(kept, measured_from(spec, experiment))


WHERE_FROM = ("data.dataset",)  # where the corpus is read from (a local copy, offline): not a setting


def recipe_differences(ran: dict, spec: dict) -> list[dict]:
    """[{"key", "ran", "recipe"}] for every recipe value an experiment ran with that is not the
    spec's (the baseline's recipe, first seed, as to_dict gives them; `--set` makes them)."""
    def flat(tables: dict) -> dict:
        return {f"{s}.{k}": v for s, table in tables.items() if isinstance(table, dict) for k, v in table.items()}

    mine, theirs = flat(json.loads(json.dumps(ran))), flat(json.loads(json.dumps(spec)))
    return [{"key": key, "ran": mine.get(key), "recipe": theirs.get(key)}
            for key in dict.fromkeys([*theirs, *mine]) if key not in WHERE_FROM and mine.get(key) != theirs.get(key)]


GENERATED = "Generated by `xformer claims`"  # in every ledger's header: how a rerun knows its own file


def build_ledger(specs: Path, runs: Path, out: Path, records: Path | None = None, *,
                 overwrite: bool = False, links_from: Path | None = None) -> Ledger:
    """Read every spec in `specs`, refresh the records from `runs`, write `out` (markdown). An
    existing `out` is regenerated only when a ledger wrote it (its header says so), or with
    `overwrite`; anything else is refused before a file is written. A record's curve PNG is drawn
    beside it when the record is refreshed or has none; the page links it from `links_from`
    (default: out's folder, where the page is read)."""
    if out.is_dir():
        raise RunError(f"{out}: is a directory; --out names the ledger's markdown file")
    if out.exists() and not overwrite and GENERATED not in out.read_text(encoding="utf-8", errors="replace")[:2000]:
        raise RunError(f"{out}: exists and is not a ledger `xformer claims` wrote (no '{GENERATED}' in its "
                       "header); choose another --out, or pass --overwrite to replace it")
    records = records or out.parent / "claims"
    paths = sorted(specs.glob("*.toml"))
    if not paths:
        raise RunError(f"{specs}: no claim specs (*.toml) found")
    for path in paths:
        kept = records / f"{path.stem}.json"
        if kept.exists() and not overwrite and not _is_record(kept):
            raise RunError(f"{kept}: exists and is not a claim record `xformer claims` wrote; choose another "
                           "--records folder, or pass --overwrite to replace it")
    rows = []
    for path in paths:
        claim, experiment = read_spec(path)
        record = refreshed = None
        if experiment is not None:
            record = refreshed = record_from_run(runs / path.stem, path, experiment)
            kept = records / f"{path.stem}.json"
            if record is not None:
                records.mkdir(parents=True, exist_ok=True)
                atomic_write_text(kept, json.dumps(record, indent=2) + "\n")
            elif kept.is_file():
                record = json.loads(kept.read_text())
        earlier = stale_record(path, experiment, record) if record is not None else None
        rows.append(_row(path, claim, experiment, None if earlier else record))
        if earlier:
            rows[-1]["earlier"] = earlier
        if record is not None and record["results"].get("curves"):
            png = records / f"{path.stem}.png"
            if refreshed is not None or not png.is_file():
                curve_png(record["results"], png)
            rows[-1]["curves_png"] = Path(os.path.relpath(png, links_from or out.parent)).as_posix()
    rows.sort(key=lambda r: (r["number"], r["spec"]))
    text = ledger_markdown(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    return Ledger(rows=rows, markdown=str(out), records=str(records))


def _is_record(path: Path) -> bool:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"spec", "measured", "results"} <= set(record)


def _budget(c) -> str:
    if c.budgets:
        return f"{c.budgets[-1]} steps (wsd; cooldowns branched at {', '.join(map(str, c.budgets[:-1]))})"
    return f"{c.max_steps} steps" if c.max_steps else f"{c.max_time:g} minutes"


def _row(path: Path, claim: Claim, experiment: Experiment | None, record: dict | None) -> dict:
    row = {"number": claim.number, "says": claim.says, "source": claim.source, "scale": claim.scale,
           "spec": path.as_posix(), "name": path.stem, "anchor": claim.anchor}
    if experiment is None:
        return {**row, "verdict": "not measurable yet", "blocked": claim.blocked}
    cells = ", ".join(f"{name} ({' '.join(sets) or 'the recipe'})" for name, sets in experiment.cells.items())
    c = experiment.config
    row["corpus"] = bool(getattr(experiment.recipe(c.baseline, c.seeds[0]).data, "dataset", ""))  # not generated
    row["design"] = (f"{experiment.config.recipe} with cells {cells}; baseline {c.baseline}; seeds "
                     f"{', '.join(map(str, c.seeds))}; " + _budget(c) + " a run")
    if record is None:
        return {**row, "verdict": "not measured yet"}
    results = record["results"]
    outcomes = [judge(check, results, c.reference) for check in experiment.checks]
    measured = verdict(outcomes)
    untestable = []  # the preconditions that fail here, or cannot be checked
    for condition in claim.preconditions:
        value = _value(experiment.recipe(condition.cell, c.seeds[0]), condition.key) if condition.below else None
        holds, found = testable(condition, results, record["hardware"].get("device"), value)
        if holds is not True:
            untestable.append(f"{condition.what} ({found}{'' if holds is False else ': not checked'})")
    converged = convergence(results, c.baseline, c.reference)
    if not any(check.metric in ("test", *ROLE_METRICS) for check in experiment.checks):  # a speed or a size only
        converged = {**converged, "converged": True, "reason": "not needed: speed and memory checks only"}
    shown = measured if converged["converged"] else (
        "inconclusive: convergence not measured" if converged["converged"] is None else "inconclusive: undertrained")
    if len(results["seeds"]) < MIN_SEEDS:
        shown = f"inconclusive: {len(results['seeds'])} seed{'s' * (len(results['seeds']) > 1)} ({MIN_SEEDS} needed)"
    if untestable:
        shown = "not testable here"
    differing = disagreements(results, timed=experiment.times_runs())
    if differing["refuse"]:
        shown = "not comparable: the runs differ in " + "; ".join(differing["refuse"])
    at_budgets = [{"budget": curve["budget"], "verdict": verdict([judge(check, {**results, **curve}, c.reference)
                                                                   for check in experiment.checks]),
                   "order": [cell["cell"] for cell in sorted(curve["cells"], key=lambda cell: -cell["test_mean"])]}
                  for curve in results.get("curves") or []]
    row.update(untestable=untestable, replication=replication(claim, results), reference=c.reference)
    return {**row, "verdict": shown, "measured_verdict": measured, "convergence": converged, "budgets": at_budgets,
            "flags": flags(results, c.baseline) + differing["flag"], "looked": claim.looked, "record": record,
            "differences": record.get("differences"),
            "checks": [{"check": describe(o.check, c.baseline), "verdict": o.verdict, "reason": o.reason,
                        "cell": o.check.cell, "metric": o.check.metric} for o in outcomes]}


def disagreements(results: dict, *, timed: bool) -> dict:
    """Where the runs of one record were made differently (a chain may cross machines): device
    or precision differing, or the CPU where the claim is a timing, refuse a verdict; the CPU,
    torch or code version differing otherwise is flagged. Runs recorded before machines were
    kept are not compared."""
    found = {key: sorted({str(r["machine"].get(key)) for r in results["runs"] if r.get("machine")})
             for key in ("device", "precision", "cpu", "torch", "commit")}
    refuse = [f"{key} ({', '.join(values)})" for key, values in found.items() if len(values) > 1
              and (key in ("device", "precision") or (timed and key == "cpu"))]
    flag = [f"runs made with different {key}: {', '.join(values)}" for key, values in found.items()
            if len(values) > 1 and not (key in ("device", "precision") or (timed and key == "cpu"))]
    return {"refuse": refuse, "flag": flag}


def _value(recipe, key: str):
    section, name = key.split(".")
    return getattr(getattr(recipe, section), name)


MIN_SEEDS = 3  # fewer cannot put an interval on the seed-to-seed spread worth a verdict
AHEAD = {"bleu": 2.0, "accuracy": 5.0}  # a variant this far ahead of its baseline gets a second look


def flags(results: dict, baseline: str) -> list[str]:
    """What a reader should look at twice: a variant far ahead of its baseline, a cell still
    improving at the end of its runs."""
    out = []
    limit = AHEAD.get(results["metric"])
    for cell in results["cells"]:
        name = cell["cell"]
        if limit is not None and cell.get("difference", 0) > limit:
            out.append(f"{name} is {cell['difference']:+.2f} ahead of {baseline} (more than {limit:g}): a second look "
                       "is due")
        if name != baseline:
            state = convergence(results, name)
            if state["converged"] is False and state["gain"] is not None and state["gain"] >= CONVERGED_GAIN:
                out.append(f"{name} still improving: {state['gain']:.1f}% over its last doubling of steps")
    return out


def ledger_problems(specs: Path, out: Path, records: Path | None = None) -> list[str]:
    """What differs between `out` and the ledger its specs and records give (for tests and CI):
    an empty list when the committed ledger is current."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "claims.md"
        kept = records or out.parent / "claims"
        build_ledger(specs, Path(tmp) / "no-runs", fresh, kept, links_from=out.parent)
        if not out.is_file():
            return [f"{out}: missing; run `xformer claims`"]
        if fresh.read_text() != out.read_text():
            return [f"{out}: not what `xformer claims` generates from {specs} and {kept}; run it again"]
    return []
