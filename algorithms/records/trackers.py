"""Metric trackers chosen by run.loggers, several at once. Each gets the run's name, its
resolved config and tags when it opens, then one metrics dict per step, and is closed at the
end (torchtune's metric loggers); RunLog (algorithms/records/runlog.py) opens and feeds them.

    jsonl        metrics.jsonl in the run directory (always listed: resume reads it back)
    tensorboard  event files in <run dir>/tensorboard/<name> (tensorboard --logdir <run dir>)
    wandb        an offline W&B run in <run dir>/wandb/offline-run-*; `wandb sync` uploads it
    mlflow       an MLflow run in the SQLite store <run dir>/mlflow.db (MLFLOW_TRACKING_URI wins)
    swanlab      an offline SwanLab run in <run dir>/swanlab; `swanlab sync` uploads it

Only numbers go to TensorBoard, W&B and MLflow (a checkpoint path stays in metrics.jsonl).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Logger name -> the pip packages it needs beyond the core install.
LOGGERS = {"jsonl": (), "tensorboard": ("tensorboard",), "wandb": ("wandb",),
           "mlflow": ("mlflow-skinny", "sqlalchemy", "alembic"), "swanlab": ("swanlab",)}
# Pip packages whose module has another name.
MODULES = {"mlflow-skinny": "mlflow"}


def numeric(record: dict) -> dict[str, float]:
    """The metrics of `record` that are numbers (not bools, not the step itself)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class JsonlFile:
    """An append-only JSON-lines file whose lines carry a "step" (metrics.jsonl, timeline.jsonl)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "a", buffering=1)

    def log(self, step: int, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")

    def rewind(self, step: int) -> list[dict]:
        """Drop the lines of steps after `step` (written after a checkpoint, before an
        interruption); returns the lines kept."""
        self._file.close()
        kept = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        kept = [r for r in kept if r.get("step", 0) <= step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", buffering=1)
        return kept

    def close(self) -> None:
        self._file.close()


class TensorBoardTracker:
    """Scalars under their metric names; the config (YAML) and the tags as text entries."""

    def __init__(self, run_dir: Path, name: str, config: dict, tags: list[str], first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.dir = run_dir / "tensorboard" / name
        # A resumed run hides the steps logged after its checkpoint from TensorBoard's view.
        self.writer = SummaryWriter(str(self.dir), purge_step=first_step or None, flush_secs=30)
        import yaml

        # TensorBoard renders text as Markdown: indenting keeps the YAML a code block.
        text = "".join(f"    {line}\n" for line in yaml.safe_dump(config, sort_keys=False).splitlines())
        self.writer.add_text("run/config", text, first_step)
        if tags:
            self.writer.add_text("run/tags", ", ".join(tags), first_step)

    def log(self, step: int, record: dict) -> None:
        for key, value in numeric(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """An offline W&B run: nothing leaves the machine until the user runs `wandb sync`. A
    resumed run keeps the run id (stored in <run dir>/wandb/run_id), so the sync joins them."""

    def __init__(self, run_dir: Path, name: str, config: dict, tags: list[str], first_step: int):
        # Set before wandb reads them: no network, and no crash reports sent anywhere.
        os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_ERROR_REPORTING"] = "false"
        import wandb

        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        if first_step and id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:8]
            id_file.write_text(run_id)
        # console="off": W&B would otherwise wrap stdout (the progress bar, pytest's capture).
        settings = wandb.Settings(mode="offline", silent=True, console="off", x_disable_stats=True,
                                  save_code=False, disable_git=True, x_save_requirements=False)
        self.run = wandb.init(project="rayroles", name=name, id=run_id, resume="allow", dir=str(run_dir),
                              config=config, tags=list(tags), settings=settings)
        self.dir = Path(self.run.dir).parent  # offline-run-<time>-<id>

    def log(self, step: int, record: dict) -> None:
        values = {k: v for k, v in numeric(record).items() if math.isfinite(v)}
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
        logger.info("wandb: offline run in %s; upload it with: wandb sync %s", self.dir, self.dir)


class MlflowTracker:
    """An MLflow run in experiment "rayroles": the run's name, its flattened config as params,
    run.tags, numeric metrics per step. The store is MLFLOW_TRACKING_URI if set, else the
    SQLite file mlflow.db of the run directory (MLflow 3 refuses its ./mlruns file store); a phase
    inside a Hydra run (<run dir>/sft_warmup) shares its run's file. A resumed run continues the
    MLflow run (id in <its dir>/mlflow_run_id); steps logged after the checkpoint keep their first
    values in the history beside the new ones (MLflow deletes no single point)."""

    def __init__(self, run_dir: Path, name: str, config: dict, tags: list[str], first_step: int):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # before mlflow is imported: nothing sent
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        for noisy in ("mlflow", "alembic"):  # "Creating initial MLflow database tables..." on each new store
            logging.getLogger(noisy).setLevel(logging.WARNING)
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{_outermost_run_dir(run_dir) / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.uri)
        id_file = run_dir / "mlflow_run_id"
        if first_step and id_file.exists():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name("rayroles")
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment("rayroles")
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
            id_file.write_text(self.run_id)
        # Params never change in MLflow: a resumed run adds only the keys it did not log yet.
        logged = self.client.get_run(self.run_id).data.params
        params = [Param(k, v) for k, v in flatten(config).items() if k not in logged]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_batch(self.run_id, tags=[RunTag(tag, "") for tag in tags])

    def log(self, step: int, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in numeric(record).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
        logger.info("mlflow: run %s in %s", self.run_id, self.uri)


class SwanlabTracker:
    """An offline SwanLab run: its files in <run dir>/swanlab, nothing sent until the user runs
    `swanlab sync`. A resumed run starts a new SwanLab run (its steps continue the old numbering)."""

    def __init__(self, run_dir: Path, name: str, config: dict, tags: list[str], first_step: int):
        import swanlab  # optional tracker: installed with `pip install swanlab`

        folder = run_dir / "swanlab"
        folder.mkdir(parents=True, exist_ok=True)
        self.swanlab = swanlab
        swanlab.init(project="rayroles", experiment_name=name, config=config, tags=list(tags), logdir=str(folder),
                     mode="offline")
        self.dir = folder

    def log(self, step: int, record: dict) -> None:
        values = {k: v for k, v in numeric(record).items() if math.isfinite(v)}
        self.swanlab.log(values, step=step)

    def close(self) -> None:
        self.swanlab.finish()
        logger.info("swanlab: offline run in %s; upload it with: swanlab sync %s", self.dir, self.dir)


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as {"trainer.lr": "0.001", ...}; a value longer than MLflow keeps is cut."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:6000]
    return out


def _outermost_run_dir(run_dir: Path) -> Path:
    """The Hydra run directory when `run_dir` lies in it (a phase's folder), else `run_dir`."""
    try:
        from hydra.core.hydra_config import HydraConfig

        top = Path(HydraConfig.get().runtime.output_dir).resolve()
    except (ImportError, ValueError):
        return run_dir.resolve()
    return top if run_dir.resolve().is_relative_to(top) else run_dir.resolve()


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker,
            "swanlab": SwanlabTracker}


def open_trackers(loggers: list[str], run_dir: Path, name: str, config: dict, tags: list[str],
                  first_step: int) -> list[Any]:
    """The trackers of `loggers` besides jsonl (RunLog writes metrics.jsonl itself), opened
    for a run whose first recorded step is `first_step`."""
    return [TRACKERS[n](run_dir, name, config, list(tags), first_step) for n in loggers if n in TRACKERS]


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The lines of a metrics.jsonl or timeline.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
