"""The training loop: run(recipe, out_dir, on_event=...) -> TrainResult.

A run directory holds everything needed to evaluate or resume:

    RUN/recipe.toml                  the resolved recipe (after --set and CLI overrides)
    RUN/tokenizer/                   sentencepiece model(s), trained here when absent
    RUN/metrics.jsonl                one JSON object per log line and per validation
    RUN/checkpoints/last.safetensors model + optimizer + RNG + progress: --resume starts here
    RUN/checkpoints/best.safetensors the best model by validation (train.best_metric)
    RUN/checkpoints/step_N.safetensors the last train.average_last validation checkpoints
    RUN/checkpoints/averaged.safetensors their average, written when training ends
    RUN/train.json                   the TrainResult summary

The loop reports progress through `on_event(kind, payload)` (kinds: "setup", "start",
"step", "valid", "end") so the CLI can draw progress bars without the core importing rich.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from xformer.checkpoint import (
    atomic_write_text,
    average_checkpoints,
    load_model_weights,
    load_optimizer_state,
    read_checkpoint,
    save_checkpoint,
)
from xformer.config import Recipe, load_recipe
from xformer.data.batching import BatchIterator
from xformer.data.corpus import encode_split, load_split
from xformer.data.tokenizer import PAD_ID
from xformer.errors import RunError
from xformer.evaluate import build_translation_model, validate
from xformer.optim import build_optimizer, learning_rate, sequence_loss
from xformer.runtime import Runtime, resolve_runtime
from xformer.tokenize import ensure_tokenizer, tokenizer_dir

Event = Callable[[str, dict], None]


@dataclass
class TrainResult:
    run_dir: str
    steps: int
    epochs: float
    stop_reason: str
    best: dict | None
    train_seconds: float
    compute_seconds: float  # forward + backward + optimizer step
    data_seconds: float  # waiting for the next batch
    target_tokens: int
    device: str
    precision: str
    history: list[dict] = field(default_factory=list)

    @property
    def loop_overhead(self) -> float:
        """Share of loop time spent outside forward/backward/step, validation excluded."""
        return self.data_seconds / max(self.compute_seconds, 1e-9)


@dataclass
class Progress:
    """Everything that must survive a resume besides tensors."""

    step: int = 0
    epoch: int = 0  # 0-based epoch in progress
    batch_in_epoch: int = 0  # batches of `epoch` already consumed
    seconds: float = 0.0
    compute_seconds: float = 0.0
    data_seconds: float = 0.0
    target_tokens: int = 0
    best: dict | None = None
    bad_validations: int = 0
    kept: list[str] = field(default_factory=list)  # step checkpoints, oldest first
    history: list[dict] = field(default_factory=list)


def prepare_run_dir(out_dir: Path, recipe: Recipe, *, resume: bool, overwrite: bool) -> None:
    """Create RUN, or check that --resume continues the same recipe; never overwrite silently."""
    saved = out_dir / "recipe.toml"
    if resume:
        if not (out_dir / "checkpoints" / "last.safetensors").is_file():
            raise RunError(f"{out_dir}: nothing to resume (no checkpoints/last.safetensors)")
        old = load_recipe(saved)
        for section in ("model", "data"):
            if getattr(old, section) != getattr(recipe, section):
                diff = [k for k, v in asdict(getattr(recipe, section)).items() if asdict(getattr(old, section))[k] != v]
                raise RunError(f"{saved}: the run was started with different [{section}] values "
                               f"({', '.join(diff)}); resume with the same recipe")
        return
    if out_dir.exists() and any(p.name not in ("tokenizer", "recipe.toml") for p in out_dir.iterdir()):
        if not overwrite:
            raise RunError(f"{out_dir}: run directory exists and is not empty; "
                           "pass --resume to continue it or --overwrite to replace it")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)


def prepare_data(recipe: Recipe, run_dir: Path, emit: Event):
    """Tokenizer (trained when the run has none yet) and the encoded train / valid splits."""
    d = recipe.data
    fields = [d.source_lang, d.target_lang]
    emit("setup", {"message": f"loading {d.dataset} ({d.train_split}, {d.valid_split})"})
    train_raw = load_split(d.dataset, d.train_split, fields)
    valid_raw = load_split(d.dataset, d.valid_split, fields)
    if not tokenizer_dir(run_dir).is_dir():
        emit("setup", {"message": f"training a {d.vocab_size}-piece {d.tokenizer} sentencepiece model"})
    tokenizer = ensure_tokenizer(recipe, run_dir, train_raw)
    emit("setup", {"message": "tokenizing"})
    train = encode_split(train_raw, tokenizer, d.source_lang, d.target_lang, max_len=d.max_len)
    valid = encode_split(valid_raw, tokenizer, d.source_lang, d.target_lang)
    return tokenizer, train, valid, valid_raw


def run(
    recipe: Recipe, out_dir: str | Path, *, device: str = "auto", resume: bool = False,
    overwrite: bool = False, on_event: Event | None = None,
) -> TrainResult:
    """Train the recipe's model into `out_dir`; see the module docstring for what is written."""
    emit = on_event or (lambda kind, payload: None)
    started = time.perf_counter()
    out_dir = Path(out_dir)
    prepare_run_dir(out_dir, recipe, resume=resume, overwrite=overwrite)
    atomic_write_text(out_dir / "recipe.toml", recipe.to_toml())
    cfg = recipe.train
    rt: Runtime = resolve_runtime(device, cfg.precision)
    emit("setup", {"message": rt.describe()})
    torch.manual_seed(cfg.seed)

    tokenizer, train_data, valid_data, valid_raw = prepare_data(recipe, out_dir, emit)
    model = build_translation_model(recipe, tokenizer).to(rt.device)
    optimizer = build_optimizer(model, cfg)
    progress = Progress()
    last = out_dir / "checkpoints" / "last.safetensors"
    if resume:
        tensors, meta = read_checkpoint(last)
        load_model_weights(model, tensors, last)
        load_optimizer_state(optimizer, tensors, meta)
        progress = Progress(**meta["progress"])
        rt.load_state(tensors, meta)
        _truncate_metrics(out_dir / "metrics.jsonl", progress.step)
    batches = BatchIterator(train_data, max_tokens=recipe.data.max_tokens, seed=cfg.seed)
    valid_batches = BatchIterator(valid_data, max_tokens=recipe.data.max_tokens, seed=cfg.seed, shuffle=False)
    refs = list(valid_raw[recipe.data.target_lang])
    emit("start", {"steps_per_epoch": len(batches) // cfg.accumulate_steps, "step": progress.step,
                   "parameters": sum(p.numel() for p in model.parameters()), "run_dir": str(out_dir)})

    seconds_before = progress.seconds  # from earlier sessions of a resumed run

    def elapsed() -> float:
        return seconds_before + time.perf_counter() - started

    def fraction_done() -> float:
        parts = [0.0]
        if cfg.max_steps:
            parts.append(progress.step / cfg.max_steps)
        if cfg.max_epochs:
            parts.append((progress.epoch + progress.batch_in_epoch / max(1, len(batches))) / cfg.max_epochs)
        if cfg.max_time:
            parts.append(elapsed() / (cfg.max_time * 60))
        return min(1.0, max(parts))

    def checkpoint(stop_reason: str | None = None) -> None:
        progress.seconds = elapsed()
        meta = {"progress": asdict(progress), "recipe": recipe.to_dict(), "stop_reason": stop_reason}
        tensors, extra_meta = rt.state()
        save_checkpoint(last, model, meta={**meta, **extra_meta}, optimizer=optimizer, extra_tensors=tensors)

    stop_reason = None
    log_loss, log_tokens, log_time = 0.0, 0, time.perf_counter()
    model.train()
    try:
        while stop_reason is None:
            epoch_iter = batches.iter_epoch(progress.epoch, skip=progress.batch_in_epoch)
            while True:
                t0 = time.perf_counter()
                group = []
                for _ in range(cfg.accumulate_steps):
                    batch = next(epoch_iter, None)
                    if batch is None:
                        break
                    group.append(batch)
                if not group:
                    break
                t1 = time.perf_counter()
                progress.step += 1
                lr = learning_rate(progress.step, cfg)
                for g in optimizer.param_groups:
                    g["lr"] = lr
                n_tokens = sum(b["n_tgt_tokens"] for b in group)
                loss_sum = 0.0
                for batch in group:
                    src, tgt_in, tgt_out = (batch[k].to(rt.device, non_blocking=True)
                                            for k in ("src", "tgt_in", "tgt_out"))
                    keep = tgt_out.ne(PAD_ID)
                    with rt.autocast():
                        logits = model(src, tgt_in, keep=keep)  # (N, V): real target positions only
                    loss = sequence_loss(logits, tgt_out[keep], PAD_ID, cfg.label_smoothing)
                    rt.backward(loss / n_tokens)
                    loss_sum += loss.item()
                rt.step(optimizer, model, cfg.clip_norm)
                optimizer.zero_grad(set_to_none=True)
                t2 = time.perf_counter()
                progress.batch_in_epoch += len(group)
                progress.data_seconds += t1 - t0
                progress.compute_seconds += t2 - t1
                progress.target_tokens += n_tokens
                log_loss += loss_sum
                log_tokens += n_tokens
                if not math.isfinite(loss_sum):
                    raise RuntimeError(f"loss is {loss_sum} at step {progress.step}; lower train.lr or use fp32")
                if progress.step % cfg.log_every == 0:
                    now = time.perf_counter()
                    record = {"kind": "train", "step": progress.step, "epoch": progress.epoch + 1,
                              "loss": log_loss / log_tokens, "lr": lr,
                              "tokens_per_s": log_tokens / (now - log_time), "seconds": elapsed()}
                    _append_jsonl(out_dir / "metrics.jsonl", record)
                    log_loss, log_tokens, log_time = 0.0, 0, now
                    emit("step", {**record, "fraction": fraction_done()})
                else:
                    emit("tick", {"step": progress.step, "fraction": fraction_done()})
                stop_reason = _stop_reason(cfg, progress, elapsed())
                if progress.step % cfg.valid_every == 0 or stop_reason:
                    stop_reason = _validate_and_save(
                        model, recipe, tokenizer, valid_batches, valid_data, refs, rt, progress, out_dir,
                        emit, elapsed,
                    ) or stop_reason
                    checkpoint(stop_reason)
                    log_time = time.perf_counter()
                    model.train()
                if stop_reason:
                    break
            if stop_reason is None:
                progress.epoch += 1
                progress.batch_in_epoch = 0
                if cfg.max_epochs and progress.epoch >= cfg.max_epochs:
                    stop_reason = "max_epochs"
                    if progress.history and progress.history[-1]["step"] == progress.step:
                        checkpoint(stop_reason)
                    else:
                        _validate_and_save(model, recipe, tokenizer, valid_batches, valid_data, refs, rt,
                                           progress, out_dir, emit, elapsed)
                        checkpoint(stop_reason)
    except KeyboardInterrupt:
        checkpoint("interrupted")
        raise
    if progress.kept:
        averaged = average_checkpoints([out_dir / "checkpoints" / k for k in progress.kept])
        load_model_weights(model, averaged)
        save_checkpoint(out_dir / "checkpoints" / "averaged.safetensors", model,
                        meta={"recipe": recipe.to_dict(), "averaged": progress.kept})
    result = TrainResult(
        run_dir=str(out_dir), steps=progress.step,
        epochs=progress.epoch + progress.batch_in_epoch / max(1, len(batches)), stop_reason=stop_reason,
        best=progress.best, train_seconds=elapsed(), compute_seconds=progress.compute_seconds,
        data_seconds=progress.data_seconds, target_tokens=progress.target_tokens, device=str(rt.device),
        precision=rt.precision, history=progress.history,
    )
    atomic_write_text(out_dir / "train.json", json.dumps({**asdict(result), "loop_overhead": result.loop_overhead},
                                                         indent=2))
    emit("end", asdict(result))
    return result


def _stop_reason(cfg, progress: Progress, seconds: float) -> str | None:
    if cfg.max_steps and progress.step >= cfg.max_steps:
        return "max_steps"
    if cfg.max_time and seconds >= cfg.max_time * 60:
        return "max_time"
    return None


def _validate_and_save(model, recipe, tokenizer, valid_batches, valid_data, refs, rt, progress, out_dir, emit,
                       elapsed) -> str | None:
    """Validate, write the step / best checkpoints; return "patience" when it is time to stop."""
    cfg = recipe.train
    scores = validate(model, tokenizer, valid_batches, valid_data, refs, recipe, rt,
                      with_bleu=cfg.best_metric == "bleu")
    record = {"kind": "valid", "step": progress.step, "epoch": progress.epoch + 1, **scores, "seconds": elapsed()}
    key, sign = ("bleu", 1.0) if cfg.best_metric == "bleu" else ("loss", -1.0)
    improved = progress.best is None or sign * scores[key] > sign * progress.best[key]
    if improved:
        progress.best = {"step": progress.step, **scores}
        progress.bad_validations = 0
        save_checkpoint(out_dir / "checkpoints" / "best.safetensors", model,
                        meta={"recipe": recipe.to_dict(), "step": progress.step, "valid": scores})
    else:
        progress.bad_validations += 1
    name = f"step_{progress.step:07d}.safetensors"
    if cfg.average_last:
        save_checkpoint(out_dir / "checkpoints" / name, model, meta={"recipe": recipe.to_dict(), "step": progress.step})
        progress.kept.append(name)
        while len(progress.kept) > cfg.average_last:
            (out_dir / "checkpoints" / progress.kept.pop(0)).unlink(missing_ok=True)
    record["best"] = improved
    progress.history.append(record)
    _append_jsonl(out_dir / "metrics.jsonl", record)
    emit("valid", record)
    if cfg.patience and progress.bad_validations >= cfg.patience:
        return "patience"
    return None


def _append_jsonl(path: Path, record: dict) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")



def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records logged after the checkpoint: they are about to be redone."""
    if path.is_file():
        keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        atomic_write_text(path, "".join(line + "\n" for line in keep))
