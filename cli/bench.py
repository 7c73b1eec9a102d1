"""xformer bench: benchmarks that compare xformer's own options in one run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from xformer.bench.peers import PEERS, bench_peers
from xformer.bench.quality import (
    LENPENS,
    SYSTEMS,
    QualityBench,
    QualityConfig,
    bench_quality,
    bleu_text,
    quality_markdown,
)
from xformer.bench.speed import (
    AttentionBench,
    AttentionBenchConfig,
    ModelBench,
    ModelBenchConfig,
    bench_attention,
    bench_decode,
    bench_train,
)
from xformer.files import atomic_write_text
from xformer.locks import FolderLock
from xformer.results import Result
from xformer.studies.grid import GridStopped
from xformer_cli.common import (
    Backend,
    Command,
    DeviceOption,
    JsonOption,
    Pattern,
    Precision,
    SetOption,
    choices,
    console,
    stdout,
    user_errors,
)
from xformer_cli.display import GridBar

OutOption = Annotated[Path | None, typer.Option("--out", help="Also write the JSON here.")]

bench_app = typer.Typer(help="Benchmarks measured in one run, each figure with a baseline from the same run.",
                        no_args_is_help=True, rich_markup_mode=None)


@bench_app.command("attention", cls=Command)
@user_errors
def attention(
    lengths: Annotated[list[int], typer.Option("--length", metavar="N", help="Sequence lengths (repeatable) "
                                                                            "[default: 512 1024 2048 4096].")
                       ] = [],  # noqa: B006
    patterns: Annotated[list[Pattern], typer.Option("--pattern", help="Patterns (repeatable) [default: all].")
                        ] = [],  # noqa: B006
    backends: Annotated[list[Backend], typer.Option("--backend", help="Backends (repeatable) "
                                                                 "[default: sdpa, explicit].")
                        ] = [],  # noqa: B006
    d_model: Annotated[int, typer.Option("--d-model", min=8, help="Width of the layer.")] = 256,
    n_heads: Annotated[int, typer.Option("--heads", min=1, help="Attention heads.")] = 4,
    window: Annotated[int, typer.Option("--window", min=1, help="sliding_window / local_global window.")] = 256,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed repeats per cell (median).")] = 3,
    decode_lengths: Annotated[list[int], typer.Option("--decode-length", metavar="N", help="Tokens to generate "
                                                      "when measuring the decoder KV cache (repeatable; 0 skips "
                                                      "it) [default: 512 1024 2048 4096].")] = [],  # noqa: B006
    max_seconds: Annotated[float, typer.Option("--max-seconds", help="Stop a series after a cell this "
                                                                     "slow.")] = 30.0,
    out: OutOption = None,
    device: DeviceOption = "auto",
    as_json: JsonOption = False,
) -> None:
    """Time one self-attention layer, forward + backward, per pattern and backend across lengths:
    seconds and peak memory, ratios to full attention, fitted growth exponents."""
    config = AttentionBenchConfig(device=device, d_model=d_model, n_heads=n_heads, window=window, repeats=repeats,
                                  max_seconds=max_seconds)
    config.lengths = lengths or config.lengths
    config.patterns = [p.value for p in patterns] or config.patterns
    config.backends = [b.value for b in backends] or config.backends
    config.decode_lengths = decode_lengths or config.decode_lengths

    def on_event(kind: str, cell: dict) -> None:
        if kind == "cache":
            console.print(f"[dim]{cell['pattern']:>14} decoder cache after {cell['generated']} tokens: "
                          f"{cell['cache_mb']:.2f} MB[/dim]")
            return
        done = f"{cell['seconds']:.3f} s" if "seconds" in cell else f"skipped: {cell['skipped']}"
        console.print(f"[dim]{cell['pattern']:>14} {cell['backend']:>8} n={cell['length']:<6} {done}[/dim]")

    result = bench_attention(config, on_event=on_event)
    if _saved(result, out, as_json):
        return
    stdout.print(bench_table(result))
    if result.cache:
        stdout.print(cache_table(result))


def cache_table(result: AttentionBench) -> Table:
    table = Table(title="decoder KV cache held while generating, one layer", header_style="bold")
    for column in ("pattern", "tokens generated", "cache MB", "ms per token"):
        table.add_column(column, justify="left" if column == "pattern" else "right")
    for row in result.cache:
        table.add_row(row["pattern"], str(row["generated"]), f"{row['cache_mb']:.3f}",
                      f"{1000 * row['seconds_per_token']:.2f}")
    return table


def bench_table(result: AttentionBench) -> Table:
    table = Table(title=f"self-attention forward + backward on {result.device} (median of "
                        f"{result.config['repeats']})", header_style="bold")
    for column in ("pattern", "backend", "length", "seconds", "vs full", "peak MB", "vs full "):
        table.add_column(column, justify="left" if column in ("pattern", "backend") else "right")
    for c in result.cells:
        if "seconds" not in c:
            table.add_row(c["pattern"], c["backend"], str(c["length"]), "skipped", "", "", "")
            continue
        ratio = c.get("time_vs_full")
        memory = c.get("memory_vs_full")
        table.add_row(c["pattern"], c["backend"], str(c["length"]), f"{c['seconds']:.3f}",
                      f"{ratio:.2f}x" if ratio is not None else "", f"{c['peak_mb']:.0f}",
                      f"{memory:.2f}x" if memory is not None else "")
    fitted = ", ".join(f"{e['pattern']}/{e['backend']} n^{e['time_exponent']:.2f}"
                       for e in result.exponents if e["time_exponent"] is not None)
    table.caption = f"time exponents: {fitted}"
    return table


RoundsOption = Annotated[int, typer.Option("--rounds", min=1, help="Timed rounds (median, min, max).")]
TrainStepsOption = Annotated[int, typer.Option("--steps", min=1, help="Training steps per round.")]


def _model_config(rounds: int, batch: int, precision: Precision, device: str, **extra) -> ModelBenchConfig:
    return ModelBenchConfig(rounds=rounds, batch=batch, precision=precision.value, device=device, **extra)


@bench_app.command("train", cls=Command)
@user_errors
def train(
    steps: TrainStepsOption = 20,
    rounds: RoundsOption = 3,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Sentence pairs per batch.")] = 64,
    precision: Annotated[Precision, typer.Option("--precision", help="fp32, bf16 (autocast) or fp16.")
                         ] = Precision.fp32,
    out: OutOption = None,
    device: DeviceOption = "auto",
    as_json: JsonOption = False,
) -> None:
    """Training speed on the peers' workload (3 + 3 layers, d 256, FFN 1024, vocabulary 8000,
    batches of 24 + 24 tokens): target tokens/s, model GFLOP/s and minor page faults per step,
    per round; MFU against a matmul peak, the peak RSS and the allocator."""
    config = _model_config(rounds, batch, precision, device, steps=steps)
    result = bench_train(config, on_event=lambda kind, p: console.print(
        f"[dim]round {p['round']}: {p['tokens_per_s']:,.0f} target tokens/s[/dim]"))
    tuned = "tuned" if result.allocator["tuned"] else result.allocator["reason"] or "glibc's defaults"
    _show(result, out, as_json, f"MFU {result.mfu:.2f} of a {result.matmul_peak_gflops:,.0f} GFLOP/s matmul peak; "
          f"peak RSS {result.peak_rss_mb:,.0f} MB; allocator {result.allocator['name']} ({tuned})")


@bench_app.command("decode", cls=Command)
@user_errors
def decode(
    rounds: RoundsOption = 3,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Sentences per batch.")] = 64,
    sentences: Annotated[int, typer.Option("--sentences", min=1, help="Sentences per round.")] = 256,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=1, help="Tokens generated per sentence.")] = 32,
    beam: Annotated[int, typer.Option("--beam", min=2, help="Beam size of the beam-search figure.")] = 5,
    precision: Annotated[Precision, typer.Option("--precision", help="fp32 or bf16 (autocast).")] = Precision.fp32,
    out: OutOption = None,
    device: DeviceOption = "auto",
    as_json: JsonOption = False,
) -> None:
    """Decoding speed on the peers' workload: sentences/s of greedy and beam search, exactly
    --new-tokens tokens per sentence."""
    config = _model_config(rounds, batch, precision, device, sentences=sentences, new_tokens=new_tokens, beam=beam)
    result = bench_decode(config, on_event=lambda kind, p: console.print(
        f"[dim]{p['search']} round {p['round']}: {p['sentences_per_s']:,.1f} sentences/s[/dim]"))
    _show(result, out, as_json, f"{sentences} sentences of {config.src_len} tokens, {new_tokens} new tokens each")


def _saved(result: Result, out: Path | None, as_json: bool) -> bool:
    """Write the JSON to --out, and print it instead of a table with --json (then True)."""
    if out is not None:
        atomic_write_text(out, result.to_json())
    if as_json:
        typer.echo(result.to_json(indent=None))
    return as_json


def _show(result: ModelBench, out: Path | None, as_json: bool, caption: str) -> None:
    if _saved(result, out, as_json):
        return
    table = Table(title=f"{result.parameters:,}-parameter encoder-decoder on {result.device}, {result.precision}",
                  header_style="bold", caption=caption)
    for column in ("figure", "median", "min", "max"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for name, figure in result.figures.items():
        table.add_row(name.replace("_", " "), *(f"{figure[k]:,.1f}" for k in ("median", "min", "max")))
    stdout.print(table)


Peer = choices("Peer", PEERS)


@bench_app.command("peers", cls=Command)
@user_errors
def peers(
    names: Annotated[list[Peer], typer.Option("--peer", help="Peers (repeatable) [default: all].")
                     ] = [],  # noqa: B006
    rounds: RoundsOption = 2,
    steps: TrainStepsOption = 20,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Pairs (training) and sentences (decoding) "
                                                              "per batch.")] = 64,
    sentences: Annotated[int, typer.Option("--sentences", min=1, help="Sentences decoded per round.")] = 256,
    precision: Annotated[Precision, typer.Option("--precision", help="fp32 or bf16 (autocast, every peer).")
                         ] = Precision.fp32,
    data: Annotated[str | None, typer.Option("--data", metavar="CORPUS",
                                             help="Also train every peer on real batches of this translation "
                                                  "corpus (a Multi30k-like folder or a Hub id), cut as xformer "
                                                  "train cuts them.")] = None,
    data_batches: Annotated[int, typer.Option("--data-batches", min=1, help="Real batches per round.")] = 20,
    out: OutOption = None,
    device: DeviceOption = "auto",
    as_json: JsonOption = False,
) -> None:
    """The peers' workload in xformer, HF Marian, x-transformers and torch.nn.Transformer, each
    in its own process, round after round: training target tokens/s and decoding sentences/s,
    with xformer's ratio to each; with --data, training on real token-bucketed batches too."""
    config = _model_config(rounds, batch, precision, device, steps=steps, sentences=sentences, data=data,
                           data_batches=data_batches)
    if data:
        console.print(f"[dim]cutting {data_batches} training batches of {data} (tokenizer first)[/dim]")

    def on_event(kind: str, p: dict) -> None:
        shown = p.get("error") or ", ".join(f"{k.replace('_', ' ')} {v:,.1f}" for k, v in p.items()
                                            if k not in ("round", "peer"))
        console.print(f"[dim]round {p['round']} {p['peer']}: {shown}[/dim]")

    result = bench_peers(config, [n.value for n in names] or None, on_event=on_event)
    if _saved(result, out, as_json):
        return
    stdout.print(_peers_table(result, rounds))


def _peers_table(result, rounds: int) -> Table:
    """bench peers' figures, one column a peer, with xformer's ratios and what the run notes."""
    table = Table(title=f"the peers' workload on {result.device}, {result.precision}: median of {rounds} rounds "
                        "(min-max)", header_style="bold")
    table.add_column("figure")
    shown = [p for p in result.peers if p in result.figures]
    for peer in shown:
        table.add_column(f"{peer} ({result.parameters[peer] / 1e6:.2f}M)", justify="right")
    table.add_column("xformer vs", justify="right")
    figures = sorted({f for p in shown for f in result.figures[p]}, key=lambda f: f.startswith("beam"))
    for figure in figures:
        cells = []
        for peer in shown:
            got = result.figures[peer].get(figure)
            cells.append(f"{got['median']:,.1f} ({got['min']:,.0f}-{got['max']:,.0f})" if got else "n/a")
        ratios = ", ".join(f"{r:.2f}x {p}" for p, r in result.xformer_vs.get(figure, {}).items())
        table.add_row(figure.replace("_", " "), *cells, ratios)
    if result.data:
        d = result.data
        table.caption = (f"multi30k: {d['batches']} batches, {d['pairs']:,} pairs, {d['target_tokens']:,} target "
                         f"tokens; padding {100 * d['padding_fraction']:.1f}% of xformer's batches "
                         f"({100 * d['random_padding_fraction']:.1f}% in random batches of the same size)\n")
    if result.mfu:
        shares = ", ".join(f"{peer} {share:.2f}" for peer, share in result.mfu.items())
        table.caption = (table.caption or "") + (f"MFU, synthetic training: {shares} of a "
                                                 f"{result.matmul_peak_gflops:,.0f} GFLOP/s matmul peak\n")
    for peer, error in result.errors.items():
        table.caption = (table.caption or "") + f"{peer} failed: {error}\n"
    return table


System = choices("System", SYSTEMS)


@bench_app.command("quality", cls=Command)
@user_errors
def quality(
    recipe: Annotated[Path, typer.Argument(help="The recipe both systems train, e.g. "
                                                "recipes/translation/multi30k_de_en.toml.")],
    out: Annotated[Path, typer.Option("--out", help="Folder of the runs and quality.json; run again to go on "
                                                    "where it stopped.")],
    minutes: Annotated[float, typer.Option("--minutes", min=0.01, help="Wall-clock budget of each run, "
                                                                       "data and tokenizer included.")] = 50.0,
    seeds: Annotated[list[int], typer.Option("--seed", help="Seeds (repeatable) [default: 1 2 3].")
                     ] = [],  # noqa: B006
    systems: Annotated[list[System], typer.Option("--system", help="Systems (repeatable) [default: all].")
                       ] = [],  # noqa: B006
    lenpens: Annotated[list[float], typer.Option("--lenpen", help="Length penalties chosen among on validation "
                                                                  "(repeatable) [default: 1.0 1.6 2.2].")
                       ] = [],  # noqa: B006
    jobs: Annotated[int, typer.Option("--jobs", min=1, help="Runs at once, each pinned to an equal share of the "
                                                          "CPUs with as many threads (the folder keeps it).")] = 1,
    overrides: SetOption = [],  # noqa: B006
    device: DeviceOption = "auto",
    as_json: JsonOption = False,
) -> None:
    """Translation quality of xformer against HF MarianMTModel of the recipe's size trained from
    scratch on the same corpus, tokenizer, batches and wall-clock budget: each run in its own
    process, the checkpoint and length penalty chosen on validation, test scored once, paired
    bootstrap seed by seed. One machine a folder: a call on another is refused."""
    config = QualityConfig(recipe=str(recipe), sets=list(overrides), systems=[s.value for s in systems] or
                           list(SYSTEMS), seeds=seeds or [1, 2, 3], minutes=minutes,
                           lenpens=lenpens or list(LENPENS), device=device, jobs=jobs)
    with FolderLock(out, "bench quality"), GridBar("quality", console) as bar:
        def on_event(kind: str, p: dict) -> None:
            if kind == "plan":
                bar.plan(p["runs"], p["done"], out)
            elif kind == "training":
                bar.start(p["name"], False)
            elif kind == "tick":
                bar.advance(p["fraction"])
            elif kind == "trained":
                bar.end(f"{p['system']} seed {p['seed']}: {p['steps']:,} steps ({p['epochs']:.1f} epochs, "
                        f"{p['precision']}), test BLEU {p['test_bleu']:.2f} (lenpen {p['lenpen']:g})")

        try:
            result = bench_quality(config, out, on_event=on_event)
        except (KeyboardInterrupt, GridStopped) as stop:
            name = stop.signal if isinstance(stop, GridStopped) else "SIGINT"
            typer.echo(f"stopped by {name}: the runs in flight stopped part way (a time budget cannot resume); "
                       f"move their folders in {out} away and run the same command again", err=True)
            raise typer.Exit(130 if name == "SIGINT" else 0) from None
    atomic_write_text(out / "quality.json", result.to_json())
    atomic_write_text(out / "quality.md", quality_markdown(result))
    if as_json:
        typer.echo(result.to_json(indent=None))
        return
    stdout.print(quality_table(result))


def quality_table(result: QualityBench) -> Table:
    minutes, jobs = result.config["minutes"], result.config["jobs"]
    precisions = ", ".join(sorted({f"{r['system']} {r['precision']}" for r in result.runs}))
    threads = "/".join(str(t) for t in sorted({r.get("threads") for r in result.runs if r.get("threads")}))
    machine = ", ".join(sorted({r["cpu"] for r in result.runs if r.get("cpu")}))
    shared = f", {jobs} runs at once" if jobs > 1 else ""
    table = Table(title=f"{minutes:g} minutes a run ({precisions}; {threads or '?'} threads a run{shared}; "
                        f"{machine or 'CPU not recorded'})", header_style="bold")
    for column in ("system", "seed", "steps", "epochs", "best", "valid", "last", "lenpen", "beam", "test",
                   "chrF"):
        table.add_column(column, justify="left" if column == "system" else "right")
    for r in result.runs:
        chosen = r["valid_beam_bleu"][f"{r['lenpen']:g}"]
        table.add_row(r["system"], str(r["seed"]), f"{r['steps']:,}", f"{r['epochs']:.1f}", f"{r['best_step']:,}",
                      f"{r['valid_bleu']:.2f}", bleu_text(r.get("last_valid_bleu")), f"{r['lenpen']:g}",
                      f"{chosen:.2f}", f"{r['test_bleu']:.2f}", f"{r['test_chrf']:.2f}")
    lines = ["best: the step chosen by greedy validation BLEU (valid); last: greedy validation BLEU where the "
             "budget ended; lenpen chosen by beam validation BLEU (beam); test: cased sacreBLEU, scored once"]
    for system, m in result.means.items():
        spread = f" (sd {m['spread']:.2f})" if m["spread"] is not None else ""
        lines.append(f"{system}: mean test BLEU {m['test_bleu']:.2f} over {m['seeds']} seed(s){spread}")
    for peer, tests in result.paired.items():
        shown = ", ".join(f"seed {t['seed']} {t['difference']:+.2f} (p {t['p_value']:.3f})" for t in tests)
        lines.append(f"xformer vs {peer}: {shown}")
    table.caption = "\n".join(lines)
    return table
