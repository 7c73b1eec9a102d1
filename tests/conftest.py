import os
import shutil
import tempfile
from pathlib import Path

import datasets
import pytest
import torch

SHARED = Path(__file__).resolve().parents[1].parent / "shared"

# One terminal width for the whole suite and the processes it starts. Without it rich wraps
# at the width of whatever terminal pytest runs in (80 in CI), and a message holding a long
# temporary path breaks at a place that moves with the path, under the tests that read it.
os.environ["COLUMNS"] = "240"


def pytest_configure(config):
    """A compile cache of the suite's own (inherited by the processes tests start): torch's
    inductor cache is keyed without ATEN_CPU_CAPABILITY, so after a native run on an AVX512 CPU
    a run under the AVX2 emulation was served the other ISA's flex-attention kernels and read
    out of bounds (torch 2.13). A user's own TORCHINDUCTOR_CACHE_DIR is kept."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        config._xformer_inductor = tempfile.mkdtemp(prefix="xformer-tests-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = config._xformer_inductor


def pytest_unconfigure(config):
    made = getattr(config, "_xformer_inductor", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """../shared beside the checkout. Absent: skip, unless XFORMER_REQUIRE_SHARED=1 (CI),
    where a missing corpus must fail the run rather than silently skip tests."""
    if not (SHARED / "data" / "multi30k").is_dir():
        message = f"needs the shared data folder {SHARED}/data/multi30k"
        if os.environ.get("XFORMER_REQUIRE_SHARED") == "1":
            pytest.fail(message + " (XFORMER_REQUIRE_SHARED=1)")
        pytest.skip(message)
    return SHARED


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _datasets_cache(tmp_path_factory):
    """Keep the Arrow caches of the tests' throwaway corpora out of the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-cache")))
        datasets.disable_progress_bars()
        yield


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, shared_dir) -> Path:
    """600 train / 40 validation / 40 test pairs of Multi30k as a local JSONL folder."""
    folder = tmp_path_factory.mktemp("m30k")
    for name, n in (("train", 600), ("val", 40), ("test", 40)):
        lines = (shared_dir / "data" / "multi30k" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()[:n]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder
