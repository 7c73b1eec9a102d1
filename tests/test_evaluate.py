"""Scoring a run never reports a wrong result: inputs are checked row by row before decoding,
results of different inputs never share a file, and a swapped tokenizer is caught."""

import json
import shutil
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from tests.test_train import RECIPE, TINY, tiny_recipe
from xformer.data.corpus import load_split
from xformer.data.tokenizer import train_tokenizer
from xformer.train import run
from xformer.training import cpuload
from xformer_cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    run(tiny_recipe(corpus, "train.max_steps=4", "train.valid_every=4"), out, device="cpu")
    return out


def one_line_error(result, *words):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.stderr
    return lines[0]


def test_other_data_never_replaces_the_results_of_a_split(trained, corpus, tmp_path):
    """An outside test.jsonl is not the recipe's test split: its scores go to their own file,
    and RUN/eval.json keeps the recipe's test split."""
    ours = runner.invoke(app, ["eval", str(trained), "--split", "test", "--beam", "1", "--json"])
    assert ours.exit_code == 0, ours.output
    report = json.loads(ours.stdout)
    before = {p.name: p.read_bytes() for p in (trained / "eval").iterdir()}
    summary = (trained / "eval.json").read_bytes()
    assert json.loads(summary)["n_sentences"] == 40
    other = tmp_path / "other" / "test.jsonl"
    other.parent.mkdir()
    lines = (corpus / "test.jsonl").read_text(encoding="utf-8").splitlines()
    other.write_text("\n".join(lines[:20]) + "\n", encoding="utf-8")
    theirs = runner.invoke(app, ["eval", str(trained), "--data", str(other), "--beam", "1", "--json"])
    assert theirs.exit_code == 0, theirs.output
    assert json.loads(theirs.stdout)["n_sentences"] == 20
    assert json.loads(theirs.stdout)["hypotheses"] != report["hypotheses"]
    assert all((trained / "eval" / name).read_bytes() == data for name, data in before.items())
    assert (trained / "eval.json").read_bytes() == summary
    # another file of the same name and other rows gets a file of its own too
    other.write_text("\n".join(lines[20:30]) + "\n", encoding="utf-8")
    third = runner.invoke(app, ["eval", str(trained), "--data", str(other), "--beam", "1", "--json"])
    assert json.loads(third.stdout)["hypotheses"] != json.loads(theirs.stdout)["hypotheses"]


GOOD = '{"de": "Ein Hund.", "en": "A dog."}'
BAD_ROWS = {
    "missing target": ('{"de": "Ein Hund."}', "field 'en' is missing"),
    "null target": ('{"de": "Ein Hund.", "en": null}', "field 'en' is null"),
    "numeric target": ('{"de": "Ein Hund.", "en": 5}', "field 'en' is a int"),
    "missing source": ('{"en": "A dog."}', "field 'de' is missing"),
    "broken json": ('{"de": "Ein Hund.", "en": ', "not valid JSON"),
    "a list, not an object": ('["Ein Hund.", "A dog."]', "expected a JSON object"),
}


@pytest.mark.parametrize("name", list(BAD_ROWS))
def test_a_bad_row_is_named_by_file_and_line_before_decoding(trained, tmp_path, name):
    row, problem = BAD_ROWS[name]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([GOOD, GOOD, row, GOOD]) + "\n", encoding="utf-8")
    one_line_error(runner.invoke(app, ["eval", str(trained), "--data", str(path)]), f"{path}:3:", problem)
    assert not list((trained / "eval").glob("data-bad-*"))


def test_invalid_utf8_is_named_by_line(trained, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes((GOOD + "\n").encode() + '{"de": "Mädchen", "en": "girl"}\n'.encode("latin-1"))
    one_line_error(runner.invoke(app, ["eval", str(trained), "--data", str(path)]), f"{path}:2:", "not UTF-8")


def test_a_tokenizer_is_never_swapped_under_a_trained_run(trained, corpus):
    """tokenize --overwrite refuses a run with checkpoints; a tokenizer replaced by hand is
    caught when a checkpoint is loaded (every checkpoint records the tokenizer's digest)."""
    model = (trained / "tokenizer" / "spm.model").read_bytes()
    values = TINY + [f"data.dataset={json.dumps(str(corpus))}", "data.vocab_size=200", "train.max_steps=4"]
    sets = [arg for value in values for arg in ("--set", value)]
    refused = runner.invoke(app, ["tokenize", str(RECIPE), "--out", str(trained), "--overwrite", *sets])
    one_line_error(refused, "has checkpoints trained with this tokenizer")
    assert (trained / "tokenizer" / "spm.model").read_bytes() == model
    saved = trained.parent / "saved-tokenizer"
    shutil.copytree(trained / "tokenizer", saved)
    try:
        rows = load_split(str(corpus), "train", ["de", "en"])
        train_tokenizer(rows, "de", "en", trained / "tokenizer", model_type="unigram", vocab_size=250, joint=True,
                        character_coverage=1.0, byte_fallback=False, seed=99)
        assert (trained / "tokenizer" / "spm.model").read_bytes() != model
        for command in (["eval", str(trained), "--beam", "1"], ["translate", str(trained)]):
            one_line_error(runner.invoke(app, command, input="Ein Hund.\n"), "trained with tokenizer")
        resumed = runner.invoke(app, ["train", str(trained / "recipe.toml"), "--out", str(trained), "--resume",
                                      "--max-steps", "6"])
        one_line_error(resumed, "trained with tokenizer")
    finally:
        shutil.rmtree(trained / "tokenizer")
        shutil.copytree(saved, trained / "tokenizer")


def test_translate_keeps_blank_lines_blank_warns_on_cut_lines_and_reads_pipes(trained, tmp_path):
    import os
    import threading

    long_line = " ".join(["Hund"] * 3000)
    result = runner.invoke(app, ["translate", str(trained), "--beam", "1"],
                           input=f"Ein Hund.\n\n   \n{long_line}\nZwei Katzen.\n")
    assert result.exit_code == 0, result.output
    out = result.stdout.split("\n")
    assert len(out) == 6 and out[1] == out[2] == "" and out[0] and out[4]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "line 4:" in warnings[0] and "translated its first 1023 pieces" in warnings[0]
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("Ein Hund.\n", encoding="utf-8"))
    writer.start()
    piped = runner.invoke(app, ["translate", str(trained), "--beam", "1", "--input", str(fifo)])
    writer.join()
    assert piped.exit_code == 0, piped.output
    assert piped.stdout.strip() == out[0]


def test_int8_scores_in_files_of_its_own_and_stays_close_to_fp32(trained):
    """--quantize int8 replaces every Linear by a dynamically quantized one; its results carry
    .int8 in their names, and RUN/eval.json keeps the model as trained."""
    import torch

    from xformer.config.loading import load_run_recipe
    from xformer.tasks import make_task

    plain = runner.invoke(app, ["eval", str(trained), "--split", "test", "--beam", "1", "--json"])
    summary = (trained / "eval.json").read_bytes()
    int8 = runner.invoke(app, ["eval", str(trained), "--split", "test", "--beam", "1", "--quantize", "int8",
                               "--json"])
    assert plain.exit_code == 0 and int8.exit_code == 0, int8.output
    report = json.loads(int8.stdout)
    assert report["quantize"] == "int8" and ".int8." in report["hypotheses"]
    assert report["hypotheses"] != json.loads(plain.stdout)["hypotheses"]
    assert (trained / "eval.json").read_bytes() == summary
    task = make_task(load_run_recipe(trained))
    model, _ = task.open_run(trained, "best", "cpu")
    quantized, _ = task.open_run(trained, "best", "cpu", quantize="int8")
    assert not any(type(m) is torch.nn.Linear for m in quantized.modules())
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    with torch.no_grad():
        exact, approx = model(src, tgt), quantized(src, tgt)
    assert (approx - exact).abs().max() < 0.1 * exact.abs().max()  # int8 weights: close, not equal
    translated = runner.invoke(app, ["translate", str(trained), "--quantize", "int8", "--beam", "1"],
                               input="Ein Hund.\n")
    assert translated.exit_code == 0 and len(translated.stdout.splitlines()) == 1
    refused = runner.invoke(app, ["eval", str(trained), "--quantize", "int4"])
    assert refused.exit_code == 2 and "'int4' is not one of" in refused.output


@pytest.mark.skipif(not cpuload.PROC_STAT.is_file(), reason="/proc/stat is Linux's")
def test_a_score_timed_beside_other_work_says_so(trained, monkeypatch):
    """Every allowed core spun by another process: the speed is not this machine's, and eval says so.
    The shortest span measured is lowered: a fast CPU scores this run in under a second."""
    monkeypatch.setattr(cpuload, "MIN_SECONDS", 0.0)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in cpuload._allowed_cpus()]
    try:
        time.sleep(0.5)
        crowded = runner.invoke(app, ["eval", str(trained), "--split", "validation", "--beam", "4", "--json"])
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert crowded.exit_code == 0, crowded.output
    printed = json.loads(crowded.stdout)
    assert cpuload.busy(printed["others_cpu"])
    assert "warning: timed while other processes took" in crowded.stderr
    # the score's file says so too: it holds exactly what was printed
    written = sorted((trained / "eval").glob("validation.*.beam4.*.json"), key=lambda p: p.stat().st_mtime)[-1]
    assert json.loads(written.read_text()) == printed
