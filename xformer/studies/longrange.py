"""The long-range comparison: a Transformer classifier against an LSTM across sequence lengths.

A sweep file names the two recipes and the grid:

    [sweep]
    transformer = "recall_transformer.toml"   # paths relative to the sweep file
    lstm = "recall_lstm.toml"
    lengths = [64, 128, 256, 512, 1024]        # data.max_len of each row
    seeds = [1, 2]                             # train.seed (the data stay those of data.seed)
    max_time = 2.0                             # minutes of training per run (or max_steps)
    max_tokens = 4096                          # optional: data.max_tokens of every run
    valid_every = 200                          # optional: train.valid_every of every run
    match_parameters = true                    # LSTM hidden size set to the Transformer's count

    [sweep.variants]                           # optional: more models, each the transformer
    sliding_window = {attention = "sliding_window", window = 64}   # recipe with these [model] keys
    alibi = {positional = "alibi"}

Models are "transformer", the variants in file order, then "lstm". For every (length, model,
seed) the recipe is trained with data.max_len = length (and model.max_positions raised to
length + 1 where needed), the checkpoint with the best validation accuracy is scored on the
test split, and the run's row is written to
SWEEP/rows/<model>-L<length>-s<seed>.json. Rows already there are skipped, and a run stopped
part way (Ctrl-C, a kill) resumes from its last checkpoint, so an interrupted sweep continues
where it stopped. Then

    SWEEP/comparison.json   every row, and per (model, length): accuracy mean and std over
                            seeds, parameters, training tokens/s, peak memory
    SWEEP/comparison.md     the same as tables, with who wins where
    SWEEP/comparison.png    accuracy and tokens/s against length, both models
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from xformer.config.loading import load_recipe, read_toml, recipe_from_dict
from xformer.config.schema import Recipe
from xformer.config.strict import did_you_mean, section_from_dict
from xformer.errors import RecipeError
from xformer.evaluate import evaluate_run
from xformer.events import Event, ignore
from xformer.files import atomic_write_text
from xformer.locks import FolderLock
from xformer.model.lstm import match_hidden
from xformer.results import SweepResult
from xformer.studies.grid import check_grid_dir, pin, stop_if_asked, train_to_end
from xformer.studies.longrange_report import MODELS, write_comparison
from xformer.tasks import make_task, parameter_count
from xformer.tasks.generated import GeneratedData
from xformer.training.progress import StopSignals
from xformer.training.run_folder import run_state
from xformer.training.trackers import Reporting, experiment_reporting

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

VARIANT_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass
class SweepConfig:
    """[sweep]: the two recipes, the lengths and seeds, and the budget of each run."""

    transformer: str = ""
    lstm: str = ""
    lengths: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    max_steps: int = 0  # per run; 0: no step limit
    max_time: float = 0.0  # minutes of training per run; 0: no time limit
    max_tokens: int = 0  # data.max_tokens (padded tokens per batch) of every run; 0: the recipes' own
    valid_every: int = 0  # train.valid_every of every run; 0: the recipes' own
    match_parameters: bool = True

    def problems(self) -> list[str]:
        out = []
        for name in MODELS:
            if not getattr(self, name):
                out.append(f"sweep.{name}: expected the path of a recipe, found nothing")
        if not self.lengths or any(n <= 0 for n in self.lengths):
            out.append(f"sweep.lengths: expected positive lengths, found {self.lengths}")
        if not self.seeds:
            out.append("sweep.seeds: expected at least one seed, found none")
        out += [f"sweep.{k}: expected a number >= 0, found {getattr(self, k)}"
                for k in ("max_steps", "max_time", "max_tokens", "valid_every") if getattr(self, k) < 0]
        if self.max_steps == 0 and self.max_time == 0:
            out.append("sweep.max_time: expected sweep.max_steps or sweep.max_time to be positive (the budget "
                       "of each run), found both 0")
        return out


@dataclass
class Sweep:
    config: SweepConfig
    recipes: dict[str, Recipe]  # "transformer", "lstm": as loaded, before per-row overrides
    source: Path
    variants: dict[str, dict] = field(default_factory=dict)  # name -> [model] keys over the transformer's

    @property
    def models(self) -> list[str]:
        return ["transformer", *self.variants, "lstm"]


def load_sweep(path: str | Path, overrides: list[str] = ()) -> Sweep:
    """Read a sweep file; `overrides` are sweep.key=value (TOML values)."""
    path = Path(path)
    raw = read_toml(path, "sweep")
    problems = [f"{path}: {k}: unknown table{did_you_mean(k, ['sweep'])}" for k in raw if k != "sweep"]
    table = dict(raw.get("sweep", {}))
    variants = table.pop("variants", {})
    problems += _variant_problems(variants, path)
    for item in overrides:
        key, sep, text = item.partition("=")
        name = key.strip().removeprefix("sweep.")
        try:
            table[name] = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            problems.append(f"--set {item}: expected sweep.key=value with a TOML value")
    local: list[str] = []
    config, typed = section_from_dict(SweepConfig, "sweep", table, local)
    if typed:
        local += config.problems()
    problems += [f"{path}: {p}" for p in local]
    if problems:
        raise RecipeError(problems)
    for name in ("lengths", "seeds"):
        values = getattr(config, name)
        if len(set(values)) != len(values):
            raise RecipeError(f"{path}: sweep.{name}: expected distinct values, found {values}")
    recipes = {name: load_recipe(path.parent / getattr(config, name)) for name in MODELS}
    _check_pair(recipes, path)
    sweep = Sweep(config, recipes, path, variants)
    for name in variants:  # a variant's own keys first, so their mistakes are named as theirs
        try:
            _variant_recipe(sweep, name)
        except RecipeError as exc:
            raise RecipeError([f"{path}: sweep.variants.{name}: {p.removeprefix('sweep: ')}"
                               for p in exc.problems]) from None
    for length in config.lengths:  # every row's recipe validates now, not hours into the sweep
        for model in sweep.models:
            try:
                row_recipe(sweep, model, length, config.seeds[0])
            except RecipeError as exc:
                raise RecipeError([f"{path}: sweep.lengths: at length {length} the {model} recipe fails: {p}"
                                   for p in exc.problems]) from None
    return sweep


def _variant_problems(variants, path: Path) -> list[str]:
    if not isinstance(variants, dict):
        return [f"{path}: sweep.variants: expected a table of name = {{model keys}}, found {variants!r}"]
    out = []
    for name, keys in variants.items():
        if not VARIANT_NAME.fullmatch(name) or name in MODELS:
            out.append(f"{path}: sweep.variants.{name}: expected a name of lowercase letters, digits and _ "
                       f"other than {' and '.join(MODELS)}")
        if not isinstance(keys, dict) or not keys:
            out.append(f"{path}: sweep.variants.{name}: expected a table of [model] keys, e.g. "
                       f"{{attention = \"sliding_window\", window = 64}}, found {keys!r}")
    return out


def _variant_recipe(sweep: Sweep, name: str) -> Recipe:
    """The transformer recipe with variant `name`'s [model] keys."""
    table = sweep.recipes["transformer"].to_dict()
    table["model"] = {**table["model"], **sweep.variants[name]}
    return recipe_from_dict(table, source="sweep")


def _check_pair(recipes: dict[str, Recipe], path: Path) -> None:
    t, lstm = recipes["transformer"], recipes["lstm"]
    problems = []
    if t.model.arch != "classifier":
        problems.append(f"{path}: sweep.transformer: expected a recipe with model.arch = 'classifier', "
                        f"found {t.model.arch!r}")
    if lstm.model.arch != "lstm":
        problems.append(f"{path}: sweep.lstm: expected a recipe with model.arch = 'lstm', found {lstm.model.arch!r}")
    if t.data != lstm.data:
        problems.append(f"{path}: the two recipes must have the same [data] table (the same task and examples)")
    if not isinstance(t.data, GeneratedData):
        problems.append(f"{path}: the sweep varies the length of a generated task (listops, recall), "
                        f"found data.task = {t.data.task!r}")
    if problems:
        raise RecipeError(problems)


def row_key(model: str, length: int, seed: int) -> str:
    return f"{model}-L{length}-s{seed}"


def row_recipe(sweep: Sweep, model: str, length: int, seed: int) -> Recipe:
    """The recipe of one row: the model's recipe at this length, seed and budget."""
    base = _variant_recipe(sweep, model) if model in sweep.variants else sweep.recipes[model]
    cfg = sweep.config
    sets = [f"data.max_len={length}", f"train.seed={seed}", f"train.max_steps={cfg.max_steps}",
            f"train.max_time={cfg.max_time}", "train.max_epochs=0"]
    if cfg.max_tokens:
        sets.append(f"data.max_tokens={cfg.max_tokens}")
    if cfg.valid_every:
        sets.append(f"train.valid_every={cfg.valid_every}")
    if base.model.max_positions < length + 1:
        sets.append(f"model.max_positions={length + 1}")
    if model == "lstm" and cfg.match_parameters:
        target = parameters(row_recipe(sweep, "transformer", length, seed))
        recipe = _with(base, sets)
        d = recipe.model
        vocab, classes = _vocab_and_classes(recipe)
        hidden = match_hidden(target, vocab, d.d_model, d.lstm_layers, classes, d.bidirectional)
        sets.append(f"model.lstm_hidden={hidden}")
    return _with(base, sets)


def _with(recipe: Recipe, sets: list[str]) -> Recipe:
    return recipe_from_dict(recipe.to_dict(), sets, source="sweep")


def _vocab_and_classes(recipe: Recipe) -> tuple[int, int]:
    sizes = make_task(recipe).model_sizes()
    return sizes["vocab_size"], sizes["n_classes"]


def parameters(recipe: Recipe) -> int:
    return parameter_count(recipe)


def run_sweep(sweep: Sweep, out_dir: str | Path, *, device: str = "auto", on_event: Event | None = None,
              report_to: tuple[str, ...] = ()) -> SweepResult:
    """Train and score every row not done yet, then write the comparison files; returns
    the comparison (what comparison.json holds). One process at a time writes to a sweep's
    folder (xformer.locks). `report_to`: the trackers each run reports to, grouped under the
    sweep (xformer.training.trackers.experiment_reporting)."""
    check_grid_dir(Path(out_dir), "sweep.json", "longrange")
    with FolderLock(out_dir, "longrange"), StopSignals() as stops:
        reporting, parent = experiment_reporting(tuple(report_to), Path(out_dir))
        finished = False
        try:
            result = _run_sweep(sweep, Path(out_dir), device=device, emit=on_event or ignore, stops=stops,
                                reporting=reporting)
            finished = True
            return result
        finally:
            if parent is not None:
                parent.close(finished)


def _run_sweep(sweep: Sweep, out_dir: Path, *, device: str, emit: Event, stops: StopSignals,
               reporting: Reporting = Reporting()) -> SweepResult:
    (out_dir / "rows").mkdir(parents=True, exist_ok=True)
    _pin_sweep(sweep, out_dir)
    cfg = sweep.config
    plan = [(length, model, seed) for length in cfg.lengths for model in sweep.models for seed in cfg.seeds]
    emit("plan", {"rows": len(plan), "done": sum((out_dir / "rows" / f"{row_key(m, n, s)}.json").is_file()
                                                 for n, m, s in plan)})
    for index, (length, model, seed) in enumerate(plan):
        stop_if_asked(stops)  # a stop that landed while the last row ended or was scored
        key = row_key(model, length, seed)
        row_path = out_dir / "rows" / f"{key}.json"
        if row_path.is_file():
            continue
        run_dir = out_dir / "runs" / key
        state = run_state(run_dir)
        emit("row_start", {"index": index, "key": key, "model": model, "length": length, "seed": seed,
                           "resume": state == "resume"})
        train_to_end(row_recipe(sweep, model, length, seed), run_dir, device=device, measure_memory=True,
                     reporting=reporting,
                     on_fraction=lambda f, index=index: emit("row_progress", {"index": index, "fraction": f}))
        trained = json.loads((run_dir / "train.json").read_text())
        test = evaluate_run(run_dir, split="test", checkpoint="best", device=device)
        best = trained["best"] or {}
        row = {
            "model": model, "length": length, "seed": seed, "parameters": trained["parameters"],
            "test_accuracy": test.accuracy, "valid_accuracy": best.get("accuracy"),
            "best_step": best.get("step"), "steps": trained["steps"], "epochs": trained["epochs"],
            "train_seconds": trained["train_seconds"],
            "tokens_per_s": throughput_at_length(run_dir, row_recipe(sweep, model, length, seed), trained),
            "peak_memory_mb": trained["peak_memory_mb"], "device": trained["device"],
            "precision": trained["precision"], "run_dir": str(run_dir),
        }
        atomic_write_text(row_path, json.dumps(row, indent=2))
        emit("row_end", row)
    stop_if_asked(stops)
    comparison = summarize(sweep, [json.loads((out_dir / "rows" / f"{row_key(m, n, s)}.json").read_text())
                                   for n, m, s in plan])
    write_comparison(comparison, out_dir)
    return SweepResult(**comparison)


def throughput_at_length(run_dir: Path, recipe: Recipe, trained: dict) -> float:
    """Training tokens/s at the row's own length: the logged intervals after any length
    curriculum (whose short steps are faster), combined as tokens over time (the harmonic
    mean of equal-token intervals); the whole run's figure when none were logged after it."""
    first = sum(k for _, k in recipe.data.curriculum())
    if first:
        first += recipe.train.log_every  # skip the interval that straddles the switch
    rates = [r["tokens_per_s"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train" and r["step"] > first and r["tokens_per_s"] > 0]
    if not rates:
        return trained["tokens"] / max(trained["loop_seconds"], 1e-9)
    return len(rates) / sum(1.0 / r for r in rates)


def _pin_sweep(sweep: Sweep, out_dir: Path) -> None:
    """Save the sweep's resolved settings; a resumed sweep must have the same ones."""
    keys = ("max_steps", "max_time", "match_parameters") + tuple(k for k in ("max_tokens", "valid_every")
                                                                 if getattr(sweep.config, k))
    pinned = {"config": {k: getattr(sweep.config, k) for k in keys},
              "recipes": {m: sweep.recipes[m].to_dict() for m in MODELS}}
    if sweep.variants:  # (absent without variants, so a sweep started before they existed still matches)
        pinned["variants"] = sweep.variants
    pin(out_dir / "sweep.json", pinned, "this sweep directory was started with other recipes or budget; use "
        "another --out (rows of different settings cannot be compared)", as_now=_recipes_as_now)


def _recipes_as_now(old: dict) -> dict:
    """A saved sweep.json's recipes through today's loader (a field added since, at its default,
    is no difference); left as saved when they no longer load (certainly not the same)."""
    try:
        old["recipes"] = {m: recipe_from_dict(r).to_dict() for m, r in old.get("recipes", {}).items()}
    except RecipeError:
        pass
    return old


def summarize(sweep: Sweep, rows: list[dict]) -> dict:
    """Per (model, length): mean and std of test accuracy over seeds, and the cost columns."""
    groups = []
    for length in sweep.config.lengths:
        for model in sweep.models:
            mine = [r for r in rows if r["model"] == model and r["length"] == length]
            acc = [r["test_accuracy"] for r in mine]
            groups.append({
                "model": model, "length": length, "seeds": len(mine),
                "accuracy_mean": statistics.fmean(acc),
                "accuracy_std": statistics.stdev(acc) if len(acc) > 1 else 0.0,
                "parameters": mine[0]["parameters"],
                "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in mine),
                "peak_memory_mb": max(r["peak_memory_mb"] for r in mine),
                "steps": statistics.fmean(r["steps"] for r in mine),
            })
    cfg = sweep.config
    budget = " and ".join(x for x in (f"{cfg.max_time:g} minutes" if cfg.max_time else "",
                                      f"{cfg.max_steps} steps" if cfg.max_steps else "") if x)
    task = sweep.recipes["transformer"].data.task
    return {"task": task, "budget_per_run": budget, "lengths": cfg.lengths, "seeds": cfg.seeds,
            "device": rows[0]["device"] if rows else None, "models": sweep.models, "summary": groups, "rows": rows}
