"""xformer.allocator: with glibc tuned, a large tensor allocated again and again reuses the heap
instead of faulting in fresh pages each time (the kernel's page-fault count, not a timing, is the
measure); PyTorch puts large tensors on huge-page boundaries where the kernel offers them; the
tuning reaches child processes, can be turned off, is never an import side effect, and the run
card says what was in effect."""

import json
import os
import platform
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from xformer import allocator as alloc
from xformer_cli.main import app

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="tunes glibc malloc only")

FAULTS = """
import resource, sys, torch
from xformer.allocator import tune_allocator
state = tune_allocator()
torch.ones(16 * 2**20)  # one 64 MB tensor first: both allocators fault its pages in once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(16 * 2**20)  # allocated, touched, freed: as a training step does its logits
print(state["tuned"], resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def clean_env(**extra) -> dict:
    """This environment without the variables tune_allocator sets (an earlier CLI test in this
    process may have set them) and without XFORMER_ALLOCATOR, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in (alloc.ENV, alloc.HUGE_PAGES)}
    return {**env, **extra}


def faults(**extra) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", FAULTS], env=clean_env(**extra), capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_tuned_glibc_reuses_large_blocks_instead_of_faulting_them_in_again():
    tuned, with_tuning = faults()
    untouched, system = faults(XFORMER_ALLOCATOR="system")
    assert tuned and not untouched
    pages = 20 * 64 * 2**20 // os.sysconf("SC_PAGE_SIZE")
    assert system > pages // 4  # glibc's default: a fresh mmap per tensor (fewer faults with huge pages)
    assert with_tuning < system / 10, (with_tuning, system)


def test_the_tuning_reaches_child_processes_and_is_not_an_import_side_effect():
    child = ("import json, os, subprocess, sys; import xformer, xformer.train; "
             "untouched = {k: v for k, v in os.environ.items() if k.startswith(('MALLOC_', 'THP_'))}; "
             "from xformer.allocator import tune_allocator; tune_allocator(); "
             "grandchild = subprocess.run([sys.executable, '-c', 'import json; from xformer.allocator import "
             "allocator; print(json.dumps(allocator()))'], capture_output=True, text=True, check=True).stdout; "
             "print(json.dumps([untouched, json.loads(grandchild)]))")
    untouched, grandchild = json.loads(subprocess.run([sys.executable, "-c", child], env=clean_env(),
                                                      capture_output=True, text=True, check=True).stdout)
    assert untouched == {}  # importing xformer changed nothing
    assert grandchild["tuned"] and grandchild["settings"] == alloc.wanted() and grandchild["name"].startswith("glibc")


HUGE = """
import json, torch
from xformer.allocator import tune_allocator
state = tune_allocator()  # before the first tensor: PyTorch reads THP_MEM_ALLOC_ENABLE at its first allocation
tensors = [torch.empty(3 * 2**20) for _ in range(4)]  # 12 MB each, over PyTorch's 2 MiB huge-page threshold
print(json.dumps({"state": state, "aligned": [t.data_ptr() % 4096 == 0 for t in tensors]}))
"""


@pytest.mark.parametrize(("mode", "huge"), [("always [madvise] never", True), ("[always] madvise never", True),
                                            ("always madvise [never]", False), (None, False)])
def test_huge_pages_are_asked_for_only_where_the_kernel_offers_them(mode, huge, monkeypatch, tmp_path):
    """The kernel's mode (injected: a file stands in for /sys/kernel/mm/transparent_hugepage/enabled,
    or no file at all) decides whether THP_MEM_ALLOC_ENABLE is among the settings, and allocator()
    records it for the run card."""
    mode_file = tmp_path / "enabled"
    if mode is not None:
        mode_file.write_text(mode + "\n")
    monkeypatch.setattr(alloc, "THP_MODE", str(mode_file))
    assert (alloc.HUGE_PAGES in alloc.wanted()) == huge
    expected = mode[mode.index("[") + 1:mode.index("]")] if mode else "unavailable"
    assert alloc.allocator()["transparent_huge_pages"] == expected


def huge_page_child(**extra) -> dict:
    return json.loads(subprocess.run([sys.executable, "-c", HUGE], env=clean_env(**extra), capture_output=True,
                                     text=True, check=True).stdout)


def test_large_tensors_are_page_aligned_for_huge_pages_when_tuned_and_not_otherwise():
    """PyTorch page-aligns a tensor of 2 MiB or more and madvises huge pages for it (its sign: a
    4 KiB-aligned pointer, where glibc's own blocks sit 64 bytes apart) only when
    THP_MEM_ALLOC_ENABLE was set before its first allocation: tune_allocator sets it where this
    kernel offers huge pages; a user's own value is kept; XFORMER_ALLOCATOR=system sets nothing."""
    tuned = huge_page_child()
    if alloc.transparent_huge_pages() in ("always", "madvise"):
        assert tuned["state"]["settings"][alloc.HUGE_PAGES] == 1 and all(tuned["aligned"]), tuned
    else:
        assert alloc.HUGE_PAGES not in tuned["state"]["settings"] and not all(tuned["aligned"]), tuned
    declined = huge_page_child(THP_MEM_ALLOC_ENABLE="0")
    assert declined["state"]["settings"][alloc.HUGE_PAGES] == 0 and not all(declined["aligned"]), declined
    system = huge_page_child(XFORMER_ALLOCATOR="system")
    assert not system["state"]["tuned"] and not all(system["aligned"]), system


def test_users_own_settings_are_kept_and_system_turns_it_off(monkeypatch):
    monkeypatch.setattr(alloc, "_applied", None)
    for variable in alloc.VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv(alloc.ENV, "system")
    state = alloc.tune_allocator()
    assert not state["tuned"] and state["reason"] == "XFORMER_ALLOCATOR=system"
    assert not any(v in os.environ for v in alloc.VARIABLES.values())
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    monkeypatch.delenv(alloc.ENV)
    state = alloc.tune_allocator()
    assert state["name"] == "tcmalloc" and not state["tuned"] and "preloaded" in state["reason"]


def test_a_bad_setting_is_one_line_and_exit_2(monkeypatch):
    monkeypatch.setattr(alloc, "_applied", None)
    monkeypatch.setenv(alloc.ENV, "jemalloc")
    result = CliRunner().invoke(app, ["check", "--help"])
    assert result.exit_code == 2
    assert result.output.strip() == "XFORMER_ALLOCATOR=jemalloc: expected tuned (the default) or system"


RELEASE = """
import sys, torch
from xformer.allocator import release, tune_allocator

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * __import__("os").sysconf("SC_PAGE_SIZE") / 2**20

state = tune_allocator()
x = torch.ones(32 * 2**20)  # 128 MB, touched: with the heap's 64 MiB pad, under the 256 MiB it keeps free
del x  # freed: the tuned heap keeps it resident for the next large tensor
held = resident_mb()
trimmed = release()
print(state["tuned"], trimmed, held - resident_mb())
"""


def test_release_gives_a_freed_tensors_pages_back_when_tuned_and_does_nothing_otherwise():
    """Between the runs of a grid the tuned heap's free pages go back to the OS: a freed 128 MB
    tensor stays resident, and release() returns (most of) it."""
    tuned, trimmed, returned = subprocess.run([sys.executable, "-c", RELEASE], env=clean_env(), capture_output=True,
                                              text=True, check=True).stdout.split()
    assert (tuned, trimmed) == ("True", "True") and float(returned) > 100, returned
    untuned = subprocess.run([sys.executable, "-c", RELEASE], env=clean_env(XFORMER_ALLOCATOR="system"),
                             capture_output=True, text=True, check=True).stdout.split()
    assert untuned[:2] == ["False", "False"]  # glibc unmapped the tensor itself


VALIDATION = """
import json, sys, torch
from pathlib import Path
from xformer import load_recipe
from xformer.allocator import tune_allocator
from xformer.training.state import validate_and_save
from xformer.training.progress import Progress
from xformer.training.device import resolve_runtime

def resident_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

tune_allocator()
recipe = load_recipe(sys.argv[1], ["train.average_last=0", "train.max_steps=1"])
step = [torch.ones(2**20) for _ in range(32)]  # a training step's 128 MB of tensors, touched
before = resident_mb()
del step  # freed: a tuned heap keeps the pages (under its 256 MiB trim threshold)
seen = []


class Task:
    def validate(self, model, rt):
        seen.append(resident_mb())
        return {"loss": 1.0, "bleu": 1.0}


task = Task()
out = Path(sys.argv[2])
(out / "checkpoints").mkdir(parents=True)
rt = resolve_runtime("cpu", sys.argv[3])
validate_and_save(torch.nn.Linear(2, 2), recipe, task, rt, Progress(step=1), out, lambda *a: None, lambda: 0.0, {})
print(json.dumps({"before": before, "validating": seen[0]}))
"""


def test_validation_runs_without_the_training_steps_freed_pages_resident_in_fp32_only(tmp_path):
    """Under the tuned heap a freed training step stays resident until something trims it; in
    fp32 the trainer hands it back before it validates, so decoding's memory comes on top of what
    is live, not of what the step left behind. In bf16 on a CPU it keeps the pages (the steps
    after a trim ran 1.2x slower there): asked for explicitly, the same on every CPU class."""
    recipe = os.path.join(os.path.dirname(__file__), "..", "recipes", "translation", "multi30k_de_en.toml")
    for precision in ("fp32", "bf16"):
        out = subprocess.run([sys.executable, "-c", VALIDATION, recipe, str(tmp_path / precision), precision],
                             env=clean_env(), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        memory = json.loads(out.stdout.strip().splitlines()[-1])
        freed = memory["before"] - memory["validating"]
        assert (freed > 100) if precision == "fp32" else (abs(freed) < 30), (precision, memory)
