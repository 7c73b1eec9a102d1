"""Device and precision: autocast, the fp16 gradient scaler, RNG state for exact resume.

precision "auto" is bf16 on a CUDA GPU that supports it, fp16 with a dynamic gradient scaler on
one that does not; on the CPU it is bf16 only where the CPU multiplies bf16 natively (AMX or
AVX512-BF16, confirmed by a ~100 ms matmul probe, since ONEDNN_MAX_CPU_ISA can keep oneDNN
off them), else fp32: elsewhere bf16 autocast is emulated and matmuls run 30-50x slower than
fp32 (measured on a 2-core AVX2 EPYC). bf16 asked for explicitly on such a CPU runs, with a
warning that gives the measured slowdown. Evaluation on the CPU keeps fp32 under "auto", so
scores stay comparable across machines. fp16 on the CPU is refused.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable
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
    reason: str = ""  # why this precision (what "auto" found, or "asked for")
    warning: str | None = None  # a choice likely to be slow here

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, model: nn.Module, clip_norm: float,
             reduce: Callable[[nn.Module], None] | None = None) -> torch.Tensor:
        """Unscale (fp16), clip, step, unless a gradient is not finite (NaN or inf: an
        overflow, a diverging run, a damaged weight): then the update is skipped and the
        optimizer's moments and step count stay as they were. fp16's scaler decides by its own
        rule, which is the same test, and lowers its scale. Returns a 0-dim float tensor on the
        device, 1.0 for a skipped step; without a host sync when the optimizer is fused (its
        kernel reads `found_inf`), with one otherwise. `reduce(model)` first sums the gradients
        over the processes of a distributed run (xformer.training.distributed), so every test below
        sees the same numbers in every process."""
        if reduce is not None:
            reduce(model)
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        if clip_norm > 0:
            norm = nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        else:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros(())
        skipped = norm.isfinite().logical_not().float()
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        elif optimizer.defaults.get("fused"):
            optimizer.found_inf = skipped  # the fused kernel leaves everything as it was when 1
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
        elif not bool(skipped):
            optimizer.step()
        return skipped

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
            return f"device: CUDA ({name}), precision {self.precision}{scaler} ({self.reason})"
        return f"device: CPU ({torch.get_num_threads()} threads), precision {self.precision} ({self.reason})"


def cpu_bf16() -> tuple[bool, str, float | None]:
    """Whether this CPU multiplies bf16 natively: (native, why, bf16 / fp32 matmul time or
    None when not measured). The hardware query decides, the same on a busy machine as on an
    idle one; only where the environment holds oneDNN below some ISA (ONEDNN_MAX_CPU_ISA, as
    the AVX2 emulation does) does a matmul probe say whether bf16 still runs natively: there
    the emulation costs ~100x, far beyond what other work on the machine can blur."""
    return _cpu_bf16_cached()


ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")  # oneDNN's cap on the instructions it uses


@functools.lru_cache(maxsize=1)
def _cpu_bf16_cached() -> tuple[bool, str, float | None]:
    flags = _cpu_bf16_flags()
    if not flags:
        return False, "this CPU has no AMX or AVX512-BF16, so bf16 would be emulated", None
    held = [f"{name}={os.environ[name]}" for name in ISA_LIMITS if os.environ.get(name)]
    if not held:
        return True, f"{' and '.join(flags)}: bf16 matmuls run natively", None
    ratio = bf16_matmul_ratio()
    if ratio < 1.0:
        return True, f"{' and '.join(flags)} ({', '.join(held)}): a bf16 matmul takes {ratio:.2f}x the fp32 time", ratio
    return False, (f"the CPU reports {' and '.join(flags)} but a bf16 matmul took {ratio:.1f}x the fp32 time "
                   f"({', '.join(held)})"), ratio


def _cpu_bf16_flags() -> list[str]:
    query = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.6
    if query is not None:
        caps = query()
        return [name for name in ("amx_bf16", "avx512_bf16") if caps.get(name)]
    try:
        with open("/proc/cpuinfo") as f:
            words = set(f.read().split())
    except OSError:
        return []
    return [name for name in ("amx_bf16", "avx512_bf16") if name in words]


def bf16_matmul_ratio(n: int = 256, repeats: int = 5) -> float:
    """Best-of time of an (n, n) @ (n, n) matmul in bf16 over the same in fp32, on the CPU
    (~100 ms where bf16 is emulated, a few ms where it is native)."""
    a, b = torch.randn(n, n), torch.randn(n, n)

    def best(x, y) -> float:
        x @ y  # warm-up: oneDNN picks and caches its kernel
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            x @ y
            times.append(time.perf_counter() - started)
        return min(times)

    return best(a.bfloat16(), b.bfloat16()) / max(best(a, b), 1e-9)


def resolve_runtime(device: str = "auto", precision: str = "auto", *, training: bool = True) -> Runtime:
    """device auto|cpu|cuda[:N] and precision auto|fp32|bf16|fp16 -> Runtime. `training`
    False (evaluation) keeps "auto" at fp32 on the CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise XformerError(f"device {device}: CUDA is not available here (torch {torch.__version__}); "
                           "use device cpu or auto")
    if device != "cpu" and not device.startswith("cuda"):
        raise XformerError(f"device {device}: expected auto, cpu, cuda or cuda:N")
    dev = torch.device(device)
    if precision != "auto" and precision not in DTYPES:
        raise XformerError(f"precision {precision}: expected auto, fp32, bf16 or fp16")
    if precision == "fp16" and dev.type == "cpu":
        raise XformerError("precision fp16: needs a CUDA device; on the CPU use fp32 or bf16")
    reason, warning = "asked for", None
    if precision == "auto" and dev.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
        precision = "bf16" if supported else "fp16"
        reason = "auto: the GPU supports bf16" if supported else "auto: no bf16 on this GPU: fp16 with a scaler"
    elif precision == "auto" and not training:
        precision, reason = "fp32", "auto: evaluation on the CPU runs in fp32"
    elif precision == "auto":
        native, why, _ = cpu_bf16()
        precision, reason = ("bf16" if native else "fp32"), f"auto: {why}"
    elif precision == "bf16" and dev.type == "cpu":
        native, why, ratio = cpu_bf16()
        if not native:
            ratio = ratio or bf16_matmul_ratio()
            warning = (f"warning: precision bf16 on this CPU is emulated: {why}; a bf16 matmul took {ratio:.0f}x the "
                       "fp32 time here, so training will crawl (train.precision = \"auto\" or --precision fp32 "
                       "picks fp32)")
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    return Runtime(dev, precision, scaler, reason, warning)
