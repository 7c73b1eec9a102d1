"""The teacher of a distilled translation run ([distill], xformer/config.py): its model, and the
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

from xformer.config import Recipe
from xformer.data.tokenizer import Tokenizer
from xformer.decode import translate_ids
from xformer.events import Event
from xformer.files import atomic_write_text
from xformer.runtime import Runtime


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
