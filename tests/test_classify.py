"""Classification data, encoders, config rules and the pieces the long-range runs are built from."""

import dataclasses

import numpy as np
import pytest
import torch

from xformer.config.loading import recipe_from_dict
from xformer.config.schema import ModelConfig
from xformer.data.classify import (
    ClassBatches,
    StagedBatches,
    TextEncoder,
    collate_tokens,
    curriculum_examples,
    fit_vocab,
    generated_splits,
)
from xformer.errors import DataError, RecipeError
from xformer.model.build import build_model, count_parameters
from xformer.tasks import build_for_recipe
from xformer.training.measure import PeakMemory

BASE = {"train": {"max_steps": 5}}


def recipe(model=None, data=None, train=None):
    return recipe_from_dict({"model": model or {}, "data": data or {}, "train": {**BASE["train"], **(train or {})}})


def problems(**tables) -> list[str]:
    with pytest.raises(RecipeError) as err:
        recipe(**tables)
    return err.value.problems


def test_classification_recipes_validate_per_task_and_arch():
    r = recipe({"arch": "lstm", "pooling": "max"}, {"task": "listops", "max_len": 128})
    assert r.best_metric == "accuracy" and recipe().best_metric == "bleu"
    assert any("model.pooling" in p and "'cls'" in p for p in problems(model={"arch": "lstm", "pooling": "cls"},
                                                                       data={"task": "recall"}))
    assert any("model.pooling" in p for p in problems(model={"arch": "classifier", "pooling": "max"},
                                                      data={"task": "recall"}))
    assert any("data.task = 'listops' needs 'classifier' or 'lstm', found 'seq2seq'" in p
               for p in problems(data={"task": "listops"}))
    assert any("data.tokenizer: applies only when" in p
               for p in problems(model={"arch": "classifier"}, data={"task": "recall", "tokenizer": "char"}))
    assert any("train.best_metric: data.task = 'recall' validates by 'accuracy' or 'loss', found 'bleu'" in p
               for p in problems(model={"arch": "classifier"}, data={"task": "recall"}, train={"best_metric": "bleu"}))
    assert any("model.lstm_hidden: applies only when" in p for p in problems(model={"lstm_hidden": 3}))
    assert any("data.tokenizer: translation uses" in p for p in problems(data={"tokenizer": "byte"}))


def test_a_saved_classification_recipe_reloads_equal():
    r = recipe({"arch": "lstm", "pooling": "last", "lstm_hidden": 7}, {"task": "recall", "max_len": 64})
    import tomllib

    assert recipe_from_dict(tomllib.loads(r.to_toml())) == r


def test_every_example_is_batched_once_per_epoch_within_the_budget():
    examples = generated_splits("listops", 300, 10, 10, 64, 0)["train"]
    batches = ClassBatches(examples, 600, seed=3)
    for epoch in (0, 1):
        plan = batches.batches(epoch)
        rows = sorted(i for b in plan for i in b)
        assert rows == list(range(len(examples)))
        assert all(len(b) * (examples.lens[b].max() + 1) <= 600 for b in plan)
    assert batches.batches(0) != batches.batches(1)  # reshuffled per epoch
    assert batches.batches(1) == ClassBatches(examples, 600, seed=3).batches(1)  # from the seed alone
    first = next(batches.iter_epoch(0))
    tokens, labels = first["tokens"], first["labels"]
    for row, i in enumerate(batches.batches(0)[0]):
        n = int(examples.lens[i])
        assert tokens[row, :n].tolist() == examples.sequence(i)
        assert tokens[row, n:].eq(0).all() and labels[row] == examples.labels[i]
    skipped = list(batches.iter_epoch(0, skip=2))
    assert len(skipped) == len(batches) - 2
    assert torch.equal(skipped[0]["tokens"], collate_tokens(examples, np.asarray(batches.batches(0)[2]))["tokens"])


def test_a_length_curriculum_runs_its_stages_in_order_then_the_full_epochs_and_resumes_anywhere():
    final = ClassBatches(generated_splits("recall", 40, 5, 5, 32, 0, (("n_pairs", 2), ("n_queries", 1)))["train"],
                         33 * 8, seed=3)
    short = ClassBatches(curriculum_examples("recall", 30, 8, 0, n_queries=1, n_pairs=2), 9 * 8, seed=3)
    middle = ClassBatches(curriculum_examples("recall", 30, 16, 0, n_queries=1, n_pairs=2), 17 * 8, seed=3)
    staged = StagedBatches([(short, 9), (middle, 2)], final)  # 9 > one epoch of `short`: cycled
    assert len(short) == 4 and len(staged) == 9 + 2 + len(final)
    epoch0 = list(staged.iter_epoch(0))
    widths = [b["tokens"].shape[1] for b in epoch0]
    assert widths == [8] * 9 + [16] * 2 + [32] * len(final)
    cycled = [b for e in (0, 1, 2) for b in short.iter_epoch(e)][:9]  # reshuffled per cycle
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(epoch0[:9], cycled, strict=True))
    for skip in range(len(epoch0) + 1):  # resuming at any batch gives the rest of the epoch
        rest = list(staged.iter_epoch(0, skip=skip))
        assert len(rest) == len(epoch0) - skip
        assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(rest, epoch0[skip:], strict=True))
    later = list(staged.iter_epoch(1, skip=1))
    assert [b["tokens"].tolist() for b in later] == [b["tokens"].tolist() for b in final.iter_epoch(1, skip=1)]
    # a stage's examples are its own: not a prefix of the train split, and deterministic
    assert curriculum_examples("recall", 30, 32, 0, n_queries=1, n_pairs=2).sequence(0) != final.examples.sequence(0)
    assert curriculum_examples("recall", 30, 8, 0, n_queries=1, n_pairs=2).sequence(5) == short.examples.sequence(5)


def test_curriculum_stages_are_validated_and_skipped_at_or_above_max_len():
    data = {"task": "recall", "n_pairs": 2, "n_queries": 1, "max_len": 64}
    r = recipe({"arch": "classifier"}, {**data, "curriculum_lengths": [16, 64, 256], "curriculum_steps": [5, 6, 7]})
    assert r.data.curriculum() == [(16, 5)]
    assert any("one step count per curriculum length (2), found 1" in p for p in problems(
        model={"arch": "classifier"}, data={**data, "curriculum_lengths": [16, 32], "curriculum_steps": [5]}))
    assert any("expected increasing lengths, found [32, 16]" in p for p in problems(
        model={"arch": "classifier"}, data={**data, "curriculum_lengths": [32, 16], "curriculum_steps": [5, 5]}))
    assert any("expected positive integers" in p for p in problems(
        model={"arch": "classifier"}, data={**data, "curriculum_lengths": [16], "curriculum_steps": [0]}))
    assert any("data.curriculum_lengths: applies only when data.task = 'listops' or 'recall'" in p
               for p in problems(data={"curriculum_lengths": [16], "curriculum_steps": [5]}))


def test_generated_splits_are_deterministic_and_differ_per_split_and_seed():
    a = generated_splits("recall", 50, 20, 20, 32, 5, (("n_pairs", 8), ("n_queries", 4)))
    b = generated_splits.__wrapped__("recall", 50, 20, 20, 32, 5, (("n_pairs", 8), ("n_queries", 4)))  # no cache
    assert all(np.array_equal(a[s].ids, b[s].ids) and np.array_equal(a[s].labels, b[s].labels) for s in a)
    assert not np.array_equal(a["valid"].ids, a["test"].ids)
    c = generated_splits.__wrapped__("recall", 50, 20, 20, 32, 6, (("n_pairs", 8), ("n_queries", 4)))
    assert not np.array_equal(a["train"].ids, c["train"].ids)
    with pytest.raises(DataError, match="data.max_len = 6"):
        generated_splits.__wrapped__("recall", 5, 5, 5, 6, 0, (("n_pairs", 8), ("n_queries", 4)))


def test_text_encoders_truncate_and_map_unknowns():
    texts = ["abca", "b c", None]
    vocab = fit_vocab(texts, "char", 4)
    assert vocab == ["<pad>", "<unk>", "a", "b"]  # most frequent first, ties in first-seen order
    enc = TextEncoder("char", vocab)
    assert enc.encode(["abcz", None], max_len=3) == [[2, 3, 1], [1]]  # empty: one unknown
    words = TextEncoder("whitespace", fit_vocab(["the cat", "the dog"], "whitespace", 10))
    assert words.encode(["the bird the"], 10) == [[2, 1, 2]]
    byte = TextEncoder("byte")
    assert byte.encode(["é!"], 10) == [[0xC3 + 2, 0xA9 + 2, ord("!") + 2]] and byte.vocab_size == 258
    assert byte.token(ord("!") + 2) == "!"


def test_last_pooling_reads_the_last_real_token_and_ignores_padding():
    cfg = ModelConfig(arch="classifier", d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, dropout=0.0,
                      pooling="last", max_positions=32)
    model = build_model(cfg, 12, n_classes=3).eval()
    tokens = torch.tensor([[4, 5, 6, 0, 0], [7, 8, 9, 10, 11]])
    alone = model(tokens[:1, :3])
    batched = model(tokens)
    torch.testing.assert_close(batched[:1], alone)
    h = model.encoder(tokens, tokens.eq(0))
    torch.testing.assert_close(batched, model.head(h[torch.arange(2), torch.tensor([2, 4])]))


@pytest.mark.parametrize("norm_position", ["pre", "post"])
@pytest.mark.parametrize("pooling", ["last", "cls"])
def test_the_last_layer_computing_only_the_pooled_position_equals_the_full_layer(norm_position, pooling):
    cfg = ModelConfig(arch="classifier", d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, n_encoder_layers=2,
                      dropout=0.0, pooling=pooling, norm_position=norm_position, max_positions=32)
    torch.manual_seed(0)
    model = build_model(cfg, 12, n_classes=3).double().eval()
    tokens = torch.tensor([[4, 5, 6, 0, 0], [7, 8, 9, 10, 11], [3, 0, 0, 0, 0]])
    pad = tokens.eq(0)
    assert model._last_row_only()
    shortcut = model(tokens)
    if pooling == "cls":
        full = model.encoder(tokens, torch.cat([pad.new_zeros(3, 1), pad], 1), prefix=model.cls.double())[:, 0]
    else:
        full = model.encoder(tokens, pad)[torch.arange(3), torch.tensor([2, 4, 0])]
    torch.testing.assert_close(shortcut, model.head(full), rtol=1e-12, atol=1e-12)
    seen = []  # while maps are captured, the last layer runs in full and hands over S x S maps
    model.encoder.layers[-1].self_attn.probe(lambda probs: seen.append(probs.shape))
    assert not model._last_row_only()
    torch.testing.assert_close(model(tokens), shortcut, rtol=1e-12, atol=1e-12)
    assert seen == [(3, 4, 5 + (pooling == "cls"), 5 + (pooling == "cls"))]
    rope = build_model(dataclasses.replace(cfg, positional="rope"), 12, n_classes=3)
    assert not rope._last_row_only()  # rotary queries rotate by position: the full layer


def test_an_lstm_recipe_is_sized_to_its_transformer_within_10_percent():
    model = {"d_model": 96, "n_heads": 4, "d_ff": 192, "n_encoder_layers": 3, "dropout": 0.0, "max_positions": 300}
    data = {"task": "listops", "max_len": 256}
    transformer = build_for_recipe(recipe({**model, "arch": "classifier", "pooling": "mean"}, data))
    lstm = build_for_recipe(recipe({**model, "arch": "lstm", "pooling": "last", "lstm_layers": 2}, data))
    t, s = count_parameters(transformer)["total"], count_parameters(lstm)["total"]
    assert abs(s - t) / t < 0.10
    assert lstm.lstm.num_layers == 2 and lstm.lstm.bidirectional


def test_peak_memory_sees_a_large_allocation():
    with PeakMemory(torch.device("cpu")) as memory:
        block = torch.ones(64 * 2**20 // 4)  # 64 MB
        block.add_(1)
        import time

        time.sleep(0.1)  # let the sampler see it
    del block
    assert memory.peak_mb > 48


@pytest.mark.parametrize("scale", [True, False])
def test_learned_positions_start_at_the_scale_of_the_tokens(scale):
    """Positions 8x weaker than sqrt(D)-scaled tokens kept a classifier from learning recall."""
    cfg = ModelConfig(arch="classifier", d_model=256, n_heads=4, d_ff=64, n_encoder_layers=1, positional="learned",
                      scale_embeddings=scale, max_positions=512)
    embed = build_model(cfg, 300, n_classes=2).encoder.embed
    tokens = embed.embedding.weight[1:] * embed.scale
    positions = embed.positional.embedding.weight
    assert positions.std().item() == pytest.approx(tokens.std().item(), rel=0.1)
