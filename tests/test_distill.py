"""Knowledge distillation ([distill]): word-level KD's term against KL written out, alpha = 0
equal to training on the references, the loss a student trains on computed by hand from the
teacher's logits, sequence-level KD training on the teacher's own translations (made once,
reused), and teachers that cannot teach refused in one line."""

import json

import pytest
import torch
from typer.testing import CliRunner

from tests.test_train import TINY, tiny_recipe
from xformer.config.loading import load_run_recipe
from xformer.data.corpus import load_split
from xformer.errors import RecipeError
from xformer.evaluate import translate_lines
from xformer.tasks import make_task
from xformer.tasks.translation import translation_loss
from xformer.train import run
from xformer.training.device import resolve_runtime
from xformer.training.losses import distillation_kl
from xformer.training.run_folder import tokenizer_digest
from xformer_cli.main import app

runner = CliRunner()


def test_the_distillation_term_is_the_kl_of_the_tempered_distributions():
    student, teacher = torch.randn(2, 5, 11, dtype=torch.float64), torch.randn(2, 5, 11, dtype=torch.float64)
    keep = torch.rand(2, 5) > 0.3
    for t in (1.0, 2.5):
        q = torch.softmax(teacher / t, -1)
        p = torch.softmax(student / t, -1)
        naive = sum(float((q[b, i] * (q[b, i] / p[b, i]).log()).sum())
                    for b in range(2) for i in range(5) if keep[b, i])
        assert float(distillation_kl(student, teacher, t, keep)) == pytest.approx(naive, rel=1e-6)
    assert float(distillation_kl(teacher, teacher, 3.0)) == pytest.approx(0.0, abs=1e-9)


@pytest.fixture(scope="module")
def teacher(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher") / "run"
    run(tiny_recipe(corpus, "train.max_steps=30", "model.d_model=48"), out, device="cpu")
    return out


def distilled(corpus, teacher, *extra):
    return tiny_recipe(corpus, f"distill.teacher={json.dumps(str(teacher))}", *extra)


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "train"]


def test_word_distillation_with_alpha_0_trains_as_the_references_do(corpus, teacher, tmp_path):
    """alpha = 0 weighs the teacher by nothing: the same losses as a student without [distill]
    (the teacher's tokenizer is the one the student would train: same corpus and settings)."""
    plain = run(tiny_recipe(corpus, "train.max_steps=10"), tmp_path / "plain", device="cpu")
    taught = run(distilled(corpus, teacher, "distill.kind=word", "distill.alpha=0.0", "train.max_steps=10"),
                 tmp_path / "word", device="cpu")
    assert plain.steps == taught.steps == 10
    assert losses(tmp_path / "word") == losses(tmp_path / "plain")
    assert tokenizer_digest(tmp_path / "word") == tokenizer_digest(teacher)


def test_the_word_distillation_loss_is_the_mix_of_nll_and_kl_to_the_teacher(corpus, teacher, tmp_path):
    recipe = distilled(corpus, teacher, "distill.kind=word", "distill.alpha=0.7", "distill.temperature=2.0",
                       "model.dropout=0.0", "train.max_steps=1")
    task = make_task(recipe)
    rt = resolve_runtime("cpu", "fp32")
    task.use_teacher(load_run_recipe(teacher), rt)
    task.load(lambda *_: None)
    task.prepare(tmp_path, lambda *_: None)
    student = task.build_model().eval()
    batch = next(iter(task.train_batches.iter_epoch(0)))
    src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
    got = translation_loss(student, src, tgt_in, tgt_out, rt, recipe.train, index_rows=False,
                           teacher=task.teacher, distill=recipe.distill)
    real = tgt_out.ne(0)
    with torch.no_grad():
        s, t = student(src, tgt_in).double(), task.teacher.model(src, tgt_in).double()
    eps = recipe.train.label_smoothing
    logp = s.log_softmax(-1)
    nll = -(logp.gather(-1, tgt_out[..., None]).squeeze(-1))
    smoothed = ((1 - eps) * nll - eps * logp.mean(-1))[real].sum()
    log_q, log_p = (t / 2.0).log_softmax(-1), (s / 2.0).log_softmax(-1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1)[real].sum()
    assert float(got.detach()) == pytest.approx(float(0.3 * smoothed + 0.7 * 4.0 * kl), rel=1e-4)


def test_sequence_distillation_trains_on_the_teachers_translations_made_once(corpus, teacher, tmp_path):
    result = run(distilled(corpus, teacher, "distill.beam=2", "train.max_steps=4"), tmp_path / "seq", device="cpu")
    assert result.steps == 4
    (made,) = (teacher / "distilled").glob("*.jsonl")
    assert made.name == "train.best.beam2.lenpen2.2.jsonl"
    rows = [json.loads(line) for line in made.read_text(encoding="utf-8").splitlines()]
    sources = list(load_split(str(corpus), "train", ["de", "en"])["de"])
    assert [r["de"] for r in rows] == sources
    # the targets are what the teacher itself translates, with the same beam and length penalty
    assert [r["en"] for r in rows] == translate_lines(teacher, sources, beam=2, device="cpu")
    assert tokenizer_digest(tmp_path / "seq") == tokenizer_digest(teacher)
    # a second student reuses them; another beam makes its own
    stamp = made.stat().st_mtime_ns
    run(distilled(corpus, teacher, "distill.beam=2", "train.max_steps=2", "train.seed=2"), tmp_path / "again",
        device="cpu")
    assert made.stat().st_mtime_ns == stamp
    saved = (tmp_path / "seq" / "recipe.toml").read_text()
    assert "[distill]" in saved and str(teacher) in saved


def test_a_teacher_that_cannot_teach_is_one_line(corpus, teacher, tmp_path):
    sets = [a for v in [*TINY, f"data.dataset={json.dumps(str(corpus))}", "train.max_steps=2"] for a in ("--set", v)]
    from tests.test_train import RECIPE

    nothing = runner.invoke(app, ["train", str(RECIPE), *sets, "--set", f"distill.teacher={tmp_path}",
                                  "--out", str(tmp_path / "a"), "--device", "cpu"])
    assert nothing.exit_code == 2 and "not a run directory" in nothing.stderr and "Traceback" not in nothing.output
    other = runner.invoke(app, ["train", str(RECIPE), *sets, "--set", "data.vocab_size=250", "--set",
                                f"distill.teacher={teacher}", "--out", str(tmp_path / "b"), "--device", "cpu"])
    assert other.exit_code == 2, other.output
    assert "distill.teacher:" in other.stderr and "data.vocab_size = 300, the student 250" in other.stderr
    assert not (tmp_path / "b").exists()


def test_distillation_keys_need_a_teacher_and_a_translation_task(corpus):
    with pytest.raises(RecipeError, match="distill.teacher: expected the teacher's run directory"):
        tiny_recipe(corpus, "distill.kind=word")
    with pytest.raises(RecipeError, match="distill.alpha: applies only when distill.kind = 'word'"):
        tiny_recipe(corpus, "distill.teacher=x", "distill.alpha=0.2")
    with pytest.raises(RecipeError, match="does not combine with train.rdrop_alpha"):
        tiny_recipe(corpus, "distill.teacher=x", "distill.kind=word", "train.rdrop_alpha=1.0")


def test_the_distill_command_is_train_with_the_teacher_set(corpus, teacher, tmp_path):
    from tests.test_train import RECIPE

    sets = [a for v in [*TINY, f"data.dataset={json.dumps(str(corpus))}"] for a in ("--set", v)]
    result = runner.invoke(app, ["distill", str(teacher), str(RECIPE), *sets, "--kind", "word", "--max-steps", "2",
                                 "--out", str(tmp_path / "student"), "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["steps"] == 2
    saved = load_run_recipe(tmp_path / "student")
    assert (saved.distill.teacher, saved.distill.kind, saved.distill.alpha) == (str(teacher), "word", 0.5)
    bad = runner.invoke(app, ["distill", str(teacher), str(RECIPE), "--kind", "phrase", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "phrase" in bad.output


def test_an_experiment_reads_each_student_beside_its_teachers_own_score(corpus, teacher, tmp_path):
    """results.json names every distilled cell's teacher with its test score and steps, and the
    ledger section prints it, so a student is never read apart from what it learned from."""
    from pathlib import Path

    from xformer.evaluate import evaluate_run

    scored = evaluate_run(teacher, checkpoint="best", device="cpu")
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "translation" / "multi30k_de_en.toml"
    spec = tmp_path / "kd.toml"
    spec.write_text(f"""[experiment]
recipe = {json.dumps(str(recipe))}
seeds = [1]
baseline = "references"
max_steps = 2
set = {json.dumps([*TINY, f"data.dataset={json.dumps(str(corpus))}"])}

[experiment.cells]
references = []
word = [{json.dumps(f"distill.teacher={json.dumps(str(teacher))}")}, "distill.kind=word"]
""")
    made = CliRunner().invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "out"), "--device", "cpu",
                                    "--json"])
    assert made.exit_code == 0, made.output
    report = json.loads(made.stdout.strip().splitlines()[-1])
    assert report["teachers"] == {"word": {"run": str(teacher), "test": scored.bleu, "steps": 30}}


def test_distilled_cells_train_through_a_learning_curve(corpus, teacher, tmp_path):
    """The ledger's distillation spec at its CPU scale: reference, word- and sequence-level
    students, each trained once through the wsd curve with a cooldown branched from it; every
    budget scored, and the teacher's score beside the students'."""
    from tests.test_train import RECIPE, TINY

    path = json.dumps(str(teacher))
    spec = tmp_path / "distillation.toml"
    spec.write_text(f'''[experiment]
recipe = {json.dumps(str(RECIPE))}
seeds = [1]
baseline = "references"
budgets = [4, 8]
set = {json.dumps([*TINY, f"data.dataset={json.dumps(str(corpus))}", "train.valid_every=2"])}

[experiment.cells]
references = []
word = ["distill.teacher={path.replace('"', '')}", "distill.kind=word"]
sequence = ["distill.teacher={path.replace('"', '')}", "distill.kind=sequence", "distill.beam=2"]
''')
    result = runner.invoke(app, ["experiment", str(spec), "--out", str(tmp_path / "out"), "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [c["budget"] for c in report["curves"]] == [4, 8]
    assert {(r["cell"], r["steps"]) for r in report["runs"]} == {(c, 8) for c in ("references", "word", "sequence")}
    assert all(len(c["runs"]) == 3 for c in report["curves"])
    assert report["teachers"]
