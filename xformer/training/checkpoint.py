"""Checkpoints: one safetensors file each, written atomically, loaded without unpickling.

Tensors (model weights, optimizer moments, RNG states) are safetensors entries under a
prefix (`model.`, `optim.<param index>.<name>`, `rng.`); everything else (step, epoch, the
recipe, optimizer hyper-parameters, trainer bookkeeping) is JSON in the file's metadata
under the key "xformer". Loading reads tensors and JSON only, so a checkpoint from anywhere
cannot execute code. The metadata holds a sha256 of the tensors (names, dtypes, shapes and
bytes), checked on every read, so a damaged file is named as damaged rather than loaded.

A tensor shared between modules (tied embeddings) is stored once, under its first name;
loading restores the sharing because the model ties the parameters itself.
"""

from __future__ import annotations

import errno
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from xformer.errors import RunError
from xformer.files import atomic_write
from xformer.locks import FolderLock
from xformer.results import AverageResult

FORMAT = "xformer-checkpoint-1"


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict with each shared tensor once (first name wins), contiguous, on the CPU."""
    out, seen = {}, set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def save_checkpoint(
    path: str | Path, model: nn.Module, *, meta: dict[str, Any],
    optimizer: torch.optim.Optimizer | None = None, extra_tensors: dict[str, torch.Tensor] | None = None,
    previous: str | Path | None = None,
) -> None:
    """Write model weights (+ optimizer state, + extra tensors such as RNG states) and the
    JSON-able `meta` to `path`, atomically: a temporary file in the same folder, then rename.
    `previous`: where the checkpoint `path` held goes once the new one is complete."""
    tensors = {f"model.{k}": v for k, v in unique_state_dict(model).items()}
    meta = dict(meta)
    if optimizer is not None:
        state = optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for index, entry in state["state"].items():
            for name, value in entry.items():
                if torch.is_tensor(value):
                    tensors[f"optim.{index}.{name}"] = value.detach().to("cpu").contiguous()
                else:
                    scalars.setdefault(str(index), {})[name] = value
        meta["optimizer"] = {"param_groups": state["param_groups"], "scalars": scalars}
    for name, value in (extra_tensors or {}).items():
        tensors[name] = value.detach().to("cpu").contiguous()
    write_tensors(path, tensors, meta, previous=previous)


def write_tensors(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *,
                  previous: str | Path | None = None) -> None:
    """Write named tensors (`model.*`, `optim.*`, ...) and JSON-able `meta` as an xformer
    checkpoint, atomically, with the tensors' sha256 in the metadata."""
    header = {"format": FORMAT, **meta, "sha256": tensors_digest(tensors)}

    def write(tmp: str) -> None:
        try:
            save_file(tensors, tmp, metadata={"xformer": json.dumps(header)})
        except Exception as exc:  # safetensors reports the OS error inside its own type
            if "code: 28," in str(exc) or "No space left" in str(exc):
                raise OSError(errno.ENOSPC, "No space left on device", str(path)) from None
            raise

    atomic_write(Path(path), write, previous=previous)


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors in name order: each name, dtype, shape and raw bytes."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
    return digest.hexdigest()


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All tensors and the JSON metadata of a checkpoint. Raises RunError naming the file
    when it is missing or not an xformer checkpoint."""
    path = Path(path)
    if not path.is_file():
        raise RunError(f"{path}: no such checkpoint")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = json.loads((f.metadata() or {}).get("xformer", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise RunError(f"{path}: not a readable safetensors checkpoint ({exc})") from None
    if header.get("format") != FORMAT:
        raise RunError(f"{path}: not an xformer checkpoint (format {header.get('format')!r}, expected {FORMAT!r})")
    saved = header.pop("sha256", None)  # checkpoints written before the digest have none
    if saved is not None and tensors_digest(tensors) != saved:
        raise RunError(f"{path}: damaged: its tensors do not match the sha256 written with them")
    return tensors, header


def run_checkpoint(run_dir: str | Path, name: str) -> Path:
    """RUN/checkpoints/<name>.safetensors; a RunError listing the ones there when it is missing."""
    path = Path(run_dir) / "checkpoints" / f"{name}.safetensors"
    if not path.is_file():
        found = sorted(p.stem for p in path.parent.glob("*.safetensors"))
        raise RunError(f"{path}: no such checkpoint (found: {', '.join(found) or 'none'})")
    return path


def read_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """The JSON metadata of a checkpoint without reading its tensors."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads((f.metadata() or {}).get("xformer", "{}"))
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise RunError(f"{path}: not a readable safetensors checkpoint ({exc})") from None


def load_model_weights(model: nn.Module, tensors: dict[str, torch.Tensor], path: str | Path = "checkpoint") -> None:
    """Copy `model.*` tensors into `model`; tied parameters are filled through their first name."""
    weights = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    expected_missing = set(model.state_dict()) - set(unique_state_dict(model))
    missing = [k for k in missing if k not in expected_missing]
    if missing or unexpected:
        raise RunError(f"{path}: weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")


def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    saved = meta["optimizer"]
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    for index, scalars in saved["scalars"].items():
        state.setdefault(int(index), {}).update(scalars)
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of the `model.*` tensors of several checkpoints (Vaswani et al. 2017
    average the last 5 or 20), in float64 to keep the sum exact, cast back to the stored dtype."""
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for path in paths:
        tensors, _ = read_checkpoint(path)
        for k, v in tensors.items():
            if k.startswith("model."):
                total[k] = total[k] + v.double() if k in total else v.double()
                dtypes.setdefault(k, v.dtype)
    return {k: (v / len(paths)).to(dtypes[k]) for k, v in total.items()}


def average_run(run_dir: str | Path, last: int, name: str | None = None) -> AverageResult:
    """Average the model weights of the newest `last` step checkpoints a run kept
    (RUN/checkpoints/step_N.safetensors, train.average_last of them) into
    RUN/checkpoints/<name>.safetensors (default averaged_last<N>), which `xformer eval
    --checkpoint <name>` reads. Never overwrites."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        raise RunError(f"{run_dir}: {'no such run directory' if not Path(run_dir).exists() else 'no checkpoints/ here'}"
                       "; expected a run directory written by xformer train")
    steps = sorted(folder.glob("step_*.safetensors"))
    if not steps and (Path(run_dir) / "imported-from.json").is_file():  # run_folder.IMPORTED
        raise RunError(f"{run_dir}: an imported model has one checkpoint (best) and no step checkpoints to average")
    if last < 1:
        raise RunError(f"last = {last}: expected at least 1 checkpoint")
    if len(steps) < last:
        raise RunError(f"{folder}: {len(steps)} step checkpoints kept, last = {last} asks for more "
                       f"(train.average_last sets how many a run keeps)")
    name = name or f"averaged_last{last}"
    if not name or Path(name).name != name or name.startswith(".") or name in ("best", "last", "averaged", "previous"):
        raise RunError(f"--name {name!r}: expected a plain file name for RUN/checkpoints/NAME.safetensors (no "
                       "folders, not hidden, not best, last, averaged or previous)")
    target = folder / f"{name}.safetensors"
    if target.exists():
        raise RunError(f"{target}: exists; choose another name")
    chosen = steps[-last:]
    with FolderLock(run_dir, "average"):  # not while train writes (and deletes) step checkpoints
        _, meta = read_checkpoint(chosen[-1])
        kept = {k: v for k, v in meta.items() if k in ("recipe", "step", "tokenizer")}
        write_tensors(target, average_checkpoints(chosen), {**kept, "averaged": [p.name for p in chosen]})
    return AverageResult(path=str(target), averaged=[p.name for p in chosen], steps=[int(p.stem[5:]) for p in chosen])
