"""Run outputs shared by the drivers: metrics.jsonl, the resolved config, a per-step
progress line with ETA, and one timer per phase.

    log = RunLog(out_dir, total_steps=cfg.run.steps)
    with log.phase("generate"): ...
    log.step(step, {"train/loss": 0.3})      # writes one JSON line, prints progress
"""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def run_dir() -> Path:
    """The Hydra run directory when under Hydra, else ./outputs/<timestamp>."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().runtime.output_dir)
    except Exception:
        path = Path("outputs") / time.strftime("%Y-%m-%d_%H-%M-%S")
        path.mkdir(parents=True, exist_ok=True)
        return path


# Counters that add nothing to a progress line (still written to metrics.jsonl).
HIDDEN = ("/step", "/sequences", "/tokens")


class RunLog:
    def __init__(self, out_dir: str | os.PathLike, total_steps: int, stream=None, resolved_config: Any = None):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.path = self.dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._phases: dict[str, float] = {}
        self._start = time.monotonic()
        self._first_step_at: float | None = None
        if resolved_config is not None:
            from omegaconf import OmegaConf

            OmegaConf.save(resolved_config, self.dir / "resolved_config.yaml", resolve=True)

    @contextmanager
    def phase(self, name: str):
        """Time one phase of the current step; reported as time/<name> seconds."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.monotonic() - t0

    def step(self, step: int, metrics: dict[str, Any], quiet: bool = False) -> dict[str, Any]:
        """Write one JSON line for `step` with `metrics` and the phase timings; print progress."""
        now = time.monotonic()
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()},
                  **{f"time/{k}": round(v, 4) for k, v in self._phases.items()}}
        record["time/step"] = round(sum(self._phases.values()), 4)
        self._phases = {}
        self._file.write(json.dumps(record) + "\n")
        if self._first_step_at is None and step > 0:
            self._first_step_at = now
        if not quiet:
            self.stream.write(self._progress_line(step, record, now) + "\n")
            self.stream.flush()
        return record

    def _progress_line(self, step: int, record: dict, now: float) -> str:
        elapsed = now - self._start
        eta = ""
        if step > 0 and self.total:
            rate = elapsed / step
            eta = f" eta {_fmt(rate * (self.total - step))}"
        keys = [k for k in record if k != "step" and not k.startswith("time/") and not k.endswith(HIDDEN)
                and isinstance(record[k], (int, float))]
        keys.sort(key=lambda k: (not k.startswith("eval/"), not k.endswith("loss")))
        shown = [f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}" for k in keys[:5]]
        width = len(str(self.total))
        return f"[{step:>{width}}/{self.total}] {_fmt(elapsed)}{eta} " + " ".join(shown)

    def close(self) -> None:
        self._file.close()


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and callable(v.item):
        return v.item()
    if isinstance(v, float):
        return round(v, 6)
    return v


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def read_metrics(path: str | os.PathLike) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
