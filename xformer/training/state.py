"""A training run's state and results: TrainState (what a checkpoint saves and --resume
restores, and what the loop reads beside it), TrainResult (train.json), the limits that stop a
run, and a validation with the checkpoints it writes. The loop itself is xformer.train."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from xformer.allocator import release
from xformer.config.schema import Recipe
from xformer.errors import RunError
from xformer.events import Event
from xformer.training.checkpoint import load_model_weights, load_optimizer_state, save_checkpoint
from xformer.training.cpuload import OtherLoad
from xformer.training.device import Runtime
from xformer.training.distributed import Cluster
from xformer.training.optim import WsdPlan
from xformer.training.pauses import Pauses
from xformer.training.progress import LogLine, Progress, StopSignals
from xformer.training.resume import branch_name
from xformer.training.run_card import RunCard
from xformer.training.run_folder import finished_at
from xformer.training.trackers import MetricsLog


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
    loop_seconds: float  # whole training steps: batch, compute, logging (validation excluded)
    tokens: int  # target tokens (translation) or input tokens (classification) trained on
    device: str
    precision: str
    parameters: int = 0
    precision_reason: str = ""  # what precision "auto" found, or "asked for"
    peak_memory_mb: float = 0.0  # CUDA: peak allocated; CPU: peak resident set growth, 0 unless measured
    paused_seconds: float = 0.0  # stopped (SIGSTOP, Ctrl-Z): left out of train_seconds and the times above
    history: list[dict] = field(default_factory=list)
    skipped_steps: int = 0  # not finite, so not taken (Runtime.step)
    card: RunCard | None = None  # what reproducing the run needs (xformer.training.run_card)
    changes: list[dict] = field(default_factory=list)  # what --resume changed, and from which step
    stop_signal: str = ""  # the signal that interrupted it, e.g. "SIGTERM"
    # mean CPU cores other processes took while it trained (xformer.training.cpuload); None: not measurable
    others_cpu: float | None = None
    # train.regularisation = "budget": what it chose and why (xformer.training.budget)
    regularisation: dict | None = None

    def to_dict(self) -> dict:
        """train.json's fields (the card in its JSON form) and the loop overhead."""
        return {**asdict(self), "card": self.card.to_dict() if self.card is not None else {},
                "loop_overhead": self.loop_overhead}

    @property
    def loop_overhead(self) -> float:
        """What the loop adds over forward + backward + step (batching, logging, progress
        events), as a fraction of that compute time; validation is not part of the loop."""
        return self.loop_seconds / max(self.compute_seconds, 1e-9) - 1.0


@dataclass
class TrainState:
    """One part of a run as it trains: what a checkpoint saves and --resume restores (the model,
    the optimizer, the runtime's RNG and loss scale, Progress with the wsd plan and the open log
    line), and what the loop reads beside it. save() and restore() are the only ways in and out."""

    recipe: Recipe  # what trains now: the recipe at this step
    whole: Recipe  # the recipe with every recorded change, as recipe.toml holds it
    out_dir: Path
    cluster: Cluster
    rt: Runtime
    task: object  # the recipe's xformer.tasks.Task
    model: torch.nn.Module
    trained: torch.nn.Module  # the model, or its compiled forward
    optimizer: torch.optim.Optimizer
    stamp: dict  # in every checkpoint: the recipe and the tokenizer's digest
    card: RunCard
    emit: Event
    started: float  # clock() when this part began
    progress: Progress = field(default_factory=Progress)
    seconds_before: float = 0.0  # from earlier parts of a resumed run
    streaks: list[bool] = field(default_factory=list)  # whether each checkpoint fell inside non-finite steps
    line: LogLine | None = None
    plan: WsdPlan | None = None
    others: OtherLoad | None = None  # the CPU other processes take while it trains, from its first step
    memory: object = None  # PeakMemory or allocator_peak
    signals: StopSignals | None = None
    change_at: int | None = None  # a recorded change, replayed: this part ends at its step
    log: MetricsLog | None = None  # metrics.jsonl and the trackers, open across the parts of a run
    clock: Callable[[], float] = time.perf_counter  # what elapsed() and the time budget read (tests inject one)
    pauses: Pauses = field(default_factory=Pauses)  # the stops left out of both clocks (xformer.training.pauses)
    paused_before: float = 0.0  # from earlier parts of a resumed run, like seconds_before
    paused_from: float = 0.0  # pauses.seconds when this part began (`started`)

    def timer(self) -> float:
        """Real seconds with the stops left out: what a step's and a log line's times are read from."""
        return time.perf_counter() - self.pauses.seconds

    def paused(self) -> float:
        """The seconds this run has stood stopped, over all its parts and processes."""
        return self.paused_before + self.pauses.seconds - self.paused_from

    @property
    def last(self) -> Path:
        return self.out_dir / "checkpoints" / "last.safetensors"

    def elapsed(self) -> float:
        return self.seconds_before + self.clock() - self.started

    def fraction_done(self, batches: int) -> float:
        cfg, progress, parts = self.recipe.train, self.progress, [0.0]
        if cfg.max_steps:
            parts.append(progress.step / cfg.max_steps)
        if cfg.max_epochs:
            parts.append((progress.epoch + progress.batch_in_epoch / max(1, batches)) / cfg.max_epochs)
        if cfg.max_time:
            parts.append(self.elapsed() / (cfg.max_time * 60))
        return min(1.0, max(parts))

    def save(self, stop_reason: str | None, now: float, branch: bool = False) -> None:
        """The full state into last, or with `branch` into checkpoints/branch_step_N (kept)."""
        if not self.cluster.writer:
            return
        progress = self.progress
        progress.seconds, progress.paused_seconds = self.elapsed(), self.paused()
        progress.others_cpu_seconds += self.others.take()
        progress.peak_memory_mb = max(progress.peak_memory_mb, self.memory.current_peak_mb)
        progress.log_line = self.line.state(now)
        self.log.flush()  # the trackers hold every record up to the step this checkpoint resumes at
        tensors, extra_meta = self.rt.state()
        meta = {**self.stamp, "progress": asdict(progress), "stop_reason": stop_reason, **extra_meta}
        if branch:
            save_checkpoint(self.last.with_name(branch_name(progress.step)), self.model, meta=meta,
                            optimizer=self.optimizer, extra_tensors=tensors)
            return
        # Inside a run of non-finite steps, `previous` keeps the last checkpoint from before it:
        # the one --resume goes back to if the NaN guard stops the run (xformer.training.resume)
        streak = float(self.line.skipped_run) > 0
        rotate = not (streak and self.streaks[-1])
        save_checkpoint(self.last, self.model, meta=meta, optimizer=self.optimizer, extra_tensors=tensors,
                        previous=self.last.with_name("previous.safetensors") if rotate else None)
        self.streaks.append(streak)

    def restore(self, point, change) -> str | None:
        """--resume: the model, optimizer, progress and RNG as `point` saved them (the recipe's
        optimizer values, not the saved ones); the limit already reached, if any."""
        cfg, tensors, meta = self.recipe.train, point.tensors, point.meta
        if point.why:
            self.emit("warning", {"message": f"{point.why}; resuming from {point.path} (step {point.step}) instead"})
        if change is not None:
            self.emit("setup", {"message": f"from step {point.step}: {change.describe()} (recorded in "
                                           f"{self.out_dir / 'recipe.toml'})"})
        load_model_weights(self.model, tensors, point.path)
        fused = self.optimizer.param_groups[0]["fused"]  # this process's choice, not the saved one
        load_optimizer_state(self.optimizer, tensors, meta)
        for group in self.optimizer.param_groups:
            group.update(betas=tuple(cfg.betas), eps=cfg.adam_eps, fused=fused,
                         weight_decay=cfg.weight_decay if group["weight_decay"] else 0.0)
        saved = dict(meta["progress"])
        saved.setdefault("tokens", saved.pop("target_tokens", 0))  # checkpoints before the rename
        self.progress = Progress(**saved)
        self.rt.load_state(tensors, meta)
        done = limit_reached(cfg, self.progress, self.progress.seconds, len(self.task.train_batches))
        if done and finished_at(self.out_dir, self.progress.step):
            raise RunError(f"{self.out_dir}: the run already stopped by train.{done}; raise that limit "
                           f"(e.g. --set train.{done}=...) to continue it")
        return done  # killed after its last checkpoint, before its average and train.json: finish those


def limit_reached(cfg, progress: Progress, seconds: float, batches_per_epoch: int) -> str | None:
    """The limit that has been reached, if any (checked after every step and on resume)."""
    if cfg.schedule == "wsd" and progress.decay_end and progress.step >= progress.decay_end:
        return progress.decay_limit  # the cooldown planned for that limit is over
    if cfg.max_steps and progress.step >= cfg.max_steps:
        return "max_steps"
    if cfg.max_time and seconds >= cfg.max_time * 60:
        return "max_time"
    if cfg.max_epochs and progress.epoch + progress.batch_in_epoch / batches_per_epoch >= cfg.max_epochs:
        return "max_epochs"
    if cfg.patience and progress.bad_validations >= cfg.patience and not (cfg.schedule == "wsd" and progress.decay_end):
        return "patience"  # with wsd: the stable phase's end (the loop starts the cooldown), never a cooldown's
    return None


def validate_and_save(model, recipe, task, rt, progress, out_dir, emit, elapsed, stamp,
                       log: MetricsLog | None = None) -> None:
    """Validate; write the step checkpoint (kept for averaging) and, on improvement, the best;
    the record to `log` (metrics.jsonl and the run's trackers; metrics.jsonl alone by default)."""
    cfg = recipe.train
    # the tuned heap keeps what it frees (xformer.allocator): hand the training step's free pages
    # back before decoding and the decoder's after, so the two are never resident together; not
    # under bf16 on a CPU, where every step after the trims ran 1.2x slower (an AMX Xeon; fp32 on
    # an AVX2 CPU: no slower, ~4% lower peak RSS; docs/results.md)
    trim = not (rt.device.type == "cpu" and rt.precision == "bf16")
    if trim:
        release()
    scores = task.validate(model, rt)
    if trim:
        release()
    record = {"kind": "valid", "step": progress.step, "epoch": progress.epoch + 1, **scores, "seconds": elapsed()}
    key = recipe.best_metric
    sign = -1.0 if key == "loss" else 1.0
    # a non-finite score (weights gone NaN) is never the best, and a best is never compared with one
    finite = math.isfinite(scores[key])
    kept = progress.best is not None and key in progress.best and progress.best[key] is not None \
        and math.isfinite(progress.best[key])
    improved = finite and (not kept or sign * scores[key] > sign * progress.best[key])
    if improved:
        progress.best = {"step": progress.step, **scores}
        progress.bad_validations = 0
        save_checkpoint(out_dir / "checkpoints" / "best.safetensors", model,
                        meta={**stamp, "step": progress.step, "valid": scores})
    else:
        progress.bad_validations += 1
    name = f"step_{progress.step:07d}.safetensors"
    if cfg.average_last:
        save_checkpoint(out_dir / "checkpoints" / name, model, meta={**stamp, "step": progress.step})
        progress.kept.append(name)
        while len(progress.kept) > cfg.average_last:
            (out_dir / "checkpoints" / progress.kept.pop(0)).unlink(missing_ok=True)
    record["best"] = improved
    progress.history.append(record)
    (log or MetricsLog(out_dir)).write(record)
    emit("valid", record)
