"""Which version of a claim spec and its recipe a record or an archive was measured from.

A record (docs/claims/<spec>.json) and an archive of finished runs keep two digests of each
file: of its bytes (`spec_sha256`, `recipe_sha256`), and of its parsed TOML, the values alone
(`spec_toml_sha256`, `recipe_toml_sha256`). A version is compared by the parsed digests where
both sides have them, so a comment edited in a spec's header leaves its record current; records
made before the parsed digests were kept are compared by their bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from xformer.config.loading import tomllib  # the stdlib's, or tomli before Python 3.11

FILES = ("spec", "recipe")


def digests(path: Path, name: str) -> dict[str, str]:
    """`{name}_sha256` of a TOML file's bytes and `{name}_toml_sha256` of its values."""
    data = path.read_bytes()
    values = json.dumps(tomllib.loads(data.decode("utf-8")), sort_keys=True, default=str)
    return {f"{name}_sha256": hashlib.sha256(data).hexdigest(),
            f"{name}_toml_sha256": hashlib.sha256(values.encode("utf-8")).hexdigest()}


def version_of(spec: Path, recipe: Path) -> dict[str, str]:
    """The four digests of a spec and the recipe it names."""
    return {**digests(spec, "spec"), **digests(recipe, "recipe")}


def changed_since(kept: dict, now: dict[str, str], files: tuple[str, ...] = FILES) -> list[str]:
    """The files (by default "spec", "recipe") whose values differ between a kept version and
    `now`: by the parsed digests where the kept version has them, else by the bytes."""
    changed = []
    for name in files:
        key = f"{name}_toml_sha256" if f"{name}_toml_sha256" in kept else f"{name}_sha256"
        if kept.get(key) != now[key]:
            changed.append(name)
    return changed
