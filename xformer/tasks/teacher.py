"""The teacher of a distilled translation run ([distill], xformer/config/schema.py): opening it (its
tokenizer must be the student's, and is copied into the student's run), its model, and the
corpus of its translations that sequence-level distillation trains on.

Sequence-level KD (Kim & Rush 2016, arXiv:1606.07947): the teacher translates every training
source with beam search, and the student trains on (source, teacher output) pairs instead of
the references. The translations are written once, beside the teacher, as

    TEACHER/distilled/<split>.<checkpoint>.beam<B>.lenpen<L>.jsonl   {src: source, tgt: output}
    ... .json                                                        what they were made from

and reused by every student whose teacher checkpoint (its sha256), sources and beam settings
are the same; anything else makes them anew (atomically: a killed run leaves no half file).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from xformer.config.schema import Recipe
from xformer.data.tokenizer import Tokenizer
from xformer.errors import RecipeError, RunError
from xformer.events import Event
from xformer.files import atomic_write_bytes, atomic_write_text
from xformer.generation.decode import translate_ids
from xformer.training.checkpoint import read_checkpoint_meta, run_checkpoint
from xformer.training.device import Runtime
from xformer.training.run_folder import tokenizer_digest, tokenizer_dir


@dataclass
class Teacher:
    run_dir: Path
    recipe: Recipe  # the teacher's own recipe (its [eval] decodes the distilled corpus)
    model: torch.nn.Module  # in eval mode, frozen
    rt: Runtime  # the teacher's runtime for decoding (fp32 on a CPU)
    checkpoint: str  # the name, e.g. "best"
    sha256: str  # of the checkpoint's tensors

    @torch.no_grad()
    def logits(self, src: torch.Tensor, tgt_in: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """The teacher's output logits for a training batch, shaped as the student's."""
        return self.model(src, tgt_in, keep=keep)


def distilled_corpus(teacher: Teacher, sources: list[str], tokenizer: Tokenizer, split: str, source_lang: str,
                     target_lang: str, beam: int | None, lenpen: float | None, emit: Event) -> Path:
    """The JSONL file of (source, teacher translation) pairs for `sources`, made now or reused."""
    cfg = teacher.recipe.eval
    beam = cfg.beam if beam is None else beam
    lenpen = cfg.lenpen if lenpen is None else lenpen
    folder = teacher.run_dir / "distilled"
    path = folder / f"{split}.{teacher.checkpoint}.beam{beam}.lenpen{lenpen:g}.jsonl"
    made_from = {"checkpoint_sha256": teacher.sha256, "beam": beam, "lenpen": lenpen,
                 "max_len_a": cfg.max_len_a, "max_len_b": cfg.max_len_b, "source_lang": source_lang,
                 "target_lang": target_lang, "n_sources": len(sources),
                 "sources_sha256": hashlib.sha256("\n".join(sources).encode()).hexdigest()}
    about = path.with_suffix(".json")
    if path.is_file() and about.is_file() and json.loads(about.read_text()) == made_from:
        emit("setup", {"message": f"sequence-level distillation: reusing the teacher's translations in {path}"})
        return path
    emit("setup", {"message": f"sequence-level distillation: the teacher translates {len(sources):,} training "
                              f"sources (beam {beam}, lenpen {lenpen:g}) into {path}"})
    ids = tokenizer.encode(sources, "source")
    done = [0]

    def on_batch(n: int) -> None:
        done[0] += n
        emit("distill", {"done": done[0], "total": len(sources)})

    hyps = tokenizer.decode(translate_ids(teacher.model, ids, teacher.recipe, teacher.rt, beam=beam, lenpen=lenpen,
                                          on_batch=on_batch), "target")
    folder.mkdir(exist_ok=True)
    atomic_write_text(path, "".join(json.dumps({source_lang: s, target_lang: h}, ensure_ascii=False) + "\n"
                                    for s, h in zip(sources, hyps, strict=True)))
    atomic_write_text(about, json.dumps(made_from, indent=2))
    return path


SHARED = ("source_lang", "target_lang", "tokenizer", "vocab_size", "joint_vocab", "character_coverage",
          "byte_fallback")  # what a student must have as its teacher had it


def open_teacher(recipe: Recipe, task, rt: Runtime) -> Teacher:
    """The teacher named by the student recipe's [distill], frozen on the student's device;
    `task` is the teacher's (a TranslationTask of its saved recipe). Refused unless it
    translates the same languages with the tokenizer the student's [data] describes."""
    run_dir, teacher_recipe = Path(recipe.distill.teacher), task.recipe
    d = teacher_recipe.data
    if d.task != "translation":
        raise RecipeError(f"distill.teacher: {run_dir} is a {d.task} run; a teacher is a translation run")
    differ = [f"distill.teacher: {run_dir} has data.{k} = {getattr(d, k)!r}, the student {getattr(recipe.data, k)!r}; "
              "a student shares its teacher's tokenizer" for k in SHARED if getattr(d, k) != getattr(recipe.data, k)]
    if differ:
        raise RecipeError(differ)
    model, teacher_rt = task.open_run(run_dir, recipe.distill.checkpoint, device=str(rt.device))
    model.requires_grad_(False)
    meta = read_checkpoint_meta(run_checkpoint(run_dir, recipe.distill.checkpoint))
    return Teacher(run_dir, teacher_recipe, model, teacher_rt, recipe.distill.checkpoint, meta.get("sha256", ""))


def share_tokenizer(teacher_dir: Path, run_dir: Path) -> None:
    """Copy the teacher's tokenizer into the student's run; one already there must be it."""
    mine, theirs = tokenizer_dir(run_dir), tokenizer_dir(teacher_dir)
    if mine.is_dir() and any(mine.glob("*.model")):
        if tokenizer_digest(run_dir) != tokenizer_digest(teacher_dir):
            raise RunError(f"{mine}: not the teacher's tokenizer ({theirs}); a distilled student shares it "
                           "(use another --out)")
        return
    for path in sorted(theirs.iterdir()):
        if path.is_file():
            atomic_write_bytes(mine / path.name, path.read_bytes())
