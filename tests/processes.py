"""Real xformer processes for the tests that kill or distribute runs: a tiny translation run's
command line, and launchers that give each process one thread (two share a 2-core machine)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "translation" / "multi30k_de_en.toml"


def train_command(tiny: list[str], corpus: Path, out: Path, *extra: str) -> list[str]:
    """`xformer train` of the de->en recipe made tiny by `tiny`, on the local corpus."""
    sets = [arg for value in [*tiny, f"data.dataset={json.dumps(str(corpus))}", *extra] for arg in ("--set", value)]
    return ["train", str(RECIPE), *sets, "--out", str(out), "--device", "cpu"]


def one_thread() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def launch(args: list[str], processes: int = 0) -> subprocess.Popen:
    """`python -m xformer_cli ARGS` (processes 0), or torchrun starting `processes` of it."""
    launcher = [sys.executable, "-m", "xformer_cli"] if not processes else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
        "-m", "xformer_cli"]
    return subprocess.Popen(launcher + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=one_thread())


def run_once(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xformer_cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=one_thread())
