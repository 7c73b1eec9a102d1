"""bench quality: HF Marian of the recipe's size trained on the same task and budget as xformer,
selected and scored by the same protocol."""

import itertools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.extras import need
from xformer.bench import quality
from xformer.bench.marian import PEER, _wsd_plan, marian_model, score_marian, train_marian
from xformer.bench.quality import cpu_groups
from xformer.config.loading import load_recipe
from xformer.errors import RunError, XformerError
from xformer.model import build_model
from xformer_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "translation" / "multi30k_de_en.toml"
TINY = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "data.vocab_size=300", "data.max_tokens=512", "train.valid_every=4",
        "eval.beam=2", "eval.batch_sentences=16"]


def tiny(corpus, *extra):
    return [*TINY, f"data.dataset={json.dumps(str(corpus))}", *extra]


def test_the_peer_has_exactly_the_flagships_trainable_parameters():
    need("transformers")
    recipe = load_recipe(RECIPE)
    ours = build_model(recipe.model, 8000)
    peer = marian_model(recipe, 8000)
    count = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in (ours, peer)]
    assert count[0] == count[1] == 7_577_600  # shared and tied embeddings, sinusoidal positions in both
    config = peer.config
    assert (config.d_model, config.encoder_layers, config.decoder_layers, config.encoder_ffn_dim,
            config.encoder_attention_heads, config.activation_function, config.dropout) == (256, 3, 3, 1024, 4,
                                                                                         "relu", 0.1)


def test_hf_wsd_plan_spends_the_time_left_at_the_measured_pace():
    """Steps left = time left / (median step + a validation's share); 20% of all steps cool down;
    the warmup keeps its 1,000 steps where they fit and shrinks where the budget is short."""
    need("transformers")
    from torch import nn, optim
    from transformers import get_wsd_schedule

    plan = _wsd_plan(150, 3000.0, [1.0, 1.0, 5.0], [30.0, 30.0], 150)
    per_step = 1.0 + 30.0 / 150  # the median ignores the slow first step
    assert plan["total"] == 150 + int(3000.0 / per_step) == 2650
    assert plan["decay"] == round(0.2 * 2650) and plan["warmup"] == PEER["warmup_steps"]
    assert plan["warmup"] + plan["stable"] + plan["decay"] == plan["total"]
    short = _wsd_plan(150, 600.0, [1.0], [30.0], 150)
    assert short["total"] == 150 + int(600 / 1.2) and short["warmup"] == short["total"] - short["decay"]
    # HF's own schedule on this plan: the peak through the stable phase, min_lr (0) at the planned end
    opt = optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    schedule = get_wsd_schedule(opt, plan["warmup"], plan["decay"], num_stable_steps=plan["stable"],
                                decay_type="1-sqrt")
    rates = [schedule.get_last_lr()[0]]
    for _ in range(plan["total"]):
        opt.step()
        schedule.step()
        rates.append(schedule.get_last_lr()[0])
    assert rates[plan["warmup"]] == 1.0 == rates[plan["total"] - plan["decay"]]
    assert rates[plan["total"]] == 0.0 and rates[plan["total"] - 1] > 0


def test_the_peer_trains_within_its_budget_and_keeps_its_best_validation_checkpoint(corpus, tmp_path):
    """With an injected clock (one second a reading) the run ends at the first step past the
    budget, validates every valid_every steps and at its end, keeps the weights of its best greedy
    validation BLEU, and its WSD plan, made at the first validation, ends where the budget does."""
    need("transformers")
    recipe = load_recipe(RECIPE, tiny(corpus))
    ticks = itertools.count()
    record = train_marian(recipe, tmp_path / "peer", schedule="wsd", minutes=0.5, device="cpu",
                          clock=lambda: float(next(ticks)))
    valid = [json.loads(line) for line in (tmp_path / "peer" / "metrics.jsonl").read_text().splitlines()]
    steps = record["steps"]
    assert record["train_seconds"] >= 30 and steps < 30  # every step reads the clock at least once
    assert [v["step"] for v in valid] == sorted({*range(4, steps + 1, 4), steps})
    best = max(valid, key=lambda v: v["bleu"])
    assert record["best"]["step"] == best["step"] and record["best"]["bleu"] == best["bleu"]
    assert record["plan"]["at_step"] == 4 and record["plan"]["warmup"] >= 4
    # the estimate, from readings of this same clock: whole steps, and the run ends on the first past the deadline
    assert abs(record["plan"]["total"] - steps) <= 2
    assert valid[-1]["lr"] < valid[0]["lr"] or record["plan"]["total"] < steps  # cooled down by the end
    assert record["precision"] in ("fp32", "bf16") and record["epochs"] > 0
    scored = score_marian(recipe, tmp_path / "peer", "validation", lenpen=1.0, device="cpu")
    assert len(scored["hypotheses"]) == 40  # every validation sentence translated
    assert scored["bleu"] >= 0 and (tmp_path / "peer" / "tokenizer").is_dir()


def test_bench_quality_refuses_bad_input_before_it_trains(corpus, tmp_path):
    runner = CliRunner()
    unknown = runner.invoke(app, ["bench", "quality", str(RECIPE), "--out", str(tmp_path / "q"), "--system", "fairseq"])
    assert unknown.exit_code == 2 and "'fairseq' is not one of" in unknown.output
    bad = runner.invoke(app, ["bench", "quality", str(RECIPE), "--out", str(tmp_path / "q"),
                              "--set", "train.lr=fast"])
    assert bad.exit_code == 2 and "train.lr" in bad.output and not (tmp_path / "q" / "xformer-seed1").exists()
    half = tmp_path / "half" / "xformer-seed1"
    half.mkdir(parents=True)
    stopped = runner.invoke(app, ["bench", "quality", str(RECIPE), "--out", str(tmp_path / "half"), "--seed", "1",
                                  "--set", f"data.dataset={json.dumps(str(corpus))}"])
    assert stopped.exit_code == 2 and "stopped before the end of its budget" in stopped.output
    assert half.is_dir()  # never removed for the user


def test_a_run_scored_before_the_last_validation_was_kept_reads_it_from_its_log(tmp_path):
    """A record's quality.json without last_valid_bleu: the report takes the last "valid" line
    of the run's metrics.jsonl, not the best one nor a training line."""
    run = tmp_path / "marian-seed1"
    run.mkdir()
    lines = [{"kind": "valid", "step": 100, "bleu": 30.5}, {"kind": "valid", "step": 200, "bleu": 31.25},
             {"kind": "valid", "step": 300, "bleu": 30.75}, {"kind": "train", "step": 310, "loss": 2.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    scored = {"system": "marian", "seed": 1, "steps": 310, "epochs": 1.0, "precision": "fp32", "best_step": 200,
              "valid_bleu": 31.25, "valid_beam_bleu": {"1": 32.0}, "lenpen": 1.0, "test_bleu": 30.0,
              "test_chrf": 50.0, "hypotheses": "marian-seed1/test.hyp", "regularisation": ""}
    (run / "quality.json").write_text(json.dumps(scored))
    report = quality.quality_report(tmp_path, quality.QualityConfig(recipe=str(RECIPE)))
    assert report.runs[0]["last_valid_bleu"] == 30.75
    assert "| 31.25 / 30.75 |" in quality.quality_markdown(report)
    (run / "metrics.jsonl").unlink()  # no log at all: said, not invented
    assert quality.quality_report(tmp_path, quality.QualityConfig(recipe=str(RECIPE))).runs[0]["last_valid_bleu"] \
        is None


def test_runs_at_once_share_the_cpus_equally_and_never_overlap(monkeypatch):
    monkeypatch.setattr(quality.os, "sched_getaffinity", lambda pid: {7, 2, 3, 5, 4})
    assert cpu_groups(1) == [None]  # one at a time keeps what it inherits
    assert cpu_groups(2) == [[2, 3], [4, 5]]  # equal shares; the fifth CPU is left idle
    assert cpu_groups(5) == [[2], [3], [4], [5], [7]]
    with pytest.raises(XformerError, match="--jobs 6: expected at most 5"):
        cpu_groups(6)


def test_xformer_and_the_first_peer_train_seed_by_seed_and_the_other_peers_after(corpus, tmp_path, monkeypatch):
    """The order runs start in: with two at once, xformer's run of each seed trains beside the
    marian run it is tested against; a run already scored is not started again."""
    started = []

    def record(waiting, *rest):
        started.extend((system, seed) for system, seed, _ in waiting)
        raise KeyboardInterrupt  # stop before anything trains

    monkeypatch.setattr(quality, "_run_all", record)
    out = tmp_path / "q"
    (out / "marian-seed2").mkdir(parents=True)
    (out / "marian-seed2" / "quality.json").write_text("{}")
    config = quality.QualityConfig(recipe=str(RECIPE), sets=tiny(corpus), seeds=[1, 2, 3], device="cpu")
    with pytest.raises(KeyboardInterrupt):
        quality.bench_quality(config, out)
    assert started == [("xformer", 1), ("marian", 1), ("xformer", 2), ("xformer", 3), ("marian", 3),
                       ("marian_wsd", 1), ("marian_wsd", 2), ("marian_wsd", 3)]


def test_bench_quality_measures_one_machine_a_folder(corpus, tmp_path):
    """A folder's runs come from one machine and one way of sharing it: a later call that
    differs (another CPU, another --jobs) is refused before it trains, naming what differs."""
    runner = CliRunner()
    command = ["bench", "quality", str(RECIPE), "--seed", "1", "--system", "xformer", "--device", "cpu",
               *itertools.chain.from_iterable(("--set", s) for s in tiny(corpus))]
    out = tmp_path / "q"
    out.mkdir()
    (out / "machine.json").write_text(json.dumps({"cpu": "Another CPU", "cpus": 2, "torch": "2.4.0",
                                                  "device": "cpu", "jobs": 1}))
    refused = runner.invoke(app, [*command, "--out", str(out)])
    assert refused.exit_code == 2 and "'Another CPU' there" in refused.output and "torch" in refused.output
    assert not (out / "xformer-seed1").exists()
    too_many = runner.invoke(app, [*command, "--out", str(tmp_path / "r"), "--jobs", "4096"])
    assert too_many.exit_code == 2 and "--jobs 4096: expected at most" in too_many.output
    assert not (tmp_path / "r").exists()


def test_a_stop_signal_stops_the_runs_in_flight_and_leaves_none_behind(corpus, tmp_path):
    """SIGTERM to the benchmark while two runs train at once: both runs are stopped (none goes
    on training with nothing to read it), the benchmark raises GridStopped, the stopped folders
    are kept for the user, and the signal handlers are put back."""
    import os
    import signal

    from xformer.studies.grid import GridStopped

    if len(quality.os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    out = tmp_path / "q"
    config = quality.QualityConfig(recipe=str(RECIPE), sets=tiny(corpus), systems=["xformer"], seeds=[1, 2],
                                   minutes=0.5, lenpens=[1.0], device="cpu", jobs=2)
    sent = []

    def on_event(kind, payload):
        # both runs begun (under load the second can start late, and the sum be the first's alone), ~6 s in
        began = all((out / f"xformer-seed{seed}").is_dir() for seed in (1, 2))
        if kind == "tick" and payload["fraction"] >= 0.4 and began and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(GridStopped) as stopped:
        quality.bench_quality(config, out, on_event=on_event)
    assert stopped.value.signal == "SIGTERM" and signal.getsignal(signal.SIGTERM) == before
    still = [p for p in Path("/proc").glob("[0-9]*") if _cmdline(p).count(str(out))]
    assert still == []  # no run outlives its benchmark
    assert (out / "xformer-seed1").is_dir() and (out / "xformer-seed2").is_dir()  # kept for the user
    with pytest.raises(RunError, match="stopped before the end of its budget"):  # never scored as if it ended
        quality.bench_quality(config, out)


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:  # a process that ended while we looked
        return ""


@pytest.mark.slow
def test_two_runs_at_once_each_train_on_their_own_cpus(corpus, tmp_path):
    """--jobs 2: xformer and the peer train side by side, each pinned to its own half of the
    CPUs with as many threads, and are scored as one at a time would be; the folder keeps its
    jobs, so the same call resumes and another --jobs is refused."""
    need("transformers")
    if len(quality.os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs")
    runner = CliRunner()
    command = ["bench", "quality", str(RECIPE), "--out", str(tmp_path / "q"), "--minutes", "0.05", "--seed", "1",
               "--system", "xformer", "--system", "marian", "--lenpen", "1.0", "--device", "cpu",
               *itertools.chain.from_iterable(("--set", s) for s in tiny(corpus, "train.warmup_steps=10"))]
    done = runner.invoke(app, [*command, "--jobs", "2", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    ours, theirs = report["runs"]
    share = len(quality.os.sched_getaffinity(0)) // 2
    assert len(ours["cpus"]) == len(theirs["cpus"]) == ours["threads"] == theirs["threads"] == share
    assert not set(ours["cpus"]) & set(theirs["cpus"])
    assert report["paired"]["marian"][0]["seed"] == 1 and len(ours["hypotheses"]) > 0
    assert json.loads((tmp_path / "q" / "machine.json").read_text())["jobs"] == 2
    again = runner.invoke(app, [*command, "--jobs", "2"])
    assert again.exit_code == 0 and "2 runs, 2 done already" in again.output
    other = runner.invoke(app, [*command, "--jobs", "1"])
    assert other.exit_code == 2 and "jobs 2 there, 1 here" in other.output


@pytest.mark.slow
def test_bench_quality_trains_both_scores_test_once_and_resumes(corpus, tmp_path):
    """Through the CLI, one seed, a few seconds a run: every system trains in its own process,
    the length penalty is the best on validation, xformer is tested against each peer on the
    same test set, and a second call trains nothing again."""
    need("transformers")
    runner = CliRunner()
    command = ["bench", "quality", str(RECIPE), "--out", str(tmp_path / "q"), "--minutes", "0.1", "--seed", "1",
               "--lenpen", "1.0", "--lenpen", "2.0", "--device", "cpu",
               *itertools.chain.from_iterable(("--set", s) for s in tiny(corpus, "train.warmup_steps=10"))]
    first = runner.invoke(app, [*command, "--json"])
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout)
    assert [(r["system"], r["seed"]) for r in report["runs"]] == [("xformer", 1), ("marian", 1), ("marian_wsd", 1)]
    for run in report["runs"]:
        assert run["lenpen"] in (1.0, 2.0)
        assert run["valid_beam_bleu"][f"{run['lenpen']:g}"] == max(run["valid_beam_bleu"].values())
        hyps = (tmp_path / "q" / run["hypotheses"]).read_text().splitlines()
        assert len(hyps) == 40
    trained = json.loads((tmp_path / "q" / "xformer-seed1" / "train.json").read_text())
    assert trained["stop_reason"] == "max_time"
    for run in report["runs"]:  # where the budget ended, beside the best: the run's own last validation
        logged = (tmp_path / "q" / f"{run['system']}-seed1" / "metrics.jsonl").read_text().splitlines()
        assert run["last_valid_bleu"] == [json.loads(m) for m in logged if '"valid"' in m][-1]["bleu"]
    assert set(report["paired"]) == {"marian", "marian_wsd"} and report["paired"]["marian"][0]["seed"] == 1
    # the budget's regularisation, as train.json explains it, beside xformer's row; the peers train as they were run
    chosen = trained["regularisation"]["chosen"]
    assert [r["regularisation"] for r in report["runs"]][1:] == ["", ""]
    assert report["runs"][0]["regularisation"].startswith(f"dropout {chosen['model.dropout']:g}, ")
    page = (tmp_path / "q" / "quality.md").read_text().splitlines()
    rows = [line for line in page if line.startswith("| xformer | 1 |") or line.startswith("| marian")]
    assert len(rows) == 3 + 2  # a row a run, and a mean a peer
    assert f"**{report['runs'][0]['test_bleu']:.2f}**" in rows[0] and report["runs"][0]["regularisation"] in rows[0]
    assert f"| {report['runs'][0]['valid_bleu']:.2f} / {report['runs'][0]['last_valid_bleu']:.2f} |" in rows[0]
    assert any(line.startswith("xformer against marian, paired bootstrap") for line in page)
    again = runner.invoke(app, command)  # the table this time
    assert again.exit_code == 0 and "3 runs, 3 done already" in again.output
    # a call for one system reports the whole folder: a benchmark is filled a sitting at a time
    one = runner.invoke(app, [*command, "--system", "marian", "--json"])
    assert one.exit_code == 0, one.output
    assert json.loads(one.stdout)["runs"] == report["runs"] and json.loads(one.stdout)["paired"] == report["paired"]
    # under another protocol (here the budget) nothing trains into the same folder
    other = [*command[:command.index("--minutes")], "--minutes", "0.2", *command[command.index("--minutes") + 2:]]
    refused = runner.invoke(app, other)
    assert refused.exit_code == 2 and "minutes 0.1 there, 0.2 here" in refused.output
    assert sorted(p.name for p in (tmp_path / "q").iterdir() if p.is_dir()) == \
        ["marian-seed1", "marian_wsd-seed1", "xformer-seed1"]


def test_the_protocol_pins_the_recipes_values_not_its_comments(tmp_path):
    """A comment edited in the recipe leaves a benchmark folder's protocol as it was; a value
    changed is another protocol, refused by name; a folder pinned by the bytes alone (before the
    values' digest was kept) is still compared by them."""
    from xformer.bench.quality import QualityConfig, _pin_protocol

    recipe, out = tmp_path / "r.toml", tmp_path / "q"
    out.mkdir()
    recipe.write_text("# measured on one machine\n[train]\nlr = 1e-3\n")
    config = QualityConfig(recipe=str(recipe), minutes=1.0)
    _pin_protocol(out, config)
    recipe.write_text("# measured on one machine, then another\n[train]\nlr = 1e-3  # the peak\n")
    _pin_protocol(out, config)
    recipe.write_text("[train]\nlr = 2e-3\n")
    with pytest.raises(RunError, match="recipe_toml_sha256"):
        _pin_protocol(out, config)
    pinned = json.loads((out / "protocol.json").read_text())
    del pinned["recipe_toml_sha256"]  # as a folder pinned before
    (out / "protocol.json").write_text(json.dumps(pinned))
    recipe.write_text("# measured on one machine\n[train]\nlr = 1e-3\n")
    _pin_protocol(out, config)  # the same bytes
    recipe.write_text("# another comment\n[train]\nlr = 1e-3\n")
    with pytest.raises(RunError, match="recipe_sha256"):
        _pin_protocol(out, config)
