"""xformer import hf: export then import is the identity; a MarianMTModel built and trained by HF
transformers imports and gives HF's logits and HF's greedy and beam `generate` output; the
imported run goes through eval, inspect-heads with pruning and export; what xformer cannot
represent (opus-mt's ids) and pickled code are refused in one line."""

import json
import pickle
import shutil

import pytest
import torch
from typer.testing import CliRunner

from tests.extras import need
from tests.test_train import tiny_recipe
from xformer.config.loading import load_run_recipe
from xformer.data.corpus import load_split
from xformer.data.tokenizer import train_tokenizer
from xformer.generation.decode import beam_search, greedy_decode
from xformer.importing import import_hf
from xformer.tasks import make_task
from xformer.train import run
from xformer.training.checkpoint import read_checkpoint
from xformer_cli.main import app

runner = CliRunner()
SHORT = ["eval.max_len_a=0", "eval.max_len_b=4"]  # hypotheses of at most 4 tokens
SENTENCES = ["Ein Hund rennt im Schnee.", "Zwei Männer spielen Fußball auf einer Wiese.", "Eine Frau liest."]


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A tiny run that ends its sentences: 100 steps on the corpus with every English side cut to
    its first three words (the full sentences take a tiny model hundreds of steps to end)."""
    short = tmp_path_factory.mktemp("short")
    for name in ("train", "val", "test"):
        rows = [json.loads(line) for line in (corpus / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]
        lines = [json.dumps({**r, "en": " ".join(r["en"].split()[:3])}, ensure_ascii=False) for r in rows]
        (short / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path_factory.mktemp("runs") / "tiny"
    run(tiny_recipe(short, "train.max_steps=100", "train.valid_every=100"), out, device="cpu")
    return out


@pytest.fixture(scope="module")
def hf_marian(corpus, tmp_path_factory):
    """A MarianMTModel made by transformers from a MarianConfig with random weights (swish; std 1
    rather than 0.02, so the next-token distributions are peaked enough for an argmax to be
    decided, not a near-tie), with a MarianTokenizer over a sentencepiece model of xformer's
    ids, saved as from_pretrained reads it."""
    transformers = need("transformers")
    import sentencepiece

    folder = tmp_path_factory.mktemp("hf-marian")
    spm_dir = folder / "spm"
    train_tokenizer(load_split(str(corpus), "train", ["de", "en"]), "de", "en", spm_dir, model_type="unigram",
                    vocab_size=300, joint=True, character_coverage=1.0, byte_fallback=False)
    spm = spm_dir / "spm.model"
    processor = sentencepiece.SentencePieceProcessor(model_file=str(spm))
    vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer = transformers.MarianTokenizer(str(spm), str(spm), str(folder / "vocab.json"), source_lang="de",
                                             target_lang="en", unk_token="<unk>", eos_token="</s>", pad_token="<pad>")
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256,
        activation_function="swish", dropout=0.0, scale_embedding=True, share_encoder_decoder_embeddings=True,
        pad_token_id=0, eos_token_id=3, bos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
        init_std=1.0)
    torch.manual_seed(3)
    hf_dir = folder / "hf"
    transformers.MarianMTModel(config).eval().save_pretrained(hf_dir, safe_serialization=True)
    tokenizer.save_pretrained(hf_dir)
    return hf_dir


def hf_generate(hf, src, mask, beam: int) -> list[list[int]]:
    """transformers' generate as xformer searches: no sampling, pad and BOS never generated,
    EOS and padding dropped from what it returns."""
    generated = hf.generate(input_ids=src, attention_mask=mask, num_beams=beam, do_sample=False, max_new_tokens=25,
                            length_penalty=1.0, early_stopping=True, suppress_tokens=[0, 2], forced_eos_token_id=None)
    return [[t for t in row[1:].tolist() if t not in (0, 3)] for row in generated]


def model_tensors(run_dir):
    tensors, meta = read_checkpoint(run_dir / "checkpoints" / "best.safetensors")
    return {k: v for k, v in tensors.items() if k.startswith("model.")}, meta


def test_export_then_import_is_the_identity(trained, corpus, tmp_path):
    need("transformers")
    exported, imported = tmp_path / "hf", tmp_path / "back"
    assert runner.invoke(app, ["export", str(trained), "--out", str(exported)]).exit_code == 0
    result = runner.invoke(app, ["import", "hf", str(exported), "--out", str(imported),
                                 "--recipe", str(trained / "recipe.toml")])  # its [data], [train], [eval]
    assert result.exit_code == 0, result.output
    ours, _ = model_tensors(trained)
    theirs, meta = model_tensors(imported)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)  # bitwise
    assert (imported / "tokenizer" / "spm.model").read_bytes() == (trained / "tokenizer" / "spm.model").read_bytes()
    assert load_run_recipe(imported).model == load_run_recipe(trained).model
    record = json.loads((imported / "imported-from.json").read_text())
    assert record["source"] == str(exported.resolve()) and meta["imported"] == record
    assert set(record["files"]) >= {"config.json", "model.safetensors", "source.spm", "vocab.json"}

    scored = runner.invoke(app, ["eval", str(imported), "--beam", "1", "--json"])
    assert scored.exit_code == 0, scored.output
    card = json.loads(scored.stdout)["card"]["checkpoint"]
    assert card["final"] and card["imported"]["source"] == str(exported.resolve())
    assert "not the run's final one" not in scored.stderr
    paired = runner.invoke(app, ["eval", str(imported), "--beam", "1", "--baseline", str(trained), "--json"])
    assert paired.exit_code == 0, paired.output  # the same model: the same hypotheses, no difference
    test = json.loads(paired.stdout)["paired"]
    assert (test["difference"], test["p_value"]) == (0.0, 1.0)

    refused = runner.invoke(app, ["average", str(imported), "--last", "2"])
    assert refused.exit_code == 2 and "an imported model has one checkpoint" in refused.stderr
    again = runner.invoke(app, ["import", "hf", str(exported), "--out", str(imported)])  # never over a run
    assert again.exit_code == 2 and "exists and is not an empty directory" in again.stderr
    assert model_tensors(imported)[0].keys() == theirs.keys()


def test_a_marian_made_by_transformers_computes_as_transformers_does(hf_marian, tmp_path):
    """Random weights: the logits, and greedy search, which decides by argmax alone (a random model
    rarely ends a sentence, so both stop at the length cap: xformer forces EOS there, transformers
    stops)."""
    transformers = need("transformers")
    out = import_hf(hf_marian, tmp_path / "run")
    recipe = load_run_recipe(out)
    assert (recipe.model.ffn, recipe.model.d_model, recipe.data.source_lang) == ("silu", 32, "de")
    task = make_task(recipe)
    model, _ = task.open_run(out, "best", "cpu")
    hf = transformers.MarianMTModel.from_pretrained(hf_marian).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(hf_marian)
    theirs = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    ours = [ids + [3] for ids in task.tokenizer.encode(SENTENCES, "source")]
    assert [row[: len(o)] for row, o in zip(theirs.input_ids.tolist(), ours, strict=True)] == ours
    src, mask = theirs.input_ids, theirs.attention_mask
    tgt = torch.tensor([[2, 5, 9, 14, 7], [2, 8, 8, 20, 11], [2, 40, 3, 0, 0]])
    # std-1 weights make logits of ~30, so they are compared in float64, to 5e-5 of their scale (the
    # two sinusoid tables are computed in float32 by different formulas)
    hf, model = hf.double(), model.double()
    with torch.no_grad():
        expected = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        torch.testing.assert_close(model(src, tgt), expected, rtol=0, atol=5e-5 * expected.abs().max().item())
        assert hf_generate(hf, src, mask, 1) == greedy_decode(model, src, max_len_a=0.0, max_len_b=25)


def test_a_trained_export_searches_as_transformers_does(trained, tmp_path):
    """A model that ends its sentences, exported and imported back: greedy
    and beam search give transformers' generate output, sentence for sentence."""
    transformers = need("transformers")
    assert runner.invoke(app, ["export", str(trained), "--out", str(tmp_path / "hf")]).exit_code == 0
    out = import_hf(tmp_path / "hf", tmp_path / "run")
    task = make_task(load_run_recipe(out))
    model, _ = task.open_run(out, "best", "cpu")
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    theirs = transformers.MarianTokenizer.from_pretrained(tmp_path / "hf")(SENTENCES, padding=True,
                                                                            return_tensors="pt")
    src, mask = theirs.input_ids, theirs.attention_mask
    with torch.no_grad():
        greedy = greedy_decode(model, src, max_len_a=0.0, max_len_b=24)
        beamed = beam_search(model, src, beam=4, lenpen=1.0, max_len_a=0.0, max_len_b=24)
        assert max(len(h) for h in greedy + beamed) < 24  # ended by the model, not the cap
        assert hf_generate(hf, src, mask, 1) == greedy
        assert hf_generate(hf, src, mask, 4) == beamed


def test_an_imported_model_goes_through_inspect_heads_with_pruning_and_export(hf_marian, corpus, tmp_path):
    need("transformers")
    out = import_hf(hf_marian, tmp_path / "run", overrides=[f"data.dataset={json.dumps(str(corpus))}", *SHORT])
    heads = runner.invoke(app, ["inspect-heads", str(out), "--n-examples", "8", "--prune", "--json"])
    assert heads.exit_code == 0, heads.output
    report = json.loads(heads.stdout)
    assert report["pruning"] and len(report["heads"]) == 2 * 4 + 2 * 4 * 2  # encoder self, decoder self + cross
    exported = runner.invoke(app, ["export", str(out), "--out", str(tmp_path / "again")])
    assert exported.exit_code == 0, exported.output
    back = import_hf(tmp_path / "again", tmp_path / "back")
    assert all(torch.equal(a, b) for a, b in zip(model_tensors(out)[0].values(), model_tensors(back)[0].values(),
                                                  strict=True))


def test_an_eos_that_is_also_pad_and_an_output_of_its_own_beside_shared_embeddings_are_refused_by_field(
        hf_marian, tmp_path):
    folder = tmp_path / "odd"
    shutil.copytree(hf_marian, folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {"eos_token_id": 0, "pad_token_id": 0, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    result = runner.invoke(app, ["import", "hf", str(folder), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    lines = result.stderr.splitlines()
    for field in ("eos_token_id", "tie_word_embeddings"):
        assert any(f"config.json: {field}" in line for line in lines), field
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module", params=["shared", "untied"])
def opus_shaped(request, corpus, tmp_path_factory):
    """A MarianMTModel laid out as the Helsinki-NLP opus-mt models are: EOS 0, unk 1, pad as the
    last id and the decoder's start, one sentencepiece model per language over one vocab.json,
    a final_logits_bias that is not zero; random weights (std 1). "untied": the encoder's
    embedding apart from the decoder's (share_encoder_decoder_embeddings = false), as in the
    larger opus-mt models."""
    transformers = need("transformers")
    import sentencepiece

    folder = tmp_path_factory.mktemp("opus")
    train_tokenizer(load_split(str(corpus), "train", ["de", "en"]), "de", "en", folder / "spm", model_type="unigram",
                    vocab_size=200, joint=False, character_coverage=1.0, byte_fallback=False)
    pieces = []
    for lang in ("de", "en"):
        processor = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spm" / f"spm.{lang}.model"))
        pieces += [processor.id_to_piece(i) for i in range(4, processor.get_piece_size())]
    ordered = ["</s>", "<unk>", *dict.fromkeys(pieces), "<pad>"]
    vocab = {piece: i for i, piece in enumerate(ordered)}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer = transformers.MarianTokenizer(str(folder / "spm" / "spm.de.model"), str(folder / "spm" / "spm.en.model"),
                                             str(folder / "vocab.json"), source_lang="de", target_lang="en",
                                             unk_token="<unk>", eos_token="</s>", pad_token="<pad>")
    last = len(vocab) - 1
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256,
        activation_function="swish", dropout=0.0, scale_embedding=True,
        share_encoder_decoder_embeddings=request.param == "shared", decoder_vocab_size=len(vocab),
        pad_token_id=last, eos_token_id=0, decoder_start_token_id=last, forced_eos_token_id=0,
        bad_words_ids=[[last]], init_std=1.0)
    torch.manual_seed(5)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 2.0)
    model.save_pretrained(folder / "hf", safe_serialization=True)
    tokenizer.save_pretrained(folder / "hf")
    return folder / "hf"


def test_an_opus_mt_layout_imports_renumbered_and_computes_as_transformers_does(opus_shaped, tmp_path):
    transformers = need("transformers")
    out = import_hf(opus_shaped, tmp_path / "run")
    recipe = load_run_recipe(out)
    untied = not json.loads((opus_shaped / "config.json").read_text())["share_encoder_decoder_embeddings"]
    assert recipe.model.tie_embeddings == ("decoder" if untied else "all")
    assert recipe.model.output_bias and sorted(p.name for p in (out / "tokenizer").iterdir()) == [
        "source.spm", "target.spm", "vocab.json"]
    task = make_task(recipe)
    model, _ = task.open_run(out, "best", "cpu")
    hf = transformers.MarianMTModel.from_pretrained(opus_shaped).eval()
    tokenizer = transformers.MarianTokenizer.from_pretrained(opus_shaped)
    theirs_of = {piece: i for piece, i in tokenizer.get_vocab().items()}
    order = [theirs_of.get(task.tokenizer.piece(i, "target"), -1) for i in range(task.tokenizer.vocab_size("target"))]
    assert order[1:4] == [1, len(theirs_of) - 1, 0] and order[0] == -1  # unk, the decoder's start (pad), EOS
    theirs = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    ours = [ids + [3] for ids in task.tokenizer.encode(SENTENCES, "source")]
    assert [[order[i] for i in row] for row in ours] == [row[: len(o)] for row, o in
                                                         zip(theirs.input_ids.tolist(), ours, strict=True)]
    width = max(map(len, ours))
    src = torch.tensor([row + [0] * (width - len(row)) for row in ours])
    tgt = torch.tensor([[2, 5, 9, 14, 7], [2, 8, 8, 20, 11], [2, 40, 3, 0, 0]])
    hf, model = hf.double(), model.double()
    with torch.no_grad():
        expected = hf(input_ids=theirs.input_ids, attention_mask=theirs.attention_mask,
                      decoder_input_ids=torch.tensor([[order[i] if i else len(order) - 2 for i in row]
                                                      for row in tgt.tolist()])).logits
        got = model(src, tgt)
        real = [x for x, o in enumerate(order) if o >= 0]
        torch.testing.assert_close(got[:, :, real], expected[:, :, [order[x] for x in real]], rtol=0,
                                   atol=5e-5 * expected.abs().max().item())
        assert (got[:, :, 0] < -9000).all()  # import's own pad row: never more than exp(-1e4) of the mass
        generated = hf.generate(input_ids=theirs.input_ids, attention_mask=theirs.attention_mask, num_beams=1,
                                do_sample=False, max_new_tokens=26)  # 25 tokens, then EOS forced as ours
        greedy = greedy_decode(model, src, max_len_a=0.0, max_len_b=25)
    last = len(theirs_of) - 1
    assert [[t for t in row[1:].tolist() if t not in (0, last)] for row in generated] == [
        [order[t] for t in hyp] for hyp in greedy]
    assert tokenizer.batch_decode(generated, skip_special_tokens=True) == task.tokenizer.decode(greedy, "target")

    exported = runner.invoke(app, ["export", str(out), "--out", str(tmp_path / "hf")])
    assert exported.exit_code == 0, exported.output
    back = import_hf(tmp_path / "hf", tmp_path / "back")
    assert (back / "tokenizer" / "vocab.json").read_bytes() == (out / "tokenizer" / "vocab.json").read_bytes()
    assert all(torch.equal(a, b) for a, b in zip(model_tensors(out)[0].values(), model_tensors(back)[0].values(),
                                                  strict=True))


class _Payload:
    def __reduce__(self):
        return (print, ("this ran while loading",))


def test_pickled_weights_load_as_tensors_only(hf_marian, tmp_path, capsys):
    need("transformers")
    from safetensors.torch import load_file

    plain = tmp_path / "bin"
    shutil.copytree(hf_marian, plain)
    weights = load_file(str(plain / "model.safetensors"))
    (plain / "model.safetensors").unlink()
    torch.save(weights, plain / "pytorch_model.bin")
    a = import_hf(plain, tmp_path / "from-bin")
    b = import_hf(hf_marian, tmp_path / "from-safetensors")
    assert all(torch.equal(x, y) for x, y in zip(model_tensors(a)[0].values(), model_tensors(b)[0].values(),
                                                  strict=True))

    hostile = tmp_path / "hostile"
    shutil.copytree(plain, hostile)
    with open(hostile / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.shared.weight": _Payload()}, f)
    result = runner.invoke(app, ["import", "hf", str(hostile), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2 and "refused: not tensors alone" in result.stderr
    assert "this ran while loading" not in capsys.readouterr().out + result.output


def test_fine_tuning_starts_from_the_imported_weights_at_step_0(hf_marian, corpus, tmp_path):
    need("transformers")
    data = f"data.dataset={json.dumps(str(corpus))}"
    imported = import_hf(hf_marian, tmp_path / "run", overrides=[data, *SHORT])
    tuned = tmp_path / "tuned"
    args = ["train", str(imported / "recipe.toml"), "--init-from", str(imported), "--out", str(tuned),
            "--set", data, "--set", "train.valid_every=2", "--set", "train.lr=1e-4", "--max-steps", "2"]
    refused = runner.invoke(app, [*args[:-2], "--max-steps", "2", "--set", "model.d_ff=128"])
    assert refused.exit_code == 2 and "model.d_ff: " in refused.stderr and not tuned.exists()
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads((tuned / "init-from.json").read_text())
    assert record["checkpoint"] == "best.safetensors" and record["imported"]["source"] == str(hf_marian.resolve())
    assert (tuned / "tokenizer" / "spm.model").read_bytes() == (imported / "tokenizer" / "spm.model").read_bytes()
    start, _ = model_tensors(imported)
    tensors, meta = read_checkpoint(tuned / "checkpoints" / "last.safetensors")
    assert meta["progress"]["step"] == 2 and meta["optimizer"]["param_groups"][0]["lr"] <= 1e-4
    moved = max((tensors[k] - start[k]).abs().max().item() for k in start)
    assert 0 < moved < 0.01  # two small steps from the imported weights (a fresh init is ~1 away)
    again = runner.invoke(app, args)  # into a run that exists: refused, as any train without --resume
    assert again.exit_code == 2


@pytest.mark.parametrize("opus_shaped", ["untied"], indirect=True)
def test_an_opus_mt_layout_goes_through_eval_inspect_heads_with_pruning_and_fine_tuning(opus_shaped, corpus,
                                                                                       tmp_path):
    need("transformers")
    data = f"data.dataset={json.dumps(str(corpus))}"
    # random weights never end a sentence: short outputs keep the decodes of eval and pruning quick
    out = import_hf(opus_shaped, tmp_path / "run", overrides=[data, *SHORT])
    scored = runner.invoke(app, ["eval", str(out), "--beam", "2", "--json"])
    assert scored.exit_code == 0, scored.output
    assert json.loads(scored.stdout)["card"]["checkpoint"]["imported"]["source"] == str(opus_shaped.resolve())
    heads = runner.invoke(app, ["inspect-heads", str(out), "--n-examples", "8", "--prune", "--json"])
    assert heads.exit_code == 0, heads.output
    assert json.loads(heads.stdout)["pruning"]
    tuned = tmp_path / "tuned"
    result = runner.invoke(app, ["train", str(out / "recipe.toml"), "--init-from", str(out), "--out", str(tuned),
                                 "--set", data, "--set", "train.valid_every=2", "--set", "train.lr=1e-4",
                                 "--max-steps", "2"])
    assert result.exit_code == 0, result.output
    start, _ = model_tensors(out)
    tensors, meta = read_checkpoint(tuned / "checkpoints" / "last.safetensors")
    assert meta["progress"]["step"] == 2
    assert 0 < max((tensors[k] - start[k]).abs().max().item() for k in start) < 0.01
    assert (tuned / "tokenizer" / "vocab.json").read_bytes() == (out / "tokenizer" / "vocab.json").read_bytes()


def test_beam_search_on_a_trained_model_in_the_opus_mt_layout_is_transformers(trained, tmp_path):
    """The trained export renumbered by hand to opus-mt's layout (EOS 0, unk 1, pad = the decoder's
    start = the last id; xformer's pad row dropped), so a model that ends its sentences: greedy and
    beam search of the import give transformers' generate output."""
    transformers = need("transformers")
    from safetensors.torch import load_file, save_file

    assert runner.invoke(app, ["export", str(trained), "--out", str(tmp_path / "hf")]).exit_code == 0
    opus = tmp_path / "opus"
    shutil.copytree(tmp_path / "hf", opus)
    config = json.loads((opus / "config.json").read_text())
    size = config["vocab_size"]
    old_of_new = [3, 1, *range(4, size), 2]  # the export's id of each opus id: EOS, unk, the pieces, BOS as pad
    tensors = load_file(str(opus / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("embed_tokens.weight") or n in ("model.shared.weight",
                                                                                   "lm_head.weight")]:
        tensors[name] = tensors[name][old_of_new].contiguous()
    tensors["final_logits_bias"] = tensors["final_logits_bias"][:, old_of_new].contiguous()
    save_file(tensors, str(opus / "model.safetensors"), metadata={"format": "pt"})
    last = size - 2
    config |= {"vocab_size": size - 1, "decoder_vocab_size": size - 1, "pad_token_id": last, "eos_token_id": 0,
               "decoder_start_token_id": last, "bos_token_id": last, "forced_eos_token_id": 0}
    (opus / "config.json").write_text(json.dumps(config))
    generation = json.loads((opus / "generation_config.json").read_text())
    generation |= {"pad_token_id": last, "eos_token_id": 0, "decoder_start_token_id": last, "bos_token_id": last,
                   "forced_eos_token_id": 0, "suppress_tokens": [last]}
    (opus / "generation_config.json").write_text(json.dumps(generation))
    pieces = {i: p for p, i in json.loads((opus / "vocab.json").read_text()).items()}
    (opus / "vocab.json").write_text(json.dumps({pieces[o]: n for n, o in enumerate(old_of_new)}, ensure_ascii=False))
    tokenizer_config = json.loads((opus / "tokenizer_config.json").read_text())
    tokenizer_config.pop("added_tokens_decoder", None)  # ids of the export's numbering: looked up in vocab.json
    (opus / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"pad_token": pieces[2]}))

    out = import_hf(opus, tmp_path / "run")
    model, _ = make_task(load_run_recipe(out)).open_run(out, "best", "cpu")
    hf = transformers.MarianMTModel.from_pretrained(opus).eval()
    theirs = transformers.MarianTokenizer.from_pretrained(opus)(SENTENCES, padding=True, return_tensors="pt")
    assert theirs.input_ids.eq(0).sum().item() == len(SENTENCES)  # one EOS a sentence, 0 now
    order = [-1, 1, last, 0, *range(2, last)]  # the opus id of each xformer id, as import numbers them
    new_of = {o: x for x, o in enumerate(order)} | {last: 0}  # the opus pad pads: xformer's pad
    src = theirs.input_ids.clone().apply_(lambda t: new_of[t])
    with torch.no_grad():
        for beam in (1, 4):
            generated = hf.generate(input_ids=theirs.input_ids, attention_mask=theirs.attention_mask,
                                    num_beams=beam, do_sample=False, max_new_tokens=25, length_penalty=1.0,
                                    early_stopping=True)
            ours = (greedy_decode(model, src, max_len_a=0.0, max_len_b=24) if beam == 1 else
                    beam_search(model, src, beam=beam, lenpen=1.0, max_len_a=0.0, max_len_b=24))
            assert max(len(h) for h in ours) < 24  # ended by the model
            assert [[t for t in row[1:].tolist() if t not in (0, last)] for row in generated] == [
                [order[t] for t in hyp] for hyp in ours], beam
