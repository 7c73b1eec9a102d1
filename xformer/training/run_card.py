"""The run card: what a number needs to be reproduced, written beside it.

`xformer train` puts it in RUN/train.json ("card") and `xformer eval` in every eval JSON: the
resolved recipe and seed, xformer's version and git commit (when it runs from a checkout),
the versions of torch, sacreBLEU, sentencepiece and datasets, Python, the platform and CPU,
the device, the precision and why, the C allocator and its settings (xformer.allocator), the
command line, and a fingerprint of each local data
file read (sha256 of its bytes). A Hub corpus is named with the revision datasets resolved,
not hashed. Evaluation compares the fingerprint of the split it reads with training's and
says when they differ (xformer.tasks)."""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from xformer.allocator import allocator
from xformer.config.schema import Recipe
from xformer.data.corpus import local_files
from xformer.training.device import Runtime

PACKAGES = ("torch", "sacrebleu", "sentencepiece", "datasets")


@dataclass
class RunCard:
    """What reproducing a number needs (module docstring); to_dict() is what the JSON holds."""

    recipe: dict  # the resolved recipe
    seed: int
    versions: dict  # package -> version (None where not installed)
    git_commit: str | None
    python: str
    platform: str
    cpu: str
    device: str | None  # None: another engine decoded
    precision: str | None
    precision_reason: str | None
    allocator: dict  # xformer.allocator.allocator()
    command: list[str]
    data: dict  # split name (or file) -> fingerprint of what it reads
    checkpoint: dict | None = None  # an evaluation's: name, step, tensor sha256, whether final
    wall_seconds: float | None = None  # the whole command's, start to end
    processes: int | None = None  # a training run's processes (torchrun)

    def to_dict(self) -> dict:
        """The card as the JSON files hold it: what only some commands record left out when unset."""
        later = ("checkpoint", "wall_seconds", "processes")
        return {k: v for k, v in asdict(self).items() if not (k in later and v is None)}


def run_card(recipe: Recipe, rt: Runtime | None, data: dict[str, str] | None = None) -> RunCard:
    """The card of a run about to train or evaluate with `recipe` on `rt` (None: another
    engine decodes); `data`: split name -> fingerprint of what it reads
    (data_fingerprints)."""
    return RunCard(recipe=recipe.to_dict(), seed=recipe.train.seed, **environment(),
                   device=str(rt.device) if rt else None, precision=rt.precision if rt else None,
                   precision_reason=rt.reason if rt else None, allocator=allocator(),
                   command=[Path(sys.argv[0]).name, *sys.argv[1:]], data=data or {})


@lru_cache(maxsize=1)
def environment() -> dict:
    """Versions, commit, platform and CPU of this process (computed once)."""
    versions = {}
    for name in ("xformer", *PACKAGES):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"versions": versions, "git_commit": git_commit(), "python": platform.python_version(),
            "platform": platform.platform(), "cpu": cpu_name()}


def git_commit() -> str | None:
    """The commit of the checkout xformer runs from, "+dirty" when files differ; None outside git."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def data_fingerprints(spec: str, fields: list[str]) -> dict[str, str]:
    """Split name -> sha256 (16 hex digits) of the bytes of its local files, each prefixed by its
    name; for a Hub id, {"hub": the id} (datasets resolves and caches the files itself)."""
    files = local_files(spec, fields)
    if files is None:
        return {"hub": spec}
    out = {}
    for name, paths in files.items():
        digest = hashlib.sha256()
        for path in paths:
            digest.update(path.name.encode() + b"\0")
            with path.open("rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    digest.update(block)
        out[name] = digest.hexdigest()[:16]
    return out
