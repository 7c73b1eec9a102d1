"""HF transformers' MarianMTModel as the quality peer of `xformer bench quality`: built from a
MarianConfig of a recipe's size (nothing downloaded), trained on the recipe's own task for a
wall-clock budget as the HF peer was run (PEER), and scored with `generate`.

    record = train_marian(recipe, out_dir, schedule="wsd", minutes=50)   # best.safetensors, train.json
    scores = score_marian(recipe, out_dir, "test", lenpen=1.6)
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model

from xformer.data.corpus import load_split
from xformer.events import Event, ignore
from xformer.files import atomic_write_text
from xformer.metrics import translation_scores
from xformer.tasks import make_task
from xformer.training.device import resolve_runtime
from xformer.training.progress import append_jsonl

PAD, BOS, EOS = 0, 2, 3
# The HF peer as it was run (its schedule aside: inverse square root, or HF's WSD for marian_wsd)
PEER = {"lr": 7e-4, "betas": (0.9, 0.98), "weight_decay": 1e-4, "warmup_steps": 1000, "clip_norm": 1.0,
        "label_smoothing": 0.1, "activation": "relu", "dropout": 0.1, "wsd_decay_fraction": 0.2}


def marian_model(recipe, vocab_size: int):
    """MarianMTModel of the recipe's size: tied and shared embeddings, sinusoidal positions."""
    from transformers import MarianConfig, MarianMTModel

    m = recipe.model
    config = MarianConfig(vocab_size=vocab_size, d_model=m.d_model, encoder_layers=m.n_encoder_layers,
                          decoder_layers=m.n_decoder_layers, encoder_attention_heads=m.n_heads,
                          decoder_attention_heads=m.n_heads, encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff,
                          max_position_embeddings=m.max_positions, dropout=PEER["dropout"], attention_dropout=0.0,
                          activation_dropout=0.0, activation_function=PEER["activation"], pad_token_id=PAD,
                          eos_token_id=EOS, bos_token_id=BOS, decoder_start_token_id=BOS, forced_eos_token_id=None,
                          scale_embedding=True, share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    return MarianMTModel(config)


def marian_translate(model, sources: list[list[int]], rt, *, beam: int, lenpen: float, max_len_a: float,
                     max_len_b: int, batch: int) -> list[list[int]]:
    """generate() over token-id sources (no EOS), longest first in batches of `batch`; at most
    max_len_a * S + max_len_b new tokens a batch, as xformer's decoder allows; ids in input order."""
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    out: list[list[int]] = [[] for _ in sources]
    model.eval()
    with torch.inference_mode(), rt.autocast():
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            width = max(1, max(len(sources[i]) for i in idx)) + 1
            src = torch.full((len(idx), width), PAD, dtype=torch.long)
            for row, i in enumerate(idx):
                src[row, :len(sources[i]) + 1] = torch.tensor([*sources[i], EOS])
            src = src.to(rt.device)
            searched = {"length_penalty": lenpen, "early_stopping": True} if beam > 1 else {}
            made = model.generate(input_ids=src, attention_mask=src.ne(PAD), num_beams=beam, do_sample=False,
                                  max_new_tokens=int(max_len_a * width + max_len_b), suppress_tokens=[PAD, BOS],
                                  **searched)
            for i, row in zip(idx, made.tolist(), strict=True):
                ids = row[1:]
                out[i] = ids[:ids.index(EOS)] if EOS in ids else ids
    return out


def train_marian(recipe, out_dir: Path, *, schedule: str = "inverse_sqrt", minutes: float, device: str = "auto",
                 emit: Event = ignore, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Train the HF peer on the recipe's task for `minutes` (clock from before the corpus is
    loaded), validating as xformer does; writes out_dir/best.safetensors (the weights with the
    best greedy validation BLEU), metrics.jsonl and train.json; returns train.json's record."""
    from transformers import get_inverse_sqrt_schedule, get_wsd_schedule

    started = clock()
    budget = minutes * 60
    cfg = recipe.train
    rt = resolve_runtime(device, cfg.precision)
    task, model, optimizer = _setup(recipe, out_dir, rt, emit)
    scheduler = get_inverse_sqrt_schedule(optimizer, PEER["warmup_steps"])  # marian_wsd: this until it plans
    step, epoch, best, plan = 0, 0, None, None
    step_seconds, valid_seconds = [], []
    model.train()
    done = False
    mark = clock()  # a step's time runs from the end of what came before it: its batch is inside
    while not done:
        for batch in task.train_batches.iter_epoch(epoch):
            _train_step(model, batch, rt, optimizer)
            scheduler.step()
            step += 1
            now = clock()
            step_seconds.append(now - mark)
            mark = now
            done = now - started >= budget
            emit("tick", {"step": step, "fraction": min(1.0, (now - started) / budget)})
            if step % cfg.valid_every and not done:
                continue
            scores = _validate(model, task, rt, recipe)
            record = {"kind": "valid", "step": step, "epoch": epoch + 1, **scores, "lr": scheduler.get_last_lr()[0],
                      "seconds": clock() - started}
            if best is None or scores["bleu"] > best["bleu"]:
                best = {"step": step, **scores}
                save_model(model, str(out_dir / "best.safetensors"))  # tied weights stored once
            append_jsonl(out_dir / "metrics.jsonl", record)
            emit("valid", record)
            mark = clock()
            valid_seconds.append(mark - now)  # all that a validation step costs over a training step
            if schedule == "wsd" and plan is None and not done:  # HF's WSD needs its steps up front
                plan = _wsd_plan(step, budget - (mark - started), step_seconds, valid_seconds, cfg.valid_every)
                scheduler = get_wsd_schedule(optimizer, plan["warmup"], plan["decay"],
                                             num_stable_steps=plan["stable"], decay_type="1-sqrt")
                for _ in range(step):
                    scheduler.step()
            if done:
                break
        epoch += 1
    record = {"system": "marian_wsd" if schedule == "wsd" else "marian", "stop_reason": "max_time", "steps": step,
              "epochs": step / len(task.train_batches), "train_seconds": clock() - started,
              "precision": rt.precision, "best": best, "plan": plan,
              "parameters": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())}
    atomic_write_text(out_dir / "train.json", json.dumps(record, indent=2))
    return record


def _setup(recipe, out_dir: Path, rt, emit: Event):
    """The recipe's task (corpus, tokenizer, batches) and the peer's model and AdamW, seeded."""
    out_dir.mkdir(parents=True, exist_ok=True)
    task = make_task(recipe)
    task.load(emit)
    task.prepare(out_dir, emit)
    torch.manual_seed(recipe.train.seed)
    model = marian_model(recipe, task.model_sizes()["vocab_size"]).to(rt.device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=PEER["lr"], betas=PEER["betas"], weight_decay=PEER["weight_decay"])
    return task, model, optimizer


def _train_step(model, batch: dict, rt, optimizer) -> None:
    """One optimizer step on a batch: label-smoothed cross-entropy, clipped, in the runtime's precision."""
    src, tgt_in, tgt_out = (batch[k].to(rt.device) for k in ("src", "tgt_in", "tgt_out"))
    with rt.autocast():
        logits = model(input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt_in).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(), ignore_index=PAD,
                           label_smoothing=PEER["label_smoothing"])
    rt.backward(loss)
    rt.step(optimizer, model, PEER["clip_norm"])
    optimizer.zero_grad(set_to_none=True)


def _validate(model, task, rt, recipe) -> dict:
    """Validation NLL a token and cased greedy BLEU / chrF, as xformer validates; back in train mode."""
    model.eval()
    total, tokens = 0.0, 0
    with torch.inference_mode(), rt.autocast():
        for b in task.valid_batches.iter_epoch(0):
            src, tgt_in, tgt_out = (b[k].to(rt.device) for k in ("src", "tgt_in", "tgt_out"))
            logits = model(input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt_in).logits
            total += F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(), ignore_index=PAD,
                                     reduction="sum").item()
            tokens += int(tgt_out.ne(PAD).sum())
    e = recipe.eval
    ids = marian_translate(model, list(task.valid_data["src_ids"]), rt, beam=1, lenpen=1.0, max_len_a=e.max_len_a,
                           max_len_b=e.max_len_b, batch=e.batch_sentences)
    scores = translation_scores(task.tokenizer.decode(ids, "target"), task.refs)
    model.train()
    return {"loss": total / tokens, "bleu": scores["bleu"], "chrf": scores["chrf"]}


def _wsd_plan(step: int, seconds_left: float, step_seconds: list[float], valid_seconds: list[float],
              valid_every: int) -> dict:
    """HF's WSD steps for a time budget: the steps left at the median step time plus a
    validation every `valid_every` steps; warmup capped so the cooldown keeps its share."""
    per_step = statistics.median(step_seconds) + statistics.mean(valid_seconds) / valid_every
    total = step + max(0, int(seconds_left / per_step))
    decay = max(1, round(PEER["wsd_decay_fraction"] * total))
    warmup = max(step, min(PEER["warmup_steps"], total - decay))
    return {"at_step": step, "total": total, "warmup": warmup, "stable": max(0, total - decay - warmup),
            "decay": decay}


def score_marian(recipe, out_dir: Path, split: str, *, lenpen: float, device: str = "auto") -> dict:
    """The peer's best checkpoint on `split` with beam eval.beam: cased BLEU, chrF, hypotheses."""
    rt = resolve_runtime(device, recipe.train.precision, training=False)
    task = make_task(recipe)
    task.load_vocabulary(out_dir)
    d, e = recipe.data, recipe.eval
    rows = load_split(d.dataset, split, [d.source_lang, d.target_lang], d.dataset_config or None, complete=True)
    model = marian_model(recipe, task.tokenizer.vocab_size("source"))
    load_model(model, str(out_dir / "best.safetensors"))
    model.to(rt.device)
    ids = marian_translate(model, task.tokenizer.encode(list(rows[d.source_lang]), "source"), rt, beam=e.beam,
                           lenpen=lenpen, max_len_a=e.max_len_a, max_len_b=e.max_len_b, batch=e.batch_sentences)
    hyps = task.tokenizer.decode(ids, "target")
    return {**translation_scores(hyps, list(rows[d.target_lang])), "hypotheses": hyps}
