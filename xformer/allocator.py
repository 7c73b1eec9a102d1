"""glibc malloc and PyTorch's CPU allocations tuned for training: large tensors reuse the heap,
on transparent huge pages, instead of a fresh mmap faulted in page by page.

glibc serves every allocation above its mmap threshold (128 KiB, rising to 32 MiB at most) with
a fresh mmap, zero-filled page by page on first touch and unmapped on free. A training step
allocates and frees the same large tensors again and again (a 4,096-token batch's logits over
8,000 words are 131 MB), so the process spends its time taking minor page faults in the kernel:
8-10% of a flagship training step's CPU time on a 2-core AVX2 EPYC in fp32, ~50% and 172,000
faults a second reported on an AMX Xeon in bf16 (docs/results.md, "Memory allocator").

tune_allocator() changes that for this process (mallopt through ctypes) and, through the
variables glibc and PyTorch read at start-up, for every process it starts (torchrun workers, the
peers of `bench peers`):

    M_MMAP_MAX            0        no chunk is mmap'ed: large blocks come from the heap and are reused
    M_TRIM_THRESHOLD      256 MiB  the heap keeps up to 256 MiB free at its top, and gives back more
    M_TOP_PAD             64 MiB   the heap grows in 64 MiB steps (untouched pages cost nothing)
    THP_MEM_ALLOC_ENABLE  1        PyTorch page-aligns each CPU tensor of 2 MiB or more and asks
                                   for transparent huge pages for it (madvise), so memory the heap
                                   takes back costs one fault per 2 MiB, not 512; set only where the
                                   kernel offers them (/sys/kernel/mm/transparent_hugepage)

The heap alone kept up to 1.55x the resident memory of glibc's defaults (freed blocks between
live ones stay resident); with the smaller trim and huge pages the peak is 0.87-1.01x glibc's in
bf16, for 2% of its page faults, but a flagship training run in fp32 still peaked at 1.38x
(docs/results.md, "Memory allocator"). PyTorch reads THP_MEM_ALLOC_ENABLE at its first CPU
allocation, so the tuning must come before the first tensor: the xformer command calls it at
start-up; a library user calls it once, before any tensor. XFORMER_ALLOCATOR=system leaves glibc
and PyTorch as they are (an environment variable, not a recipe field: the allocator changes
speed, never a result). Where glibc is not the C library, or another allocator is preloaded
(LD_PRELOAD of tcmalloc or jemalloc), nothing is changed. allocator() says what is in effect, for
the run card; release() gives the free pages back between the runs of a grid.
"""

from __future__ import annotations

import ctypes
import os
import platform

from xformer.errors import XformerError

ENV = "XFORMER_ALLOCATOR"  # "tuned" (the default) or "system"
# mallopt's parameter numbers (glibc's malloc.h) and the values tune_allocator sets
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
PARAMETERS = {"M_MMAP_MAX": M_MMAP_MAX, "M_TRIM_THRESHOLD": M_TRIM_THRESHOLD, "M_TOP_PAD": M_TOP_PAD}
HUGE_PAGES = "THP_MEM_ALLOC_ENABLE"  # PyTorch's (c10's alloc_cpu), read at its first CPU allocation
SETTINGS = {"M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": 256 * 2**20, "M_TOP_PAD": 64 * 2**20, HUGE_PAGES: 1}
# the start-up variables for the same settings (children read them before any allocation)
VARIABLES = {"M_MMAP_MAX": "MALLOC_MMAP_MAX_", "M_TRIM_THRESHOLD": "MALLOC_TRIM_THRESHOLD_",
             "M_TOP_PAD": "MALLOC_TOP_PAD_", HUGE_PAGES: HUGE_PAGES}
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
PRELOADED = ("tcmalloc", "jemalloc", "mimalloc")

_applied: dict | None = None  # what tune_allocator did in this process


def tune_allocator() -> dict:
    """Tune glibc malloc and PyTorch's CPU tensors for this process and the processes it starts
    (module docstring); returns allocator(). Call it before the first tensor (PyTorch reads its
    huge-page switch once, at its first CPU allocation). Idempotent; a no-op under
    XFORMER_ALLOCATOR=system, off glibc, or with another allocator preloaded. Settings the user
    gave in MALLOC_*_ variables or THP_MEM_ALLOC_ENABLE are kept."""
    global _applied
    state = allocator()
    if state["tuned"] or state["reason"] != "":
        return state
    libc = ctypes.CDLL(None)
    settings = {}
    for name, value in wanted().items():
        given = os.environ.get(VARIABLES[name])
        if given is not None:  # the user's own: glibc read it at start-up, PyTorch reads it later
            settings[name] = int(given) if given.isdigit() else given
            continue
        if name in PARAMETERS and libc.mallopt(PARAMETERS[name], value) != 1:
            raise OSError(f"mallopt({name}, {value}) failed")
        os.environ[VARIABLES[name]] = str(value)
        settings[name] = value
    _applied = settings
    return allocator()


def wanted() -> dict:
    """SETTINGS as this machine can take them: huge pages only where the kernel offers them."""
    return {k: v for k, v in SETTINGS.items() if k != HUGE_PAGES or transparent_huge_pages() in ("always", "madvise")}


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or "unavailable"."""
    try:
        with open(THP_MODE) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    chosen = text[text.find("[") + 1:text.find("]")] if "[" in text else ""
    return chosen or "unavailable"


def release() -> bool:
    """Return the heap's free pages to the OS (glibc's malloc_trim), where tune_allocator keeps
    them: between the runs of a grid in one process (experiment, longrange), so one run's freed
    memory does not stay resident beside the next run's. Returns whether anything was trimmed;
    a no-op untuned (glibc trims by itself then) and off glibc."""
    if not allocator()["tuned"]:
        return False
    return bool(ctypes.CDLL(None).malloc_trim(0))


def allocator() -> dict:
    """The C library's allocator and what xformer set in it: {"name", "tuned", "settings",
    "reason", "transparent_huge_pages"}; reason says why it is left as it is ("" when tuned or
    tunable); the last is the kernel's mode, which decides whether THP_MEM_ALLOC_ENABLE is set."""
    return {**_state(), "transparent_huge_pages": transparent_huge_pages()}


def _state() -> dict:
    name, version = platform.libc_ver()
    preload = os.environ.get("LD_PRELOAD", "")
    other = next((a for a in PRELOADED if a in preload), None)
    if other is not None:
        return {"name": other, "tuned": False, "settings": {}, "reason": f"preloaded: LD_PRELOAD={preload}"}
    if name != "glibc":
        return {"name": name or platform.system(), "tuned": False, "settings": {},
                "reason": "not glibc: left as it is"}
    label = f"glibc {version}"
    chosen = os.environ.get(ENV, "tuned")
    if chosen not in ("tuned", "system"):
        raise XformerError(f"{ENV}={chosen}: expected tuned (the default) or system")
    if chosen == "system":
        return {"name": label, "tuned": False, "settings": {}, "reason": f"{ENV}=system"}
    if _applied is not None:
        return {"name": label, "tuned": True, "settings": dict(_applied), "reason": ""}
    inherited = {key: os.environ[var] for key, var in VARIABLES.items() if var in os.environ}
    if inherited == {key: str(value) for key, value in wanted().items()}:  # started by a tuned xformer
        return {"name": label, "tuned": True, "settings": wanted(), "reason": ""}
    return {"name": label, "tuned": False, "settings": inherited, "reason": ""}
