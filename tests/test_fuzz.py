"""Bad input, drawn by hypothesis: random recipes, random --set values and damaged data files
thrown at check, train (one step), eval and translate. Whatever comes, the command exits 0 or
2 (2: one line naming what is wrong), never 1 (an error nobody classified) and never with a
traceback, and the files of an existing run directory stay as they were.

The draws are derandomized, so CI sees the same cases on every run; XFORMER_FUZZ_EXAMPLES
raises their number for a longer hunt."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from xformer.config.loading import load_recipe
from xformer.train import run
from xformer_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "translation" / "multi30k_de_en.toml"
SWEEP = ROOT / "recipes" / "longrange" / "recall_cpu_sweep.toml"
TINY = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "data.vocab_size=300", "data.max_tokens=512", "train.max_time=0.0",
        "train.valid_every=1000", "train.average_last=0", "eval.beam=1", "eval.batch_sentences=16"]
EXAMPLES = int(os.environ.get("XFORMER_FUZZ_EXAMPLES", "12"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
runner = CliRunner()


def invoke(*args: str, input: str | bytes | None = None):
    result = runner.invoke(app, list(args), input=input)
    assert result.exit_code in (0, 2), (args, result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output, (args, result.output)
    if result.exit_code == 2:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines, (args, result.output)
    return result


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def existing(corpus, tmp_path_factory):
    """A finished run whose files no fuzzed command may change, and their digests."""
    out = tmp_path_factory.mktemp("existing") / "run"
    run(load_recipe(RECIPE, [*TINY, f"data.dataset={json.dumps(str(corpus))}", "train.max_steps=2"]), out,
        device="cpu")
    return out, snapshot(out)


def unchanged(existing) -> None:
    out, before = existing
    now = snapshot(out)
    assert {k: v for k, v in now.items() if k in before} == before
    assert all(k.startswith("eval") for k in now.keys() - before.keys()), sorted(now.keys() - before.keys())


# ------------------------------------------------------------------ strategies
KEYS = ["model.d_model", "model.n_heads", "model.d_ff", "model.dropout", "model.attention", "model.positions",
        "model.arch", "data.max_tokens", "data.vocab_size", "data.max_len", "data.source_lang", "data.tokenizer",
        "train.lr", "train.warmup_steps", "train.precision", "train.accumulate_steps", "train.clip_norm",
        "eval.beam", "eval.lenpen", "data", "model", "nonsense.key", "train.nonsense", "train", ""]
SCALARS = st.one_of(
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: {"inf": "inf", "-inf": "-inf"}.get(str(f), repr(f))),
    st.booleans().map(lambda b: str(b).lower()),
    st.text(max_size=12).map(json.dumps),  # a TOML string
    st.text(max_size=12),  # raw text: often not TOML at all
    st.sampled_from(["[1, 2]", "{a = 1}", "[]", "''", '"fp16"', '"sdpa"', "1e400", "-0", "0", "1"]),
)
SETS = st.lists(st.builds(lambda key, value: f"{key}={value}", st.sampled_from(KEYS) | st.text(max_size=8), SCALARS),
                max_size=3)
BASE = RECIPE.read_text()
RECIPES = st.one_of(
    st.just(""), st.text(max_size=60), st.binary(max_size=40).map(lambda b: b"\xff" + b),
    st.sampled_from(["model = 3", "[model]\nd_model = 'big'", "[[model]]\nd_model = 1", "[model\n", "x = [1,",
                     "[data]\ndataset = 7", "[train]\nlr = -1", "[sweep]\nlengths = [1]"]),
    st.just(SWEEP.read_text()),  # a sweep where a recipe belongs
    st.integers(min_value=0, max_value=BASE.count("\n")).map(
        lambda n: "\n".join(line for i, line in enumerate(BASE.splitlines()) if i != n)),  # one line gone
)
LONG = "Ein sehr langer Satz " * 3000


def damaged_jsonl(kind: str, lines: list[str]) -> bytes:
    """The first rows of a split, damaged one way."""
    text = "\n".join(lines) + "\n"
    return {
        "empty": b"", "whitespace": b"  \n\t\n\n",
        "not json": b"this is not json\n" + text.encode(),
        "invalid utf-8": text.encode()[:200] + b"\xff\xfe\xc3\x28" + text.encode()[200:],
        "no language field": "\n".join(json.dumps({"fr": json.loads(line)["fr"]}) for line in lines).encode(),
        "not objects": b"[1, 2]\n\"text\"\n3\n",
        "null texts": "\n".join(json.dumps({"de": None, "en": json.loads(line)["en"]}) for line in lines).encode(),
        "numbers": "\n".join(json.dumps({"de": 5, "en": json.loads(line)["en"]}) for line in lines).encode(),
        "blank lines": ("\n\n   \n" + "\n \n".join(lines) + "\n\n").encode(),
        "empty texts": "\n".join(json.dumps({"de": "", "en": " "}) if i % 3 == 0 else line
                                 for i, line in enumerate(lines)).encode(),
        "absurdly long": "\n".join([json.dumps({"de": LONG, "en": LONG, "fr": ""}), *lines]).encode(),
        "cut short": text.encode()[: len(text) // 2 + 7],
        "nul bytes": text.replace("a", "a\0", 3).encode(),
    }[kind]


DAMAGE = ["empty", "whitespace", "not json", "invalid utf-8", "no language field", "not objects", "null texts",
          "numbers", "blank lines", "empty texts", "absurdly long", "cut short", "nul bytes", "missing", "a folder"]


def damaged_corpus(source: Path, where: Path, split: str, kind: str) -> Path:
    folder = where / "data"
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(source, folder)
    target = folder / f"{split}.jsonl"
    lines = target.read_text(encoding="utf-8").splitlines()[:200]
    target.unlink()
    if kind == "a folder":
        target.mkdir()
    elif kind != "missing":
        target.write_bytes(damaged_jsonl(kind, lines))
    return folder


# ------------------------------------------------------------------ properties
@FUZZ
@given(text=RECIPES, sets=SETS)
def test_check_and_train_on_random_recipes_and_sets(text, sets, tmp_path_factory, existing):
    where = tmp_path_factory.mktemp("recipe")
    recipe = where / "recipe.toml"
    recipe.write_bytes(text if isinstance(text, bytes) else text.encode())
    flags = [arg for value in sets for arg in ("--set", value)]
    invoke("check", str(recipe), *flags)
    invoke("train", str(recipe), *flags, "--max-steps", "1", "--out", str(where / "run"), "--device", "cpu")
    invoke("train", str(recipe), *flags, "--out", str(existing[0]), "--device", "cpu")  # exists: refused
    unchanged(existing)


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.parametrize("split", ["train", "val"])
def test_train_one_step_on_damaged_data(split, kind, corpus, tmp_path, existing):
    """Every damage on both splits, not left to the draw: refused in one line, or trained on
    what is usable, with the rest dropped and counted."""
    folder = damaged_corpus(corpus, tmp_path, split, kind)
    flags = [arg for value in [*TINY, f"data.dataset={json.dumps(str(folder))}"] for arg in ("--set", value)]
    result = invoke("train", str(RECIPE), *flags, "--max-steps", "1", "--out", str(tmp_path / "run"), "--device", "cpu")
    if kind in ("empty texts", "absurdly long") and split == "train":
        assert result.exit_code == 0 and "dropped (a side empty or blank" in result.output
    unchanged(existing)


VALUES = st.one_of(st.text(max_size=30), st.none(), st.integers(), st.floats(), st.booleans(),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
ROWS = st.lists(st.one_of(
    st.fixed_dictionaries({"de": VALUES, "en": VALUES}).map(json.dumps),
    st.fixed_dictionaries({"de": st.text(min_size=1, max_size=40), "en": st.text(min_size=1, max_size=40)})
    .map(json.dumps),
    st.dictionaries(st.text(max_size=3), VALUES, max_size=3).map(json.dumps),
    VALUES.map(json.dumps), st.text(max_size=30)), max_size=12)


@FUZZ
@given(split=st.sampled_from(["train", "val"]), rows=ROWS)
def test_train_one_step_on_random_rows(split, rows, corpus, tmp_path_factory, existing):
    where = tmp_path_factory.mktemp("rows")
    folder = damaged_corpus(corpus, where, split, "missing")
    (folder / f"{split}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8", errors="surrogatepass")
    flags = [arg for value in [*TINY, f"data.dataset={json.dumps(str(folder))}"] for arg in ("--set", value)]
    invoke("train", str(RECIPE), *flags, "--max-steps", "1", "--out", str(where / "run"), "--device", "cpu")
    unchanged(existing)


@FUZZ
@given(kind=st.sampled_from(DAMAGE), as_file=st.booleans())
def test_eval_on_damaged_data(kind, as_file, corpus, tmp_path_factory, existing):
    where = tmp_path_factory.mktemp("eval")
    folder = damaged_corpus(corpus, where, "test", kind)
    data = folder / "test.jsonl" if as_file else folder
    invoke("eval", str(existing[0]), "--data", str(data), "--device", "cpu", "--beam", "1")
    unchanged(existing)


@FUZZ
@given(lines=st.lists(st.one_of(st.text(max_size=40), st.just(""), st.just("   "), st.just(LONG)), max_size=4),
       raw=st.binary(max_size=30))
def test_translate_random_lines(lines, raw, tmp_path_factory, existing):
    where = tmp_path_factory.mktemp("translate")
    source = where / "input.txt"
    source.write_bytes("\n".join(lines).encode("utf-8", errors="surrogatepass") + b"\n" + raw)
    invoke("translate", str(existing[0]), "--input", str(source), "--device", "cpu", "--beam", "1")
    unchanged(existing)


def test_the_fixed_cases(corpus, tmp_path, existing):
    """Cases not left to the draw: CUDA asked for where there is none, a recipe where a sweep
    belongs, a tokenizer other than the one the checkpoint was trained with."""
    import torch

    flags = [arg for value in [*TINY, f"data.dataset={json.dumps(str(corpus))}"] for arg in ("--set", value)]
    if not torch.cuda.is_available():
        result = invoke("train", str(RECIPE), *flags, "--max-steps", "1", "--out", str(tmp_path / "c"),
                        "--device", "cuda")
        assert result.exit_code == 2 and "CUDA is not available" in result.stderr
    result = invoke("longrange", str(RECIPE), "--out", str(tmp_path / "l"))
    assert result.exit_code == 2
    copy = tmp_path / "copy"
    shutil.copytree(existing[0], copy)
    other = [arg if arg != "data.vocab_size=300" else "data.vocab_size=250" for arg in flags]
    made = invoke("tokenize", str(RECIPE), *other, "--set", "train.max_steps=1", "--out", str(tmp_path / "other"))
    assert made.exit_code == 0, made.output
    for path in (tmp_path / "other" / "tokenizer").iterdir():  # a 250-piece vocabulary for a 300-piece model
        shutil.copy(path, copy / "tokenizer" / path.name)
    result = invoke("eval", str(copy), "--device", "cpu")
    assert result.exit_code == 2 and "tokenizer" in result.stderr
    unchanged(existing)
