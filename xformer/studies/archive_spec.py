"""A ledger spec's finished runs archived and restored (xformer.studies.archive), for
benchmarks/ledger_chain.sh:

    python -m xformer.studies.archive_spec save SPEC OUT DEST      after the experiment
    python -m xformer.studies.archive_spec restore SPEC DEST OUT   before it

The archive is marked with the digests of the spec and its recipe (the ledger's measured_from),
so runs of an earlier version of either are never restored into the spec as it is now; the
experiment's sittings (its wall time, xformer.studies.sittings) travel with it.
Experiments that score a model again from its weights (lengths, inspect_heads, rescore) cannot
be archived.
"""

from __future__ import annotations

import sys
from pathlib import Path

from xformer.errors import RunError, XformerError
from xformer.studies.archive import archive_runs, restore_runs, stale_archive
from xformer.studies.experiment import load_experiment, run_key
from xformer.studies.ledger import measured_from
from xformer.studies.sittings import merge_sittings


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
    if Path(src).is_dir() and stale_archive(Path(src), version):
        return None
    if not Path(src).is_dir():
        return []
    done = restore_runs(src, out_dir, version)
    merge_sittings(Path(src), Path(out_dir))
    return done


def main(argv: list[str]) -> None:
    if len(argv) == 4 and argv[0] == "save":
        done = save_spec(*argv[1:])
        print(f"{argv[3]}: {len(done)} runs archived" + (f" ({', '.join(done)})" if done else ""))
    elif len(argv) == 4 and argv[0] == "restore":
        done = restore_spec(*argv[1:])
        print(f"{argv[2]}: archived from another version of {argv[1]} or its recipe; nothing restored"
              if done is None else f"{argv[3]}: {len(done)} archived runs restored from {argv[2]}")
    else:
        raise SystemExit("usage: python -m xformer.studies.archive_spec save SPEC OUT DEST | restore SPEC DEST OUT")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except XformerError as error:  # one line, as the CLI says it (a spec that cannot be archived, a bad file)
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
