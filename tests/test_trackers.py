"""--report-to: what TensorBoard, W&B and MLflow hold of a run, read back through each one's own
reader (TensorBoard's EventAccumulator, W&B's offline transaction log as wandb 0.31 writes it,
MLflow's client on its store), against the run's metrics.jsonl; a run SIGKILLed between a
checkpoint and its next log line, then resumed, holds the curves an uninterrupted run does."""

import json
import struct
from pathlib import Path

import pytest

from tests.extras import need
from tests.processes import RECIPE, launch, train_command
from tests.test_kill import TIMING, kill_when
from xformer.config.loading import load_recipe
from xformer.errors import RunError
from xformer.training.trackers import flat_params, requested, scalars

TINY = ["train.schedule=inverse_sqrt", "train.regularisation=recipe",  # the mechanics tested, not the recipe's choice
        "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_encoder_layers=1",
        "model.n_decoder_layers=1", "data.vocab_size=300", "data.max_tokens=512", "train.warmup_steps=10",
        "train.lr=3e-3", 'train.precision="fp32"', "eval.beam=2", "eval.batch_sentences=16",
        "train.log_every=5", "train.valid_every=10", "train.average_last=0", "train.log_seconds=0",
        "train.max_steps=30"]
ALL = ("--report-to", "tensorboard", "--report-to", "wandb", "--report-to", "mlflow")
TIMED = {f"{kind}/{field}" for kind in ("train", "valid") for field in TIMING}


@pytest.fixture
def offline(monkeypatch):
    """W&B offline (its files in the run folder: WANDB_DIR unset), MLflow's default local store."""
    for name in ("wandb", "mlflow", "sqlalchemy", "alembic", "tensorboard"):
        need(name)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "XFORMER_REPORT_TO"):
        monkeypatch.delenv(name, raising=False)


def curves(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's records as the trackers are sent them: name -> [(step, value)]."""
    out: dict[str, list] = {}
    for record in records:
        for name, value in scalars(record).items():
            out.setdefault(name, []).append((record["step"], value))
    return out


def jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tensorboard_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # purges what a resumed writer's purge_step hides, as TensorBoard shows it
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file: a 7-byte header (':W&B', magic, version), then
    LevelDB-log blocks of 32 KiB, each record in chunks with a 7-byte header (CRC-32, length,
    type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def wandb_runs(run_dir: Path) -> list[list]:
    """Each offline run W&B wrote for this run folder (one a process), oldest first."""
    return [wandb_records(f) for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))]


def wandb_curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The history W&B holds once its offline runs are synced: each process's rows in order."""
    out: dict[str, list] = {}
    for records in wandb_runs(run_dir):
        for record in records:
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        out.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return out


def mlflow_curves(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], object]:
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert state["uri"] == f"sqlite:///{run_dir.parent.resolve() / 'mlflow.db'}"  # the store beside the runs
    client = MlflowClient(tracking_uri=state["uri"])
    run = client.get_run(state["run_id"])
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
            for key in run.data.metrics}, run


def without_timing(named: dict) -> dict:
    return {k: v for k, v in named.items() if k not in TIMED}


def test_a_run_killed_after_a_checkpoint_and_resumed_shows_one_uninterrupted_curve_in_each_tracker(
        corpus, tmp_path, offline):
    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    straight = launch(train_command(TINY, corpus, a, *()) + list(ALL))
    _, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err
    expected = curves(jsonl(a))
    assert {"train/loss", "train/lr", "train/tokens_per_s", "valid/loss", "valid/bleu", "valid/chrf"} <= set(expected)
    # uninterrupted: each tracker holds exactly what metrics.jsonl does, timings included
    assert tensorboard_curves(a) == {k: [(s, pytest.approx(v, rel=1e-6)) for s, v in c] for k, c in expected.items()}
    assert wandb_curves(a) == expected
    held, run = mlflow_curves(a)
    assert held == expected and run.info.status == "FINISHED" and run.data.params["model.d_model"] == "32"

    # killed once its first checkpoint (step 10) is whole, before the log line of step 15
    first = launch(train_command(TINY, corpus, b) + list(ALL))
    assert kill_when(first, lambda: (b / "checkpoints" / "last.safetensors").is_file())
    resumed = launch(train_command(TINY, corpus, b) + ["--resume", *ALL])
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    again = curves(jsonl(b))
    assert without_timing(again) == without_timing(expected)  # as test_kill proves for metrics.jsonl
    board = tensorboard_curves(b)
    assert board == {k: [(s, pytest.approx(v, rel=1e-6)) for s, v in c] for k, c in again.items()}
    assert len(wandb_runs(b)) == 2  # the killed process's offline run and the resumed one's: one W&B run id
    assert without_timing(wandb_curves(b)) == without_timing(again)
    assert [s for s, _ in wandb_curves(b)["train/tokens_per_s"]] == [s for s, _ in again["train/tokens_per_s"]]
    held, run = mlflow_curves(b)
    assert without_timing(held) == without_timing(again) and run.info.status == "FINISHED"
    assert [s for s, _ in held["train/tokens_per_s"]] == [s for s, _ in again["train/tokens_per_s"]]
    # not a recipe field: the run is the same run to --reuse with trackers or without
    plain = load_recipe(RECIPE, [*TINY, f"data.dataset={json.dumps(str(corpus))}"])
    assert load_recipe(b / "recipe.toml").to_dict() == plain.to_dict()


def test_a_tracker_added_on_resume_gets_the_history_and_one_that_fails_mid_run_warns_once(
        corpus, tmp_path, offline):
    """A run started with TensorBoard alone, stopped by max_steps raised on resume with MLflow
    added: MLflow is sent the history first. Then MLflow's run is deleted mid-run (its own
    error on every later log): one warning, training ends, metrics.jsonl has every record."""
    from mlflow.tracking import MlflowClient

    from xformer.train import run
    from xformer.training.trackers import Reporting

    out = tmp_path / "runs" / "r"
    recipe = load_recipe(RECIPE, [*TINY, f"data.dataset={json.dumps(str(corpus))}", "train.max_steps=10"])
    run(recipe, out.with_name("plain"), device="cpu")
    assert not (out.with_name("plain") / "trackers.json").exists()  # a run that reports nowhere: nothing new
    run(recipe, out, device="cpu", reporting=Reporting(("tensorboard",)))
    longer = load_recipe(RECIPE, [*TINY, f"data.dataset={json.dumps(str(corpus))}", "train.max_steps=20"])
    run(longer, out, device="cpu", resume=True, reporting=Reporting(("tensorboard", "mlflow")))
    held, _ = mlflow_curves(out)
    assert held == curves(jsonl(out))
    assert tensorboard_curves(out) == {k: [(s, pytest.approx(v, rel=1e-6)) for s, v in c]
                                       for k, c in curves(jsonl(out)).items()}

    warnings, deleted = [], []
    state = json.loads((out / "trackers.json").read_text())["mlflow"]

    def on_event(kind, payload):
        if kind == "warning":
            warnings.append(payload["message"])
        if kind == "step" and payload["step"] == 25 and not deleted:
            MlflowClient(tracking_uri=state["uri"]).delete_run(state["run_id"])
            deleted.append(True)

    further = load_recipe(RECIPE, [*TINY, f"data.dataset={json.dumps(str(corpus))}", "train.max_steps=40"])
    result = run(further, out, device="cpu", resume=True, on_event=on_event,
                 reporting=Reporting(("tensorboard", "mlflow")))
    assert result.steps == 40 and deleted
    assert len(warnings) == 1 and warnings[0].startswith("--report-to mlflow:"), warnings
    assert [r["step"] for r in jsonl(out) if r["kind"] == "train"] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert json.loads((out / "trackers.json").read_text())["mlflow"]["active"] is False
    assert max(s for s, _ in tensorboard_curves(out)["train/loss"]) == 40  # the others go on


def test_report_to_names_a_tracker_and_needs_it_installed(monkeypatch):
    assert requested(["wandb", "tensorboard", "wandb"], environ={}) == ("wandb", "tensorboard")
    with pytest.raises(RunError, match="'tensorbord' is no tracker; expected one of tensorboard, wandb, mlflow"):
        requested(["tensorbord"], environ={})
    with pytest.raises(RunError, match="XFORMER_REPORT_TO: 'x' is no tracker"):
        requested([], environ={"XFORMER_REPORT_TO": "tensorboard, x"})
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RunError, match=r"--report-to wandb: wandb not installed; pip install 'xformer\[trackers\]'"):
        requested(["wandb"], environ={})


def test_report_to_a_tracker_not_installed_is_one_line_and_exit_2_before_training(corpus, tmp_path, monkeypatch):
    import importlib.util

    from typer.testing import CliRunner

    from xformer_cli.main import app

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    for command in (train_command(TINY, corpus, tmp_path / "r"), ["experiment", "nothing.toml"],
                    ["longrange", "nothing.toml"]):
        result = CliRunner().invoke(app, [*command, "--report-to", "mlflow"])
        assert result.exit_code == 2, result.output
        assert result.output.strip().splitlines() == [
            "--report-to mlflow: mlflow not installed; pip install 'xformer[trackers]'"], result.output
    assert not (tmp_path / "r").exists()


def test_scalars_are_a_records_numbers_and_the_recipe_flattens_to_parameters():
    record = {"kind": "valid", "step": 10, "epoch": 2, "loss": 2.5, "bleu": 3.0, "best": True, "nonfinite": {}}
    assert scalars(record) == {"valid/epoch": 2.0, "valid/loss": 2.5, "valid/bleu": 3.0}
    params = flat_params({"model": {"d_model": 32, "window": None}, "data": {"lengths": [1, 2]}, "name": "x"})
    assert params == {"model.d_model": 32, "data.lengths": "[1, 2]", "name": "x"}


def test_an_experiments_runs_report_as_one_group(corpus, tmp_path, offline):
    """`experiment --report-to`, two runs at once: each run's TensorBoard folder under the
    experiment's runs/, its W&B run in a group named after the experiment's folder, its MLflow
    run a child of the experiment's own (finished when the experiment is)."""
    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from tests.test_experiment import SPEC, sets
    from xformer_cli.main import app

    spec = tmp_path / "heads.toml"
    spec.write_text(SPEC)
    out = tmp_path / "grid"
    result = CliRunner().invoke(app, ["experiment", str(spec), *sets(corpus), "--set", "experiment.seeds=[1]",
                                      "--out", str(out), "--device", "cpu", "--jobs", "2", *ALL])
    assert result.exit_code == 0, result.output
    parent = json.loads((out / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=parent["uri"])
    assert client.get_run(parent["run_id"]).info.status == "FINISHED"
    for cell in ("heads_1", "heads_2"):
        run_dir = out / "runs" / f"{cell}-s1"
        expected = curves(jsonl(run_dir))
        assert tensorboard_curves(run_dir) == {k: [(s, pytest.approx(v, rel=1e-6)) for s, v in c]
                                               for k, c in expected.items()}
        (records,) = wandb_runs(run_dir)
        (opened,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert (opened.run_group, opened.display_name) == ("grid", f"{cell}-s1")
        assert wandb_curves(run_dir) == expected
        held, run = mlflow_curves(run_dir)
        assert held == expected and run.data.tags["mlflow.parentRunId"] == parent["run_id"]
