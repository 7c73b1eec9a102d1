from pathlib import Path

import pytest

from xformer.config.loading import load_recipe, parse_override, recipe_from_dict
from xformer.config.schema import ModelConfig, Recipe
from xformer.errors import RecipeError

VALID = {"train": {"max_steps": 10}}


def problems(raw, overrides=()):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(raw, list(overrides), source="r.toml")
    return info.value.problems


def test_unknown_key_suggests_the_closest():
    (line,) = problems({**VALID, "model": {"d_modle": 256}})
    assert line == "r.toml: model.d_modle: unknown key; did you mean 'd_model'?"


def test_unknown_table_suggests_the_closest():
    (line,) = problems({**VALID, "modle": {}})
    assert "modle: unknown table; did you mean 'model'?" in line


def test_all_problems_are_reported_together():
    lines = problems({
        "model": {"d_model": "512", "positional": "alibi2", "n_heads": 8, "dropout": 1.5},
        "train": {"lr": -1.0, "max_steps": 10, "betas": [0.9]},
        "eval": {"beam": 0},
    })
    text = "\n".join(lines)
    assert 'model.d_model: expected an integer, found "512" (string)' in text
    assert ("model.positional: expected one of 'sinusoidal', 'learned', 'rope', 'alibi', 'relative', 'none', "
            "found \"alibi2\" (string); did you mean 'alibi'?") in text
    assert "train.lr: expected a positive number, found -1.0" in text
    assert "train.betas: expected two numbers in [0, 1), found [0.9]" in text
    assert "eval.beam: expected a positive number, found 0" in text
    assert len(lines) == 5  # model.dropout waits: the table has a type error, its ranges are not checked


@pytest.mark.parametrize("model,expected", [
    ({"d_model": 100, "n_heads": 3}, "model.d_model: expected a multiple of model.n_heads = 3, found 100"),
    ({"n_heads": 8, "n_kv_heads": 3}, "model.n_kv_heads: expected a divisor of model.n_heads = 8, found 3"),
    ({"arch": "seq2seq", "pooling": "mean"}, "model.pooling: applies only when model.arch = 'classifier'"),
    ({"arch": "classifier", "n_decoder_layers": 2}, "model.n_decoder_layers: applies only when model.arch = 'seq2seq'"),
    ({"head_dropout": 1.5}, "model.head_dropout: expected a number in [0, 1), found 1.5"),
    ({"arch": "lstm", "head_dropout": 0.1},
     "model.head_dropout: applies only when model.arch = 'seq2seq' or 'classifier'"),
    ({"arch": "seq2seq", "causal": True}, "model.causal: applies only when model.arch = 'classifier'"),
    ({"arch": "classifier", "causal": True, "pooling": "cls"},
     "model.pooling: a causal classifier's prepended CLS position would see only itself"),
    ({"arch": "classifier", "causal": True, "pooling": "last", "attention": "low_rank"},
     "model.attention: low_rank mixes the keys along the whole sequence"),
    ({"arch": "classifier", "causal": True, "pooling": "last", "downsample_every": 1},
     "model.downsample_every: downsampling pools each position with the next"),
])
def test_cross_field_rules(model, expected):
    assert any(expected in line for line in problems({**VALID, "model": model}))


def test_tie_all_needs_a_joint_vocabulary():
    lines = problems({**VALID, "model": {"tie_embeddings": "all"}, "data": {"joint_vocab": False}})
    assert lines == ["r.toml: model.tie_embeddings: 'all' shares one embedding between both languages "
                     "and needs data.joint_vocab = true, found false"]


def test_a_stopping_rule_is_required():
    assert any("train.max_steps: expected at least one of" in line for line in problems({}))


def test_overrides_are_toml_typed_and_validated_the_same_way():
    recipe = recipe_from_dict(VALID, ["train.lr=3e-4", "model.positional=learned", "train.betas=[0.9, 0.99]",
                                      "model.scale_embeddings=false"])
    assert recipe.train.lr == 3e-4
    assert recipe.model.positional == "learned"
    assert recipe.train.betas == [0.9, 0.99]
    assert recipe.model.scale_embeddings is False
    assert problems(VALID, ["model.d_model=abc"]) == ['--set model.d_model: expected an integer, found "abc" (string)']


def test_a_problem_a_set_causes_is_blamed_on_that_set_not_the_file():
    """A table that only --set names is the --set's; a rule between two keys that a --set broke
    names the file's key and the --set value it met."""
    assert problems(VALID, ["foo.bar=1"]) == ["--set foo: unknown table"]
    assert problems(VALID, ["model.max_positions=100"]) == [
        "r.toml with --set model.max_positions=100: data.max_len: expected at most model.max_positions - 1 = 99, "
        "found 256"]
    assert problems({**VALID, "foo": {"bar": 1}}) == ["r.toml: foo: unknown table"]


@pytest.mark.parametrize("bad", ["lr=1", "train.lr", "=3", "train.=3", "a.b.c=1"])
def test_malformed_override(bad):
    assert problems(VALID, [bad]) == [f"--set {bad}: expected section.key=value, e.g. train.lr=3e-4"]


def test_parse_override_types():
    assert parse_override("model.n_heads=4") == ("model", "n_heads", 4)
    assert parse_override("data.dataset=../shared/data/multi30k") == ("data", "dataset", "../shared/data/multi30k")
    assert parse_override('data.dataset="x y"') == ("data", "dataset", "x y")


def test_int_is_accepted_where_a_float_is_expected():
    recipe = recipe_from_dict({"train": {"max_steps": 10, "lr": 1}})
    assert recipe.train.lr == 1.0 and isinstance(recipe.train.lr, float)


def test_bool_is_not_an_integer():
    assert problems({**VALID, "model": {"d_model": True}}) == [
        "r.toml: model.d_model: expected an integer, found true (boolean)"]


def test_derived_values_are_properties_and_not_saved():
    cfg = ModelConfig(d_model=256, n_heads=4, n_kv_heads=2)
    assert (cfg.head_dim, cfg.kv_heads) == (64, 2)
    saved = Recipe(model=cfg).to_dict()["model"]
    assert "head_dim" not in saved and "kv_heads" not in saved


def test_saved_recipe_round_trips(tmp_path):
    recipe = recipe_from_dict({"model": {"n_kv_heads": 2, "norm_position": "pre", "norm_eps": 1e-6},
                               "data": {"dataset": 'a "quoted" path\\x'},
                               "train": {"max_time": 50.0, "betas": [0.9, 0.98]}})
    path = tmp_path / "saved.toml"
    recipe.save(path)
    assert load_recipe(path) == recipe


def test_switched_off_fields_are_left_out_of_saved_recipes():
    saved = Recipe(model=ModelConfig(arch="classifier")).to_dict()
    assert "n_decoder_layers" not in saved["model"] and "tie_embeddings" not in saved["model"]
    assert saved["model"]["pooling"] == "mean"


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(RecipeError, match="bad.toml: not valid TOML"):
        load_recipe(bad)


def test_training_length_must_fit_the_positions():
    lines = problems({**VALID, "model": {"max_positions": 100}, "data": {"max_len": 100}})
    assert lines == ["r.toml: data.max_len: expected at most model.max_positions - 1 = 99, found 100"]


def test_a_type_error_is_not_followed_by_its_consequences():
    lines = problems({**VALID, "model": {"arch": "clasifier", "pooling": "mean"}})
    assert len(lines) == 1 and "did you mean 'classifier'" in lines[0]


def test_non_bmp_characters_survive_a_round_trip(tmp_path):
    recipe = recipe_from_dict({**VALID, "data": {"dataset": "corpus-\U0001F600"}})
    recipe.save(tmp_path / "r.toml")
    assert load_recipe(tmp_path / "r.toml").data.dataset == "corpus-\U0001F600"


def test_subword_sampling_is_bounded_and_translation_only():
    lines = problems({**VALID, "data": {"sampling_alpha": 1.5, "sampling_nbest": 1}})
    assert lines == ["r.toml: data.sampling_alpha: expected a number in [0, 1] (0: no sampling), found 1.5",
                     "r.toml: data.sampling_nbest: expected -1 (all segmentations) or at least 2, found 1"]
    lines = problems({**VALID, "model": {"arch": "classifier"}, "data": {"task": "listops", "sampling_alpha": 0.1}})
    assert lines == ["r.toml: data.sampling_alpha: applies only when data.task = 'translation', "
                     "found data.task = 'listops'; remove it"]


def test_a_bad_value_is_shown_as_written_not_escaped():
    with pytest.raises(RecipeError) as refused:
        load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "translation" / "multi30k_de_en.toml",
                    ['model.norm="läyer"'])
    assert 'found "läyer" (string)' in str(refused.value) and "\\u00e4" not in str(refused.value)


def test_changes_round_trip_and_give_the_recipe_as_it_stood_at_each_step():
    """[[changes]] tables: the tables hold the latest values; recipe_at undoes the changes made
    after a step, one after another, and a saved recipe reloads equal."""
    import tomllib

    from xformer.config.loading import recipe_at

    raw = {"train": {"max_steps": 30, "lr": 1e-4, "clip_norm": 1.0},
           "changes": [{"step": 10, "set": {"train.lr": 5e-4, "train.max_steps": 20}, "was": {"train.lr": 1e-3,
                                                                                            "train.max_steps": 10}},
                       {"step": 20, "set": {"train.lr": 1e-4, "train.max_steps": 30, "train.clip_norm": 1.0},
                        "was": {"train.lr": 5e-4, "train.max_steps": 20, "train.clip_norm": 0.0}}]}
    recipe = recipe_from_dict(raw)
    assert [(r.train.lr, r.train.max_steps, r.train.clip_norm, len(r.changes))
            for r in (recipe_at(recipe, s) for s in (0, 9, 10, 19, 20, 99))] == [
        (1e-3, 10, 0.0, 0), (1e-3, 10, 0.0, 0), (5e-4, 20, 0.0, 1), (5e-4, 20, 0.0, 1), (1e-4, 30, 1.0, 2),
        (1e-4, 30, 1.0, 2)]
    assert recipe.next_change(0) == 10 and recipe.next_change(10) == 20 and recipe.next_change(20) is None
    assert recipe_from_dict(tomllib.loads(recipe.to_toml())) == recipe


@pytest.mark.parametrize(("change", "found"), [
    ({"step": 5, "set": {"model.d_model": 64}, "was": {"model.d_model": 32}}, "model.d_model cannot change"),
    ({"step": 5, "set": {"train.seed": 2}, "was": {"train.seed": 1}}, "train.seed cannot change"),
    ({"step": -1, "set": {"train.lr": 1.0}, "was": {"train.lr": 2.0}}, "changes[0].step: expected"),
    ({"step": 5, "set": {"train.lr": 1.0}, "was": {}}, "same section.key names"),
    ({"step": 5, "set": {"train.lr": 1e-3}, "was": {"train.lr": "fast"}}, "changes: train.lr: expected"),
])
def test_a_change_that_a_run_cannot_make_is_refused(change, found):
    (line,) = problems({**VALID, "changes": [change]})
    assert found in line, line
