"""xformer export --format hf: the exported MarianMTModel loads with from_pretrained and computes
the same logits and the same greedy translations as the run; its tokenizer gives the run's ids;
models Marian cannot express are refused by field."""

import json
import shutil
import warnings

import pytest
import torch
from typer.testing import CliRunner

from tests.extras import need
from tests.test_train import tiny_recipe
from xformer.config.loading import load_run_recipe
from xformer.generation.decode import greedy_decode
from xformer.tasks import make_task
from xformer.train import run
from xformer_cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny"
    run(tiny_recipe(corpus, "train.max_steps=6", "train.valid_every=6"), out, device="cpu")
    return out


def test_the_hf_export_is_the_same_model(trained, tmp_path):
    transformers = need("transformers")
    out = tmp_path / "hf"
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        result = runner.invoke(app, ["export", str(trained), "--format", "hf", "--out", str(out)])
    assert result.exit_code == 0, result.output
    # neither transformers' progress bars nor its advice to install sacremoses: nothing to act on
    assert "it/s" not in result.stderr and not [w for w in warned if "sacremoses" in str(w.message)]
    hf = transformers.MarianMTModel.from_pretrained(out).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(out)
    task = make_task(load_run_recipe(trained))
    model, _ = task.open_run(trained, "best", "cpu")
    sentences = ["Ein Hund rennt im Schnee.", "Zwei Männer spielen Fußball auf einer Wiese."]
    ours = [ids + [3] for ids in task.tokenizer.encode(sentences, "source")]  # pieces + EOS
    theirs = tokenizer(sentences, padding=True, return_tensors="pt")
    assert [row[: len(o)] for row, o in zip(theirs.input_ids.tolist(), ours, strict=True)] == ours
    src = theirs.input_ids
    tgt = torch.tensor([[2, 5, 9, 14, 7], [2, 8, 8, 20, 11]])
    with torch.no_grad():
        expected = model(src, tgt)
        got = hf(input_ids=src, attention_mask=theirs.attention_mask, decoder_input_ids=tgt).logits
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        greedy = greedy_decode(model, src, max_len_a=0.0, max_len_b=12)
        generated = hf.generate(input_ids=src, attention_mask=theirs.attention_mask, num_beams=1, do_sample=False,
                                max_new_tokens=13)
    hf_greedy = [[t for t in row[1:].tolist() if t not in (0, 3)] for row in generated]
    assert hf_greedy == greedy
    again = runner.invoke(app, ["export", str(trained), "--out", str(out)])  # never over an export
    assert again.exit_code == 2 and "exists and is not an empty directory" in again.output


def test_a_model_marian_cannot_express_is_refused_by_field(trained, tmp_path):
    recipe = json.loads(json.dumps(load_run_recipe(trained).to_dict()))
    (trained.parent / "rope").mkdir()
    import shutil

    from xformer.config.loading import recipe_from_dict

    other = trained.parent / "rope"
    shutil.copytree(trained, other, dirs_exist_ok=True)
    recipe["model"]["positional"] = "rope"
    recipe_from_dict(recipe).save(other / "recipe.toml")
    result = runner.invoke(app, ["export", str(other), "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "model.positional: Marian has 'sinusoidal', found 'rope'" in result.output
    assert not (tmp_path / "x").exists()


def test_ctranslate2_decodes_the_export_as_xformer_does(trained, tmp_path):
    need("transformers")
    need("ctranslate2")
    out = tmp_path / "ct2"
    result = runner.invoke(app, ["export", str(trained), "--format", "ctranslate2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    ours = runner.invoke(app, ["eval", str(trained), "--beam", "1", "--json"])
    theirs = runner.invoke(app, ["eval", str(trained), "--beam", "1", "--ctranslate2", str(out), "--json"])
    assert ours.exit_code == 0 and theirs.exit_code == 0, theirs.output
    a, b = json.loads(ours.stdout), json.loads(theirs.stdout)
    assert b["engine"] == "ctranslate2" and ".ct2." in b["hypotheses"]
    with open(a["hypotheses"], encoding="utf-8") as mine, open(b["hypotheses"], encoding="utf-8") as engine:
        pairs = list(zip(mine.read().splitlines(), engine.read().splitlines(), strict=True))
    # the same greedy path; CTranslate2 takes one length limit per batch (its longest source's),
    # xformer one per sentence, so where a sentence runs to its limit the engine may go on
    assert sum(theirs.startswith(ours) for ours, theirs in pairs) >= 0.9 * len(pairs)
    assert json.loads((trained / "eval.json").read_text())["hypotheses"] == a["hypotheses"]


def test_eval_decodes_only_the_runs_own_export_as_it_was_written(trained, corpus, tmp_path):
    """--ctranslate2 DIR must be RUN's export: another run's (other weights), one whose files
    changed since, or a classification run are refused in one line, before decoding."""
    need("ctranslate2")
    out = tmp_path / "ct2"
    assert runner.invoke(app, ["export", str(trained), "--format", "ctranslate2", "--out", str(out)]).exit_code == 0
    other = tmp_path / "other"
    run(tiny_recipe(corpus, "train.max_steps=3", "train.valid_every=3", "train.seed=2"), other, device="cpu")
    refused = runner.invoke(app, ["eval", str(other), "--beam", "1", "--ctranslate2", str(out)])
    assert refused.exit_code == 2 and refused.stderr.strip().count("\n") == 0, refused.output
    assert f"exported from {trained}'s 'best' with other weights than {other}" in refused.stderr
    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    (tampered / "model.bin").write_bytes((tampered / "model.bin").read_bytes()[:-4] + b"\0\0\0\0")
    refused = runner.invoke(app, ["eval", str(trained), "--beam", "1", "--ctranslate2", str(tampered)])
    assert refused.exit_code == 2 and "model.bin changed, added or missing since export" in refused.stderr


def test_a_silu_model_exports_as_marians_swish(corpus, tmp_path):
    """model.ffn = "silu" is Marian's activation_function = "swish" (the opus-mt models'): the
    export computes the run's logits."""
    transformers = need("transformers")
    run_dir = tmp_path / "silu"
    run(tiny_recipe(corpus, "train.max_steps=2", "train.valid_every=2", 'model.ffn="silu"'), run_dir, device="cpu")
    result = runner.invoke(app, ["export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.activation_function == "swish"
    model, _ = make_task(load_run_recipe(run_dir)).open_run(run_dir, "best", "cpu")
    src, tgt = torch.tensor([[5, 9, 14, 3], [8, 20, 3, 0]]), torch.tensor([[2, 5, 9], [2, 8, 8]])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt).logits,
                                   model(src, tgt), atol=1e-4, rtol=1e-4)
