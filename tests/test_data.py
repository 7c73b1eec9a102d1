"""The data layer: sentencepiece tokenizers, corpus loading and its errors, token batching."""

import unicodedata
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from xformer.data import corpus
from xformer.data.batching import BatchIterator, SampledBatchIterator, collate, collate_source, token_batches
from xformer.data.corpus import encode_split, load_corpus, load_split
from xformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, train_tokenizer
from xformer.errors import DataError

FIELDS = ["de", "en"]
SMALL = dict(model_type="unigram", vocab_size=500, character_coverage=1.0, byte_fallback=False)


_TRAINED: dict = {}


@pytest.fixture
def multi30k(shared_dir) -> str:
    return str(shared_dir / "data" / "multi30k")


@pytest.fixture
def small_train(multi30k) -> datasets.Dataset:
    return load_split(multi30k, "train", FIELDS).select(range(2000))


@pytest.fixture
def joint(small_train, tmp_path_factory) -> Tokenizer:
    """A joint 500-piece unigram model of 2000 Multi30k pairs, trained once per module."""
    if "joint" not in _TRAINED:
        directory = tmp_path_factory.mktemp("spm")
        _TRAINED["joint"] = train_tokenizer(small_train, "de", "en", directory, joint=True, **SMALL)
    return _TRAINED["joint"]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def data_error(call, *args, **kwargs) -> str:
    """The one line of the DataError that call(*args, **kwargs) raises."""
    with pytest.raises(DataError) as info:
        call(*args, **kwargs)
    (line,) = info.value.problems
    assert "\n" not in line
    return line


# -- tokenizer ------------------------------------------------------------------------------

def test_round_trip_on_real_sentences(joint, multi30k):
    valid = load_split(multi30k, "validation", FIELDS)[:300]
    for side, texts in (("source", valid["de"]), ("target", valid["en"])):
        # sentencepiece's nmt_nfkc normalises (NFKC, single spaces): only such text can come back.
        normal = [t for t in texts if " ".join(unicodedata.normalize("NFKC", t).split()) == t]
        assert len(normal) > 0.95 * len(texts)
        assert joint.decode(joint.encode(normal, side), side) == normal


def test_special_ids_are_fixed_and_never_produced_by_encode(joint):
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    model = joint._model("source")
    assert (model.pad_id(), model.unk_id(), model.bos_id(), model.eos_id()) == (0, 1, 2, 3)
    ids = joint.encode(["Ein Mann fährt Fahrrad.", "A dog runs."], "source")
    assert all(i > EOS_ID for seq in ids for i in seq)


def test_decode_drops_pad_bos_eos_but_keeps_unknowns(joint):
    (ids,) = joint.encode(["Zwei Hunde spielen im Schnee."], "source")
    padded = [BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]
    assert joint.decode([padded], "source") == ["Zwei Hunde spielen im Schnee."]
    assert joint.decode(torch.tensor([padded]), "source") == ["Zwei Hunde spielen im Schnee."]
    assert joint.decode([[UNK_ID]], "source") != [""]


def test_joint_and_separate_layouts(small_train, tmp_path, joint):
    assert joint.joint and [f.name for f in joint.files] == ["spm.model"]
    assert joint.vocab_size("source") == joint.vocab_size("target") == 500
    separate = train_tokenizer(small_train, "de", "en", tmp_path, joint=False, **{**SMALL, "vocab_size": 300})
    assert not separate.joint
    assert [f.name for f in separate.files] == ["spm.de.model", "spm.en.model"]
    assert separate.vocab_size("source") == separate.vocab_size("target") == 300
    # Each side has its own pieces: the German model splits English worse than the English one.
    english = small_train["en"][:200]
    lengths = {side: sum(map(len, separate.encode(english, side))) for side in ("source", "target")}
    assert lengths["source"] > lengths["target"]
    loaded = Tokenizer.load(tmp_path, "de", "en")
    assert loaded.files == separate.files and loaded.digest == separate.digest
    # Retraining joint in the same place replaces the per-language models, so loading is unambiguous.
    train_tokenizer(small_train, "de", "en", tmp_path, joint=True, **SMALL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spm.model"]
    assert Tokenizer.load(tmp_path, "de", "en").joint


def test_training_is_deterministic_and_the_seed_matters(small_train, tmp_path):
    def model_bytes(name, seed):
        tok = train_tokenizer(small_train, "de", "en", tmp_path / name, joint=True, max_sentences=1000,
                              seed=seed, **SMALL)
        return tok.files[0].read_bytes()

    first = model_bytes("a", seed=1)
    assert model_bytes("b", seed=1) == first
    assert model_bytes("c", seed=2) != first  # another sample of 500 pairs


def test_load_names_the_missing_model(tmp_path):
    line = data_error(Tokenizer.load, tmp_path, "de", "en")
    assert line.startswith(f"{tmp_path / 'spm.model'}: no such file")
    write(tmp_path / "spm.de.model", "")
    assert data_error(Tokenizer.load, tmp_path, "de", "en").startswith(f"{tmp_path / 'spm.en.model'}: no such file")
    write(tmp_path / "spm.en.model", "not a model")
    assert "cannot read as a sentencepiece model" in data_error(Tokenizer.load, tmp_path, "de", "en")


def test_a_vocabulary_the_corpus_cannot_fill_suggests_a_smaller_one(tmp_path):
    tiny = datasets.Dataset.from_dict({"de": ["ein Hund", "zwei Katzen"] * 5, "en": ["a dog", "two cats"] * 5})
    line = data_error(train_tokenizer, tiny, "de", "en", tmp_path, joint=True, **SMALL)
    assert line.startswith("data.vocab_size: 500 is more pieces than this corpus yields")
    assert "--set data.vocab_size=" in line
    assert not list(tmp_path.iterdir())  # nothing half-written


# -- corpus loading -------------------------------------------------------------------------

def test_multi30k_folder_has_the_hub_splits(multi30k):
    sizes = {name: len(load_split(multi30k, name, FIELDS)) for name in ("train", "validation", "test")}
    assert sizes == {"train": 29000, "validation": 1014, "test": 1000}
    assert {k: len(v) for k, v in load_corpus(multi30k, ["de", "en", "fr"]).items()} == sizes


def test_tsv_folder_reads_cells_verbatim(tmp_path):
    write(tmp_path / "train.tsv", 'de\ten\nNA\t"quoted\nnull\t123\n')
    write(tmp_path / "dev.tsv", "de\ten\nHallo\tHello\n")
    corpus_ = load_corpus(str(tmp_path), FIELDS)
    assert sorted(corpus_) == ["train", "validation"]
    assert corpus_["train"][:] == {"de": ["NA", "null"], "en": ['"quoted', "123"]}


def test_parallel_text_folder_gives_a_column_per_language(tmp_path):
    write(tmp_path / "train.de", "Ein Hund.\n\nZwei Katzen.\n")
    write(tmp_path / "train.en", "A dog.\n\nTwo cats.")  # no final newline: still three lines
    write(tmp_path / "train.fr", "Un chien.\n")  # a language not asked for is left alone
    split = load_split(str(tmp_path), "train", FIELDS)
    assert split[:] == {"de": ["Ein Hund.", "", "Zwei Katzen."], "en": ["A dog.", "", "Two cats."]}


def test_a_single_file_is_the_split_whatever_it_is_called(tmp_path):
    path = write(tmp_path / "newstest2014-deen.jsonl", '{"de": "Hallo", "en": "Hello"}\n')
    assert load_split(str(path), "test", FIELDS)["en"] == ["Hello"]
    assert list(load_corpus(str(path), FIELDS)) == ["newstest2014_deen"]


def test_missing_field(tmp_path):
    write(tmp_path / "train.jsonl", '{"en": "a", "de": "b", "fr": "c"}\n')
    line = data_error(load_split, str(tmp_path), "train", ["de", "xx"])
    assert line == f"{tmp_path / 'train.jsonl'}: no field 'xx' (found: en, de, fr)"


def test_empty_file(tmp_path):
    path = write(tmp_path / "train.jsonl", "\n\n")
    line = data_error(load_split, str(tmp_path), "train", FIELDS)
    assert line == f"{path}: empty, expected JSONL lines with fields de, en"
    header_only = write(tmp_path / "t.tsv", "de\ten\n")
    assert data_error(load_split, str(header_only), "t", FIELDS).startswith(f"{header_only}: empty, expected a header")


def test_nonexistent_path(tmp_path):
    missing = str(tmp_path / "nope")
    assert data_error(load_split, missing, "train", FIELDS) == f"{missing}: no such file or folder"
    assert data_error(load_split, "data/nope.jsonl", "train", FIELDS) == "data/nope.jsonl: no such file or folder"


def test_unknown_split(tmp_path):
    for name in ("train", "val", "test"):
        write(tmp_path / f"{name}.jsonl", '{"de": "a", "en": "b"}\n')
    line = data_error(load_split, str(tmp_path), "dev", FIELDS)
    assert line.startswith(f"{tmp_path}: no split 'dev' (found: train, validation, test)")


def test_malformed_json_line_is_located(tmp_path):
    path = write(tmp_path / "train.jsonl", '{"de": "a", "en": "b"}\n\n{"de": "a" "en": "b"}\n')
    line = data_error(load_split, str(tmp_path), "train", FIELDS)
    assert line.startswith(f"{path}:3: not valid JSON")


def test_parallel_text_line_counts_must_match(tmp_path):
    de, en = write(tmp_path / "test.de", "a\nb\nc\n"), write(tmp_path / "test.en", "a\nb\n")
    line = data_error(load_split, str(tmp_path), "test", FIELDS)
    assert line == f"{de}: 3 lines but {en} has 2 lines; parallel files must align line by line"


def test_hub_failures_point_to_a_local_copy(monkeypatch):
    def offline(spec, config=None):
        raise ConnectionError("Couldn't reach 'someone/corpus' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(corpus.datasets, "load_dataset", offline)
    assert data_error(load_split, "someone/corpus", "train", FIELDS) == (
        "data.dataset: cannot load 'someone/corpus' from the Hugging Face Hub (ConnectionError: Couldn't reach "
        "'someone/corpus' on the Hub (LocalEntryNotFoundError)); pass a local copy with --set data.dataset=PATH"
    )


# -- encoding -------------------------------------------------------------------------------

def test_encode_split_columns_lengths_and_max_len(joint, tmp_path):
    path = write(tmp_path / "c.jsonl", "".join(
        f'{{"de": "{de}", "en": "{en}"}}\n' for de, en in
        [("Ein Hund läuft.", "A dog runs."), ("", "Nothing."), ("Mann " * 30, "Man."), ("Zwei Katzen.", "Two cats.")]
    ))
    split = load_split(str(path), "c", FIELDS)
    encoded = encode_split(split, joint, "de", "en")
    assert encoded.column_names == ["src_ids", "tgt_ids", "src_len", "tgt_len"] and len(encoded) == 4
    assert encoded[0]["src_ids"] == joint.encode(["Ein Hund läuft."], "source")[0]
    assert [len(ids) for ids in encoded["src_ids"]] == encoded["src_len"]
    kept = encode_split(split, joint, "de", "en", max_len=20)
    assert kept["tgt_ids"] == [encoded[0]["tgt_ids"], encoded[3]["tgt_ids"]]  # empty and over-long dropped
    assert max(encoded["src_len"]) > 20


def test_encoding_is_cached_per_tokenizer(joint, small_train, tmp_path):
    other = train_tokenizer(small_train, "de", "en", tmp_path, joint=True, **{**SMALL, "vocab_size": 400})
    subset = small_train.select(range(50))
    a, b = encode_split(subset, joint, "de", "en"), encode_split(subset, other, "de", "en")
    assert a._fingerprint != b._fingerprint and a["src_ids"] != b["src_ids"]
    assert encode_split(subset, joint, "de", "en")._fingerprint == a._fingerprint


# -- batching -------------------------------------------------------------------------------

def random_lengths(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 60, n)
    return src, np.clip(src + rng.integers(-8, 9, n), 0, 80)


@pytest.mark.parametrize("max_tokens", [100, 1024])
def test_batches_fit_the_budget_and_cover_every_example_once(max_tokens):
    src, tgt = random_lengths()
    batches = token_batches(src, tgt, max_tokens, shuffle=True, seed=3, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(src)))
    for batch in batches:
        assert len(batch) * (src[batch].max() + 1) <= max_tokens  # + EOS
        assert len(batch) * (tgt[batch].max() + 1) <= max_tokens  # + BOS / EOS
    assert np.mean([len(b) for b in batches]) > 0.5 * max_tokens / 60  # batches are filled, not singletons


def test_batches_are_reproducible_per_epoch_and_differ_between_epochs():
    src, tgt = random_lengths()

    def plan(seed, epoch):
        return token_batches(src, tgt, 1024, shuffle=True, seed=seed, epoch=epoch)

    assert plan(1, 0) == plan(1, 0)
    assert plan(1, 0) != plan(1, 1)
    assert plan(1, 0) != plan(2, 0)
    assert len(plan(1, 0)) == len(plan(1, 1))


def test_unshuffled_batches_come_sorted_and_an_over_long_example_gets_its_own():
    src, tgt = np.array([5, 1, 50, 3, 2]), np.array([5, 1, 2, 3, 2])
    batches = token_batches(src, tgt, 10, shuffle=False, seed=0, epoch=0)
    assert batches == [[1, 4], [3], [0], [2]]  # widths (+1) 2,3 | 4 | 6 | 51 > 10


def test_collate_places_bos_eos_and_padding():
    batch = collate([([11, 12, 13], [21]), ([14], [22, 23, 24])])
    assert batch["src"].tolist() == [[11, 12, 13, EOS_ID], [14, EOS_ID, PAD_ID, PAD_ID]]
    assert batch["tgt_in"].tolist() == [[BOS_ID, 21, PAD_ID, PAD_ID], [BOS_ID, 22, 23, 24]]
    assert batch["tgt_out"].tolist() == [[21, EOS_ID, PAD_ID, PAD_ID], [22, 23, 24, EOS_ID]]
    assert batch["src"].dtype == batch["tgt_in"].dtype == torch.long
    assert (batch["n_src_tokens"], batch["n_tgt_tokens"]) == (6, 6)
    assert collate_source([[5], [6, 7]]).tolist() == [[5, EOS_ID, PAD_ID], [6, 7, EOS_ID]]


def test_batch_iterator_yields_each_pair_once_collated_within_budget(joint, multi30k):
    encoded = encode_split(load_split(multi30k, "validation", FIELDS), joint, "de", "en", max_len=64)
    iterator = BatchIterator(encoded.select(range(0, len(encoded), 2)), 512, seed=1)  # an indices mapping too
    rows = encoded.select(range(0, len(encoded), 2))
    batches = list(iterator.iter_epoch(0))
    assert len(batches) == len(iterator)
    seen = []
    for batch in batches:
        assert batch["src"].numel() <= 512 and batch["tgt_in"].numel() <= 512
        assert (batch["tgt_in"][:, 0] == BOS_ID).all()
        for src in batch["src"].tolist():
            seen.append(tuple(src[:src.index(EOS_ID)]))
    assert sorted(seen) == sorted(tuple(ids) for ids in rows["src_ids"])
    # Resuming after k batches gives exactly the rest of the epoch.
    rest = list(iterator.iter_epoch(0, skip=3))
    assert all(torch.equal(a["tgt_out"], b["tgt_out"]) for a, b in zip(rest, batches[3:], strict=True))
    assert not torch.equal(next(iterator.iter_epoch(1))["src"], batches[0]["src"])


def test_sampled_batches_resegment_the_same_text_reproducibly_per_epoch(joint, small_train):
    """Subword regularization: every pair comes back once per epoch, segmented differently
    from the one best (and from epoch to epoch) but decoding to the same text; the same
    (seed, epoch) gives the same batches, so resuming mid-epoch is exact."""
    rows = small_train.select(range(300))
    best = joint.encode(rows["de"], "source")
    sampled = SampledBatchIterator(rows, joint, "de", "en", 512, seed=3, alpha=0.2, nbest=-1, max_len=256)
    epoch0 = list(sampled.iter_epoch(0))
    assert len(epoch0) == len(sampled)
    sources = [tuple(s[:s.index(EOS_ID)]) for b in epoch0 for s in b["src"].tolist()]
    assert len(sources) == 300
    assert sorted(joint.decode(sources, "source")) == sorted(joint.decode(best, "source"))
    assert len(set(sources) - {tuple(ids) for ids in best}) > 100  # most were re-segmented
    again = SampledBatchIterator(rows, joint, "de", "en", 512, seed=3, alpha=0.2, nbest=-1, max_len=256)
    joint.sampler(["Ein Hund."], "source", alpha=0.2).sample(np.random.default_rng(99))  # other sampling between
    rest = list(again.iter_epoch(0, skip=2))
    assert all(torch.equal(a["src"], b["src"]) and torch.equal(a["tgt_out"], b["tgt_out"])
               for a, b in zip(rest, epoch0[2:], strict=True))
    epoch1 = [tuple(s[:s.index(EOS_ID)]) for b in sampled.iter_epoch(1) for s in b["src"].tolist()]
    assert sorted(epoch1) != sorted(sources)
    # pairs longer than max_len after sampling sit the epoch out
    short = SampledBatchIterator(rows, joint, "de", "en", 512, seed=3, alpha=0.2, nbest=-1, max_len=24)
    kept = [b for b in short.iter_epoch(0)]
    assert 0 < sum(len(b["src"]) for b in kept) < 300
    assert all(b["src"].shape[1] <= 25 and b["tgt_out"].shape[1] <= 25 for b in kept)
    none = SampledBatchIterator(rows, joint, "de", "en", 512, seed=3, alpha=0.2, nbest=-1, max_len=1)
    assert "data.max_len = 1: no training pair's sampled segmentation" in data_error(len, none)


def test_a_nested_translation_column_becomes_one_column_per_language(tmp_path):
    """The layout of the Hub's wmt14 / iwslt2017: {"translation": {"de": ..., "en": ...}}."""
    rows = ['{"translation": {"de": "Ein Hund.", "en": "A dog."}}',
            '{"translation": {"de": "Zwei Katzen.", "en": "Two cats."}}']
    write(tmp_path / "c" / "train.jsonl", "\n".join(rows) + "\n")
    split = load_split(str(tmp_path / "c"), "train", FIELDS)
    assert split["de"] == ["Ein Hund.", "Zwei Katzen."] and split["en"] == ["A dog.", "Two cats."]
    missing = data_error(load_split, str(tmp_path / "c"), "train", ["de", "fr"])
    assert "no field 'de'" in missing or "no field 'fr'" in missing
