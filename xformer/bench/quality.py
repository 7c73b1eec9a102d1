"""Translation quality against HF Marian at the same time budget (`xformer bench quality`).

Each system trains a recipe (the flagship by default) for `minutes` of wall time in a process of
its own, then chooses and scores in that process; seed by seed xformer and the first peer, then
the other peers; one run at a time, or with `jobs` > 1 that many at once, each pinned to its own
share of the CPUs with as many threads (so with 2, xformer's run of each seed trains beside the
first peer's, and the two main rows share the machine alike):

    xformer     `xformer train` of the recipe as it stands
    marian      HF transformers' MarianMTModel of the recipe's size from a MarianConfig (nothing
                downloaded), trained as the HF peer was run: AdamW lr 7e-4, betas (0.9, 0.98),
                weight decay 1e-4, 1,000 warmup steps then inverse square root
                (get_inverse_sqrt_schedule), clip 1.0, label smoothing 0.1, ReLU, dropout 0.1
    marian_wsd  the same with HF's own get_wsd_schedule: warmup, constant, then a 1-sqrt cooldown
                over the last 20% of the steps it estimates the budget holds (estimated at its
                first validation, when a step and a validation have both been timed)

Fair both ways, by construction rather than by care:
- the same corpus, sentencepiece settings and batches: the peer is fed by the recipe's own task
  (the token buckets of data.max_tokens, the same order for the same seed);
- the same budget accounting: each process's clock starts before the corpus is loaded, so
  loading, tokenizer training and validation are inside the minutes for both;
- the same threads, allocator (inherited from this process) and precision (the recipe's
  train.precision, resolved by the same rule: bf16 autocast where "auto" picks it);
- the same selection: validated every train.valid_every steps and at the end, the best
  checkpoint by cased greedy sacreBLEU on validation; then one length penalty chosen on
  validation from the same grid for both, beam eval.beam; test scored once, with that checkpoint
  and penalty. Paired bootstrap (sacreBLEU) of xformer against each peer, seed by seed;
- the same machine: the output folder keeps the CPU, CPU count, torch, device and jobs of its
  first call (machine.json), and a later call on another machine, or with other jobs, is refused rather
  than mixed into one side-by-side;
- the same protocol: it keeps the recipe (its name and digest), the overrides, the minutes and
  the length penalties too (protocol.json), refused alike when they differ.
A folder is one benchmark, filled a sitting at a time (--seed and --system pick what a call
trains); every call reports every scored run in it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from xformer.bench.marian import score_marian, train_marian
from xformer.config.loading import load_recipe
from xformer.errors import RunError, XformerError
from xformer.evaluate import evaluate_run, paired_set
from xformer.events import Event, ignore
from xformer.files import atomic_write_text
from xformer.results import Result
from xformer.significance import paired_bleu
from xformer.studies import versions
from xformer.studies.grid import stop_if_asked
from xformer.studies.jobs import Jobs
from xformer.tasks.base import EvalRequest
from xformer.train import run
from xformer.training.progress import StopSignals
from xformer.training.run_card import cpu_name
from xformer.training.run_folder import run_state

SYSTEMS = ("xformer", "marian", "marian_wsd")
LENPENS = (1.0, 1.6, 2.2)


@dataclass
class QualityConfig:
    recipe: str  # the recipe file both systems train (their size, corpus, tokenizer, budget accounting)
    sets: list[str] = field(default_factory=list)  # --set overrides of the recipe, for both
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    minutes: float = 50.0
    lenpens: list[float] = field(default_factory=lambda: list(LENPENS))
    device: str = "auto"
    jobs: int = 1  # runs at once, each pinned to len(CPUs) // jobs of them (cpu_groups)


@dataclass
class QualityBench(Result):
    """Per run (system x seed): what it trained and scored; per peer: xformer's paired tests."""

    config: dict
    runs: list[dict]  # {"system", "seed", "steps", "epochs", "train_seconds", "precision", "cpu", "threads",
    #                    "cpus", "best_step", "valid_bleu" (greedy, the best checkpoint), "last_valid_bleu" (greedy,
    #                    the last validation: where the budget ended), "lenpen", "valid_beam_bleu",
    #                    "test_bleu", "test_chrf", "hypotheses"}
    means: dict  # system -> {"test_bleu", "spread"} over seeds
    paired: dict  # peer -> [paired_bleu of xformer against it, one per seed]


# ---------------------------------------------------------------------------- the benchmark
def bench_quality(config: QualityConfig, out_dir: str | Path, *, on_event: Event | None = None) -> QualityBench:
    """Train every system for every seed (each in its own process, `config.jobs` at a time),
    choose the length penalty on validation, score test once, and test xformer against each
    peer, seed by seed. Events: "plan" {"runs", "done"}, "training" {"name"}, "tick" {"fraction":
    the runs in flight, summed}, "trained" {run}. A run whose folder already holds its result is
    not trained again (the benchmark resumes), on the machine it began on only."""
    emit = on_event or ignore
    out_dir = Path(out_dir)
    unknown = [s for s in config.systems if s not in SYSTEMS]
    if unknown:
        raise XformerError(f"system {unknown[0]}: expected one of {', '.join(SYSTEMS)}")
    groups = cpu_groups(config.jobs)
    load_recipe(config.recipe, config.sets)  # a bad recipe or --set fails before an hour of training
    folders = [(system, seed, out_dir / f"{system}-seed{seed}") for seed in config.seeds for system in config.systems]
    for _, _, folder in folders:
        if not (folder / "quality.json").is_file() and folder.exists() and not _ended(folder):
            raise RunError(f"{folder}: a run that stopped before the end of its budget; move it away to train "
                           "it again")
    out_dir.mkdir(parents=True, exist_ok=True)
    _pin_machine(out_dir, config)
    _pin_protocol(out_dir, config)
    # seed by seed, the first two systems (xformer and a peer) side by side; the other peers after
    order = [(s, seed) for seed in config.seeds for s in config.systems[:2]] + \
        [(s, seed) for s in config.systems[2:] for seed in config.seeds]
    waiting = [(s, seed, out_dir / f"{s}-seed{seed}") for s, seed in order
               if not (out_dir / f"{s}-seed{seed}" / "quality.json").is_file()]
    emit("plan", {"runs": len(folders), "done": len(folders) - len(waiting)})
    for _, _, folder in folders:
        if (folder / "quality.json").is_file():
            emit("trained", json.loads((folder / "quality.json").read_text()))
    _run_all(waiting, config, groups, emit)
    return quality_report(out_dir, config)


def quality_report(out_dir: Path, config: QualityConfig) -> QualityBench:
    """The side-by-side of every scored run in `out_dir`, not only this call's: a folder is one
    benchmark (one machine, one protocol, both pinned), filled a sitting at a time with --seed and
    --system. Each system's mean over its seeds; xformer against each peer, paired seed by seed
    wherever both scored that seed."""
    runs = [json.loads(path.read_text()) for path in out_dir.glob("*-seed*/quality.json")]
    runs = sorted((r for r in runs if r["system"] in SYSTEMS), key=lambda r: (r["seed"], SYSTEMS.index(r["system"])))
    for r in runs:  # scored before quality.json kept it: the run's own validation log has it
        r.setdefault("last_valid_bleu", last_valid_bleu(out_dir / f"{r['system']}-seed{r['seed']}"))
    means = {}
    for system in (s for s in SYSTEMS if any(r["system"] == s for r in runs)):
        scores = [r["test_bleu"] for r in runs if r["system"] == system]
        means[system] = {"test_bleu": statistics.mean(scores),
                         "spread": statistics.stdev(scores) if len(scores) > 1 else None, "seeds": len(scores)}
    scored = {(r["system"], r["seed"]) for r in runs}
    paired = {}
    for peer in (s for s in means if s != "xformer"):
        seeds = sorted(seed for system, seed in scored if system == peer and ("xformer", seed) in scored)
        if seeds:
            paired[peer] = []
        for seed in seeds:
            ours, theirs = (_recorded(out_dir, s, seed, "hypotheses") for s in ("xformer", peer))
            refs = _recorded(out_dir, "xformer", seed, "references")
            paired[peer].append({"seed": seed, **paired_bleu(ours, theirs, refs).to_dict()})
    slim = [{k: v for k, v in r.items() if k != "references"} for r in runs]
    return QualityBench(config=vars(config), runs=slim, means=means, paired=paired)


def cpu_groups(jobs: int) -> list[list[int] | None]:
    """The CPUs each of `jobs` runs at once is pinned to: this process's CPUs in equal shares
    (the remainder unused); [None] for one run at a time, which keeps what it inherits."""
    if jobs == 1:
        return [None]
    mine = sorted(os.sched_getaffinity(0))
    if jobs > len(mine):
        raise XformerError(f"--jobs {jobs}: expected at most {len(mine)}, the CPUs this process may use "
                           "(each run needs one of its own)")
    share = len(mine) // jobs
    return [mine[i * share:(i + 1) * share] for i in range(jobs)]


def _pin_machine(out_dir: Path, config: QualityConfig) -> None:
    """Record the machine of the folder's first call, and refuse another: one side-by-side is
    measured on one machine, with one way of sharing it."""
    here = {"cpu": cpu_name(), "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "device": config.device, "jobs": config.jobs}
    pinned = out_dir / "machine.json"
    if not pinned.is_file():
        atomic_write_text(pinned, json.dumps(here, indent=2))
        return
    there = json.loads(pinned.read_text())
    differs = [f"{key} {there.get(key)!r} there, {value!r} here" for key, value in here.items()
               if there.get(key) != value]
    if differs:
        raise RunError(f"{pinned}: this benchmark's runs were measured with another machine or setting "
                       f"({'; '.join(differs)}); measure this one into another --out")


def _pin_protocol(out_dir: Path, config: QualityConfig) -> None:
    """Record the protocol of the folder's first call (the recipe's values, its overrides, the
    minutes and the length penalties), and refuse another: runs trained under two protocols
    are not one side-by-side. Seeds and systems may differ from call to call. The recipe is
    compared by its values (studies.versions), so an edited comment in it is no new protocol;
    a folder pinned before the values' digest was kept is compared by the recipe's bytes."""
    digests = versions.digests(Path(config.recipe), "recipe")
    here = {"recipe": Path(config.recipe).name, **digests,
            "sets": sorted(config.sets), "minutes": config.minutes, "lenpens": sorted(config.lenpens)}
    pinned = out_dir / "protocol.json"
    if not pinned.is_file():
        atomic_write_text(pinned, json.dumps(here, indent=2))
        return
    there = json.loads(pinned.read_text())
    differs = [key for key, value in here.items() if key not in digests and there.get(key) != value]
    if versions.changed_since(there, digests, files=("recipe",)):
        key = "recipe_toml_sha256" if "recipe_toml_sha256" in there else "recipe_sha256"
        differs.append(key)
    if differs:
        raise RunError(f"{pinned}: this benchmark's runs were trained under another protocol "
                       f"({', '.join(f'{k} {there.get(k)!r} there, {here[k]!r} here' for k in differs)}); "
                       "measure this one into another --out")


def _ended(folder: Path) -> bool:
    """A run that trained its whole budget, by the rule every driver of runs uses (run_state):
    a train.json (written last, by both systems) that does not say it was interrupted (a stopped
    `xformer train` writes one that does)."""
    return run_state(folder) == "trained"


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def _recorded(out_dir: Path, system: str, seed: int, what: str) -> list[str]:
    """The lines of a scored run's test hypotheses or references (quality.json names the file)."""
    record = json.loads((out_dir / f"{system}-seed{seed}" / "quality.json").read_text())
    return _lines(out_dir / record[what])


def _run_all(waiting: list[tuple[str, int, Path]], config: QualityConfig, groups: list, emit: Event) -> None:
    """Each waiting run in a fresh interpreter (its own threads, allocator state, clock), as many
    at once as there are CPU groups, the bar moved by the time each has had. A run that fails
    lets the others in flight finish, starts no more, and is reported by its stderr's last line.
    A stop signal (Ctrl-C, SIGTERM, SIGHUP) is passed on to the runs in flight, which stop as
    `xformer train` does (their folders are then stopped runs: moved away, trained again); the
    benchmark raises GridStopped once they have."""
    waiting, free, jobs, failed = list(waiting), list(groups), Jobs(), None
    held = {}  # a job's key -> the CPUs it holds

    def in_flight():
        emit("training", {"name": ", ".join(job.key[2].name for job in jobs)})

    with StopSignals() as stops:
        try:
            while waiting or len(jobs):
                while waiting and free and failed is None and not stops.received:
                    system, seed, folder = waiting.pop(0)
                    cpus = free.pop(0)
                    held[(system, seed, folder)] = cpus
                    jobs.start((system, seed, folder), *_command(system, seed, folder, config, cpus), append=True)
                    in_flight()
                time.sleep(1.0)
                if stops.received:
                    jobs.stop()
                    stop_if_asked(stops)
                now = time.perf_counter()
                emit("tick", {"fraction": sum(min(1.0, (now - job.began) / (config.minutes * 60)) for job in jobs)})
                for job in jobs.ended():
                    system, seed, folder = job.key
                    free.append(held.pop(job.key))
                    if job.process.returncode != 0:
                        failed = failed or RunError(f"{system} (seed {seed}) stopped: {job.last_line()}; see {job.log}")
                        continue
                    emit("trained", json.loads((folder / "quality.json").read_text()))
                    if len(jobs):
                        in_flight()
        finally:
            jobs.stop()  # never leave a run training with no benchmark to read it
    if failed is not None:
        raise failed


def _command(system: str, seed: int, folder: Path, config: QualityConfig,
             cpus: list[int] | None) -> tuple[list[str], Path, dict]:
    """`python -m xformer.bench.quality SYSTEM FIELDS`: trains (unless the run ended already), then
    chooses the length penalty on validation and scores test; its stderr to the folder's .log.
    The command, the log and the environment (as many threads as `cpus`)."""
    command = [sys.executable, "-m", "xformer.bench.quality", system, json.dumps(
        {"recipe": str(config.recipe), "sets": config.sets, "seed": seed, "minutes": config.minutes,
         "device": config.device, "out": str(folder), "lenpens": config.lenpens, "cpus": cpus})]
    env = os.environ.copy()
    if cpus is not None:  # read by torch's thread pools as the interpreter starts
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(len(cpus))
    return command, folder.with_name(folder.name + ".log"), env


def _select_and_score(system: str, recipe, folder: Path, lenpens: list[float], device: str) -> None:
    """Length penalty chosen on validation (beam eval.beam, the best checkpoint), then test once;
    writes folder/quality.json, folder/test.hyp and folder/test.ref."""
    valid, test = recipe.data.valid_split, recipe.data.test_split
    if system == "xformer":
        def score(split, lenpen):
            result = evaluate_run(folder, split=split, lenpen=lenpen, checkpoint="best", device=device)
            return {"bleu": result.bleu, "chrf": result.chrf, "hypotheses": _lines(Path(result.hypotheses))}
    else:
        def score(split, lenpen):
            return score_marian(recipe, folder, split, lenpen=lenpen, device=device)
    trained = json.loads((folder / "train.json").read_text())
    steps, seconds, best = trained["steps"], trained["train_seconds"], trained["best"]
    epochs, precision = trained["epochs"], trained["precision"]
    on_valid = {lenpen: score(valid, lenpen)["bleu"] for lenpen in lenpens}
    lenpen = max(on_valid, key=lambda k: (on_valid[k], -abs(k - 1.0)))  # a tie goes to the plainer penalty
    tested = score(test, lenpen)
    refs = paired_set(recipe, EvalRequest(split=test))  # the references, as every paired test reads them
    atomic_write_text(folder / "test.hyp", "".join(h + "\n" for h in tested["hypotheses"]))
    atomic_write_text(folder / "test.ref", "".join(r + "\n" for r in refs))
    record = {"system": system, "seed": recipe.train.seed, "steps": steps, "epochs": epochs,
              "train_seconds": seconds, "precision": precision, "cpu": cpu_name(),
              "threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0)), "best_step": best["step"],
              "valid_bleu": best.get("bleu"), "last_valid_bleu": last_valid_bleu(folder),
              "valid_beam_bleu": {f"{k:g}": v for k, v in on_valid.items()},
              "lenpen": lenpen,
              "test_bleu": tested["bleu"], "test_chrf": tested["chrf"],
              "regularisation": _regularisation(trained.get("regularisation")),
              "hypotheses": f"{folder.name}/test.hyp", "references": f"{folder.name}/test.ref"}
    atomic_write_text(folder / "quality.json", json.dumps(record, indent=2))


def last_valid_bleu(folder: Path) -> float | None:
    """Greedy validation BLEU at the run's last validation (metrics.jsonl): how far from its best
    the run ended, which a schedule that ends with its budget keeps small."""
    path = folder / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    valid = [m for m in lines if m.get("kind") == "valid" and m.get("bleu") is not None]
    return valid[-1]["bleu"] if valid else None


def _regularisation(record: dict | None) -> str:
    """train.json's regularisation = "budget" choice in words ("" for a recipe's own values)."""
    if not record:
        return ""
    chosen = ", ".join(f"{k.split('.')[1]} {v:g}" for k, v in record["chosen"].items())
    return f"{chosen} ({record['expected_epochs']:.1f} epochs expected)"


def _own(system: str) -> str:
    """The regularisation column of a run that did not choose from its budget."""
    return "as the recipe" if system == "xformer" else "the peer's own: dropout 0.1, no sampling"


def quality_markdown(result: QualityBench) -> str:
    """The side-by-side as a Markdown page (quality.md beside quality.json): a row a run, each
    system's mean, and xformer's paired tests against each peer."""
    c = result.config
    machine = ", ".join(sorted({r["cpu"] for r in result.runs if r.get("cpu")})) or "CPU not recorded"
    threads = "/".join(str(t) for t in sorted({r["threads"] for r in result.runs if r.get("threads")})) or "?"
    lines = [f"# {Path(c['recipe']).name}: xformer against HF Marian, {c['minutes']:g} minutes a run", "",
             f"Machine: {machine}; {threads} thread(s) a run, {c['jobs']} run(s) at once; device {c['device']}.", "",
             "| system | seed | precision | steps (epochs) | regularisation | best step | valid greedy best / last | "
             "lenpen | "
             "valid beam | test2016 BLEU | chrF |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result.runs:
        beam = r["valid_beam_bleu"][f"{r['lenpen']:g}"]
        lines.append(f"| {r['system']} | {r['seed']} | {r['precision']} | {r['steps']:,} ({r['epochs']:.1f}) | "
                     f"{r.get('regularisation') or _own(r['system'])} | {r['best_step']:,} | {r['valid_bleu']:.2f} / "
                     f"{bleu_text(r.get('last_valid_bleu'))} | "
                     f"{r['lenpen']:g} | {beam:.2f} | **{r['test_bleu']:.2f}** | "
                     f"{r['test_chrf']:.2f} |")
    lines += ["", "| system | mean test2016 BLEU | sd | seeds |", "|---|---|---|---|"]
    for system, m in result.means.items():
        sd = f"{m['spread']:.2f}" if m["spread"] is not None else "-"
        lines.append(f"| {system} | {m['test_bleu']:.2f} | {sd} | {m['seeds']} |")
    for peer, tests in result.paired.items():
        lines += ["", f"xformer against {peer}, paired bootstrap (sacreBLEU) seed by seed: " + "; ".join(
            f"seed {t['seed']} {t['difference']:+.2f} (p {t['p_value']:.3f})" for t in tests) + "."]
    lines += ["", "The checkpoint is chosen by greedy validation BLEU, the length penalty by beam validation "
                  "BLEU; test2016 (cased sacreBLEU) is scored once, with both."]
    return "\n".join(lines) + "\n"


def bleu_text(value: float | None) -> str:
    """A BLEU score for a table, "-" where the run has none."""
    return "-" if value is None else f"{value:.2f}"


def _main(system: str, fields: dict) -> None:
    if fields.get("cpus"):
        os.sched_setaffinity(0, fields["cpus"])
        torch.set_num_threads(len(fields["cpus"]))
    sets = [*fields["sets"], f"train.seed={fields['seed']}", f"train.max_time={fields['minutes']}"]
    recipe = load_recipe(fields["recipe"], sets)
    out = Path(fields["out"])
    if not _ended(out):
        if system == "xformer":
            run(recipe, out, device=fields["device"], recipe_path=fields["recipe"])
        else:
            peer = recipe
            if getattr(recipe.data, "sampling_alpha", 0.0):  # the HF peer as it was run: one segmentation
                peer = load_recipe(fields["recipe"], [*sets, "data.sampling_alpha=0.0"])
            train_marian(peer, out, schedule="wsd" if system == "marian_wsd" else "inverse_sqrt",
                         minutes=fields["minutes"], device=fields["device"])
    if not _ended(out):  # a stop signal ended the training: a part of the budget is not scored
        raise SystemExit(f"{out}: stopped before the end of its budget; not scored")
    _select_and_score(system, recipe, out, fields["lenpens"], fields["device"])


if __name__ == "__main__":  # python -m xformer.bench.quality SYSTEM FIELDS_JSON
    _main(sys.argv[1], json.loads(sys.argv[2]))
