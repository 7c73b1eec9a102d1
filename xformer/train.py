"""The training loop: run(recipe, out_dir, on_event=...) -> TrainResult.

A run directory holds everything needed to evaluate or resume:

    RUN/recipe.toml                  the resolved recipe (after --set and CLI overrides), with the
                                     [[changes]] a --resume made (xformer.training.resume)
    RUN/tokenizer/                   sentencepiece model(s), trained here when absent
    RUN/metrics.jsonl                one JSON object per log line and per validation
    RUN/checkpoints/last.safetensors model + optimizer + RNG + progress: --resume starts here
    RUN/checkpoints/previous.safetensors the `last` before it, for --resume when last is damaged
                                     or not finite
    RUN/checkpoints/best.safetensors the best model by validation (train.best_metric)
    RUN/checkpoints/step_N.safetensors the last train.average_last validation checkpoints
    RUN/checkpoints/averaged.safetensors their average, written when training ends
    RUN/checkpoints/branch_step_N.safetensors full states kept every train.branch_every steps
    RUN/train.json                   the TrainResult summary

The run's state, its result and the limits that stop it are xformer.training.state's; this
module is the loop. It reports progress through `on_event(kind, payload)` (kinds: "setup", "start",
"step", "valid", "end") so the CLI can draw progress bars without the core importing rich.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import time
from dataclasses import replace
from pathlib import Path

import torch

from xformer.config.loading import load_run_recipe, recipe_at
from xformer.config.schema import Recipe
from xformer.errors import DivergedError, RunError
from xformer.events import Event, ignore
from xformer.files import atomic_write_text, finite_json
from xformer.locks import FolderLock, check_free
from xformer.model.dropout import use_fast_dropout
from xformer.model.flex import cannot_train as flex_cannot_train
from xformer.tasks import make_task
from xformer.training import cpuload
from xformer.training.budget import fit_run, in_hindsight
from xformer.training.checkpoint import average_checkpoints, load_model_weights, save_checkpoint
from xformer.training.compiling import compiled_forward
from xformer.training.cpuload import OtherLoad
from xformer.training.device import Runtime, resolve_runtime
from xformer.training.distributed import Cluster, cluster_from_env
from xformer.training.measure import PeakMemory, allocator_peak
from xformer.training.optim import WsdPlan, build_optimizer, learning_rate
from xformer.training.pauses import Pauses
from xformer.training.progress import LogLine, Progress, StopSignals, truncate_metrics
from xformer.training.resume import (
    has_checkpoint,
    init_weights,
    prepare_run_dir,
    resume_point,
    resumed_recipe,
    set_aside,
    start_from_another,
)
from xformer.training.run_card import run_card
from xformer.training.run_folder import disk_full_error, out_of_memory_error, remove_temporaries, tokenizer_digest
from xformer.training.state import TrainResult, TrainState, limit_reached, validate_and_save
from xformer.training.trackers import MetricsLog, Reporting, flat_params

clock = time.perf_counter  # the run's time budget is read from it (tests pass their own)
PLANNED = {"schedule", "max_steps", "max_epochs", "max_time", "decay_fraction", "patience"}  # a change: plan anew


def run(
    recipe: Recipe, out_dir: str | Path, *, device: str = "auto", resume: bool = False,
    overwrite: bool = False, on_event: Event | None = None, recipe_path: str | Path | None = None,
    measure_memory: bool = False, branch_from: str | Path | None = None, at_step: int | None = None,
    reporting: Reporting = Reporting(), init: str | Path | None = None, init_checkpoint: str | None = None,
) -> TrainResult:
    """Train the recipe's model into `out_dir`; see the module docstring for what is written.
    `recipe_path` is the file the recipe was read from: never written to, and never inside a
    run directory that `overwrite` would clear. `measure_memory`: on the CPU, sample the
    resident set in a thread (instrument.PeakMemory) for TrainResult.peak_memory_mb; without
    it the CPU figure is 0 and CUDA's comes from the allocator's own peak counter.
    `branch_from` / `at_step`: out_dir starts as that run stood at that step (resume.branch),
    and trains on with this recipe's values, recorded as a change at that step.
    `reporting`: the trackers each log line and validation also go to (xformer.training.trackers).
    `init`: a new run whose first weights and tokenizer are that run's `init_checkpoint` (default:
    its eval.checkpoint), trained from step 0 with a fresh optimizer (a fine-tune; resume.init_from).

    Started by torchrun (WORLD_SIZE > 1), every process calls this; see xformer.training.distributed."""
    cluster = cluster_from_env(device, recipe.train.accumulate_steps)
    resume = start_from_another(cluster, out_dir, recipe, on_event or ignore, resume=resume, overwrite=overwrite,
                                recipe_path=recipe_path, branch_from=branch_from, at_step=at_step, init=init,
                                init_checkpoint=init_checkpoint)
    log, result = MetricsLog(Path(out_dir), reporting, on_event, cluster.writer), None
    try:
        with contextlib.ExitStack() as hold:  # the run folder's lock, once _run takes it
            pauses = hold.enter_context(Pauses())
            result = _run(recipe, Path(out_dir), cluster, device=device, resume=resume, overwrite=overwrite,
                          emit=on_event or ignore, recipe_path=recipe_path, measure_memory=measure_memory, hold=hold,
                          log=log, pauses=pauses)
            while result.stop_reason == "change":  # a recorded change is due: continue as --resume did
                result = _run(load_run_recipe(out_dir), Path(out_dir), cluster, device=device, resume=True,
                              overwrite=False, emit=on_event or ignore, recipe_path=None,
                              measure_memory=measure_memory, hold=hold, locked=True, log=log, pauses=pauses)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise disk_full_error(exc, Path(out_dir)) from None
    except torch.OutOfMemoryError as exc:  # no checkpoint is written: the last one stays as it was
        raise out_of_memory_error(exc, recipe, device, Path(out_dir)) from None
    finally:  # the trackers' runs end with this process's part of the run, however it ends
        log.close(finished=result is not None and result.stop_reason != "interrupted")
    cluster.close()  # not on an exception: torchrun stops the processes still waiting
    return result


def _run(recipe: Recipe, out_dir: Path, cluster: Cluster, *, device: str, resume: bool, overwrite: bool,
         emit: Event, recipe_path: str | Path | None, measure_memory: bool, hold: contextlib.ExitStack,
         log: MetricsLog, pauses: Pauses, locked: bool = False) -> TrainResult:
    """One part of a run: all of it, or up to a recorded change (run() goes on from there with
    `locked`: the run folder's lock, in `hold`, is already this process's)."""
    state, point, stop_reason = _open(recipe, out_dir, cluster, device=device, resume=resume, overwrite=overwrite,
                                      emit=emit, recipe_path=recipe_path, hold=hold, locked=locked, pauses=pauses)
    state.log = log
    _begin(state, point, resume, measure_memory)
    with state.signals, state.memory:
        while stop_reason is None:
            stop_reason = _epoch(state)
    return _close(state, stop_reason)


def _open(recipe: Recipe, out_dir: Path, cluster: Cluster, *, device: str, resume: bool, overwrite: bool,
          emit: Event, recipe_path: str | Path | None, hold: contextlib.ExitStack, locked: bool, pauses: Pauses):
    """Setup: the run folder checked and locked, the runtime, the task's data and tokenizer, the
    model and optimizer, and the state a resume restores. Bad input fails before minutes of work.
    Its times leave out the seconds the process stood stopped (`pauses`)."""
    running, paused_from = pauses.leave_out(clock), pauses.seconds
    started = running()
    if cluster.writer and not locked:
        check_free(out_dir)  # another writer first: it explains any other refusal below
    recipe_path = Path(recipe_path) if recipe_path is not None else None
    where = dict(resume=resume, overwrite=overwrite, recipe_path=recipe_path)
    prepare_run_dir(out_dir, recipe, **where, check_only=True)  # before minutes of data loading
    resumable = resume and has_checkpoint(out_dir)
    point, change = resume_point(out_dir) if resumable else None, None
    if resumable:  # the recipe with its changes, recorded; what trains now is the recipe at this step
        recipe, change = resumed_recipe(out_dir, recipe, point)
    whole, recipe = recipe, recipe_at(recipe, point.step if point else 0)
    cfg = recipe.train
    rt: Runtime = resolve_runtime(device, cfg.precision)  # bad input fails before the run dir is touched
    flex = recipe.model.arch != "lstm" and recipe.model.attention_backend == "flex"
    if flex and flex_cannot_train(rt.device.type):
        raise RunError(f"model.attention_backend = 'flex': {flex_cannot_train(rt.device.type)}")
    if cluster.writer and not locked:  # one writer a run folder, until run() returns (rank 0 under torchrun)
        hold.enter_context(FolderLock(out_dir, "train"))
    task = make_task(recipe)
    if recipe.distill.teacher:  # a teacher that cannot teach fails before minutes of data loading
        task.use_teacher(load_run_recipe(recipe.distill.teacher), rt)
    task.load(emit)
    card = run_card(whole, rt, recipe.data.fingerprints())
    removed = prepare_run_dir(out_dir, recipe, **where) if cluster.writer else []
    _announce(out_dir, cluster, rt, emit, removed, resume and not resumable)
    torch.manual_seed(cfg.seed)

    # the tokenizer is trained once, by process 0; the others then read it
    if cluster.writer:
        task.prepare(out_dir, emit)
    cluster.barrier()
    if not cluster.writer:
        task.prepare(out_dir, ignore)
    fitted = None
    if cfg.regularisation == "budget" and not resumable:  # chosen once; a resumed run has its recipe.toml's
        left = cfg.max_time * 60 - (running() - started) if cfg.max_time else 0.0
        recipe, whole, fitted = fit_run(recipe, whole, task, rt, cluster, left, out_dir, running, emit)
        card = run_card(whole, rt, recipe.data.fingerprints())

    # the model, its optimizer, and its compiled forward where asked (tried on the first batch)
    model = task.build_model()
    if not resumable:
        init_weights(model, out_dir)  # `train --init-from`: the weights it names
    model = use_fast_dropout(model, recipe.train.fast_paths).to(rt.device)
    optimizer = build_optimizer(model, recipe.train)
    trained = model
    if recipe.train.compile:
        first = next(iter(task.train_batches.iter_epoch(0)))
        trained = compiled_forward(model, lambda forward: rt.backward(task.loss(forward, first, rt)), rt, emit)
    state = TrainState(recipe=recipe, whole=whole, out_dir=out_dir, cluster=cluster, rt=rt, task=task, model=model,
                       trained=trained, optimizer=optimizer, card=card, emit=emit, started=started, clock=running,
                       stamp={"recipe": whole.to_dict(), "tokenizer": tokenizer_digest(out_dir)},
                       progress=Progress(regularisation=fitted), pauses=pauses,
                       paused_from=paused_from)
    stop_reason = state.restore(point, change) if resumable else None
    return state, point, stop_reason


def _announce(out_dir: Path, cluster: Cluster, rt: Runtime, emit: Event, removed: list[str], restart: bool) -> None:
    """What setup did and chose: what --overwrite removed, the runtime, a resume from step 0."""
    if removed:
        emit("setup", {"message": f"--overwrite removed {', '.join(removed)} from {out_dir}"})
    emit("setup", {"message": rt.describe() + (f", process {cluster.rank} of {cluster.world}" if cluster.world > 1
                                               else "")})
    if rt.warning:
        emit("warning", {"message": rt.warning})
    if restart:
        emit("warning", {"message": f"{out_dir}: no checkpoint yet (stopped before its first one): "
                                    "training from step 0"})


def _begin(state: TrainState, point, resume: bool, measure_memory: bool) -> None:
    """What a (resumed) run writes before its first step, and the plan it trains to."""
    out_dir, progress, whole, cfg = state.out_dir, state.progress, state.whole, state.recipe.train
    history, logged_to = [], -1
    if state.cluster.writer:
        if resume:
            history, logged_to = truncate_metrics(out_dir / "metrics.jsonl", progress.step)
            stray = remove_temporaries(out_dir)
            if stray:
                state.emit("setup", {"message": f"removed what a killed run left half-written: {', '.join(stray)}"})
        aside = set_aside(point) if point else None
        if aside:
            state.emit("setup", {"message": f"kept the non-finite checkpoint as {aside}"})
        saved = out_dir / "recipe.toml"  # as resolved, new limits and changes included
        if not saved.is_file() or saved.read_text(encoding="utf-8") != whole.to_toml():
            atomic_write_text(saved, whole.to_toml())
        state.log.start(history, logged_to, progress.step, flat_params(whole.to_dict()), state.card.to_dict())
    batches = len(state.task.train_batches)
    state.signals = StopSignals()
    state.emit("start", {"steps_per_epoch": batches // cfg.accumulate_steps, "step": progress.step,
                         "parameters": _parameters(state.model), "run_dir": str(out_dir)})
    state.seconds_before = progress.seconds
    state.paused_before = progress.paused_seconds
    state.change_at = whole.next_change(progress.step)
    taking_effect = [k.split(".")[1] for c in whole.changes if point and c.step == point.step for k in c.set]
    if PLANNED.intersection(taking_effect):  # a change (made now, or replayed) to what a wsd cooldown is planned from
        progress.decay_start, progress.decay_end, progress.decay_limit = 0, 0, ""
    state.plan = WsdPlan(cfg, -(-batches // cfg.accumulate_steps), progress, state.cluster, state.rt.device)
    state.line = LogLine(state.rt.device, progress.log_line, state.timer)
    state.streaks = [float(state.line.skipped_run) > 0]
    state.others = OtherLoad()
    state.model.train()
    state.memory = PeakMemory(state.rt.device) if measure_memory else allocator_peak(state.rt.device)


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _epoch(state: TrainState) -> str | None:
    """Train the rest of the current epoch; the reason the run stops, if it does inside it."""
    progress, cfg = state.progress, state.recipe.train
    epoch = state.task.train_batches.iter_epoch(progress.epoch, skip=progress.batch_in_epoch)
    while True:
        t0 = state.timer()
        group = list(itertools.islice(epoch, cfg.accumulate_steps))
        if not group:
            break
        t1 = state.timer()
        progress.step += 1
        lr = learning_rate(progress.step, cfg, _cooldown(state))
        step = _step(state, group, lr)
        t2 = state.timer()
        progress.data_seconds += t1 - t0
        progress.compute_seconds += t2 - t1
        state.plan.measure(state.elapsed())
        stop_reason = _boundary(state, step, lr, t0, t2)
        if stop_reason:
            return stop_reason
    progress.epoch += 1
    progress.batch_in_epoch = 0
    return None


def _cooldown(state: TrainState) -> tuple[int, int] | None:
    window, began = state.plan.window(state.elapsed())
    if began:
        state.emit("setup", {"message": began})
    return window


def _step(state: TrainState, group: list, lr: float) -> tuple:
    """One optimizer step over `group` (accumulate_steps batches, shared out among the processes):
    this process's summed loss, whether the step was skipped (not finite), and the units and
    tokens it averaged over."""
    cfg, task, rt, cluster = state.recipe.train, state.task, state.rt, state.cluster
    for g in state.optimizer.param_groups:
        g["lr"] = lr
    n_units = sum(task.units(b) for b in group)  # what the loss is averaged over, all processes
    n_tokens = sum(task.tokens(b) for b in group)
    step_loss = torch.zeros((), device=rt.device)
    for batch in cluster.shard(group):
        loss = task.loss(state.trained, batch, rt)
        rt.backward(loss / n_units)
        step_loss = step_loss + loss.detach()
    skipped = rt.step(state.optimizer, state.model, cfg.clip_norm, reduce=cluster.reduce_gradients)  # 1.0: not finite
    state.optimizer.zero_grad(set_to_none=True)
    state.progress.batch_in_epoch += len(group)
    state.progress.tokens += n_tokens
    return step_loss, skipped, n_units, n_tokens


def _log(state: TrainState, stop_reason: str | None, lr: float, now: float, step: tuple) -> None:
    """The step into the open log line; the line written when due (by steps, by the clock, or at
    the run's end); the NaN guard."""
    progress, cfg, line = state.progress, state.recipe.train, state.line
    line.add(*step)
    logged = line.due(progress.step, cfg.log_every, cfg.log_seconds, now) or stop_reason not in (None, "interrupted")
    batches = len(state.task.train_batches)
    if logged:
        fields, skips = line.close(now)
        record = {"kind": "train", "step": progress.step, "epoch": progress.epoch + 1, "loss": fields["loss"],
                  "lr": lr, "tokens_per_s": fields["tokens_per_s"], "seconds": state.elapsed()}
        if skips:
            record["skipped"] = skips
            progress.skipped_steps += skips
        state.log.write(record)
        state.emit("step", {**record, "fraction": state.fraction_done(batches)})
    else:
        state.emit("tick", {"step": progress.step, "fraction": state.fraction_done(batches)})
    # a host sync: every step on the CPU (free there), at log lines elsewhere
    if (logged or state.rt.device.type == "cpu") and int(line.skipped_run) > cfg.max_nonfinite_steps:
        state.save("nonfinite", state.timer())  # the skipped steps left the weights as they were
        scale = f", loss scale {state.rt.scaler.get_scale():g}" if state.rt.scaler is not None else ""
        raise DivergedError(f"train.max_nonfinite_steps: the loss or gradients were not finite for "
                            f"{int(line.skipped_run)} steps in a row, up to step {progress.step}{scale}; "
                            "lower train.lr, raise train.warmup_steps, set train.clip_norm (e.g. 1.0) "
                            "or train in fp32, then --resume", step=progress.step)


def _boundary(state: TrainState, step: tuple, lr: float, started: float, now: float) -> str | None:
    """After a step: what all processes agree on (the stop reason, the summed loss), the log line,
    validation and checkpoints where due (a validation step, the run's end), a branch point;
    returns the stop reason (patience and time are process 0's word)."""
    progress, cfg, task = state.progress, state.recipe.train, state.task
    # A signal is acted on at a step boundary, so the checkpoint resumes exactly; one that lands
    # on a validation step lets that validation and its step checkpoint happen first, so the
    # resumed run averages what an uninterrupted one would.
    stop_reason, step_loss = state.cluster.agree(limit_reached(cfg, progress, state.elapsed(), len(task.train_batches)),
                                                 bool(state.signals.received), step[0])
    if stop_reason is None and progress.step == state.change_at:  # run() goes on with the recipe changed
        stop_reason = "change"
    _log(state, stop_reason, lr, now, (step_loss, *step[1:]))
    boundary = state.timer()
    progress.loop_seconds += boundary - started
    interrupted = stop_reason in ("interrupted", "change")  # a checkpoint, no final validation
    final = stop_reason is not None and not interrupted
    if progress.step % cfg.valid_every == 0 or final:
        # a length curriculum's steps are checkpointed but not validated: scores at max_len say
        # nothing about a model still training on shorter examples
        if progress.step >= task.curriculum_steps or final:
            if stop_reason == "interrupted":
                state.emit("setup", {"message": f"finishing the validation of step {progress.step} first "
                                                "(a second interrupt stops at once)"})
            if state.cluster.writer:
                validate_and_save(state.model, state.recipe, task, state.rt, progress, state.out_dir, state.emit,
                                   state.elapsed, state.stamp, state.log)
            if not interrupted:
                reason = limit_reached(cfg, progress, state.elapsed(), len(task.train_batches))
                stop_reason, _ = state.cluster.agree(reason, False, torch.zeros((), device=state.rt.device))
                if stop_reason == "patience" and cfg.schedule == "wsd":  # it ends the stable phase
                    state.emit("setup", {"message": state.plan.cool_down_now()})
                    stop_reason = None
        state.save(stop_reason, boundary)
        state.line.pause(state.timer() - boundary)  # validation is not training time
        state.model.train()
    elif interrupted:
        state.save(stop_reason, boundary)
    if cfg.branch_every and progress.step % cfg.branch_every == 0:  # a point to branch from
        state.save(stop_reason, boundary, branch=True)
    return stop_reason


def _close(state: TrainState, stop_reason: str | None) -> TrainResult:
    """The run's end: its averaged checkpoint, the TrainResult and train.json."""
    progress, out_dir, cluster, batches = state.progress, state.out_dir, state.cluster, len(state.task.train_batches)
    progress.peak_memory_mb = max(progress.peak_memory_mb, state.memory.current_peak_mb)
    if stop_reason != "interrupted" and progress.step == state.change_at:  # a limit the change raised: go on
        stop_reason = "change"
    if progress.kept and cluster.writer:
        averaged = average_checkpoints([out_dir / "checkpoints" / k for k in progress.kept])
        load_model_weights(state.model, averaged)
        save_checkpoint(out_dir / "checkpoints" / "averaged.safetensors", state.model,
                        meta={**state.stamp, "averaged": progress.kept})
    epochs = progress.epoch + progress.batch_in_epoch / max(1, batches)
    result = TrainResult(
        run_dir=str(out_dir), steps=progress.step, epochs=epochs,
        stop_reason=stop_reason, best=progress.best, train_seconds=state.elapsed(),
        compute_seconds=progress.compute_seconds, data_seconds=progress.data_seconds,
        loop_seconds=progress.loop_seconds, tokens=progress.tokens, device=str(state.rt.device),
        precision=state.rt.precision, precision_reason=state.rt.reason, parameters=_parameters(state.model),
        peak_memory_mb=progress.peak_memory_mb, paused_seconds=state.paused(), history=progress.history,
        skipped_steps=progress.skipped_steps,
        card=replace(state.card, wall_seconds=state.clock() - state.started, processes=cluster.world),
        stop_signal=state.signals.name, changes=state.whole.to_dict().get("changes", []),
        regularisation=in_hindsight(progress.regularisation, epochs, stop_reason, state.emit),
        # under torch.distributed the other processes are this run's own: not measured
        others_cpu=progress.others_cpu_seconds / progress.seconds
        if state.others.available and progress.seconds >= cpuload.MIN_SECONDS and cluster.world == 1 else None,
    )
    if cluster.writer:
        atomic_write_text(out_dir / "train.json",
                          finite_json(result.to_dict(), indent=2))
    state.emit("end", {k: v for k, v in result.to_dict().items() if k != "loop_overhead"})
    return result
