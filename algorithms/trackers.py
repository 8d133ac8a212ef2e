"""Metric trackers chosen by run.loggers, several at once. Each gets the run's name, its
resolved config and tags when it opens, then one metrics dict per step, and is closed at the
end (torchtune's metric loggers); RunLog (algorithms/runlog.py) opens and feeds them.

    jsonl        metrics.jsonl in the run directory (always listed: resume reads it back)
    tensorboard  event files in <run dir>/tensorboard/<name> (tensorboard --logdir <run dir>)
    wandb        an offline W&B run in <run dir>/wandb/offline-run-*; `wandb sync` uploads it

Only numbers go to TensorBoard and W&B (a checkpoint path stays in metrics.jsonl).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

# Logger name -> the pip package it needs (None: nothing beyond the core install).
LOGGERS = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"}


def check_loggers(loggers: Any, key: str = "run.loggers") -> None:
    """Refuse unknown or repeated logger names, a list without jsonl, and a tracker whose
    package is not installed, as one ConfigError naming `key`."""
    from algorithms.validation import require

    names = list(loggers)
    for name in names:
        require(name in LOGGERS, key, names, f"names an unknown logger {name!r}",
                f"list some of {list(LOGGERS)}, e.g. {key}=[jsonl,tensorboard]")
    require(len(set(names)) == len(names), key, names, "names a logger twice", "list each logger once")
    require("jsonl" in names, key, names, "leaves out jsonl (metrics.jsonl, which resume reads back)",
            f"keep it in the list, e.g. {key}=[jsonl,{','.join(n for n in names if n != 'jsonl') or 'tensorboard'}]")
    for name in names:
        package = LOGGERS[name]
        require(package is None or importlib.util.find_spec(package) is not None, key, names,
                f"needs the Python package '{package}', which is not installed",
                f"pip install -c constraints.txt {package} (or the '.[trackers]' extra), or drop {name} from {key}")


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
        print(f"wandb: offline run in {self.dir}; upload it with: wandb sync {self.dir}")


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}


def open_trackers(loggers: list[str], run_dir: Path, name: str, config: dict, tags: list[str],
                  first_step: int) -> list[Any]:
    """The trackers of `loggers` besides jsonl (RunLog writes metrics.jsonl itself), opened
    for a run whose first recorded step is `first_step`."""
    return [TRACKERS[n](run_dir, name, config, list(tags), first_step) for n in loggers if n in TRACKERS]
