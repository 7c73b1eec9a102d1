"""Device and precision: autocast, the fp16 gradient scaler, RNG state for exact resume.

precision "auto" is bf16 on a CUDA GPU that supports it, fp16 with a dynamic gradient scaler on
one that does not, and fp32 on the CPU. bf16 on the CPU is allowed when asked for explicitly
(CPUs with AMX or AVX512-BF16 run it faster than fp32); fp16 on the CPU is refused.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from xformer.errors import XformerError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Runtime:
    device: torch.device
    precision: str  # fp32 | bf16 | fp16
    scaler: torch.amp.GradScaler | None = None

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module, clip_norm: float) -> None:
        """Unscale (fp16), clip, step; the scaler skips steps whose gradients overflowed."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        if clip_norm > 0:
            nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """RNG states as tensors and the scaler's state as JSON, for checkpoints."""
        tensors = {"rng.torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(self.device)
        meta = {"scaler": self.scaler.state_dict() if self.scaler is not None else None}
        return tensors, meta

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        torch.set_rng_state(tensors["rng.torch"])
        if self.device.type == "cuda" and "rng.cuda" in tensors:
            torch.cuda.set_rng_state(tensors["rng.cuda"], self.device)
        if self.scaler is not None and meta.get("scaler"):
            self.scaler.load_state_dict(meta["scaler"])

    def describe(self) -> str:
        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
            scaler = " with gradient scaler" if self.scaler else ""
            return f"device: CUDA ({name}), precision {self.precision}{scaler}"
        return f"device: CPU ({torch.get_num_threads()} threads), precision {self.precision}"


def resolve_runtime(device: str = "auto", precision: str = "auto") -> Runtime:
    """--device auto|cpu|cuda[:N] and --precision auto|fp32|bf16|fp16 -> Runtime."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise XformerError(f"--device {device}: CUDA is not available here (torch {torch.__version__}); "
                           "use --device cpu or auto")
    if device != "cpu" and not device.startswith("cuda"):
        raise XformerError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    dev = torch.device(device)
    if precision == "auto":
        if dev.type == "cuda":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            precision = "fp32"
    if precision not in DTYPES:
        raise XformerError(f"--precision {precision}: expected auto, fp32, bf16 or fp16")
    if precision == "fp16" and dev.type == "cpu":
        raise XformerError("--precision fp16: needs a CUDA device; on the CPU use fp32 or bf16")
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    return Runtime(dev, precision, scaler)
