"""Scoring and using a finished run: `evaluate_run` (what `xformer eval` does) and
`translate_lines` (what `xformer translate` does). The run's task does the work
(xformer/tasks/): a translation run decodes with beam search and scores with sacreBLEU and
chrF; a classification run reports accuracy and a confusion matrix.

Results are written to RUN/eval/<name>.*, named so that different inputs never share a file
(rundir.eval_name); the scores of the recipe's own test split are copied to RUN/eval.json.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from xformer.config.loading import load_run_recipe, recipe_from_dict
from xformer.config.schema import Recipe
from xformer.errors import DataError, RunError
from xformer.files import atomic_write_text
from xformer.locks import describe, holder
from xformer.results import ClassificationEval, EvalView, Paired, TranslationEval
from xformer.tasks import make_task
from xformer.tasks.base import EvalRequest
from xformer.tasks.generated import GeneratedData


class CannotExtrapolate(RunError):
    """A run asked for a length its model has no positions for: a result ("cannot extrapolate"),
    which `xformer eval` prints as one and an experiment scores as no correct answer."""


POSITION_TABLES = ("learned",)  # positional variants whose positions are trained parameters
SEQUENCE_TABLES = ("low_rank", "synthesizer")  # attention variants with parameters per position


def at_length(recipe: Recipe, length: int) -> Recipe:
    """The recipe of a generated-task run with its examples generated at `length` tokens: the
    same model, its position formulas extended where they are formulas (sinusoidal, RoPE,
    ALiBi, relative, none); CannotExtrapolate where its positions are trained parameters that
    stop short (learned positions, low-rank and Synthesizer tables)."""
    if not isinstance(recipe.data, GeneratedData):
        raise RunError(f"--length: a generated task's examples at another length; this is a {recipe.data.task} run")
    m = recipe.model
    needed = length + 1  # + CLS
    if needed > m.max_positions and (m.positional in POSITION_TABLES or m.attention in SEQUENCE_TABLES):
        what = f"model.positional = {m.positional!r}" if m.positional in POSITION_TABLES else \
            f"model.attention = {m.attention!r}"
        raise CannotExtrapolate(f"cannot extrapolate to {length} tokens: {what} has trained parameters for "
                                f"model.max_positions = {m.max_positions} positions only")
    return recipe_from_dict(recipe.to_dict(), [f"data.max_len={length}",
                                               f"model.max_positions={max(m.max_positions, needed)}"],
                            "--length")


def evaluate_run(
    run_dir: str | Path, *, split: str | None = None, data: str | None = None, beam: int | None = None,
    lenpen: float | None = None, checkpoint: str | None = None, device: str = "auto",
    on_progress: Callable[[int, int], None] | None = None, quantize: str | None = None,
    ctranslate2: str | None = None, baseline: str | Path | None = None, length: int | None = None,
) -> TranslationEval | ClassificationEval:
    """Score the run on `split` (default: the recipe's test split) or on `data` (a JSONL file
    or folder with the recipe's fields). beam and lenpen apply to translation runs; None means
    the recipe's [eval] value. quantize "int8": Linear layers in dynamic int8 (CPU); its files
    carry ".int8" in their names and RUN/eval.json stays the model's as trained. ctranslate2:
    decode with CTranslate2 from that directory (xformer export --format ctranslate2; int8
    compute with quantize "int8"), files marked ".ct2". baseline: another run of
    the same task scored on the same test set, and the paired test between the two in
    result.paired (xformer.significance): sacreBLEU's paired bootstrap for translation,
    McNemar's exact test for classification. length: a generated task's examples generated at
    this data.max_len instead of the run's (at_length), scored into files named
    SPLIT.lenN.* (extrapolation: train at L, score at 2L)."""
    run_dir = Path(run_dir)
    recipe = load_run_recipe(run_dir)
    if length is not None:
        recipe = at_length(recipe, length)
    task = make_task(recipe)
    request = EvalRequest(split=split, data=data, checkpoint=checkpoint, device=device, beam=beam, lenpen=lenpen,
                          on_progress=on_progress, quantize=quantize, ctranslate2=ctranslate2, length=length)
    pairing = check_pairable(run_dir, recipe, Path(baseline), request) if baseline is not None else None
    # its card says which checkpoint, whether the run had finished, and whether the timing is the machine's alone
    result = task.evaluate(run_dir, request)
    if pairing is not None:
        result.paired = compare_with(result, pairing)
    return result


@dataclass
class Pairing:
    """A baseline run that may be compared with this one: same task, same test set."""

    baseline: Path
    recipe: Recipe
    request: EvalRequest  # the baseline's: its own checkpoint choice, decoded as it was trained
    test_set: list  # the references (translation) or (text, gold label) pairs (classification)


def check_pairable(run_dir: Path, recipe: Recipe, baseline: Path, request: EvalRequest) -> Pairing:
    """Refuse, before anything is decoded, a baseline of another task or scored on another test set."""
    base_recipe = load_run_recipe(baseline)
    if base_recipe.data.task != recipe.data.task:
        raise RunError(f"--baseline {baseline}: a {base_recipe.data.task} run; a {recipe.data.task} run compares "
                       f"with a {recipe.data.task} run")
    base_request = replace(request, checkpoint=None, quantize=None, ctranslate2=None)
    task = make_task(recipe)
    own, other = task.paired_set(request), make_task(base_recipe).paired_set(base_request)
    if own != other:
        raise DataError(f"--baseline {baseline}: its test set has other {task.SCORED} than {run_dir}'s "
                        f"({task.first_difference(own, other)}); {task.pairing_hint()}")
    return Pairing(baseline, base_recipe, base_request, own)


def compare_with(result: TranslationEval | ClassificationEval, pairing: Pairing) -> Paired:
    """Score the same test set with the baseline run and run the task's paired test; the
    comparison is also written beside the run's outputs as <stem>.vs-<baseline folder>.json."""
    baseline, task = pairing.baseline, make_task(pairing.recipe)
    base = task.evaluate(baseline, pairing.request)
    mine, theirs = getattr(result, task.OUTPUTS), getattr(base, task.OUTPUTS)
    paired = Paired(baseline=str(baseline), baseline_checkpoint=base.checkpoint,
                    outcome=task.paired_test(mine, theirs, pairing.test_set), **base.as_baseline_of(result))
    stem = Path(mine).with_suffix("")
    atomic_write_text(stem.with_name(f"{stem.name}.vs-{baseline.resolve().name}.json"), paired.to_json())
    return paired


def paired_set(recipe: Recipe, request: EvalRequest | None = None) -> list:
    """What a paired test needs to be the same in two runs (the task's paired_set): the
    references (translation) or the examples (classification) of the split or file `request`
    scores (default: the test split)."""
    return make_task(recipe).paired_set(request)


def eval_view(run_dir: str | Path, result: TranslationEval | ClassificationEval) -> EvalView:
    """What `xformer eval` shows a person of `result`, a score of the run in `run_dir`: its task's view."""
    return make_task(load_run_recipe(Path(run_dir))).view(result, str(run_dir))


def translate_lines(run_dir: str | Path, lines: list[str], *, checkpoint: str | None = None,
                    beam: int | None = None, lenpen: float | None = None, device: str = "auto",
                    on_warning: Callable[[str], None] | None = None, quantize: str | None = None) -> list[str]:
    """Translate raw sentences with a trained run; the recipe's [eval] settings by default.
    A blank line stays blank (nothing is decoded for it); a line longer than the model's
    positions is translated from its first model.max_positions - 1 pieces, and `on_warning`
    is told which line was cut."""
    run_dir = Path(run_dir)
    task = make_task(load_run_recipe(run_dir))
    if on_warning is not None and (training := holder(run_dir)) is not None:
        on_warning(f"{run_dir}: still training ({describe(training)}): translating with its checkpoint as it is now")
    return task.predict(run_dir, lines, checkpoint=checkpoint, beam=beam, lenpen=lenpen, device=device,
                        on_warning=on_warning, quantize=quantize)
