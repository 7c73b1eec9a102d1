"""Strict loading of dataclasses from plain tables (what tomllib returns), and back.

Generic over any dataclass whose fields are bool, int, float, str, a Literal of strings, a
list of those, or `X | None`; config.py uses it for the recipe tables. Problems are returned
as lines "section.key: expected ..., found ..." for the caller to collect and locate.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from typing import Any, Literal


def only_when(controlling_field: str, *values: str) -> dict:
    """Field metadata: the field belongs to a variant and may be set only when
    `controlling_field` (in the same table) has one of `values`."""
    return {"only_when": (controlling_field, values)}


def section_from_dict(cls: type, section: str, table: dict, problems: list[str]) -> tuple[Any, bool]:
    """The dataclass instance (bad values left at their defaults) and whether every value
    had the right type."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    values, bad = {}, set()
    for key, value in table.items():
        if key not in known:
            problems.append(f"{section}.{key}: unknown key{did_you_mean(key, known)}")
            continue
        error = type_problem(hints[key], value)
        if error:
            problems.append(f"{section}.{key}: {error}")
            bad.add(key)
        else:
            values[key] = float(value) if hints[key] is float else value
    instance = cls(**values)
    for key in values:
        rule = known[key].metadata.get("only_when")
        if rule and rule[0] not in bad and getattr(instance, rule[0]) not in rule[1]:
            allowed = " or ".join(repr(v) for v in rule[1])
            problems.append(
                f"{section}.{key}: applies only when {section}.{rule[0]} = {allowed}, "
                f"found {section}.{rule[0]} = {getattr(instance, rule[0])!r}; remove it"
            )
    return instance, not bad


def section_to_dict(instance) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(instance):
        rule = f.metadata.get("only_when")
        if rule and getattr(instance, rule[0]) not in rule[1]:
            continue
        value = getattr(instance, f.name)
        if value is not None:  # TOML has no null; None fields are the default
            out[f.name] = list(value) if isinstance(value, list) else value
    return out


def type_problem(hint, value) -> str | None:
    """None when `value` fits the annotation `hint`, else 'expected ..., found ...'."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # `X | None`: TOML cannot say None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value in choices and isinstance(value, str):
            return None
        listed = ", ".join(repr(c) for c in choices)
        hint_text = did_you_mean(value, choices) if isinstance(value, str) else ""
        return f"expected one of {listed}, found {describe(value)}{hint_text}"
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list) or any(type_problem(item, v) for v in value):
            return f"expected a list of {_TYPE_NAMES[item]}s, found {describe(value)}"
        return None
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[hint]
    if ok and hint is float and not math.isfinite(value):
        return f"expected a finite number, found {value}"
    return None if ok else f"expected {_TYPE_NAMES[hint]}, found {describe(value)}"


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def describe(value) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "table"}.get(type(value), type(value).__name__)
    return f"{json.dumps(value, default=str, ensure_ascii=False)} ({kind})"


def did_you_mean(word: str, candidates) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table; keys quoted, so "train.lr" stays one key
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


# Range rules for a config table: each returns "section.key: expected ..., found ..." lines for
# the fields that break it; the section is the dataclass's SECTION class attribute.


def positive(cfg, *names: str) -> list[str]:
    return [f"{cfg.SECTION}.{n}: expected a positive number, found {getattr(cfg, n)}"
            for n in names if getattr(cfg, n) <= 0]


def non_negative(cfg, *names: str) -> list[str]:
    return [f"{cfg.SECTION}.{n}: expected a number >= 0, found {getattr(cfg, n)}"
            for n in names if getattr(cfg, n) < 0]


def probability(cfg, *names: str) -> list[str]:
    return [f"{cfg.SECTION}.{n}: expected a number in [0, 1), found {getattr(cfg, n)}"
            for n in names if not 0 <= getattr(cfg, n) < 1]
