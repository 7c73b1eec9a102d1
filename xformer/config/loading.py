"""Reading recipes: a TOML file or plain tables, plus `--set section.key=value` overrides,
validated into a config.Recipe; every problem is collected into one RecipeError whose lines
name the file (or the --set) they come from.

Overrides are parsed as TOML values (`--set train.lr=3e-4`, `--set model.positional=learned`
where a bare word is taken as a string) and merged into the raw tables before validation, so
they go through exactly the same checks as the file.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any

from xformer.config.schema import CHANGEABLE, FIXED_ON_RESUME, SECTIONS, Change, DataConfig, Recipe
from xformer.config.strict import describe, did_you_mean, section_from_dict
from xformer.errors import RecipeError, RunError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# data.task -> its task class, whose `Data` is the task's [data] table. The one dict is
# xformer.tasks.TASKS: the tasks fill it as they are imported (`import xformer` does that first),
# so the loader knows every task's fields without config/ importing the floors above it.
TASKS: dict[str, Any] = {}


def read_toml(path: Path, what: str) -> dict:
    """A TOML file's tables; a RecipeError naming the file and `what` it should have been
    ("experiment", "sweep", ...) when it is missing or unreadable."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such {what} file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read the {what} ({exc})") from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a TOML recipe, apply `--set` overrides, validate; raise RecipeError listing
    every problem found."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read the recipe ({exc})") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: not valid TOML: {exc}") from None
    if "sweep" in raw:
        raise RecipeError(f"{path}: a [sweep] file, not a recipe; `xformer longrange {path}` runs it "
                          "(its recipes are checked with `xformer check RECIPE`)")
    if not any(name in SECTIONS for name in raw):
        found = f"only {', '.join(f'[{k}]' for k in raw)}" if raw else "nothing"
        raise RecipeError(f"{path}: expected a recipe with [model], [data] and [train] tables, found {found}")
    return recipe_from_dict(raw, overrides or [], source=str(path))


def recipe_from_dict(raw: dict, overrides: list[str] = (), source: str = "recipe") -> Recipe:
    """Validate plain tables (as tomllib returns them) plus overrides into a Recipe."""
    problems: list[str] = []
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    changes = _changes_from(raw.pop("changes", []), problems)
    tables = set(raw)  # the source's own, before --set adds any
    overridden = _apply_overrides(raw, overrides, problems)
    _rename_legacy_keys(raw, problems)
    sections: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in SECTIONS:
            problems.append(f"{name}: unknown table{did_you_mean(name, SECTIONS)}")
        elif not isinstance(value, dict):
            problems.append(f"{name}: expected a table [{name}], found {describe(value)}")
    typed = True
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        table = table if isinstance(table, dict) else {}
        if name == "data":
            sections[name], values_ok = _data_from_dict(table, problems)
        else:
            sections[name], values_ok = section_from_dict(cls, name, table, problems)
        if values_ok:  # range and cross-field rules only make sense once every value has its type
            problems += sections[name].problems()
        typed = typed and values_ok
    recipe = Recipe(**sections, changes=changes)
    if typed:
        problems += recipe.cross_section_problems()
    if not problems and changes:  # each step's recipe must be one too
        try:
            recipe_at(recipe, -1)
        except RecipeError as exc:
            problems += exc.problems  # "changes: section.key: ..." (recipe_at's source)
    if problems:
        raise RecipeError([_locate(p, source, overridden, tables) for p in problems])
    return recipe


def recipe_at(recipe: Recipe, step: int) -> Recipe:
    """The recipe as it stood at optimizer step `step`: the changes made after it undone."""
    later = [c for c in recipe.changes if c.step > step]
    if not later:
        return recipe
    raw = recipe.to_dict()
    raw["changes"] = [c for c in raw.pop("changes") if c["step"] <= step]
    for change in reversed(later):
        for key, value in change.was.items():
            section, name = key.split(".")
            raw.setdefault(section, {})[name] = value
    return recipe_from_dict(raw, source="changes")


def _changes_from(value, problems: list[str]) -> list[Change]:
    """[[changes]] tables into Change records; what is wrong with them into `problems`."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        problems.append(f"changes: expected [[changes]] tables, found {describe(value)}")
        return []
    out = []
    for i, table in enumerate(value):
        where = f"changes[{i}]"
        unknown = set(table) - {"step", "set", "was"}
        if unknown:
            problems.append(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; expected step, set and was")
        step, now, was = table.get("step"), table.get("set"), table.get("was")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            problems.append(f"{where}.step: expected an optimizer step >= 0, found {describe(step)}")
            continue
        if not isinstance(now, dict) or not isinstance(was, dict) or set(now) != set(was) or not now:
            problems.append(f"{where}: expected set and was, tables of the same section.key names")
            continue
        fields = {f"{name}.{f.name}" for name in CHANGEABLE for f in dataclasses.fields(SECTIONS[name])}
        bad = sorted(k for k in now if k not in fields or k in FIXED_ON_RESUME)
        if bad:
            problems.append(f"{where}: {', '.join(bad)} cannot change during a run (only [train] and [eval] values, "
                            f"not {' or '.join(FIXED_ON_RESUME)})")
            continue
        out.append(Change(step=step, set=dict(now), was=dict(was)))
    if [c.step for c in out] != sorted(c.step for c in out):
        problems.append("changes: expected in the order of their steps")
    return out


LEGACY_KEYS = {("model", "activation"): "ffn"}  # key -> its new name; run directories still hold the old one


def _rename_legacy_keys(raw: dict, problems: list[str]) -> None:
    for (section, old), new in LEGACY_KEYS.items():
        table = raw.get(section)
        if isinstance(table, dict) and old in table:
            if new in table:
                problems.append(f"{section}.{old}: the old name of {section}.{new}; give only {section}.{new}")
            else:
                table[new] = table.pop(old)


def _data_from_dict(table: dict, problems: list[str]):
    """[data] into the Data class of its task (TASKS): a field that only another
    task has is named with the task it belongs to."""
    task = table.get("task", DataConfig.task)
    if not isinstance(task, str) or task not in TASKS:
        listed = ", ".join(repr(t) for t in TASKS)
        hint = did_you_mean(task, TASKS) if isinstance(task, str) else ""
        problems.append(f"data.task: expected one of {listed}, found {describe(task)}{hint}")
        return DataConfig(), False
    cls = TASKS[task].Data
    own = {f.name for f in dataclasses.fields(cls)}
    elsewhere = {}
    for key in table:
        if key not in own:
            users = [name for name, t in TASKS.items() if key in {f.name for f in dataclasses.fields(t.Data)}]
            if users:
                elsewhere[key] = users
    for key, users in elsewhere.items():
        allowed = " or ".join(repr(u) for u in users)
        problems.append(f"data.{key}: applies only when data.task = {allowed}, found data.task = {task!r}; remove it")
    data, ok = section_from_dict(cls, "data", {k: v for k, v in table.items() if k not in elsewhere}, problems)
    return data, ok


def parse_override(item: str) -> tuple[str, str, Any]:
    """'train.lr=3e-4' -> ('train', 'lr', 0.0003). The value is parsed as TOML; a value that
    is not TOML (a bare word like `learned`) is taken as a string."""
    key, sep, text = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not section or not name or "." in name:
        raise RecipeError(f"--set {item}: expected section.key=value, e.g. train.lr=3e-4")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return section, name, value


def _apply_overrides(raw: dict, overrides: list[str], problems: list[str]) -> dict[str, str]:
    """Merge the overrides into raw; {section.key: the --set item} of those applied."""
    touched = {}
    for item in overrides:
        try:
            section, name, value = parse_override(item)
        except RecipeError as exc:
            problems += exc.problems
            continue
        table = raw.setdefault(section, {})
        if isinstance(table, dict):
            table[name] = value
            touched[f"{section}.{name}"] = item
    return touched


def _locate(problem: str, source: str, overridden: dict[str, str], tables: set[str]) -> str:
    """Blame a problem on what caused it: the --set of its key, or of a table only --set made;
    the source for its own keys, naming the --set values the problem depends on."""
    if problem.startswith("--set"):
        return problem
    key = problem.split(":", 1)[0]
    if key in overridden or ("." not in key and key not in tables and any(k.startswith(f"{key}.") for k in overridden)):
        return f"--set {problem}"
    involved = [item for name, item in overridden.items() if re.search(rf"\b{re.escape(name)}\b", problem)]
    return f"{source} with --set {', --set '.join(involved)}: {problem}" if involved else f"{source}: {problem}"


def load_run_recipe(run_dir: str | Path, overrides: list[str] | None = None) -> Recipe:
    """The resolved recipe a run was trained with (RUN/recipe.toml)."""
    path = Path(run_dir) / "recipe.toml"
    if not path.is_file():
        raise RunError(f"{run_dir}: not a run directory (no recipe.toml)")
    return load_recipe(path, overrides)
