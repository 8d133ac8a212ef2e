"""A run's checkpoints: written whole or not at all, found again on resume.

    <run dir>/checkpoints/step_4/         the trainer's save (HF weights, optimizer, scheduler,
                                          step, each rank's RNG) + driver_state.json
    <run dir>/checkpoints/latest          "step_4": the newest complete checkpoint

Every rank writes into `step_N.tmp`; the driver adds its own state (driver_state.json: the
step, the prompt stream's position, ...) and only then renames the folder to `step_N` and
moves `latest`, so a crash at any point leaves the previous checkpoint usable. A folder is
complete when its name has no suffix and it holds driver_state.json, the trainer state and
the model config; anything else is skipped on resume with a message. `run.keep_last` k
keeps the k newest.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

from orchestration.config import ConfigError
from roles.trainer import STATE_FILE

logger = logging.getLogger(__name__)

DRIVER_STATE = "driver_state.json"
LATEST = "latest"
# The key of driver_state.json holding the step's metrics record as it stood at the save.
SAVED_RECORD = "record"
# Files that make a checkpoint folder usable for resume (the weights' file name depends on the
# engine's HF save: safetensors or a sharded index).
REQUIRED = (DRIVER_STATE, STATE_FILE, "config.json")
_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | os.PathLike, step: int, write: Callable[[Path], Any], driver_state: dict,
                    keep_last: int) -> Path:
    """`write(folder)` (the trainer's ranks save into it, all done when it returns), then the
    driver's state, then the rename and the `latest` marker; older checkpoints beyond
    `keep_last` (0: keep all) are removed. Returns the checkpoint folder."""
    root = checkpoint_root(run_dir)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    write_json_atomic(tmp / DRIVER_STATE, {"step": step, **driver_state})
    if final.exists():  # a resumed run saving the same step again: the new one replaces it
        shutil.rmtree(final)
    tmp.rename(final)
    _write_atomic(root / LATEST, final.name)
    if keep_last > 0:
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(root: str | os.PathLike, report: Callable[[str], None] = lambda _: None) -> list[Path]:
    """Complete checkpoint folders under `root`, oldest step first; each incomplete one is
    named through `report`."""
    root = Path(root)
    found = []
    for path in sorted(root.glob("step_*")) if root.is_dir() else []:
        match = _STEP.match(path.name)
        missing = [f for f in REQUIRED if not (path / f).is_file()]
        if match is None or missing:
            report(f"skipping checkpoint {path}: " + ("half-written (never renamed)" if match is None
                                                       else f"incomplete, missing {missing}"))
            continue
        try:
            json.loads((path / DRIVER_STATE).read_text())
        except (OSError, ValueError) as e:
            report(f"skipping checkpoint {path}: unreadable {DRIVER_STATE} ({e})")
            continue
        found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def find_resume(run_dir: str | os.PathLike, resume: Optional[str],
                report: Callable[[str], None] = logger.info) -> Optional[Path]:
    """The checkpoint to continue from: None for a fresh run (`resume` unset, or "auto" with no
    complete checkpoint in the run directory), the newest complete one for "auto", else the
    folder `resume` names (ConfigError if it is not a complete checkpoint)."""
    if not resume:
        return None
    if resume != "auto":
        path = Path(resume).expanduser()
        missing = [f for f in REQUIRED if not (path / f).is_file()]
        if missing:
            raise ConfigError(f"config key 'run.resume'={resume!r} is not a complete checkpoint (missing "
                              f"{missing}). Fix: name a checkpoints/step_N folder of an earlier run, or use auto")
        return path
    found = complete_checkpoints(checkpoint_root(run_dir), report)
    if not found:
        report(f"run.resume=auto: no complete checkpoint in {checkpoint_root(run_dir)}; starting from step 0")
        return None
    return found[-1]


def driver_state(checkpoint: str | os.PathLike) -> dict:
    """What the driver saved beside the trainer's state ({"step": N, ...})."""
    return json.loads((Path(checkpoint) / DRIVER_STATE).read_text())


def write_json_atomic(path: Path, value: Any) -> None:
    _write_atomic(path, json.dumps(value, indent=1))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".writing")
    tmp.write_text(text)
    os.replace(tmp, path)
