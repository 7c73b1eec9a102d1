"""Head inspection (issue 5): statistics find a head built to attend to the previous token,
ablation and gate gradients mean what they say, physical pruning equals masking, and the CLI
writes every artifact for a translation and a classification run."""

import base64
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from xformer.config.loading import load_recipe
from xformer.config.schema import ModelConfig
from xformer.config.sites import heads_by_site
from xformer.data.classify import Examples, TextEncoder
from xformer.heads import importance as imp
from xformer.heads import stats
from xformer.heads.stats import clusters, collect
from xformer.model.build import attention_modules, build_model
from xformer.tasks.classification import ClassificationSubject
from xformer.training.device import resolve_runtime
from xformer_cli.main import app

ROOT = Path(__file__).resolve().parents[1]
RECALL = ROOT / "recipes" / "longrange" / "recall_transformer.toml"
MT = ROOT / "recipes" / "translation" / "multi30k_de_en.toml"
runner = CliRunner()
T = 30  # sequence length of the constructed examples


def subject_for(model, cfg: ModelConfig, vocab: int = 20, n: int = 12, seed: int = 0) -> ClassificationSubject:
    recipe = load_recipe(RECALL, ["data.max_tokens=4096"])
    recipe = dataclasses.replace(recipe, model=cfg)
    rng = np.random.default_rng(seed)
    examples = Examples.from_pairs([(rng.integers(1, vocab, T).tolist(), int(rng.integers(0, 3))) for _ in range(n)])
    encoder = TextEncoder("task", [f"t{i}" for i in range(vocab)])
    frequency = {"source": np.arange(vocab, 0, -1)}  # id 1 most frequent, id vocab-1 rarest
    return ClassificationSubject(model, recipe, resolve_runtime("cpu", "fp32"), encoder, examples, frequency)


def previous_token_model():
    """Encoder layer 0, head 0 attends to the previous position by construction: positions are
    one-hot in dims 0..31 (tokens live in dims 32..63), q = 10 * position, k = 10 * (position + 1)."""
    cfg = ModelConfig(arch="classifier", d_model=64, n_heads=2, d_ff=32, n_encoder_layers=2, dropout=0.0,
                      positional="learned", max_positions=32, scale_embeddings=False, norm_position="post",
                      pooling="mean")
    model = build_model(cfg, 20, n_classes=3).eval()
    with torch.no_grad():
        model.encoder.embed.positional.embedding.weight.zero_()
        model.encoder.embed.positional.embedding.weight[:, :32] = torch.eye(32)
        model.encoder.embed.embedding.weight[:, :32] = 0.0
        attn = model.encoder.layers[0].self_attn
        attn.q_proj.weight[:32].zero_()
        attn.k_proj.weight[:32].zero_()
        attn.q_proj.weight[:32, :32] = 10 * torch.eye(32)
        attn.k_proj.weight[:32, :32] = 10 * torch.eye(32).roll(1, dims=0)  # k_j lands where q_{j+1} is
        for proj in (attn.q_proj, attn.k_proj):
            proj.bias.zero_()
    return cfg, model


def test_the_positional_detector_finds_exactly_the_previous_token_head():
    cfg, model = previous_token_model()
    subject = subject_for(model, cfg)
    stats = collect(subject, attention_modules(model))
    head = stats["heads"]["encoder.0.self_attn"][0]
    assert head["offset_rates"]["-1"] == pytest.approx((T - 1) / T)  # every query but position 0
    assert head["roles"] == ["positional-1"]
    others = [h for site, hs in stats["heads"].items() for i, h in enumerate(hs)
              if (site, i) != ("encoder.0.self_attn", 0)]
    assert not any(r.startswith("positional") for h in others for r in h["roles"])
    assert head["confidence"] > 0.95 and head["entropy"] < 0.3
    # one position away, except position 0, which sees nothing to prefer and spreads over all T
    assert head["distance"] == pytest.approx(((T - 1) + (T - 1) / 2) / T, abs=1e-3)


def test_a_head_that_reads_its_memory_slots_is_found_and_its_token_roles_survive():
    """Memory slots (model.memory_tokens) are not tokens: each head reports its share on them,
    and the token statistics read the token probabilities renormalised."""
    cfg, plain = previous_token_model()
    cfg = dataclasses.replace(cfg, memory_tokens=2)
    model = build_model(cfg, 20, n_classes=3).eval()
    model.load_state_dict(plain.state_dict(), strict=False)
    attn = model.encoder.layers[0].self_attn
    with torch.no_grad():  # head 1's query is a constant 5s vector: slots of 5s win, slots of -5s lose
        dh = attn.head_dim
        attn.q_proj.weight[dh:].zero_()
        attn.q_proj.bias[dh:] = 5.0
        attn.k_proj.weight[dh:].zero_()
        attn.mem_k[1] = 5.0
        attn.mem_k[0] = -5.0  # head 0 (previous token) never looks at them
    heads = collect(subject_for(model, cfg), attention_modules(model))["heads"]["encoder.0.self_attn"]
    assert heads[1]["memory"] > 0.99 and "memory" in heads[1]["roles"]
    assert heads[0]["memory"] < 1e-6 and heads[0]["roles"] == ["positional-1"]  # as without slots


def test_rare_word_rate_counts_the_argmax_on_the_rarest_key():
    cfg, model = previous_token_model()
    subject = subject_for(model, cfg, n=4)
    for batch in subject.batches:  # one rare token (id 19) at position 5 among frequent ones:
        batch["tokens"][:, :] = 1  # the previous-token head lands on it from position 6 only
        batch["tokens"][:, 5] = 19
    stats = collect(subject, attention_modules(model))
    head = stats["heads"]["encoder.0.self_attn"][0]
    assert head["rare_rate"] == pytest.approx(1 / T)
    assert head["rare_chance"] == pytest.approx(1 / T)


def test_ablating_a_head_whose_output_projection_is_zero_changes_nothing():
    cfg, model = previous_token_model()
    with torch.no_grad():
        model.encoder.layers[1].self_attn.out_proj.weight[:, 32:] = 0.0  # head 1 of layer 1 writes nothing
    subject = subject_for(model, cfg)
    sites = attention_modules(model)
    _, deltas = imp.ablation(subject, sites, "loss")
    assert deltas["encoder.1.self_attn"][1] == pytest.approx(0.0, abs=1e-6)
    assert abs(deltas["encoder.1.self_attn"][0]) > 1e-5 and abs(deltas["encoder.0.self_attn"][0]) > 1e-5


def test_mean_ablation_of_a_head_with_constant_output_changes_nothing():
    cfg, model = previous_token_model()
    with torch.no_grad():  # head 0 of layer 1 reads values that do not depend on the input: a constant
        attn = model.encoder.layers[1].self_attn
        attn.v_proj.weight[:32] = 0.0
        attn.v_proj.bias[:32] = torch.linspace(-1, 1, 32)
    subject = subject_for(model, cfg)
    sites = attention_modules(model)
    means = collect(subject, sites)["mean_outputs"]
    torch.testing.assert_close(means["encoder.1.self_attn"][0], torch.linspace(-1, 1, 32), atol=1e-5, rtol=0)
    _, mean_deltas = imp.ablation(subject, sites, "loss", fill=means)
    _, zero_deltas = imp.ablation(subject, sites, "loss")
    assert mean_deltas["encoder.1.self_attn"][0] == pytest.approx(0.0, abs=1e-6)
    assert abs(zero_deltas["encoder.1.self_attn"][0]) > 1e-4  # removing the constant does matter


def test_gate_gradient_matches_finite_differences():
    cfg, model = previous_token_model()
    subject = subject_for(model.double(), cfg, n=6)  # float64: central differences to 1e-4 are exact enough
    subject.batches = subject.batches[:1]
    sites = attention_modules(model)
    grads = imp.gate_gradients(subject, sites)
    eps = 1e-4
    for site, h in (("encoder.0.self_attn", 0), ("encoder.1.self_attn", 1)):
        values = []
        for step in (eps, -eps):
            gate = torch.ones(sites[site].n_heads, dtype=torch.float64)
            gate[h] += step
            sites[site].gate(gate)
            values.append(subject.mean_loss())
            sites[site].gate(None)
        numeric = (values[0] - values[1]) / (2 * eps)
        assert grads[site][h] == pytest.approx(abs(numeric), rel=1e-4)


def test_rescaled_gate_is_the_least_squares_reconstruction_of_the_site():
    torch.manual_seed(0)
    n, h, d = 400, 4, 6
    c = torch.randn(n, h, d, dtype=torch.float64)
    c[:, 3] = 0.5 * c[:, 0] + 0.3 * c[:, 3] + 2.0  # head 3 partly repeats head 0, plus a constant
    centered = c - c.mean(0)
    cov = torch.einsum("nhd,ngd->hg", centered, centered) / n
    assert torch.equal(imp.rescaled_gate(cov, []), torch.ones(h))
    removed, kept = [3], [0, 1, 2]
    gate = imp.rescaled_gate(cov, removed, ridge=0.0).double()
    design = centered[:, kept].permute(0, 2, 1).reshape(-1, len(kept))  # (N * D, |K|)
    target = centered.sum(1).reshape(-1, 1)
    expected = torch.linalg.lstsq(design, target).solution.squeeze(1)
    torch.testing.assert_close(gate[kept], expected, atol=1e-6, rtol=0)
    assert gate[3] == 0.0 and gate[0] > 1.3  # head 0 takes over head 3's share of it


def test_rescale_ablation_of_a_duplicated_head_changes_nothing():
    cfg, model = previous_token_model()
    with torch.no_grad():  # head 1 of layer 1 computes exactly what head 0 does, through the same columns
        attn = model.encoder.layers[1].self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight[32:] = proj.weight[:32]
            proj.bias[32:] = proj.bias[:32]
        attn.out_proj.weight[:, 32:] = attn.out_proj.weight[:, :32]
    subject = subject_for(model, cfg)
    sites = attention_modules(model)
    assert "contribution_cov" not in collect(subject, sites)  # only computed when asked for
    stats = collect(subject, sites, contributions=True)
    cov = stats["contribution_cov"]["encoder.1.self_attn"]
    assert cov[0, 1] == pytest.approx(float(cov[0, 0]), rel=1e-4)  # identical contributions
    torch.testing.assert_close(imp.rescaled_gate(cov, [1]), torch.tensor([2.0, 0.0]), atol=1e-4, rtol=0)
    rule = imp.least_squares(stats["contribution_cov"])
    _, rescaled = imp.ablation(subject, sites, "loss", stats["mean_outputs"], rule)
    _, mean_only = imp.ablation(subject, sites, "loss", stats["mean_outputs"])
    assert rescaled["encoder.1.self_attn"][1] == pytest.approx(0.0, abs=1e-5)
    assert abs(mean_only["encoder.1.self_attn"][1]) > 1e-4  # without the rescaling, half the output goes


def test_renormalised_gates_scale_the_survivors_by_heads_over_kept():
    torch.testing.assert_close(imp.renormalised("s", 4, [1]), torch.tensor([4 / 3, 0.0, 4 / 3, 4 / 3]))
    torch.testing.assert_close(imp.renormalised("s", 4, []), torch.ones(4))
    torch.testing.assert_close(imp.renormalised("s", 2, [0, 1]), torch.zeros(2))


@pytest.mark.parametrize("gates", ["unchanged", "least-squares", "renormalised"])
@pytest.mark.parametrize("n_kv_heads,remove", [(None, [1]), (2, [0]), (2, [0, 1]), (1, [1, 2])])
def test_a_physically_pruned_model_equals_the_masked_one(n_kv_heads, remove, gates):
    cfg = ModelConfig(d_model=32, n_heads=4, n_kv_heads=n_kv_heads, d_ff=32, n_encoder_layers=2, n_decoder_layers=2,
                      dropout=0.0, tie_embeddings="none")
    model = build_model(cfg, 30).eval()
    src, tgt = torch.randint(4, 30, (3, 7)), torch.randint(4, 30, (3, 5))
    sites = attention_modules(model)
    heads = [(s, h) for s in ("encoder.1.self_attn", "decoder.0.cross_attn", "decoder.1.self_attn") for h in remove]
    fill = {site: torch.randn(4, 8) for site in sites}  # mean-ablation: a removed head outputs fill[h]
    root = {site: torch.randn(4, 4) for site in sites}
    cov = {site: r @ r.T + 0.1 * torch.eye(4) for site, r in root.items()}
    rule = {"unchanged": None, "least-squares": imp.least_squares(cov), "renormalised": imp.renormalised}[gates]
    with torch.no_grad(), imp.masked(sites, heads, fill, rule):
        expected = model(src, tgt)
    pruned_cfg = dataclasses.replace(cfg, pruned_heads=[f"{s}:{h}" for s, h in heads])
    assert pruned_cfg.problems() == []
    for site, hs in heads_by_site(pruned_cfg.pruned_heads).items():
        gate = None if rule is None else rule(site, 4, hs)
        sites[site].prune_heads(hs, fill[site], gate)
    reloaded = build_model(pruned_cfg, 30, init=False).eval()
    reloaded.load_state_dict(model.state_dict())  # shapes agree with what the recipe builds
    with torch.no_grad():
        torch.testing.assert_close(reloaded(src, tgt), expected, atol=1e-5, rtol=0)
        memory, pad = reloaded.encode(src)  # incremental decoding still equals the full forward
        cache = reloaded.new_cache()
        steps = torch.cat([reloaded.decode(tgt[:, t:t + 1], memory, pad, cache) for t in range(5)], dim=1)
    torch.testing.assert_close(steps, expected, atol=1e-5, rtol=0)
    assert attention_modules(reloaded)["encoder.1.self_attn"].n_heads == 4 - len(remove)


def test_pruned_heads_are_validated():
    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1)
    bad = dataclasses.replace(cfg, pruned_heads=["encoder.3.self_attn:0", "decoder.0.cross_attn:5", "nonsense"])
    assert len(bad.problems()) == 3
    every = dataclasses.replace(cfg, pruned_heads=["encoder.0.self_attn:0", "encoder.0.self_attn:1"])
    assert "must keep at least one head" in every.problems()[0]


def test_greedy_order_removes_the_cheapest_head_given_those_already_removed():
    cfg, model = previous_token_model()
    subject = subject_for(model, cfg)
    sites = attention_modules(model)
    heads = [(site, h) for site in sites for h in range(2)]
    order = imp.greedy_order(subject, sites, heads, "loss", [1, 1])
    assert sorted(order) == sorted(heads)

    def loss_without(removed):
        with imp.masked(sites, removed):
            return subject.mean_loss()

    first = min(heads, key=lambda head: loss_without([head]))
    second = min((h for h in heads if h != first), key=lambda head: loss_without([first, head]))
    assert order[:2] == [first, second]
    assert imp.round_sizes(36, [0.0, 0.1, 0.2, 0.3]) == [4, 3, 4]


def test_spearman_and_clusters_on_known_cases():
    assert imp.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert imp.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert imp.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(np.corrcoef([0, 1.5, 1.5, 3], [0, 1, 2, 3])[0, 1])
    distance = np.array([[0, 0.1, 0.9, 0.9], [0.1, 0, 0.9, 0.9], [0.9, 0.9, 0, 0.2], [0.9, 0.9, 0.2, 0]])
    assert clusters(distance, 0.3) == [[0, 1], [2, 3]]


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_cli_inspects_a_classifier_and_writes_every_artifact(tmp_path):
    run = tmp_path / "recall"
    sets = ["data.max_len=24", "data.n_train=200", "data.n_valid=40", "data.n_test=40", "data.max_tokens=1024",
            "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.pooling=cls", "train.max_steps=10",
            "train.max_time=0.0", "train.valid_every=10", "train.warmup_steps=2"]
    trained = invoke("train", RECALL, "--out", run, *[x for s in sets for x in ("--set", s)], "--device", "cpu")
    assert trained.exit_code == 0, trained.output
    out = tmp_path / "heads"
    result = invoke("inspect-heads", run, "--out", out, "--n-examples", 30, "--importance", "accuracy", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # progress goes to stderr
    assert len(report["heads"]) == 2 * 2 and report["n_examples"] == 30
    assert {"heads.json", "heads_grid.png", "report.html", "attention_example0.png"} <= {p.name for p in out.iterdir()}
    html = (out / "report.html").read_text()
    assert "http" not in html.replace("http-equiv", "")  # offline
    pngs = sorted(p for p in out.iterdir() if p.suffix == ".png")
    assert html.count("data:image/png;base64,") == len(pngs) >= 2  # every figure embedded, once
    assert all(base64.b64encode(p.read_bytes()).decode("ascii") in html for p in pngs)
    assert json.loads((out / "heads.json").read_text())["rank_correlation"].keys() == report["rank_correlation"].keys()
    by_gradient = invoke("inspect-heads", run, "--out", tmp_path / "g", "--n-examples", 30, "--prune",
                         "--prune-order", "gradient", "--prune-step", 0.25, "--json")
    assert by_gradient.exit_code == 0, by_gradient.output
    pruning = json.loads(by_gradient.stdout)["pruning"]
    least = min(report["heads"], key=lambda h: h["gradient"])  # Michel et al.'s order: lowest normalised first
    assert pruning["order"] == "gradient" and pruning["overall"][1]["heads"] == [f"{least['site']}:{least['head']}"]
    bad = invoke("inspect-heads", run, "--prune", "--prune-order", "random")
    assert bad.exit_code == 2 and "'one-shot', 'gradient', 'greedy'" in bad.output  # click lists the Enum's words
    bad = invoke("inspect-heads", run, "--importance", "bleu")
    assert bad.exit_code == 2 and "accuracy" in bad.output
    bad = invoke("inspect-heads", run, "--prune", "--max-drop", "-1")
    assert bad.exit_code == 2 and "--max-drop" in bad.output
    bad = invoke("inspect-heads", run, "--prune", "--prune-step", "0")
    assert bad.exit_code == 2 and "--prune-step: expected a fraction of the heads in (0, 0.5], found 0" in bad.output


@pytest.fixture(scope="module")
def translation_run(tmp_path_factory, shared_dir):
    folder = tmp_path_factory.mktemp("m30k")
    for name, n in (("train", 400), ("val", 30), ("test", 30)):
        lines = (shared_dir / "data" / "multi30k" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()[:n]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = tmp_path_factory.mktemp("runs") / "mt"
    sets = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_encoder_layers=2",
            "model.n_decoder_layers=1", "data.vocab_size=300", "data.max_tokens=512", "train.warmup_steps=5",
            "train.lr=3e-3", "train.valid_every=20", "train.average_last=2", "train.max_time=0.0",
            "train.max_steps=20", "eval.beam=2", f"data.dataset={json.dumps(str(folder))}"]
    result = invoke("train", MT, "--out", run, *[x for s in sets for x in ("--set", s)], "--device", "cpu")
    assert result.exit_code == 0, result.output
    return run


@pytest.mark.parametrize("ablate", ["rescale", "renorm"])
def test_cli_inspects_prunes_and_saves_a_translation_model(translation_run, tmp_path, ablate):
    out, pruned = tmp_path / "heads", tmp_path / "pruned"
    result = invoke("inspect-heads", translation_run, "--out", out, "--n-examples", 20, "--save-pruned", pruned,
                    "--max-drop", 100, "--checkpoint", "last", "--prune-step", 0.25,
                    "--ablate", ablate)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "heads.json").read_text())
    assert {h["space"] for h in report["heads"]} == {"encoder", "decoder", "cross"}
    assert len(report["heads"]) == 2 * 2 + 2 + 2 and report["ablate"] == ablate
    curve = report["pruning"]["overall"]
    assert [p["pruned"] for p in curve] == [0, 2, 4, 6]  # --prune-step 0.25 of 8 heads
    assert set(report["pruning"]["by_space"]) == {"encoder", "decoder", "cross"}
    assert (out / "pruning.png").exists() and "pruning" in report["artifacts"]
    saved = report["pruned_model"]
    assert saved["parameters"] < saved["parameters_before"]
    evaluated = invoke("eval", pruned, "--json")  # the pruned run is a run `xformer eval` loads
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads(evaluated.stdout)["bleu"] == pytest.approx(saved["metric"], abs=1e-6)
    again = invoke("inspect-heads", translation_run, "--out", out, "--n-examples", 5, "--save-pruned", pruned)
    assert again.exit_code == 2 and "not empty" in again.output  # nothing is overwritten
    assert invoke("inspect-heads", tmp_path / "missing").exit_code == 2


def test_role_counts_are_what_inspect_heads_finds_trained_and_at_initialisation(translation_run, tmp_path,
                                                                                 monkeypatch):
    """The ledger's "heads specialise" counts: the trained checkpoint's roles are those of
    inspect-heads' own report, and the chance level is what inspect-heads reports for a run
    whose checkpoint holds the same model as built before training (seeded as train seeds it).
    The criteria are loosened so that a 20-step model's heads take roles to count."""
    import shutil

    import torch

    from xformer.config.loading import load_run_recipe
    from xformer.heads.roles import ROLES, role_counts
    from xformer.tasks import make_task
    from xformer.training.checkpoint import save_checkpoint

    def counted(run, out):
        result = invoke("inspect-heads", run, "--out", out, "--n-examples", 20, "--checkpoint", "last")
        assert result.exit_code == 0, result.output
        heads = json.loads((out / "heads.json").read_text())["heads"]
        return len(heads), {key: sum(any(r.startswith(role) for r in h["roles"]) for h in heads)
                            for role, key in ROLES.items()}

    for name, value in (("POSITIONAL_MIN", 0.4), ("SPECIAL_MIN", 0.2), ("RARE_MIN_RATIO", 1.2),
                        ("RARE_MIN_RATE", 0.05)):
        monkeypatch.setattr(stats, name, value)
    counts = role_counts(translation_run, 20, checkpoint="last")
    n, trained = counted(translation_run, tmp_path / "trained")
    assert counts["heads"] == n == 8 and {k: counts[k] for k in trained} == trained

    untrained = tmp_path / "untrained"
    shutil.copytree(translation_run, untrained, ignore=shutil.ignore_patterns("heads", "*.lock"))
    recipe = load_run_recipe(untrained)
    task = make_task(recipe)
    task.open_run(untrained, "last", "cpu")  # the run's vocabulary, so the model has its sizes
    torch.manual_seed(recipe.train.seed)
    save_checkpoint(untrained / "checkpoints" / "last.safetensors", task.build_model(), meta={"step": 0})
    _, at_init = counted(untrained, tmp_path / "init")
    assert {k: counts[f"{k}_init"] for k in at_init} == at_init
    assert trained != at_init  # so the comparison can tell the trained model from its initialisation
