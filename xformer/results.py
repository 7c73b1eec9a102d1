"""What the core's commands return: plain dataclasses, written to JSON with the same keys.

The CLI renders them by type; a library caller reads fields. `to_dict()` is what the JSON
files (RUN/eval.json, RUN/eval/*.json, heads.json, ...) hold.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from xformer.files import finite_json


class Result:
    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON holds them; an optional field (default None) that is None is left
        out, as the files have always left out what a run did not compute."""
        optional = {f.name for f in fields(self) if f.default is None}
        out = {k: v for k, v in asdict(self).items() if not (v is None and k in optional)}
        for key in out:  # a field that is an object with its own JSON form (a run card) writes that
            value = getattr(self, key)
            if hasattr(value, "to_dict"):
                out[key] = value.to_dict()
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return finite_json(self.to_dict(), indent=indent)  # null (and "nonfinite") for NaN / inf


@dataclass
class EvalView:
    """A score as a person reads it (the CLI renders it): a titled table of rows, grids (title,
    column labels, rows led by their label), dim notes, and the paired test against a
    baseline as (title, rows, notes)."""

    title: str
    rows: dict
    notes: list[str] = field(default_factory=list)
    grids: list[tuple[str, list[str], list[list]]] = field(default_factory=list)
    paired: tuple[str, dict, list[str]] | None = None


@dataclass
class Paired(Result):
    """A score's paired test against a baseline run (`xformer eval --baseline`); its JSON is one
    flat object: the baseline, what the baseline adds beside the test, then the test's fields."""

    baseline: str  # the baseline's run folder
    baseline_checkpoint: str
    outcome: Any  # xformer.significance.PairedBleu (translation) or McNemar (classification)
    baseline_beam: int | None = None  # translation: the beam the baseline decoded with
    accuracy: float | None = None  # classification: this run's accuracy and the baseline's, percent
    baseline_accuracy: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        outcome = out.pop("outcome")
        return {**out, **outcome}


@dataclass
class TranslationEval(Result):
    """A translation run scored on a split or a file (`xformer eval`)."""

    bleu: float  # cased sacreBLEU
    bleu_lc: float  # lowercased
    chrf: float
    signature: str  # sacreBLEU's signature of the cased score
    chrf_signature: str
    n_sentences: int
    data: str  # the corpus or file scored
    split: str | None  # None when `data` is a file given instead of the recipe's corpus
    checkpoint: str
    beam: int
    lenpen: float
    decode_seconds: float
    sentences_per_s: float
    hypotheses: str  # the file of hypotheses, one per line
    others_cpu: float | None = None  # mean CPU cores other processes took while it decoded (xformer.training.cpuload)
    kv_cache_mb: float | None = None  # the most the decoder's key/value caches held at once (one batch), MB
    quantize: str | None = None  # "int8" when scored with quantized Linear layers
    engine: str | None = None  # "ctranslate2" when an exported model decoded
    card: Any = None  # xformer.training.run_card.RunCard: what reproducing the score needs
    warnings: list[str] | None = None  # e.g. the split's files differ from what training read
    paired: Paired | None = None  # with --baseline: the paired bootstrap against that run (xformer.significance)

    def as_baseline_of(self, other: TranslationEval) -> dict:
        """What a paired comparison records of this score as `other`'s baseline, beside the test
        (Paired's fields)."""
        return {"baseline_beam": self.beam}



@dataclass
class ClassificationEval(Result):
    """A classification run scored on a split or a file (`xformer eval`)."""

    accuracy: float  # percent
    loss: float  # mean cross-entropy per example
    n_examples: int
    task: str
    split: str  # the split, or data-<name>-<digest> for a file
    checkpoint: str
    labels: list[str]  # class index -> label
    majority_accuracy: float  # percent, always predicting the most frequent label
    predictions: str  # the file of predicted labels, one per line
    confusion: list[list[int]] | None = None  # [true][predicted]; None above 20 classes
    eval_seconds: float | None = None  # the forward passes over the split, timed
    examples_per_s: float | None = None
    # mean CPU cores other processes took while it classified (xformer.training.cpuload)
    others_cpu: float | None = None
    quantize: str | None = None  # "int8" when scored with quantized Linear layers
    card: Any = None  # xformer.training.run_card.RunCard: what reproducing the score needs
    warnings: list[str] | None = None  # e.g. the split's files differ from what training read
    paired: Paired | None = None  # with --baseline: McNemar's exact test against that run (xformer.significance)

    def as_baseline_of(self, other: ClassificationEval) -> dict:
        """What a paired comparison records of this score as `other`'s baseline, beside the test
        (Paired's fields)."""
        return {"accuracy": other.accuracy, "baseline_accuracy": self.accuracy}



@dataclass
class CheckResult(Result):
    """A validated recipe and the size of its model (`xformer check`)."""

    config: dict[str, dict[str, Any]]
    derived: dict[str, Any]
    parameters: dict[str, int]  # total, embedding, non_embedding


@dataclass
class AverageResult(Result):
    """An averaged checkpoint written into a run (`xformer average`)."""

    path: str
    averaged: list[str]  # checkpoint file names, oldest first
    steps: list[int]


@dataclass
class TokenizeResult(Result):
    """A run's trained tokenizer described on a sample of training pairs (`xformer tokenize`)."""

    directory: str
    files: list[str]
    joint: bool
    source_vocab: int
    target_vocab: int
    source_pieces_per_sentence: float
    target_pieces_per_sentence: float
    source_unk_rate: float
    target_unk_rate: float


@dataclass
class HeadsReport(Result):
    """The head analysis of a run (`xformer inspect-heads`): what heads.json holds."""

    run: str
    kind: str  # "translation" or "classification"
    split: str
    data: str | None
    n_examples: int
    importance_metric: str
    ablate: str
    base_metric: float
    heads: list[dict]  # one per head: site, space, layer, head, ablation, gradient, roles, ...
    kv_groups: dict
    rank_correlation: dict[str, float]
    similarity: dict
    criteria: dict[str, str]
    syntactic: str
    pruning: dict | None = None
    pruned_model: dict | None = None
    seconds: float = 0.0
    artifacts: dict[str, str] = field(default_factory=dict)


@dataclass
class SweepResult(Result):
    """A Transformer-vs-LSTM length sweep with any Transformer variants (`xformer longrange`):
    what comparison.json holds."""

    task: str
    budget_per_run: str
    lengths: list[int]
    seeds: list[int]
    device: str | None
    models: list[str]  # "transformer", any variants, "lstm"
    summary: list[dict]  # per (model, length): accuracy mean and std over seeds, parameters, tokens/s, memory
    rows: list[dict]  # one per trained run


@dataclass
class ExperimentResult(Result):
    """A grid of cells over seeds compared with a baseline cell (`xformer experiment`): what
    results.json holds."""

    metric: str  # "bleu" (cased sacreBLEU) or "accuracy"
    baseline: str
    seeds: list[int]
    budget_per_run: str
    cells: list[dict]  # per cell: test and valid mean/std, difference from the baseline, paired tests
    runs: list[dict]  # one per (cell, seed)
    source: str  # the spec file
    # with experiment.budgets: per budget, {"budget", "cells", "runs"} as above (the largest is
    # `cells` and `runs` themselves, the others cooldowns branched from them)
    curves: list[dict] | None = None
    test_lengths: dict | None = None  # the test inputs' median and longest length in tokens ("median_source", ...)
    teachers: dict | None = None  # per distilled cell: its teacher's run, test score and steps


@dataclass
class Ledger(Result):
    """The claims ledger (`xformer claims`): one row per claim spec, with its verdict."""

    rows: list[dict]  # number, says, spec, verdict; checks and the record when measured; blocked when not
    markdown: str  # the file written
    records: str  # the folder of records


@dataclass
class LedgerPlan(Result):
    """What a ledger's specs cost before they run (`xformer claims --plan`, xformer.studies.plan):
    per spec its runs, those an earlier spec trains already, the steps it adds and, timed, the
    hours its runs take and the wall-clock hours at `jobs` runs at once."""

    # spec, cells, seeds, runs, new_runs, shared_runs, new_steps, alone; run_hours and wall_hours when timed
    specs: list[dict]
    total: dict  # runs, new_runs, new_steps, run_hours, wall_hours
    jobs: int
    timed: bool
    # pace_of (the first run of that shape), step_seconds, valid_seconds, threads, precision
    paces: list[dict] = field(default_factory=list)
    shared: list[dict] = field(default_factory=list)  # spec, run, trained_by (SPEC/RUN)
