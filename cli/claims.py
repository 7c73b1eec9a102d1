"""xformer claims: the claims ledger (docs/claims.md) from the claim specs and their experiments."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from xformer.errors import RecipeError
from xformer.studies.ledger import build_ledger
from xformer.studies.plan import plan_ledger
from xformer_cli.common import DeviceOption, JsonOption, stdout, user_errors

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
    plan: Annotated[bool, typer.Option("--plan", help="Write nothing: count what the specs cost before they run "
                                                      "(runs, runs an earlier spec trains already, steps), in "
                                                      "--spec order as a chain runs them with --reuse.")] = False,
    spec_names: Annotated[list[str], typer.Option("--spec", help="With --plan: a spec of SPECS by name, in the "
                                                                "order they run (repeatable) [default: every spec, "
                                                                "by name].")] = [],  # noqa: B006
    timed: Annotated[bool, typer.Option("--time", help="With --plan: time a few steps and a validation of each "
                                                       "distinct model here, and estimate the runs' hours and "
                                                       "the wall-clock hours (test decoding not counted).")] = False,
    jobs: Annotated[int, typer.Option("--jobs", min=1, help="With --plan: runs at once, as `xformer experiment "
                                                          "--jobs`; each is timed with its share of the CPU "
                                                          "threads.")] = 2,
    device: DeviceOption = "cpu",
    overrides: Annotated[list[str], typer.Option(
        "--set", help="With --plan: a recipe value for every cell, as `xformer experiment --set`; "
                      "data.dataset=PATH goes only to specs that read a corpus, as the chain passes it; "
                      "repeatable.")] = [],  # noqa: B006
    as_json: JsonOption = False,
) -> None:
    """Judge every claim against its experiment's results and write the ledger: each claim in
    its circulating wording, the experiment and its command, the numbers with their spread and a
    verdict (supported, contradicted, depends, inconclusive). With --plan, count what measuring
    them costs instead."""
    if plan:
        _plan(specs, spec_names, timed=timed, jobs=jobs, device=device, overrides=overrides, as_json=as_json)
        return
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


def _plan(folder: Path, names: list[str], *, timed: bool, jobs: int, device: str, overrides: list[str],
          as_json: bool) -> None:
    paths = [folder / f"{name}.toml" for name in names] if names else sorted(folder.glob("*.toml"))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise RecipeError(f"--spec: expected a spec in {folder}, found no {missing[0]}")
    result = plan_ledger(paths, timed=timed, jobs=jobs, device=device, overrides=overrides,
                         emit=lambda kind, fields: stdout.print(f"[dim]{fields['message']}[/dim]") if not as_json
                         else None)
    if as_json:
        typer.echo(result.to_json(indent=None))
        return
    table = Table(title=f"what the ledger costs ({jobs} runs at once)", header_style="bold")
    columns = ["spec", "runs", "trained earlier", "new runs", "new steps"]
    if timed:
        columns += ["run hours", "wall hours"]
    for column in columns:
        table.add_column(column, justify="left" if column == "spec" else "right")
    for row in result.specs:
        if "runs" not in row:
            table.add_row(row["spec"], "[dim]blocked[/dim]", *[""] * (len(columns) - 2))
            continue
        cells = [row["spec"] + (" (one at a time)" if row["alone"] else ""), str(row["runs"]), str(row["shared_runs"]),
                 str(row["new_runs"]), f"{row['new_steps']:,}"]
        if timed:
            cells += [f"{row['run_hours']:.2f}", f"{row['wall_hours']:.2f}"]
        table.add_row(*cells)
    total = result.total
    cells = ["total", str(total["runs"]), str(total["runs"] - total["new_runs"]), str(total["new_runs"]),
             f"{total['new_steps']:,}"]
    if timed:
        cells += [f"{total['run_hours']:.2f}", f"{total['wall_hours']:.2f}"]
    table.add_row(*cells, style="bold")
    stdout.print(table)
    if timed:
        stdout.print("[dim]estimated from "
                     + "; ".join(f"{p['pace_of']}: {p['step_seconds']:.3f} s a step, {p['valid_seconds']:.1f} s a "
                                 f"validation ({p['threads']} thread(s), {p['precision']})" for p in result.paces)
                     + "; test decoding not counted[/dim]")
