"""data.task = "translation": sentence pairs, a sentencepiece tokenizer, a Seq2Seq model.

Training loss: label-smoothed token NLL averaged per target token (R-Drop optional).
Validation: loss without smoothing and, when BLEU picks the best checkpoint, greedy cased
sacreBLEU and chrF. `xformer eval` decodes with the recipe's beam and scores with sacreBLEU
(cased and lowercased) and chrF, writing RUN/eval/<name>.<checkpoint>.beam<N>.lenpen<L>.{hyp,json};
`xformer translate` decodes raw lines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from xformer.config.schema import DistillConfig, Recipe, TrainConfig
from xformer.data.batching import BatchIterator, SampledBatchIterator
from xformer.data.corpus import encode_split, load_split
from xformer.data.tokenizer import PAD_ID, Tokenizer
from xformer.errors import DataError
from xformer.events import Event
from xformer.files import atomic_write_text
from xformer.generation.ctranslate2_engine import check_export, ctranslate2_ids
from xformer.generation.decode import DecodeStats, translate_ids
from xformer.metrics import translation_scores
from xformer.results import EvalView, TranslationEval
from xformer.significance import PairedBleu, paired_bleu
from xformer.tasks.base import (
    CorpusData,
    EvalRequest,
    Task,
    load_training_splits,
)
from xformer.tasks.teacher import Teacher, distilled_corpus, open_teacher, share_tokenizer
from xformer.tasks.translation_heads import TranslationSubject, translation_subject
from xformer.tasks.translation_tokenizer import ensure_tokenizer
from xformer.training.cpuload import OtherLoad
from xformer.training.device import Runtime
from xformer.training.losses import distillation_kl, rdrop_kl, sequence_loss
from xformer.training.run_folder import eval_name, tokenizer_dir


@dataclass
class _Decoder:
    """An evaluation's decoder (TranslationTask._decoder): `translate(sources, beam, lenpen,
    tick, stats)` -> target ids."""

    checkpoint: str  # which checkpoint it decodes with
    quantize: str | None  # "int8" or None
    mark: str  # in the output files' names: ".ct2" and/or ".int8", or ""
    engine: str | None  # "ctranslate2", or None: xformer's own beam search
    rt: Runtime | None  # xformer's runtime (None under CTranslate2)
    translate: Callable


@dataclass
class TranslationData(CorpusData):
    """[data] of a translation task: which fields of the corpus are the two languages, and the
    shared or separate sentencepiece vocabularies."""

    METRICS: ClassVar[tuple[str, ...]] = ("bleu",)
    ARCHS: ClassVar[tuple[str, ...]] = ("seq2seq",)
    DISTILLS: ClassVar[bool] = True

    source_lang: str = "de"
    target_lang: str = "en"
    joint_vocab: bool = True
    # Subword regularization (Kudo 2018, arXiv:1804.10959): with sampling_alpha > 0 each training
    # epoch re-segments the training pairs, sampled from the unigram lattice's probabilities raised
    # to alpha, over the sampling_nbest best segmentations (-1 = all), reproducibly from
    # (train.seed, epoch) in any process (xformer.data.sampling). Unigram tokenizers only.
    # Validation, eval and translate always use the single best segmentation.
    sampling_alpha: float = 0.0
    sampling_nbest: int = -1

    def fields(self) -> list[str]:
        return [self.source_lang, self.target_lang]

    def problems(self) -> list[str]:
        out = super().problems()
        if self.source_lang == self.target_lang:
            out.append("data.target_lang: expected a language other than data.source_lang, "
                       f"found {self.target_lang!r} for both")
        if self.tokenizer not in ("unigram", "bpe"):
            out.append(f"data.tokenizer: translation uses sentencepiece 'unigram' or 'bpe', found {self.tokenizer!r}")
        if not 0 <= self.sampling_alpha <= 1:
            out.append(f"data.sampling_alpha: expected a number in [0, 1] (0: no sampling), "
                       f"found {self.sampling_alpha}")
        if self.sampling_alpha > 0 and self.tokenizer == "bpe":
            out.append("data.sampling_alpha: subword sampling needs data.tokenizer = 'unigram', found 'bpe' "
                       "(sentencepiece's BPE-dropout draws differ from process to process, so runs would not "
                       "repeat); use a unigram tokenizer or sampling_alpha = 0")
        if self.sampling_nbest != -1 and self.sampling_nbest < 2:
            out.append(f"data.sampling_nbest: expected -1 (all segmentations) or at least 2, "
                       f"found {self.sampling_nbest}")
        return out

    def recipe_problems(self, recipe: Recipe) -> list[str]:
        out = super().recipe_problems(recipe)
        if recipe.model.arch == "seq2seq" and recipe.model.tie_embeddings == "all" and not self.joint_vocab:
            out.append("model.tie_embeddings: 'all' shares one embedding between both languages and "
                       "needs data.joint_vocab = true, found false")
        return out


def translation_loss(model, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, rt: Runtime,
                     train: TrainConfig, index_rows: bool, teacher: Teacher | None = None,
                     distill: DistillConfig | None = None) -> torch.Tensor:
    """Summed label-smoothed NLL of tgt_out; `index_rows`: project only the real target
    positions (the model returns (N, V)) instead of masking pad in (B, T, V). With
    train.rdrop_alpha > 0 the batch runs twice (two dropout masks) and the loss is the mean of
    the two NLLs plus alpha / 2 times rdrop_kl: fairseq's R-Drop criterion divided by 2 (the
    same optimum at the usual loss scale). With a `teacher` (word-level distillation) it is
    (1 - alpha) * the NLL + alpha * T^2 * the summed KL(teacher || student) at temperature T."""
    alpha = train.rdrop_alpha
    if alpha > 0:
        src, tgt_in, tgt_out = (torch.cat([x, x]) for x in (src, tgt_in, tgt_out))
    keep = tgt_out.ne(PAD_ID) if index_rows else None
    with rt.autocast():
        logits = model(src, tgt_in, keep=keep)
    target = tgt_out[keep] if keep is not None else tgt_out
    loss = sequence_loss(logits, target, PAD_ID, train.label_smoothing, fused=train.fast_paths)
    if teacher is not None:
        with rt.autocast():
            taught = teacher.logits(src, tgt_in, keep)
        a, t = distill.alpha, distill.temperature
        kl = distillation_kl(logits, taught, t, None if index_rows else tgt_out.ne(PAD_ID))
        return (1 - a) * loss + a * t * t * kl
    if alpha == 0:
        return loss
    # indexed rows are copy 1's real positions, then copy 2's, in the same order
    real = None if index_rows else tgt_out.chunk(2)[0].ne(PAD_ID)
    return loss / 2 + alpha / 2 * rdrop_kl(logits, real)


class TranslationTask(Task):
    Data = TranslationData
    tokenizer: Tokenizer | None = None
    teacher: Teacher | None = None  # [distill]'s (use_teacher), before prepare

    def use_teacher(self, teacher_recipe: Recipe, rt: Runtime) -> None:
        """Distil from the run [distill] names, whose saved recipe is `teacher_recipe`."""
        self.teacher = open_teacher(self.recipe, TranslationTask(teacher_recipe), rt)

    # ------------------------------------------------------------ training
    def load(self, emit: Event) -> None:
        d = self.recipe.data
        self.train_raw, self.valid_raw = load_training_splits(d, [d.source_lang, d.target_lang], emit)

    def prepare(self, run_dir: Path, emit: Event) -> None:
        recipe, d = self.recipe, self.recipe.data
        if self.teacher is not None:  # a student shares its teacher's vocabulary
            share_tokenizer(self.teacher.run_dir, run_dir)
        if not tokenizer_dir(run_dir).is_dir():
            emit("setup", {"message": f"training a {d.vocab_size}-piece {d.tokenizer} sentencepiece model"})
        self.tokenizer = ensure_tokenizer(recipe, run_dir, self.train_raw)
        if self.teacher is not None and recipe.distill.kind == "sequence":
            sources = [s or "" for s in self.train_raw[d.source_lang]]
            path = distilled_corpus(self.teacher, sources, self.tokenizer, d.train_split, d.source_lang,
                                    d.target_lang, recipe.distill.beam, recipe.distill.lenpen, emit)
            self.train_raw = load_split(str(path), d.train_split, [d.source_lang, d.target_lang])
        emit("setup", {"message": "tokenizing"})
        self.valid_data = encode_split(self.valid_raw, self.tokenizer, d.source_lang, d.target_lang)
        if d.sampling_alpha > 0:  # the training pairs are encoded afresh every epoch
            emit("setup", {"message": f"sampling segmentations every epoch (alpha {d.sampling_alpha}, "
                                      f"nbest {d.sampling_nbest})"})
            self.train_batches = SampledBatchIterator(self.train_raw, self.tokenizer, d.source_lang, d.target_lang,
                                                      d.max_tokens, seed=recipe.train.seed, alpha=d.sampling_alpha,
                                                      nbest=d.sampling_nbest, max_len=d.max_len)
        else:
            train = encode_split(self.train_raw, self.tokenizer, d.source_lang, d.target_lang, max_len=d.max_len)
            dropped = len(self.train_raw) - len(train)
            if dropped:
                emit("setup", {"message": f"training on {len(train):,} of {len(self.train_raw):,} pairs: {dropped:,} "
                                          f"dropped (a side empty or blank, or over data.max_len = {d.max_len} "
                                          "pieces)"})
            self.train_batches = BatchIterator(train, max_tokens=d.max_tokens, seed=recipe.train.seed)
            self._check_batch_budget(train)
        if len(self.train_batches) == 0:
            raise DataError(f"{d.dataset}: no training pair has 1 to data.max_len = {d.max_len} pieces on both sides")
        self.valid_batches = BatchIterator(self.valid_data, max_tokens=d.max_tokens, seed=recipe.train.seed,
                                           shuffle=False)
        self.refs = list(self.valid_raw[d.target_lang])

    def model_sizes(self) -> dict:
        """The vocabularies of the tokenizer actually trained (sentencepiece may give fewer
        pieces than data.vocab_size on a small corpus); data.vocab_size before there is one."""
        if self.tokenizer is None:
            size = self.recipe.data.vocab_size
            return {"vocab_size": size, "tgt_vocab_size": size, "pad_id": PAD_ID}
        return {"vocab_size": self.tokenizer.vocab_size("source"),
                "tgt_vocab_size": self.tokenizer.vocab_size("target"), "pad_id": PAD_ID}

    def units(self, batch: dict) -> int:
        return batch["n_tgt_tokens"]

    def tokens(self, batch: dict) -> int:
        return batch["n_tgt_tokens"]

    def loss(self, model, batch: dict, rt: Runtime) -> torch.Tensor:
        """Summed label-smoothed NLL over the batch's target tokens (translation_loss)."""
        src, tgt_in, tgt_out = (batch[k].to(rt.device, non_blocking=True) for k in ("src", "tgt_in", "tgt_out"))
        # On the CPU, project only real target positions (the largest matmul); on CUDA the
        # boolean index would cost a host sync per batch, so pad is masked instead.
        word = self.teacher is not None and self.recipe.distill.kind == "word" and self.recipe.distill.alpha > 0
        return translation_loss(model, src, tgt_in, tgt_out, rt, self.recipe.train, index_rows=rt.device.type == "cpu",
                                teacher=self.teacher if word else None, distill=self.recipe.distill)

    def validate(self, model, rt: Runtime, *, lengths: list[int] | None = None) -> dict:
        """Validation loss (token NLL, no label smoothing) and, when BLEU picks the best
        checkpoint, cased sacreBLEU and chrF of greedy translations of the validation sources
        (each exactly lengths[i] pieces when given)."""
        recipe = self.recipe
        model.eval()
        total, tokens = 0.0, 0
        limit = recipe.model.max_positions  # a longer validation pair is scored on its first positions
        with torch.inference_mode(), rt.autocast():
            for batch in self.valid_batches.iter_epoch(0):
                src, tgt_in, tgt_out = (batch[k][:, :limit].to(rt.device) for k in ("src", "tgt_in", "tgt_out"))
                keep = tgt_out.ne(PAD_ID)
                total += sequence_loss(model(src, tgt_in, keep=keep), tgt_out[keep], PAD_ID).item()
                tokens += int(keep.sum())
        scores = {"loss": total / tokens, "ppl": math.exp(min(total / tokens, 50))}
        if recipe.best_metric == "bleu":
            started = time.perf_counter()
            ids = translate_ids(model, list(self.valid_data["src_ids"]), recipe, rt, beam=1, lengths=lengths)
            bleu = translation_scores(self.tokenizer.decode(ids, "target"), self.refs)
            scores.update(bleu=bleu["bleu"], chrf=bleu["chrf"], decode_seconds=time.perf_counter() - started)
        return scores

    def validate_as_trained(self, model, rt: Runtime) -> dict:
        """Each greedy translation as long as its reference: an untrained model's stop at once or
        run to max_len (the flagship's calibration timed 1.4 s one day, 13.2 s another)."""
        return self.validate(model, rt, lengths=[len(ids) for ids in self.valid_data["tgt_ids"]])

    # ------------------------------------------------------------ a trained run
    def _check_batch_budget(self, train) -> None:
        """Refuse a data.max_tokens that the longest training pair does not fit: every pair would
        otherwise sit in a batch of its own, over budget, and the setting would mean nothing."""
        d, batches = self.recipe.data, self.train_batches
        width = np.maximum(batches.src_lens, batches.tgt_lens) + 1  # + EOS / BOS
        widest = int(np.argmax(width)) if len(width) else 0
        if len(width) and width[widest] > d.max_tokens:
            text = self.tokenizer.decode([train[widest]["src_ids"]], "source")[0]
            raise DataError(f"data.max_tokens = {d.max_tokens}: the longest training pair ({d.dataset}, "
                            f"{batches.src_lens[widest]} source and {batches.tgt_lens[widest]} target pieces: "
                            f"\"{text[:60]}{'...' if len(text) > 60 else ''}\") needs {width[widest]} tokens a batch; "
                            f"expected data.max_tokens >= {width[widest]}, or a smaller data.max_len "
                            f"(now {d.max_len}) to drop such pairs")

    def load_vocabulary(self, run_dir: Path) -> None:
        d = self.recipe.data
        self.tokenizer = Tokenizer.load(tokenizer_dir(run_dir), d.source_lang, d.target_lang)

    def evaluate(self, run_dir: Path, request: EvalRequest) -> TranslationEval:
        """Translate a split (default: the recipe's test split) or request.data and score it."""
        recipe, d = self.recipe, self.recipe.data
        decoder = self._decoder(Path(run_dir), request)
        spec = request.data if request.data is not None else d.dataset
        split = request.split or d.test_split
        config = d.dataset_config or None if request.data is None else None  # a Hub configuration names the corpus
        raw = load_split(spec, split, [d.source_lang, d.target_lang], config, complete=True)
        sources = self.tokenizer.encode(list(raw[d.source_lang]), "source")
        beam = recipe.eval.beam if request.beam is None else request.beam
        lenpen = recipe.eval.lenpen if request.lenpen is None else request.lenpen
        done = 0

        def tick(n):
            nonlocal done
            done += n
            if request.on_progress:
                request.on_progress(done, len(sources))

        started, others, stats = time.perf_counter(), OtherLoad(), DecodeStats()
        hyps = self.tokenizer.decode(decoder.translate(sources, beam, lenpen, tick, stats), "target")
        seconds, others_cpu = time.perf_counter() - started, others.cores()
        scores = translation_scores(hyps, list(raw[d.target_lang]))
        name = eval_name(split, request.data, [raw[d.source_lang], raw[d.target_lang]])
        out_dir = Path(run_dir) / "eval"
        stem = f"{name}.{decoder.checkpoint}{decoder.mark}.beam{beam}.lenpen{lenpen:g}"
        result = TranslationEval(
            **scores, data=spec, split=split if request.data is None else None, checkpoint=decoder.checkpoint,
            beam=beam, lenpen=lenpen, decode_seconds=seconds, sentences_per_s=len(hyps) / max(seconds, 1e-9),
            hypotheses=str(out_dir / f"{stem}.hyp"), quantize=decoder.quantize, others_cpu=others_cpu,
            kv_cache_mb=stats.cache_bytes / 2**20 if decoder.engine is None else None, engine=decoder.engine)
        result.card, result.warnings = self.eval_card(run_dir, decoder.rt, split, request.data, decoder.checkpoint,
                                                      others_cpu)
        result.card.wall_seconds = time.perf_counter() - started
        atomic_write_text(out_dir / f"{stem}.hyp", "".join(h + "\n" for h in hyps))
        atomic_write_text(out_dir / f"{stem}.json", result.to_json())
        as_trained = decoder.engine is None and decoder.quantize == (recipe.eval.quantize or None)
        if request.data is None and split == d.test_split and as_trained:  # RUN/eval.json: the recipe's own
            # test split, decoded as the recipe says (eval.quantize included)
            atomic_write_text(Path(run_dir) / "eval.json", result.to_json())
        return result

    EXPORTS: ClassVar[bool] = True
    UNIT: ClassVar[str] = "sentence"
    SCORED: ClassVar[str] = "references"
    OUTPUTS: ClassVar[str] = "hypotheses"
    OUTPUT_SUFFIX: ClassVar[str] = ".hyp"
    METRIC: ClassVar[str] = "bleu"

    def test_input_lengths(self, run_dir: Path) -> list[int]:
        """The length in source pieces of every test source, with `run_dir`'s tokenizer."""
        d = self.recipe.data
        self.load_vocabulary(run_dir)
        rows = load_split(d.dataset, d.test_split, [d.source_lang, d.target_lang], d.dataset_config or None)
        return [len(ids) for ids in self.tokenizer.encode(list(rows[d.source_lang]), "source")]

    def scored_set(self, split: str | None, data: str | None) -> list[str]:
        """The references `evaluate` scores against (default: the test split), in order."""
        d = self.recipe.data
        spec = data if data is not None else d.dataset
        config = d.dataset_config or None if data is None else None
        rows = load_split(spec, split or d.test_split, [d.source_lang, d.target_lang], config, complete=True)
        return list(rows[d.target_lang])

    def paired_test(self, outputs: str | Path, baseline_outputs: str | Path, scored: list) -> PairedBleu:
        """sacreBLEU's paired bootstrap of two runs' hypotheses against the references (xformer.significance)."""
        lines = [Path(f).read_text(encoding="utf-8").splitlines() for f in (outputs, baseline_outputs)]
        return paired_bleu(lines[0], lines[1], scored)

    def first_difference(self, own: list, other: list) -> str:
        if len(own) != len(other):
            return f"{len(other)} against {len(own)} {self.UNIT}s"
        i = next(i for i, (a, b) in enumerate(zip(own, other, strict=True)) if a != b)
        shorter = min(len(own[i]), len(other[i]))
        at = next((k for k in range(shorter) if own[i][k] != other[i][k]), shorter)
        start = max(at - 20, 0)
        return f"{self.UNIT} {i + 1}: {other[i][start:at + 40]!r} against {own[i][start:at + 40]!r}"

    def view(self, result: TranslationEval, run: str) -> EvalView:
        """What `xformer eval` shows a person of a score of this task."""
        rows = {"bleu": result.bleu, "bleu_lc": result.bleu_lc, "chrf": result.chrf, "n_sentences": result.n_sentences,
                "checkpoint": result.checkpoint, "beam": result.beam, "lenpen": result.lenpen,
                "sentences/s": result.sentences_per_s, **({"quantize": result.quantize} if result.quantize else {}),
                **({"KV cache MB": result.kv_cache_mb} if result.kv_cache_mb is not None else {})}
        view = EvalView(f"{run}: {result.split or result.data}", rows, notes=[result.signature,
                                                                           f"hypotheses: {result.hypotheses}"])
        if result.paired:
            p = result.paired.outcome
            view.paired = (f"paired bootstrap against {result.paired.baseline} ({p.samples} resamples)", {
                "bleu": f"{p.bleu:.2f} (mean {p.mean:.2f} +- {p.interval:.2f})",
                "baseline bleu": f"{p.baseline_bleu:.2f} (mean {p.baseline_mean:.2f} +- {p.baseline_interval:.2f})",
                "difference": f"{p.difference:+.2f}", "p-value": f"{p.p_value:.4f}"}, [p.signature])
        return view

    def _decoder(self, run_dir: Path, request: EvalRequest) -> _Decoder:
        """What decodes this evaluation, chosen once: the run's model (in int8 with --quantize or
        the recipe's eval.quantize), or CTranslate2 from the run's own export (--ctranslate2; the
        run supplies tokenizer and data, the export says which checkpoint it holds)."""
        recipe = self.recipe
        quantize = request.quantize or recipe.eval.quantize or None  # --quantize, else the recipe's
        mark = "." + quantize if quantize else ""
        if request.ctranslate2:
            meta = check_export(request.ctranslate2, run_dir)  # RUN's own export, as written
            self.load_vocabulary(run_dir)
            pieces = [self.tokenizer.piece(i, "source") for i in range(self.tokenizer.vocab_size("source"))]
            e = recipe.eval

            def translate(sources, beam, lenpen, tick, stats):
                ids = ctranslate2_ids(request.ctranslate2, sources, pieces, beam=beam, lenpen=lenpen,
                                      max_len_a=e.max_len_a, max_len_b=e.max_len_b,
                                      compute_type="int8" if quantize else "float32")
                tick(len(sources))
                return ids

            return _Decoder(meta["checkpoint"], quantize, ".ct2" + mark, "ctranslate2", None, translate)
        checkpoint = request.checkpoint or recipe.eval.checkpoint
        model, rt = self.open_run(run_dir, checkpoint, request.device, quantize=quantize)

        def translate(sources, beam, lenpen, tick, stats):
            return translate_ids(model, sources, recipe, rt, beam=beam, lenpen=lenpen, on_batch=tick, stats=stats)

        return _Decoder(checkpoint, quantize, mark, None, rt, translate)

    def predict(self, run_dir: Path, lines: list[str], *, checkpoint: str | None = None, beam: int | None = None,
                lenpen: float | None = None, device: str = "auto", on_warning=None,
                quantize: str | None = None) -> list[str]:
        """Translate raw sentences; the recipe's [eval] settings by default. A blank line stays
        blank (nothing is decoded for it); a line longer than the model's positions is
        translated from its first model.max_positions - 1 pieces, and `on_warning` is told."""
        recipe = self.recipe
        model, rt = self.open_run(run_dir, checkpoint or recipe.eval.checkpoint, device,
                                  quantize=quantize or recipe.eval.quantize or None)
        sources = self.tokenizer.encode(lines, "source")
        limit = recipe.model.max_positions - 1  # room for EOS
        for number, ids in enumerate(sources, start=1):
            if len(ids) > limit and on_warning:
                on_warning(f"line {number}: {len(ids)} pieces, more than the model's {limit} positions; "
                           f"translated its first {limit} pieces")
        kept = [i for i, ids in enumerate(sources) if ids]
        hyps = translate_ids(model, [sources[i] for i in kept], recipe, rt, beam=beam, lenpen=lenpen) if kept else []
        out = [""] * len(lines)
        for i, text in zip(kept, self.tokenizer.decode(hyps, "target"), strict=True):
            out[i] = text
        return out

    def subject(self, run_dir: Path, *, split: str | None, data: str | None, n_examples: int,
                checkpoint: str, device: str) -> TranslationSubject:
        """The model in fp32 (statistics and gradients want full precision) and the first
        n_examples pairs of `split` (default: the validation split) or of `data`."""
        model, rt = self.open_run(run_dir, checkpoint, device, "fp32")
        return translation_subject(self, model, rt, Path(run_dir), split=split, data=data, n_examples=n_examples)
