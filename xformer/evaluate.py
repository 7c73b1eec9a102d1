"""Scoring and using a finished run: `evaluate_run` (what `xformer eval` does) and
`translate_lines` (what `xformer translate` does). The run's task does the work
(xformer/tasks/): a translation run decodes with beam search and scores with sacreBLEU and
chrF; a classification run reports accuracy and a confusion matrix.

Results are written to RUN/eval/<name>.*, named so that different inputs never share a file
(rundir.eval_name); the scores of the recipe's own test split are copied to RUN/eval.json.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from xformer.recipe_io import load_run_recipe
from xformer.results import ClassificationEval, TranslationEval
from xformer.tasks import make_task
from xformer.tasks.base import EvalRequest


def evaluate_run(
    run_dir: str | Path, *, split: str | None = None, data: str | None = None, beam: int | None = None,
    lenpen: float | None = None, checkpoint: str | None = None, device: str = "auto",
    on_progress: Callable[[int, int], None] | None = None, quantize: str | None = None,
    ctranslate2: str | None = None,
) -> TranslationEval | ClassificationEval:
    """Score the run on `split` (default: the recipe's test split) or on `data` (a JSONL file
    or folder with the recipe's fields). beam and lenpen apply to translation runs; None means
    the recipe's [eval] value. quantize "int8": Linear layers in dynamic int8 (CPU); its files
    carry ".int8" in their names and RUN/eval.json stays the model's as trained. ctranslate2:
    decode with CTranslate2 from that directory (xformer export --format ctranslate2; int8
    compute with quantize "int8"), files marked ".ct2"."""
    run_dir = Path(run_dir)
    task = make_task(load_run_recipe(run_dir))
    request = EvalRequest(split=split, data=data, checkpoint=checkpoint, device=device, beam=beam, lenpen=lenpen,
                          on_progress=on_progress, quantize=quantize, ctranslate2=ctranslate2)
    return task.evaluate(run_dir, request)


def translate_lines(run_dir: str | Path, lines: list[str], *, checkpoint: str | None = None,
                    beam: int | None = None, lenpen: float | None = None, device: str = "auto",
                    on_warning: Callable[[str], None] | None = None, quantize: str | None = None) -> list[str]:
    """Translate raw sentences with a trained run; the recipe's [eval] settings by default.
    A blank line stays blank (nothing is decoded for it); a line longer than the model's
    positions is translated from its first model.max_positions - 1 pieces, and `on_warning`
    is told which line was cut."""
    run_dir = Path(run_dir)
    task = make_task(load_run_recipe(run_dir))
    return task.predict(run_dir, lines, checkpoint=checkpoint, beam=beam, lenpen=lenpen, device=device,
                        on_warning=on_warning, quantize=quantize)
