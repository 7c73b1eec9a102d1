"""Decoding engines other than xformer's own search, for `xformer eval --ctranslate2 DIR`:
CTranslate2 (an optional extra) on a model `xformer export --format ctranslate2` wrote. Sources
go in as the run's sentencepiece pieces plus "</s>" (what Marian-converted models read), and
come back as pieces, mapped to the run's ids. Imported packages load only when used."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from xformer.errors import RunError
from xformer.training.checkpoint import read_checkpoint_meta, run_checkpoint
from xformer.training.run_folder import tokenizer_digest

CT2_META = "xformer-ctranslate2.json"  # what export writes beside the converted model


def ctranslate2_meta(model_dir: str | Path) -> dict:
    """The export's record (run, checkpoint, quantization, digests) of a CTranslate2 directory."""
    path = Path(model_dir) / CT2_META
    if not path.is_file():
        raise RunError(f"ctranslate2 {model_dir}: not a directory written by xformer export --format ctranslate2 "
                       f"(no {CT2_META})")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RunError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(meta, dict) or not {"checkpoint", "weights", "tokenizer", "files"} <= set(meta):
        raise RunError(f"{path}: no record of the weights, tokenizer and files it was exported with (an older "
                       "export?); export the run again")
    return meta


def export_record(run_dir: Path, checkpoint: str) -> dict:
    """What ties an export to its run: the checkpoint's name and tensor digest and the tokenizer's."""
    return {"run": str(run_dir), "checkpoint": checkpoint,
            "weights": read_checkpoint_meta(run_checkpoint(run_dir, checkpoint)).get("sha256"),
            "tokenizer": tokenizer_digest(run_dir)}


def file_digests(model_dir: Path) -> dict[str, str]:
    """sha256 of every file an export wrote (its record aside), by name."""
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(model_dir.iterdir())
            if path.is_file() and path.name != CT2_META}


def check_export(model_dir: str | Path, run_dir: str | Path) -> dict:
    """The export's record, once it is shown to be RUN's: the same checkpoint tensors and
    tokenizer as RUN has now, and its files as export wrote them; else a RunError."""
    model_dir, run_dir = Path(model_dir), Path(run_dir)
    meta = ctranslate2_meta(model_dir)
    ours = export_record(run_dir, meta["checkpoint"])
    if meta["weights"] != ours["weights"] or meta["tokenizer"] != ours["tokenizer"]:
        what = "weights" if meta["weights"] != ours["weights"] else "tokenizer"
        other = "other weights" if what == "weights" else "another tokenizer"
        raise RunError(f"ctranslate2 {model_dir}: exported from {meta.get('run')}'s '{meta['checkpoint']}' with "
                       f"{other} than {run_dir} has ({what} digest {str(meta[what])[:16]}, the run's "
                       f"{str(ours[what])[:16]}); export {run_dir} again")
    found = file_digests(model_dir)
    changed = sorted(name for name in {*found, *meta["files"]} if found.get(name) != meta["files"].get(name))
    if changed:
        raise RunError(f"ctranslate2 {model_dir}: {', '.join(changed)} changed, added or missing since export; "
                       f"export {run_dir} again")
    return meta


def ctranslate2_ids(model_dir: str | Path, sources: list[list[int]], pieces: list[str], *, beam: int,
                    lenpen: float, max_len_a: float, max_len_b: int, compute_type: str = "default",
                    batch: int = 64, threads: int = 0) -> list[list[int]]:
    """Translate token-id sources (no EOS) with CTranslate2: ids (no BOS/EOS) per source.
    `pieces` maps ids to the run's piece strings. The length limit is max_len_a * |src| +
    max_len_b of the longest source of each batch (CTranslate2 takes one per batch)."""
    try:
        import ctranslate2
    except ImportError:
        raise RunError("ctranslate2: not installed (pip install ctranslate2)") from None
    translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type=compute_type,
                                        intra_threads=threads)
    index = {p: i for i, p in enumerate(pieces)}
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out: list[list[int]] = [[] for _ in sources]
    for start in range(0, len(order), batch):
        chunk = order[start:start + batch]
        tokens = [[pieces[t] for t in sources[i]] + ["</s>"] for i in chunk]
        longest = max(len(sources[i]) for i in chunk)
        results = translator.translate_batch(tokens, beam_size=beam, length_penalty=lenpen,
                                             max_decoding_length=int(max_len_a * longest + max_len_b),
                                             suppress_sequences=[["<pad>"], ["<s>"]])
        for i, result in zip(chunk, results, strict=True):
            out[i] = [index[p] for p in result.hypotheses[0] if p not in ("</s>", "<s>", "<pad>")]
    return out
