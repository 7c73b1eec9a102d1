"""Measurement that benchmarks and sweeps ask for, kept out of the training loop's way.

PeakMemory samples the process's resident set in a thread (CPU) or reads the CUDA allocator's
peak; train.run uses it only with measure_memory=True (xformer longrange does, to compare a
Transformer's memory with an LSTM's). allocator_peak is the free default: CUDA's own counter,
nothing on the CPU.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading

import torch


class allocator_peak:  # noqa: N801 - used like a function in a `with`
    """CUDA: peak allocated over the block (tensors only), in MB; CPU: 0 (not measured)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peak_mb = 0.0

    def __enter__(self) -> allocator_peak:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        return self

    @property
    def current_peak_mb(self) -> float:
        if self.device.type == "cuda":
            return (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
        return 0.0

    def __exit__(self, *exc) -> None:
        self.peak_mb = self.current_peak_mb


class PeakMemory:
    """Peak memory of the code inside `with PeakMemory(device) as m:`, in MB (m.peak_mb).

    CUDA: torch.cuda.max_memory_allocated over the block (tensors only, the caching
    allocator's slack excluded). CPU: the peak resident set size of the process above its
    size on entry, sampled every 20 ms by a thread (so a spike shorter than that can be
    missed); where /proc/self/statm is missing (not Linux) it stays 0.
    """

    _INTERVAL = 0.02

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            _release_free_memory()  # else memory freed by earlier work hides this block's growth
            self._base = _rss_bytes()
            if self._base is not None:
                self._thread = threading.Thread(target=self._sample, daemon=True)
                self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self._INTERVAL):
            self._update(_rss_bytes())

    def _update(self, now: int | None) -> None:
        if now is not None:
            self.peak_mb = max(self.peak_mb, (now - self._base) / 2**20)

    @property
    def current_peak_mb(self) -> float:
        if self.device.type == "cuda":
            return (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
        return self.peak_mb

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak_mb = self.current_peak_mb
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._update(_rss_bytes())


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _release_free_memory() -> None:
    """Collect garbage and hand glibc's free heap pages back to the OS (malloc_trim), so the
    resident size on entry is the live size."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
