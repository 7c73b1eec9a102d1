"""An experiment's spec (the [experiment] table of xformer.studies.experiment, and the [claim]
it tests): read, checked cell by cell, and turned into each run's recipe and folder name."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from xformer.config.loading import load_recipe, parse_override, read_toml
from xformer.config.schema import Recipe
from xformer.config.strict import did_you_mean, section_from_dict
from xformer.errors import RecipeError
from xformer.studies.claim_spec import Check, Claim, claim_from_table

CELL_NAME = re.compile(r"[a-z0-9][a-z0-9_.]*")
TABLES = ("experiment", "claim")


@dataclass
class ExperimentConfig:
    recipe: str = ""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    baseline: str = ""
    max_steps: int = 0  # per run; 0: no step limit
    # a learning curve: each cell and seed trains once, in the wsd schedule, to the largest of
    # these steps, keeping branch points; every smaller budget is a cooldown branched from it
    # (xformer.train's branches), so the curve costs about one run and its cooldowns
    budgets: list[int] = field(default_factory=list)
    # a generated task's runs also scored at these lengths (extrapolation: train at data.max_len,
    # score at 2x and 4x); a model with no positions that far scores "cannot extrapolate"
    lengths: list[int] = field(default_factory=list)
    max_time: float = 0.0  # minutes of training per run; 0: no time limit
    set: list[str] = field(default_factory=list)
    # each run's best checkpoint has its attention heads' roles counted on this many validation
    # examples, beside the same model's at initialisation (xformer.heads.roles); 0: not inspected
    inspect_heads: int = 0
    rescore: bool = False  # score runs copied by --reuse again here (a speed claim times every run in one sitting)
    # the baseline's converged test score at this scale (measured, e.g. the CPU scale's); the
    # ledger gives no verdict while the baseline scores under 90% of it (xformer.studies.claims); 0: none
    reference: float = 0.0

    def problems(self, cells: dict) -> list[str]:
        out = []
        if not self.recipe:
            out.append("experiment.recipe: expected the path of a recipe, found nothing")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            out.append(f"experiment.seeds: expected distinct seeds, found {self.seeds}")
        if self.baseline not in cells:
            out.append(f"experiment.baseline: expected one of the cells ({', '.join(cells) or 'none'}), "
                       f"found {self.baseline!r}{did_you_mean(self.baseline, list(cells))}")
        if self.inspect_heads < 0:
            out.append(f"experiment.inspect_heads: expected a number of examples (0: none), found {self.inspect_heads}")
        if any(n < 2 for n in self.lengths):
            out.append(f"experiment.lengths: expected lengths of at least 2 tokens, found {self.lengths}")
        if self.budgets:
            if sorted(set(self.budgets)) != self.budgets or self.budgets[0] < 2:
                out.append(f"experiment.budgets: expected increasing steps of at least 2, found {self.budgets}")
            if self.max_steps or self.max_time:
                out.append("experiment.budgets: the curve's budgets replace experiment.max_steps and max_time; "
                           "set neither")
        elif self.max_steps < 0 or self.max_time < 0 or (self.max_steps == 0 and self.max_time == 0):
            out.append("experiment.max_time: expected experiment.max_steps or experiment.max_time to be positive "
                       "(the budget of each run)")
        return out


@dataclass
class Experiment:
    config: ExperimentConfig
    cells: dict[str, list[str]]
    source: Path
    overrides: list[str] = field(default_factory=list)  # --set of every cell, after experiment.set
    claim: Claim | None = None  # the [claim] the experiment tests (xformer/studies/claim_spec.py), if any
    checks: list[Check] = field(default_factory=list)

    def recipe(self, cell: str, seed: int, budget: int = 0) -> Recipe:
        """The run of `cell` and `seed`; with experiment.budgets, the wsd run of `budget` steps
        (0: the largest, the stable run the others branch from)."""
        c = self.config
        steps = budget or (c.budgets[-1] if c.budgets else c.max_steps)
        sets = [*c.set, *self.overrides, *self.cells[cell], f"train.seed={seed}", f"train.max_steps={steps}",
                f"train.max_time={c.max_time}", "train.max_epochs=0"]
        if not c.budgets:
            return load_recipe(self.source.parent / c.recipe, sets)
        sets.append("train.schedule=wsd")
        fraction = load_recipe(self.source.parent / c.recipe, sets).train.decay_fraction
        every = math.gcd(*(cooldown_start(b, fraction) for b in c.budgets[:-1])) if len(c.budgets) > 1 else 0
        every = 0 if budget else every  # the stable run keeps the branch points; its cooldowns need none
        return load_recipe(self.source.parent / c.recipe, [*sets, f"train.branch_every={every}",
                                                           "train.patience=0"])

    def times_runs(self) -> bool:
        """Whether its checks read the runs' timed speeds: such an experiment trains and times its
        runs one at a time, and its timings compare only within one machine."""
        return any(check.metric in ("train_speed", "decode_speed") for check in self.checks)

    def reads_corpus(self) -> bool:
        """Whether its runs read a corpus (their recipe has data.dataset); a generated task's do not,
        and refuse a data.dataset given them."""
        return hasattr(self.recipe(self.config.baseline, self.config.seeds[0]).data, "dataset")


def load_experiment(path: str | Path, overrides: list[str] = ()) -> Experiment:
    """Read a spec; `overrides` are --set values: experiment.KEY=VALUE replaces the spec's
    [experiment] value (max_steps, seeds, baseline, ...), any other section.key=value is a
    recipe override applied to every cell. Every cell's recipe is checked now, not hours
    into the experiment."""
    path = Path(path)
    raw = read_toml(path, "experiment")
    if "experiment" not in raw:
        raise RecipeError(f"{path}: no [experiment] table; an experiment names a recipe, seeds and cells "
                          "(a recipe runs with `xformer train`)")
    problems = [f"{path}: {k}: unknown table{did_you_mean(k, TABLES)}" for k in raw if k not in TABLES]
    table = dict(raw["experiment"])
    recipe_sets = _apply_overrides(table, overrides, problems)
    cells = table.pop("cells", {})
    if not isinstance(cells, dict) or not cells:
        problems.append(f"{path}: experiment.cells: expected a table of name = [\"section.key=value\", ...]")
        cells = {}
    problems += _cell_problems(path, cells)
    local: list[str] = []
    config, typed = section_from_dict(ExperimentConfig, "experiment", table, local)
    if typed:
        local += config.problems(cells)
    problems += [f"{path}: {p}" for p in local]
    claim, checks = None, []
    if isinstance(raw.get("claim"), dict):
        claim, checks, found = claim_from_table(raw["claim"], list(cells), str(path), config.baseline)
        problems += found
        for i, check in enumerate(checks):
            wrong = [n for n in (check.length, check.than_length) if n and n not in config.lengths]
            if wrong:
                problems.append(f"{path}: claim.checks[{i}]: length {wrong[0]} is not one of experiment.lengths "
                                f"({config.lengths or 'none'}), where the runs are scored")
    elif "claim" in raw:
        problems.append(f"{path}: claim: expected a table, found {raw['claim']!r}")
    experiment = Experiment(config, cells, path, recipe_sets, claim, checks)
    if typed:  # every cell's recipe, checked beside the spec's own problems: all of them at once
        for name in cells:
            try:
                experiment.recipe(name, (config.seeds or [1])[0])
            except RecipeError as exc:
                problems += [f"{path}: experiment.cells.{name}: {p}" for p in exc.problems]
    if problems:
        raise RecipeError(list(dict.fromkeys(problems)))
    return experiment


def _apply_overrides(table: dict, overrides: list[str], problems: list[str]) -> list[str]:
    """experiment.KEY=VALUE changes the spec's table (a budget, the seeds); the rest are returned,
    recipe overrides for every cell. What cannot be set is added to `problems`."""
    recipe_sets = []
    for item in overrides:  # experiment.KEY=VALUE changes the spec (a budget, the seeds); the rest every recipe
        if not item.strip().startswith("experiment."):
            recipe_sets.append(item)
            continue
        try:
            _, name, value = parse_override(item)
        except RecipeError as exc:
            problems += exc.problems
            continue
        if name in ("cells", "recipe", "set"):
            problems.append(f"--set {item}: experiment.{name} cannot be set from the command line; "
                            "write another spec")
        else:
            table[name] = value
    return recipe_sets


def _cell_problems(path: Path, cells: dict) -> list[str]:
    """Cell names and their override lists, checked."""
    problems = []
    for name, sets in cells.items():
        if not CELL_NAME.fullmatch(name):
            problems.append(f"{path}: experiment.cells.{name}: expected a name of lowercase letters, digits, _ and .")
        if not isinstance(sets, list) or not all(isinstance(s, str) for s in sets):
            problems.append(f"{path}: experiment.cells.{name}: expected a list of \"section.key=value\" strings, "
                            f"found {sets!r}")
    return problems


def run_key(cell: str, seed: int, budget: int = 0) -> str:
    """The run's folder name: CELL-sSEED, and -atSTEPS for a budget branched from it."""
    return f"{cell}-s{seed}" + (f"-at{budget}" if budget else "")


def cooldown_start(budget: int, fraction: float) -> int:
    """The step a wsd run of `budget` steps starts cooling down at (xformer.training.optim.wsd_window):
    where its branch leaves the stable run."""
    return budget - max(1, round(fraction * budget))
