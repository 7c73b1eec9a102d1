"""xformer claims: the claims ledger (docs/claims.md) from the claim specs and their experiments."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from xformer.studies.ledger import build_ledger
from xformer_cli.common import JsonOption, stdout, user_errors

STYLE = {"supported": "green", "contradicted": "red", "depends": "yellow"}


@user_errors
def claims(
    specs: Annotated[Path, typer.Argument(help="Folder of claim specs (TOML with a [claim] table).")] = Path(
        "recipes/claims"),
    runs: Annotated[Path, typer.Option("--runs", help="Folder of experiment folders, one per spec, named "
                                                      "after it (`xformer experiment SPEC --out RUNS/NAME`).")] = Path(
        "runs/claims"),
    out: Annotated[Path, typer.Option("--out", help="The ledger to write.")] = Path("docs/claims.md"),
    records: Annotated[Path | None, typer.Option("--records", help="Folder of the results the ledger keeps, "
                                                                   "used where a spec has no run folder "
                                                                   "[default: beside --out, claims/].")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out even when it is not a ledger "
                                                                "this command wrote.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Judge every claim against its experiment's results and write the ledger: each claim in
    its circulating wording, the experiment and its command, the numbers with their spread and a
    verdict (supported, contradicted, depends, inconclusive)."""
    ledger = build_ledger(specs, runs, out, records, overwrite=overwrite)
    if as_json:
        typer.echo(ledger.to_json(indent=None))
        return
    table = Table(title="claims ledger", header_style="bold")
    for column in ("#", "claim", "verdict", "spec"):
        table.add_column(column)
    for row in ledger.rows:
        style = STYLE.get(row["verdict"], "dim")
        table.add_row(str(row["number"]), row["says"], f"[{style}]{row['verdict']}[/{style}]", row["name"])
    stdout.print(table)
    stdout.print(f"[dim]{ledger.markdown}; records in {ledger.records}[/dim]")
