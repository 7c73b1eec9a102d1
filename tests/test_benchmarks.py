"""The benchmark scripts that run the ledger (a GPU session's subset, the CPU-scale chain),
started on a CPU at a few steps: they must train, score, judge and resume before anyone spends
GPU minutes or CPU hours on them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ("model.d_model=32 model.d_ff=64 model.n_encoder_layers=1 model.n_decoder_layers=1 data.vocab_size=300 "
        "data.max_tokens=512 train.warmup_steps=2 train.valid_every=2 train.average_last=1 eval.beam=2 "
        "eval.batch_sentences=16")


@pytest.mark.slow  # ~75 s of 2 cores: `python -m pytest -m slow` runs it
def test_the_gpu_claims_subset_trains_scores_and_judges_on_a_cpu(corpus, tmp_path):
    """Two specs sharing their baseline cell, 3 seeds, budgets of 2 and 4 steps: every run and
    cooldown lands in OUT, the shared baseline trains once, and OUT/claims.md judges the subset
    (and only it: the other specs are not in OUT/specs). A second call trains nothing."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SPECS": "qkv_sharing head_dim", "SEEDS": "[1, 2, 3]", "BUDGETS": "[2, 4]", "DEVICE": "cpu", "JOBS": "1",
           "SETS": TINY}
    out = tmp_path / "gpu"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_claims.sh"), str(out), str(corpus)], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    folders = sorted(p.name for p in (out / "runs" / "qkv_sharing" / "runs").iterdir() if p.is_dir())
    assert folders == sorted(f"{c}-s{s}{b}" for c in ("separate", "shared") for s in (1, 2, 3) for b in ("", "-at2"))
    copied = sorted(p.name for p in (out / "runs" / "head_dim" / "runs").glob("dk_32-s*")
                    if (p / "copied-from.json").is_file())
    assert copied == [f"dk_32-s{s}{b}" for s in (1, 2, 3) for b in ("", "-at2")]  # the baseline, trained once for both
    copy = (out / "specs" / "qkv_sharing.toml").read_text()  # the subset's recipe (the flagship) and scale
    assert 'multi30k_de_en.toml"' in copy and "the GPU subset" in copy and copy.count("budgets = ") == 1
    text = (out / "claims.md").read_text()
    assert "[`qkv_sharing`](#qkv_sharing)" in text and "[`head_dim`](#head_dim)" in text and "[`depth`]" not in text
    record = json.loads((out / "records" / "qkv_sharing.json").read_text())
    assert record["results"]["seeds"] == [1, 2, 3] and [c["budget"] for c in record["results"]["curves"]] == [2, 4]
    again = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_claims.sh"), str(out), str(corpus)], env=env,
                           capture_output=True, text=True)
    assert again.returncode == 0 and "12 runs, 12 done already" in again.stderr + again.stdout


def test_the_ledger_chain_resumes_from_committed_records_without_retraining(tmp_path):
    """The chain measures each spec once: a second call on a machine without the run folders
    (a fresh clone with the records committed) trains nothing, and a spec changed since its
    record was measured is trained again. A spec that fails is logged and skipped. The corpus
    the chain is given goes only to specs that read one (this generated task refuses it)."""
    from tests.test_claims import SPEC

    specs, ledger = tmp_path / "specs", tmp_path / "docs" / "claims.md"
    specs.mkdir()
    (specs / "depth.toml").write_text(SPEC)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SPECS": "missing depth", "SPEC_DIR": str(specs), "LEDGER": str(ledger), "JOBS": "2",
           "ARCHIVE": str(tmp_path / "archive")}

    def chain(runs):
        done = subprocess.run(["bash", str(ROOT / "benchmarks" / "ledger_chain.sh"), str(runs),
                               str(tmp_path / "multi30k")], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    chain(tmp_path / "runs")
    record = ledger.parent / "claims" / "depth.json"
    measured = json.loads(record.read_text())
    log = (tmp_path / "runs" / "chain.log").read_text()
    assert measured["results"]["seeds"] == [1, 2, 3] and "\ndepth " in log
    assert log.startswith("missing FAILED (exit 2)")  # a spec that fails is logged, and the chain goes on
    env["SPECS"] = "depth"
    assert "depth: measured already" in chain(tmp_path / "fresh")  # no run folders: the record is enough
    assert json.loads(record.read_text()) == measured
    # nothing trained; the archived records are back for later specs to copy (no weights)
    restored = tmp_path / "fresh" / "depth" / "runs"
    assert sorted(p.name for p in restored.iterdir() if p.is_dir()) == sorted(
        p.name for p in (tmp_path / "archive" / "depth").iterdir() if p.is_dir())
    assert not list(restored.rglob("*.safetensors"))
    (specs / "depth.toml").write_text(SPEC.replace("seeds = [1, 2, 3]", "seeds = [1, 2, 4]"))
    assert "measured already" not in chain(tmp_path / "fresh")
    assert json.loads(record.read_text())["results"]["seeds"] == [1, 2, 4]
    # the first version's archived runs are moved aside, not restored into the second's folder
    archived = sorted(p.name for p in (tmp_path / "archive").iterdir())
    assert len(archived) == 2 and archived[0] == "depth" and archived[1].startswith("depth.")
    assert {p.name for p in (tmp_path / "archive" / "depth").glob("*-s4")} and not list(
        (tmp_path / "archive" / archived[1]).glob("*-s4"))
