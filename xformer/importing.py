"""Import a Hugging Face MarianMTModel as an xformer run (`xformer import hf`): export's inverse.

    import_hf("runs/exported-hf", "runs/imported")            a folder from_pretrained reads
    import_hf("Helsinki-NLP/opus-mt-de-en", "runs/opus")       a Hub id (downloaded; needs a network)

The run folder holds what a trained run holds for eval, translate, inspect-heads and export:
recipe.toml, tokenizer/spm.model, checkpoints/best.safetensors, and imported-from.json (where
the model came from: the Hub id and revision or the folder, every file's sha256, the licence
and attribution its model card states). Nothing is trained; no train.json is written.

Every tensor maps exactly (xformer.export.marian_names, the feature permutation undone), and
only tensors and JSON are read: safetensors, or a pytorch_model.bin through
torch.load(weights_only=True); a config asking for remote code is refused. A model xformer
cannot represent is refused with the config field, file or tensor that stands in the way.

The special ids come from the config's fields (pad_token_id, eos_token_id,
decoder_start_token_id) and the tokenizer's unk_token, and are renumbered to xformer's (pad 0,
unk 1, BOS 2 = the decoder's start, EOS 3; every other id keeps its order): a permutation of the
embedding rows and of final_logits_bias (model.output_bias), so the logits are the checkpoint's,
relabelled. Where the checkpoint's pad is also its decoder's start (the opus-mt models), xformer's
pad gets a row of its own, zero, with an output bias of -1e4 (exp(-1e4) is 0 in float32: the
softmax over the others is unchanged). A model whose ids already are xformer's and whose two
sentencepiece files are one (what `xformer export --format hf` writes) keeps tokenizer/spm.model;
any other gets source.spm, target.spm and the renumbered vocab.json (xformer.data.tokenizer).
Untied embeddings (share_encoder_decoder_embeddings = false: the larger opus-mt models) are
model.tie_embeddings = "decoder" ("none" where the output is untied too).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import sentencepiece
import torch
from safetensors.torch import load_file

from xformer.config.loading import recipe_from_dict
from xformer.config.schema import Recipe
from xformer.data.tokenizer import VOCABULARY
from xformer.errors import RunError
from xformer.export import EMBEDDINGS, MARIAN_ACTIVATION, feature_order, marian_names
from xformer.files import atomic_write_folder
from xformer.tasks import make_task
from xformer.training.checkpoint import save_checkpoint
from xformer.training.run_folder import IMPORTED, mark_run_dir, tokenizer_digest

PAD_BIAS = -1e4  # the output bias of a pad row import adds: exp(-1e4) is 0 in float32
FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "vocab.json", "source.spm", "target.spm",
         "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "README.md", "LICENSE")
ACTIVATION = {marian: ffn for ffn, marian in MARIAN_ACTIVATION.items()}  # Marian's activation_function -> model.ffn
# (share_encoder_decoder_embeddings, tie_word_embeddings) -> model.tie_embeddings
TIES = {(True, True): "all", (False, True): "decoder", (False, False): "none"}
UNUSED = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")  # sinusoids, recomputed


def import_hf(source: str | Path, out_dir: str | Path, *, base: Recipe | None = None,
              overrides: list[str] = ()) -> Path:
    """Write the MarianMTModel at `source` (a local folder, or a Hub id when no such folder
    exists) as the run `out_dir` (new or empty; written in a temporary sibling, then renamed).
    [model] comes from the checkpoint's config; [data], [train] and [eval] from `base` (default:
    xformer's defaults, with the languages of tokenizer_config.json) and `overrides`."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise RunError(f"out {out_dir}: exists and is not an empty directory; choose a new one")
    if any(o.split("=", 1)[0].strip().startswith("model.") for o in overrides):
        raise RunError("--set model.*: an imported model's [model] is its checkpoint's; set [data], [train] or [eval]")
    folder, origin = _resolve(str(source))
    config = _json(folder / "config.json")
    problems = import_problems(config, folder)
    if problems:
        raise RunError([f"{folder}: cannot be an xformer run: {p}" for p in problems])
    tokenizer = _json(folder / "tokenizer_config.json", missing={})
    pieces = _json(folder / "vocab.json")
    unk = tokenizer.get("unk_token") or "<unk>"
    order = relabelling(config, pieces, unk["content"] if isinstance(unk, dict) else unk)
    tensors = read_weights(folder)
    bias = tensors.get("final_logits_bias")
    output_bias = -1 in order or (bias is not None and bool(bias.count_nonzero()))
    recipe = _recipe(config, tokenizer, _json(folder / "generation_config.json", missing={}), base, overrides,
                     output_bias, len(order))  # with import's own pad row, where it adds one
    origin |= _provenance(folder)
    return atomic_write_folder(out_dir, lambda staging: _write_run(staging, folder, recipe, tensors, order, pieces,
                                                                    origin))


def _resolve(source: str) -> tuple[Path, dict]:
    """(the local folder holding the model, {"source", "revision"}): `source` itself when it is
    a folder, else the Hub's snapshot of the model id `source` (its commit as the revision)."""
    path = Path(source)
    if path.is_dir():
        return path, {"source": str(path.resolve()), "revision": None}
    if path.exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        raise RunError(f"{source}: not a folder holding a MarianMTModel, nor a Hub model id (owner/name)")
    from huggingface_hub import snapshot_download  # datasets' own dependency
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        folder = Path(snapshot_download(source, allow_patterns=list(FILES)))
    except (RepositoryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RunError(f"{source}: cannot download from the Hugging Face Hub ({reason})") from None
    return folder, {"source": f"https://huggingface.co/{source}", "revision": folder.name}


def _json(path: Path, missing: dict | None = None) -> dict:
    if not path.is_file():
        if missing is not None:
            return missing
        raise RunError(f"{path}: no such file; a MarianMTModel folder holds it")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunError(f"{path}: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise RunError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def import_problems(config: dict, folder: Path) -> list[str]:
    """Why the checkpoint in `folder` (its config.json as `config`) cannot be an xformer run
    today, each naming the field, file or tensor (empty: it can)."""
    out = []
    if config.get("model_type") != "marian":
        out.append(f"config.json: model_type {config.get('model_type')!r}, expected 'marian' (a MarianMTModel)")
        return out
    if "auto_map" in config:
        out.append("config.json: auto_map asks for the model's own code; xformer never runs code from a checkpoint")
    pairs = (("decoder_attention_heads", "encoder_attention_heads", "model.n_heads"),
             ("decoder_ffn_dim", "encoder_ffn_dim", "model.d_ff"))
    for theirs, ours, field in pairs:
        if config.get(theirs) != config.get(ours):
            out.append(f"config.json: {theirs} {config.get(theirs)} differs from {ours} {config.get(ours)}; "
                       f"{field} is one number for both")
    if config.get("activation_function") not in ACTIVATION:
        out.append(f"config.json: activation_function {config.get('activation_function')!r}; model.ffn has "
                   f"{', '.join(repr(a) for a in ACTIVATION)}")
    if config.get("share_encoder_decoder_embeddings", True) and not config.get("tie_word_embeddings", True):
        out.append("config.json: tie_word_embeddings false with share_encoder_decoder_embeddings true: an output "
                   "matrix of its own beside one shared embedding; model.tie_embeddings has all, decoder or none")
    vocab = config.get("vocab_size")
    if config.get("decoder_vocab_size") not in (None, vocab):
        out.append(f"config.json: decoder_vocab_size {config['decoder_vocab_size']} differs from vocab_size {vocab}; "
                   "one joint vocabulary is what import reads")
    specials = {key: config.get(key) for key in ("pad_token_id", "eos_token_id", "decoder_start_token_id")}
    for key, value in specials.items():
        if not isinstance(value, int) or not 0 <= value < (vocab or 0):
            out.append(f"config.json: {key} {value!r}, expected an id below vocab_size {vocab}")
    if specials["eos_token_id"] in (specials["pad_token_id"], specials["decoder_start_token_id"]):
        out.append(f"config.json: eos_token_id {specials['eos_token_id']} is also the pad or the decoder's start; "
                   "xformer needs EOS apart from both")
    return out + _tokenizer_problems(folder, vocab)


def _tokenizer_problems(folder: Path, vocab_size: int | None) -> list[str]:
    source, target, vocab = folder / "source.spm", folder / "target.spm", folder / "vocab.json"
    missing = [p.name for p in (source, target, vocab) if not p.is_file()]
    if missing:
        return [f"{', '.join(missing)}: no such file; MarianTokenizer's source.spm, target.spm and vocab.json are "
                "what import reads"]
    out = []
    for path in (source, target):
        try:
            sentencepiece.SentencePieceProcessor().Load(model_file=str(path))
        except (OSError, RuntimeError) as exc:
            out.append(f"{path.name}: cannot read as a sentencepiece model ({str(exc).strip()[:200]})")
    pieces = _json(vocab)
    if sorted(pieces.values()) != list(range(len(pieces))):
        out.append("vocab.json: expected its pieces numbered 0 to N-1, each id once")
    elif vocab_size is not None and vocab_size != len(pieces):
        out.append(f"config.json: vocab_size {vocab_size}, but vocab.json has {len(pieces)} pieces")
    return out


def relabelling(config: dict, pieces: dict[str, int], unk_token: str) -> list[int]:
    """The checkpoint's id of each xformer id, in xformer's order (-1: a row import adds): pad,
    unk, the decoder's start (BOS), EOS, then every other id in its order (module docstring)."""
    pad, eos = config["pad_token_id"], config["eos_token_id"]
    start = config.get("decoder_start_token_id", pad)
    unk = pieces.get(unk_token, -1)
    if unk < 0 or unk in (pad, eos, start):
        raise RunError(f"vocab.json: the unknown piece {unk_token!r} is {'missing' if unk < 0 else 'a special id'}; "
                       "xformer needs one apart from pad, EOS and the decoder's start")
    head = [-1 if pad == start else pad, unk, start, eos]
    return head + [i for i in range(config["vocab_size"]) if i not in head]


def _recipe(config: dict, tokenizer: dict, generation: dict, base: Recipe | None, overrides: list[str],
            output_bias: bool, vocab_size: int) -> Recipe:
    """The run's recipe: [model] from config.json, the rest from `base` and `overrides`."""
    shared, tied = (bool(config.get(k, True)) for k in ("share_encoder_decoder_embeddings", "tie_word_embeddings"))
    tie = TIES[shared, tied]
    model = {"arch": "seq2seq", "d_model": config["d_model"], "n_heads": config["encoder_attention_heads"],
             "d_ff": config["encoder_ffn_dim"], "n_encoder_layers": config["encoder_layers"],
             "n_decoder_layers": config["decoder_layers"], "ffn": ACTIVATION[config["activation_function"]],
             "dropout": config.get("dropout", 0.1), "attention_dropout": config.get("attention_dropout", 0.0),
             "activation_dropout": config.get("activation_dropout", 0.0),
             "max_positions": config.get("max_position_embeddings", 512), "positional": "sinusoidal",
             "norm": "layernorm", "norm_position": "post", "norm_eps": 1e-5, "tie_embeddings": tie,
             "scale_embeddings": bool(config.get("scale_embedding", True)), "output_bias": output_bias}
    raw = base.to_dict() if base is not None else {
        "data": {"source_lang": tokenizer.get("source_lang") or "src",
                 "target_lang": tokenizer.get("target_lang") or "tgt"},
        "eval": {"beam": int(generation.get("num_beams") or config.get("num_beams") or 5)},
        "train": {"max_epochs": 1}}  # nothing is trained on import; a fine-tune names its own recipe
    raw.pop("changes", None)
    raw["model"] = model
    data = raw.get("data", {})
    longest = min(data.get("max_len", 256), model["max_positions"] - 1)  # BOS or EOS takes a position
    raw["data"] = {**data, "vocab_size": vocab_size, "joint_vocab": True, "max_len": longest}
    return recipe_from_dict(raw, list(overrides), source="the imported model's recipe")


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: model.safetensors (or the shards its index names), else
    pytorch_model.bin read with torch.load(weights_only=True), which unpickles tensors only."""
    single, index, pickled = folder / "model.safetensors", folder / "model.safetensors.index.json", \
        folder / "pytorch_model.bin"
    if single.is_file():
        return _safetensors(single)
    if index.is_file():
        shards = sorted(set(_json(index).get("weight_map", {}).values()))
        return {k: v for shard in shards for k, v in _safetensors(folder / shard).items()}
    if pickled.is_file():
        try:
            tensors = torch.load(pickled, map_location="cpu", weights_only=True)
        except Exception as exc:  # UnpicklingError, or a damaged file
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RunError(f"{pickled}: refused: not tensors alone ({reason[:200]}); xformer loads no pickled code, "
                           "convert it to model.safetensors") from None
        if not isinstance(tensors, dict) or not all(torch.is_tensor(v) for v in tensors.values()):
            raise RunError(f"{pickled}: expected a state dict of tensors")
        return tensors
    raise RunError(f"{folder}: no model.safetensors nor pytorch_model.bin")


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise RunError(f"{path}: not a readable safetensors file ({exc})") from None


def load_marian_tensors(model, tensors: dict[str, torch.Tensor], d_model: int, order: list[int]) -> None:
    """Copy a MarianMTModel's tensors into the xformer `model` (export.marian_names, the feature
    permutation undone, vocabulary rows renumbered by `order`: relabelling). The tied embedding
    must hold the same matrix under every name present; a tensor left over, or a
    final_logits_bias that is not zero for a model without model.output_bias, is refused by name."""
    inverse = torch.argsort(feature_order(d_model))
    rows = torch.tensor(order)  # -1 picks the row appended below: import's own pad

    def relabel(t: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.cat([t, t.new_full((1, *t.shape[1:]), fill)])[rows]

    unpermute = {"rows": lambda t: t[inverse], "cols": lambda t: t[:, inverse], "": lambda t: t,
                 "row": lambda t: relabel(t[0], PAD_BIAS)}
    names = marian_names(model)
    groups: dict[int, list[str]] = {}  # Marian's names of each tied xformer matrix
    for name, tensor, _ in names:
        if name in EMBEDDINGS:
            groups.setdefault(id(tensor), []).append(name)
    held = {}  # each name -> the name it is read from: the first of its group the checkpoint holds
    for group in groups.values():
        first = next((n for n in group if n in tensors), None)
        if first is None:
            raise RunError(f"no embedding tensor: expected one of {', '.join(group)}")
        for name in group:
            if name in tensors and not torch.equal(tensors[name], tensors[first]):
                raise RunError(f"{name}: differs from {first}; model.tie_embeddings ties them")
            held[name] = first
    bias = tensors.get("final_logits_bias")
    if model.output.bias is None and bias is not None and bias.count_nonzero():
        raise RunError("final_logits_bias: not zero, and the recipe has no model.output_bias")
    if bias is None:
        tensors = {**tensors, "final_logits_bias": torch.zeros(1, len(order) - order.count(-1))}
    with torch.no_grad():
        for name, tensor, axis in names:
            value = tensors[held[name]] if name in held else tensors.get(name)
            if value is None:
                raise RunError(f"{name}: missing from the checkpoint")
            value = unpermute[axis](value)
            if name in EMBEDDINGS:  # one row per id: renumbered
                value = relabel(value, 0.0)
            if value.shape != tensor.shape:
                raise RunError(f"{name}: shape {tuple(value.shape)}, the config's model has {tuple(tensor.shape)}")
            tensor.copy_(value)
    left = set(tensors) - {n for n, _, _ in names} - set(EMBEDDINGS) - {"final_logits_bias", *UNUSED}
    if left:
        raise RunError(f"{sorted(left)[0]}: a tensor xformer's model has no place for ({len(left)} such)")


def _write_run(out: Path, folder: Path, recipe: Recipe, tensors: dict[str, torch.Tensor], order: list[int],
               pieces: dict[str, int], origin: dict) -> None:
    mark_run_dir(out)
    _write_tokenizer(out / "tokenizer", folder, order, pieces)
    recipe.save(out / "recipe.toml")
    task = make_task(recipe)
    task.load_vocabulary(out)
    model = task.build_model(init=False)
    load_marian_tensors(model, tensors, recipe.model.d_model, order)
    (out / "checkpoints").mkdir()
    meta = {"recipe": recipe.to_dict(), "step": 0, "tokenizer": tokenizer_digest(out), "imported": origin}
    save_checkpoint(out / "checkpoints" / "best.safetensors", model, meta=meta)
    (out / IMPORTED).write_text(json.dumps(origin, indent=2) + "\n", encoding="utf-8")


def _write_tokenizer(directory: Path, folder: Path, order: list[int], pieces: dict[str, int]) -> None:
    """spm.model where the checkpoint's ids are the sentencepiece model's own and xformer's (one
    model for both sides); else source.spm, target.spm and vocab.json renumbered by `order`."""
    directory.mkdir()
    source = folder / "source.spm"
    processor = sentencepiece.SentencePieceProcessor(model_file=str(source))
    own = (order == list(range(len(order))) and source.read_bytes() == (folder / "target.spm").read_bytes()
           and (processor.pad_id(), processor.unk_id(), processor.bos_id(), processor.eos_id()) == (0, 1, 2, 3)
           and all(i < processor.get_piece_size() and processor.id_to_piece(i) == p for p, i in pieces.items()))
    if own:
        shutil.copyfile(source, directory / "spm.model")
        return
    names = {i: p for p, i in pieces.items()}
    renumbered = {names[o] if o >= 0 else "<xformer-pad>": x for x, o in enumerate(order)}
    for name in ("source.spm", "target.spm"):
        shutil.copyfile(folder / name, directory / name)
    (directory / VOCABULARY).write_text(json.dumps(renumbered, ensure_ascii=False), encoding="utf-8")


def _provenance(folder: Path) -> dict:
    """The licence and attribution the model card (README.md's front matter) states, and every
    file's sha256."""
    card = folder / "README.md"
    text = card.read_text(encoding="utf-8", errors="replace") if card.is_file() else ""
    front = text.split("---", 2)[1] if text.startswith("---") and text.count("---") >= 2 else ""
    licence = re.search(r"^license:\s*(\S.*)$", front, re.MULTILINE)
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
             if p.is_file() and p.name in FILES}
    return {"licence": licence.group(1).strip().strip("'\"") if licence else "not stated in the model card",
            "attribution": _attribution(text), "files": files}


def _attribution(card: str) -> str:
    """The model card's first heading (opus-mt's name the model and its corpus), else ""."""
    heading = re.search(r"^#+\s*(\S.*)$", card, re.MULTILINE)
    return heading.group(1).strip() if heading else ""
