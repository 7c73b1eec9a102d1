"""Trackers: a run's log lines and validations sent where engineers watch runs, beside
metrics.jsonl: TensorBoard, Weights & Biases and MLflow (`--report-to NAME`, repeatable, or
XFORMER_REPORT_TO="tensorboard,wandb"). Each is an optional extra (`pip install
'xformer[trackers]'`); none is a recipe field, so a run's identity (and --reuse) ignores them.

Where each writes:

    tensorboard  RUN/tensorboard (an experiment's runs: one folder each under EXP/runs)
    wandb        its own environment (WANDB_MODE=offline, WANDB_PROJECT [default "xformer"],
                 WANDB_DIR [default: the run folder]); an experiment's runs form a group
                 named after its folder
    mlflow       MLFLOW_TRACKING_URI, else a SQLite store beside the run folders
                 (runs/mlflow.db, artifacts in runs/mlartifacts); MLFLOW_EXPERIMENT_NAME
                 [default "xformer"]; an experiment's runs are children of one parent run

What each gets: every record metrics.jsonl gets, its numbers as KIND/FIELD (train/loss,
train/lr, train/tokens_per_s, train/skipped, valid/bleu, ...) at its step; the resolved recipe
as hyper-parameters; the run card as text (TensorBoard), config (W&B) or an artifact (MLflow).
Only process 0 of a torchrun job reports.

A resumed run continues the same tracker run, and its curves end as an uninterrupted run's,
as metrics.jsonl's do. RUN/trackers.json keeps each tracker's run id and `held`: the last step
it is known to hold. TensorBoard rewrites: its writer purges the steps after the checkpoint.
MLflow only appends: it is sent nothing at or below what it holds (records a killed run sent
after its checkpoint stay as first sent: the redone steps are the same numbers, timings aside).
W&B writes a run when the run finishes, so a process killed outright (SIGKILL, power lost)
loses what it sent; the resumed run sends W&B the history after what its last finished
process held (online, W&B ignores steps it already holds). A tracker first asked for on a
resumed run is sent the history first.

A tracker that fails mid-run warns once, gets nothing more from this run, and training goes
on; a full disk is the run's own error (train: no space left, --resume continues)."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from xformer.errors import RunError
from xformer.events import Event
from xformer.files import atomic_write_text
from xformer.training.progress import append_jsonl

ENV = "XFORMER_REPORT_TO"
STATE = "trackers.json"
# what each needs installed: the tracker's package, and for MLflow's local store SQLAlchemy and alembic
NEEDS = {"tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic")}


@dataclass(frozen=True)
class Reporting:
    """Where a run reports: the trackers, and the experiment it belongs to (its folder's name
    groups its runs in W&B; `parent` is the MLflow run its runs are children of)."""

    to: tuple[str, ...] = ()
    group: str | None = None
    parent: str | None = None

    def to_dict(self) -> dict:
        return {"to": list(self.to), "group": self.group, "parent": self.parent}

    @classmethod
    def from_dict(cls, d: dict) -> Reporting:
        return cls(tuple(d.get("to", ())), d.get("group"), d.get("parent"))


def requested(names: list[str] | tuple[str, ...] | None, environ=os.environ) -> tuple[str, ...]:
    """The trackers asked for: `names` (--report-to), else XFORMER_REPORT_TO (comma or space
    separated); each known and installed, or a RunError naming it."""
    source = "--report-to"
    if not names:
        names, source = environ.get(ENV, "").replace(",", " ").split(), ENV
    chosen = []
    for name in names:
        if name not in NEEDS:
            raise RunError(f"{source}: '{name}' is no tracker; expected one of {', '.join(NEEDS)}")
        missing = [p for p in NEEDS[name] if importlib.util.find_spec(p) is None]
        if missing:
            raise RunError(f"{source} {name}: {' and '.join(missing)} not installed; pip install 'xformer[trackers]'")
        if name not in chosen:
            chosen.append(name)
    return tuple(chosen)


def scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record's numbers, named KIND/FIELD (the step is where they go)."""
    return {f"{record['kind']}/{k}": float(v) for k, v in record.items()
            if k not in ("kind", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_params(tables: dict, prefix: str = "") -> dict[str, object]:
    """A recipe's tables as `section.key` -> a value every tracker takes (lists as text)."""
    out: dict[str, object] = {}
    for key, value in tables.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        elif value is not None:
            out[f"{prefix}{key}"] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
    return out


def mlflow_store(runs_folder: Path, environ=os.environ) -> tuple[str, str | None]:
    """MLflow's tracking URI and, for the local default, where artifacts go."""
    if environ.get("MLFLOW_TRACKING_URI"):
        return environ["MLFLOW_TRACKING_URI"], None
    folder = runs_folder.resolve()
    return f"sqlite:///{folder / 'mlflow.db'}", (folder / "mlartifacts").as_uri()


class TensorBoard:
    """RUN/tensorboard through torch's SummaryWriter; a resumed run purges the steps after
    its checkpoint (TensorBoard hides them), so nothing is sent twice."""

    kept_when_killed = True  # flushed before every checkpoint (MetricsLog.flush)

    def __init__(self, out_dir: Path, kept: int, step: int, params: dict, card: dict):
        """`kept`: the last step it keeps of what it holds (-1: it holds nothing, a new run)."""
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(out_dir / "tensorboard"), purge_step=kept + 1 if kept >= 0 else None)
        self.writer.add_text("recipe", "\n".join(f"    {k} = {v}" for k, v in params.items()), step)
        self.writer.add_text("run_card", "    " + json.dumps(card, indent=2).replace("\n", "\n    "), step)
        if kept < 0:  # the hyper-parameters tab: once, for the run
            for summary in hparams(params, {}):
                self.writer.file_writer.add_summary(summary)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()


class WandB:
    """A W&B run, in its own environment (offline mode included), resumed by the id kept in
    RUN/trackers.json."""

    kept_when_killed = False  # its service writes the run's file when the run finishes

    def __init__(self, out_dir: Path, params: dict, card: dict, entry: dict, group: str | None):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "xformer"), id=entry.get("id"), resume="allow",
                              name=out_dir.name, group=group, dir=os.environ.get("WANDB_DIR") or str(out_dir),
                              reinit="create_new")
        entry["id"] = self.run.id  # a new run's, drawn by W&B
        self.run.config.update({"recipe": params, "run_card": card}, allow_val_change=True)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def flush(self) -> None:
        pass  # nothing to ask for: a run killed outright loses what was sent since it started

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


class MLflow:
    """An MLflow run (a child of the experiment's run where there is one), resumed by the run
    id kept in RUN/trackers.json for the same store."""

    kept_when_killed = True  # each batch is committed to the store when sent

    def __init__(self, out_dir: Path, params: dict, card: dict, entry: dict, parent: str | None):
        """`out_dir`: the run folder, named as the run, its store beside it (mlflow_store)."""
        from mlflow.tracking import MlflowClient

        uri, artifacts = mlflow_store(out_dir.parent)
        self.client = MlflowClient(tracking_uri=uri)
        if entry.get("uri") != uri or not self._exists(entry.get("run_id")):  # another store: a new run there
            entry.clear()
            entry["uri"] = uri
        if "run_id" not in entry:
            experiment = experiment_id(self.client, artifacts)
            tags = {"mlflow.parentRunId": parent} if parent else {}
            entry["run_id"] = self.client.create_run(experiment, run_name=out_dir.name, tags=tags).info.run_id
            self._params(entry["run_id"], params)
        else:
            self.client.update_run(entry["run_id"], status="RUNNING")
        self.run_id = entry["run_id"]
        self.client.log_text(self.run_id, "\n".join(f"{k} = {json.dumps(v)}" for k, v in params.items()) + "\n",
                             "recipe.txt")
        self.client.log_dict(self.run_id, card, "run_card.json")

    def _exists(self, run_id: str | None) -> bool:
        if run_id is None:
            return False
        try:
            self.client.get_run(run_id)
        except Exception:  # MlflowException: no such run in this store
            return False
        return True

    def _params(self, run_id: str, params: dict) -> None:
        """Once, when the run is created: MLflow refuses a parameter logged again with another
        value, and a resumed run's recorded changes do change some (recipe.txt has them)."""
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # at most 100 a batch
            self.client.log_batch(run_id, params=items[i:i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, step) for k, v in values.items()])

    def flush(self) -> None:
        pass  # each batch is committed when sent

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


def experiment_id(client, artifacts: str | None) -> str:
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "xformer")
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found else client.create_experiment(name, artifact_location=artifacts)


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


class MetricsLog:
    """RUN/metrics.jsonl and the run's trackers: each record goes to the file, then to every
    tracker. start() opens the trackers at a run's first step (once: they stay open across the
    parts of one train.run, a recorded change going on in the same process); close() at its end.
    A process other than 0 of a torchrun job (`writer` False) writes nothing."""

    def __init__(self, out_dir: Path, reporting: Reporting = Reporting(), emit: Event | None = None,
                 writer: bool = True):
        self.out_dir, self.reporting, self.writer = out_dir, reporting, writer
        self.emit = emit or (lambda kind, payload: None)
        self.trackers: dict[str, object] = {}
        self.state: dict[str, dict] = {}  # RUN/trackers.json
        self.skip: dict[str, int] = {}  # each tracker is sent only steps after this one
        self.sent: dict[str, int] = {}  # the last step sent to each
        self.started = False

    def start(self, history: list[dict], logged_to: int, step: int, params: dict, card: dict) -> None:
        """Open the trackers for a run at `step` (0: from the start). `history`: metrics.jsonl's
        records up to `step`; `logged_to`: the last step the file held before a resume cut it
        back to `step` (-1: none). A tracker that cannot start is the user's to fix, before the
        first step: RunError."""
        if self.started or not self.writer:
            return
        self.started = True
        self.state = read_state(self.out_dir)
        for name, entry in self.state.items():  # reported to before, not now: it holds what it kept
            if name not in self.reporting.to and entry.get("active"):
                entry.update(active=False, held=self._held(name, entry, logged_to))
        for name in self.reporting.to:
            entry = self.state.setdefault(name, {})
            held = self._held(name, entry, logged_to)
            try:
                self._open(name, entry, held, step, params, card)
            except Exception as exc:  # the tracker's own error (a server not reached, a bad setting), not a full disk
                if _disk_full(exc):
                    raise
                raise RunError(f"--report-to {name}: could not start ({_line(exc)}); nothing was trained") from None
            for record in history:  # what it lacks of the history, in order
                if record["step"] > self.skip[name]:
                    self.trackers[name].log(record["step"], scalars(record))
                    self.sent[name] = record["step"]
            # what it is known to hold if this process is killed: W&B, what it held already
            entry.update(active=True, held=max(held, step) if TRACKERS[name].kept_when_killed else held)
        self._save()

    @staticmethod
    def _held(name: str, entry: dict, logged_to: int) -> int:
        """The last step a tracker holds: what it was sent up to the kill, if the last process
        that reported to it was killed, where it keeps what it was sent (not W&B)."""
        held = entry.get("held", -1)
        return max(held, logged_to) if entry.get("active") and TRACKERS[name].kept_when_killed else held

    def _open(self, name: str, entry: dict, held: int, step: int, params: dict, card: dict) -> None:
        if name == "tensorboard":  # it rewrites: what it holds after the checkpoint is purged
            self.skip[name] = min(held, step)
            self.trackers[name] = TensorBoard(self.out_dir, self.skip[name], step, params, card)
        else:  # it appends: sent nothing at or below what it holds
            self.skip[name] = held
            extra = self.reporting.group if name == "wandb" else self.reporting.parent
            self.trackers[name] = TRACKERS[name](self.out_dir, params, card, entry, extra)

    def write(self, record: dict) -> None:
        """One record: appended to metrics.jsonl, then sent to each tracker not holding its step."""
        if not self.writer:
            return
        append_jsonl(self.out_dir / "metrics.jsonl", record)
        values = scalars(record)
        for name, tracker in list(self.trackers.items()):
            if record["step"] > self.skip[name]:
                self._call(name, partial(tracker.log, record["step"], values))
                self.sent[name] = record["step"]

    def flush(self) -> None:
        """Before a checkpoint: every tracker holds what was sent up to it (TensorBoard buffers)."""
        for name, tracker in list(self.trackers.items()):
            self._call(name, tracker.flush)

    def close(self, finished: bool) -> None:
        """The run's end (`finished`: by its own limits, not a stop signal or an error). It
        never raises: the run's own outcome, or error, is what the caller reports."""
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.close(finished)
                self._sent_held(name)
            except Exception as exc:
                self.emit("warning", {"message": f"--report-to {name}: closing its run: {_line(exc)}"})
        self.trackers.clear()
        if self.started:
            with contextlib.suppress(OSError):  # a full disk: the run's error says so
                self._save()

    def _call(self, name: str, call) -> None:
        """A tracker's error mid-run: one warning, and it is sent nothing more; a full disk is
        the run's to report (train's disk-full rule)."""
        try:
            call()
        except Exception as exc:
            if _disk_full(exc):
                raise
            self._drop(name, exc)

    def _drop(self, name: str, exc: BaseException) -> None:
        tracker = self.trackers.pop(name)
        if TRACKERS[name].kept_when_killed:
            self._sent_held(name)
        self.state[name]["active"] = False
        self._save()
        self.emit("warning", {"message": f"--report-to {name}: {_line(exc)}; it is sent nothing more from this run "
                                         f"(training goes on; {self.out_dir / 'metrics.jsonl'} has every record)"})
        try:
            tracker.close(False)
        except Exception:  # it has failed once already; its first error is the one reported
            pass

    def _sent_held(self, name: str) -> None:
        entry = self.state[name]
        entry["held"] = max(entry.get("held", -1), self.sent.get(name, -1))

    def _save(self) -> None:
        if self.state:  # a run never reported from has none
            atomic_write_text(self.out_dir / STATE, json.dumps(self.state, indent=2) + "\n")


def read_state(folder: Path) -> dict[str, dict]:
    """FOLDER/trackers.json: each tracker's run id and the last step it holds (none: {})."""
    path = folder / STATE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def experiment_reporting(to: tuple[str, ...], out_dir: Path) -> tuple[Reporting, MLflow | None]:
    """An experiment's (or sweep's) runs report as a group named after its folder; with MLflow,
    as children of one run (kept in EXP/trackers.json) that the caller closes at the end."""
    parent = None
    if "mlflow" in to:
        state = read_state(out_dir)
        try:  # named as the experiment, in the store beside its runs
            parent = MLflow(out_dir / "runs" / out_dir.name, {}, {"experiment": str(out_dir)},
                            state.setdefault("mlflow", {}), None)
        except Exception as exc:
            raise RunError(f"--report-to mlflow: could not start ({_line(exc)}); nothing was trained") from None
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out_dir / STATE, json.dumps(state, indent=2) + "\n")
    return Reporting(to, out_dir.name, parent.run_id if parent else None), parent
