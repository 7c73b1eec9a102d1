"""A ledger spec's finished runs archived and restored (xformer.studies.archive), and the
teachers its cells name trained where their weights are missing, for benchmarks/ledger_chain.sh:

    python -m xformer.studies.archive_spec save SPEC OUT DEST      after the experiment
    python -m xformer.studies.archive_spec restore SPEC DEST OUT   before it
    python -m xformer.studies.archive_spec teachers SPEC DEVICE [SECTION.KEY=VALUE...]   before it
    python -m xformer.studies.archive_spec reads-corpus SPEC      exit 0 when its runs read data.dataset

The chain passes its corpus (--set data.dataset=PATH) only to the specs that read one: a generated
task's recipe has no data.dataset and refuses it.

A teacher is named by its folder, RUNS/<other spec>/runs/<cell>-s<seed>: the run of that cell
and seed of the other spec (beside SPEC), at its largest budget. An archive keeps no weights, so
on a fresh machine such a run is trained again from its spec (an archived copy found there is
moved aside to <run>.archived first, never deleted).

The archive is marked with the digests of the spec and its recipe (the ledger's measured_from),
so runs of an earlier version of either are never restored into the spec as it is now; the
experiment's sittings (its wall time, xformer.studies.sittings) travel with it.
Experiments that score a model again from its weights (lengths, inspect_heads, rescore) cannot
be archived.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from xformer.errors import RunError, XformerError
from xformer.studies.archive import ARCHIVED, archive_runs, restore_runs, stale_archive
from xformer.studies.experiment_spec import load_experiment, run_key
from xformer.studies.grid import train_to_end
from xformer.studies.ledger import measured_from
from xformer.studies.sittings import merge_sittings

TEACHER = re.compile(r"(?P<cell>.+)-s(?P<seed>\d+)")  # a teacher's folder: the cell and seed of its run


def save_spec(spec: str | Path, out_dir: str | Path, dest: str | Path) -> list[str]:
    """Archive every finished cell of the experiment SPEC ran into OUT; the runs archived now."""
    experiment = load_experiment(spec)
    c = experiment.config
    if c.lengths or c.inspect_heads or c.rescore:
        raise RunError(f"{spec}: its runs are scored again from their weights (lengths, inspect_heads or "
                       "rescore), so they cannot be archived without them")
    cells = [[run_key(cell, seed, b) for b in [0, *c.budgets[:-1]]] for cell in experiment.cells for seed in c.seeds]
    done = archive_runs(cells, out_dir, dest, measured_from(Path(spec), experiment),
                        tokenizer_of=run_key(c.baseline, c.seeds[0], 0))  # the test inputs' lengths
    merge_sittings(Path(out_dir), Path(dest))  # the wall time so far, on every machine
    return done


def restore_spec(spec: str | Path, src: str | Path, out_dir: str | Path) -> list[str] | None:
    """Put SRC's archived runs back into OUT; None when SRC archived another version of SPEC."""
    experiment = load_experiment(spec)
    version = measured_from(Path(spec), experiment)
    if not Path(src).is_dir():
        return []
    if stale_archive(Path(src), version):
        return None
    done = restore_runs(src, out_dir)
    merge_sittings(Path(src), Path(out_dir))
    return done


def train_teachers(spec: str | Path, device: str, overrides: list[str] = (),
                   on_fraction: Callable[[float], None] = lambda f: None) -> list[str]:
    """Train every teacher SPEC's cells name whose best checkpoint is missing; the runs trained."""
    experiment = load_experiment(spec, overrides)
    teachers = {experiment.recipe(cell, seed).distill.teacher for cell in experiment.cells
                for seed in experiment.config.seeds} - {"", None}
    trained = []
    for teacher in sorted(teachers):
        run_dir = Path(teacher)
        if (run_dir / "checkpoints" / "best.safetensors").is_file():
            continue
        found = TEACHER.fullmatch(run_dir.name)
        source = Path(spec).parent / f"{run_dir.parent.parent.name}.toml"
        if run_dir.parent.name != "runs" or not found or not source.is_file():
            raise RunError(f"{spec}: the teacher {teacher} has no checkpoints, and it is not a run of a spec "
                           f"beside it (RUNS/<spec>/runs/<cell>-s<seed>) to train again")
        if (run_dir / ARCHIVED).is_file():  # records without weights: kept beside, the run trained afresh
            run_dir.rename(run_dir.with_name(run_dir.name + ".archived"))
        recipe = load_experiment(source, overrides).recipe(found["cell"], int(found["seed"]))
        train_to_end(recipe, run_dir, device=device, on_fraction=on_fraction)
        trained.append(teacher)
    return trained


def main(argv: list[str]) -> None:
    if len(argv) == 4 and argv[0] == "save":
        done = save_spec(*argv[1:])
        print(f"{argv[3]}: {len(done)} runs archived" + (f" ({', '.join(done)})" if done else ""))
    elif len(argv) == 4 and argv[0] == "restore":
        done = restore_spec(*argv[1:])
        print(f"{argv[2]}: archived from another version of {argv[1]} or its recipe; nothing restored"
              if done is None else f"{argv[3]}: {len(done)} archived runs restored from {argv[2]}")
    elif len(argv) >= 3 and argv[0] == "teachers":
        done = train_teachers(argv[1], argv[2], argv[3:])
        print(f"{argv[1]}: " + (f"teachers trained: {', '.join(done)}" if done else "no teacher to train"))
    elif len(argv) == 2 and argv[0] == "reads-corpus":
        raise SystemExit(0 if load_experiment(argv[1]).reads_corpus() else 1)
    else:
        raise SystemExit("usage: python -m xformer.studies.archive_spec save SPEC OUT DEST | restore SPEC DEST OUT "
                         "| teachers SPEC DEVICE [SECTION.KEY=VALUE...] | reads-corpus SPEC")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except XformerError as error:  # one line, as the CLI says it (a spec that cannot be archived, a bad file)
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
