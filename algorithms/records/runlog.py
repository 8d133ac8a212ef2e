"""Run outputs shared by the drivers: metrics.jsonl and the trackers of run.loggers
(algorithms/records/trackers.py), the resolved config, a progress bar with ETA, one timer per phase,
and timeline.jsonl (when each role was busy).

    log = RunLog(out_dir, total_steps=cfg.run.steps, cfg=cfg)
    with log.phase("generate", "rollout"): ...   # time/generate; the rollout busy meanwhile
    log.moved("train", "offload", results)       # move/train_offload_{bytes,s}
    log.memory("train", results)                 # mem/train_{rss,rss_peak,device_peak}_bytes
    log.step(step, {"train/loss": 0.3})          # one record to every tracker, progress shown

Progress: on a terminal, one tqdm bar per RunLog (a run or a phase of one) with ETA and a few
metrics; every run.log_every steps, at the first and at the last step, a line with every
metric. Elsewhere (CI, a log file) only those lines. The lines also go to the log files of the
Python logging (a Hydra app's <run dir>/<job name>.log), as INFO records of algorithms.runlog.

Times in timeline.jsonl are seconds since the RunLog was created (this process's monotonic
clock; a resumed run continues after the intervals it kept), one line per busy interval:
{"step", "role", "phase", "start", "end"}. `close()` draws curves.png, timeline.png and
trace.json (algorithms/records/plots.py).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from algorithms.records.checkpoints import find_resume
from algorithms.records.plots import write_run_pictures
from algorithms.records.trackers import JsonlFile, open_trackers

logger = logging.getLogger(__name__)


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
# Metric families left out of the progress line for the same reason.
HIDDEN_PREFIXES = ("time/", "mem/", "move/")


class RunLog:
    """`run`: the run's `run:` section (algorithms/config/schema.py LoopConfig); it chooses the
    trackers (run.loggers), the full-line cadence (run.log_every), the run's name and tags.
    `resolved_config`: the config the run uses (the drivers pass their typed one, config_file
    values and derived steps included), saved as resolved_config.yaml and handed to the
    trackers."""

    def __init__(self, out_dir: str | os.PathLike, total_steps: int, run: Any, stream=None,
                 resolved_config: Any = None):
        self.loggers, self.log_every, self.tags = list(run.loggers), run.log_every, list(run.tags)
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = run.name or self.dir.resolve().name
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.path = self.dir / "metrics.jsonl"
        self._metrics = JsonlFile(self.path)
        self._phases: dict[str, float] = {}
        self._sums: dict[str, float] = {}
        self._start = time.monotonic()
        self._progress_start = self._start  # this process's share of the run (for the ETA)
        self._steps_before = 0  # steps of an earlier, resumed-from run (for the ETA)
        self._step_started = self._start
        self.current_step = 0  # the step being run: timeline lines without an explicit step get it
        self.timeline_path = self.dir / "timeline.jsonl"
        self._timeline = JsonlFile(self.timeline_path)
        self._trackers: list[Any] | None = None  # opened at the first record (or rewind)
        self._bar: Any = None
        self._lines_shown = 0
        self._config: dict = {}
        if resolved_config is not None:
            resolved_config = OmegaConf.create(resolved_config)
            OmegaConf.save(resolved_config, self.dir / "resolved_config.yaml", resolve=True)
            self._config = OmegaConf.to_container(resolved_config, resolve=True)

    @contextmanager
    def phase(self, name: str, *roles: str):
        """Time one phase of the current step, reported as time/<name> seconds; the `roles`
        named are busy with it for that time (timeline.jsonl)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            t1 = time.monotonic()
            self._phases[name] = self._phases.get(name, 0.0) + t1 - t0
            for role in roles:
                self.busy(role, name, t0, t1)

    def busy(self, role: str, phase: str, start: float, end: float, step: int | None = None) -> None:
        """One busy interval of `role` (time.monotonic() values), for the step it serves."""
        line = {"step": self.current_step if step is None else step, "role": role, "phase": phase,
                "start": round(start - self._start, 4), "end": round(end - self._start, 4)}
        self._timeline.log(line["step"], line)

    def add(self, key: str, value: float) -> None:
        """Add `value` to metric `key` of the current step (summed until the step is written)."""
        self._sums[key] = self._sums.get(key, 0.0) + float(value)

    def moved(self, role: str, op: str, results: Any) -> None:
        """Bytes and seconds of an offload/onload/sleep/wake_up call (one result per rank, or
        one result): bytes summed over ranks, seconds (where the role reports them) of the
        slowest rank, and each part the role times (`<part>_s`) as move/<role>_<op>_<part>_s,
        its slowest rank's."""
        per_rank = [r for r in (results if isinstance(results, list) else [results]) if isinstance(r, dict)]
        if per_rank:
            self.add(f"move/{role}_{op}_bytes", sum(v for r in per_rank for k, v in r.items() if k.endswith("bytes")))
        if any("seconds" in r for r in per_rank):
            self.add(f"move/{role}_{op}_s", max(float(r.get("seconds", 0.0)) for r in per_rank))
        for part in sorted({k for r in per_rank for k in r if k.endswith("_s")}):
            self.add(f"move/{role}_{op}_{part}", max(float(r.get(part, 0.0)) for r in per_rank))

    def memory(self, role: str, results: Any) -> None:
        """A role's memory() figures, the largest over its ranks, as mem/<role>_<figure>."""
        per_rank = [r for r in (results if isinstance(results, list) else [results]) if isinstance(r, dict)]
        for key in sorted({k for r in per_rank for k in r}):
            self._sums[f"mem/{role}_{key}"] = max(r.get(key, 0) for r in per_rank)

    def step(self, step: int, metrics: dict[str, Any], quiet: bool = False) -> dict[str, Any]:
        """Send one record for `step` (`metrics`, the added sums, the phase timings) to every
        tracker; show progress (nothing printed with `quiet`). Returns the record."""
        now = time.monotonic()
        record = self.draft(step, metrics, now)
        self._phases, self._sums, self._step_started = {}, {}, now
        self.current_step = step + 1
        self._metrics.log(step, record)
        for tracker in self._open_trackers(step):
            tracker.log(step, record)
        if not quiet:
            self._show(step, record, now)
        return record

    def draft(self, step: int, metrics: dict[str, Any], now: float | None = None) -> dict[str, Any]:
        """The record `step` would get now (`metrics`, the added sums, the phase timings so
        far), nothing written."""
        now = time.monotonic() if now is None else now
        record = {"step": step, **{k: _plain(v) for k, v in {**self._sums, **metrics}.items()},
                  **{f"time/{k}": round(v, 4) for k, v in self._phases.items()}}
        record["time/step"] = round(sum(self._phases.values()), 4)
        # Wall time since the previous record: with overlap, phases of different roles
        # run at once and no longer add up to it.
        record["time/step_wall"] = round(now - self._step_started, 4)
        return record

    def _open_trackers(self, first_step: int) -> list[Any]:
        if self._trackers is None:
            self._trackers = open_trackers(self.loggers, self.dir, self.name, self._config, self.tags, first_step)
        return self._trackers

    def _show(self, step: int, record: dict, now: float) -> None:
        """The bar (on a terminal) and, when due, the line with every metric."""
        keys = _shown_keys(record)
        if self._bar is None and _is_tty(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, initial=step, file=self.stream, desc=self.name, unit="step",
                             dynamic_ncols=True)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix({k.split("/")[-1]: _short(record[k]) for k in keys[:3]}, refresh=False)
        if not self._lines_shown or step == self.total or (self.log_every > 0 and step % self.log_every == 0):
            line = self._progress_line(step, record, now, keys)
            self._lines_shown += 1
            if self._bar is not None:
                self._bar.write(line, file=self.stream)
            else:
                self.stream.write(line + "\n")
                self.stream.flush()
            _to_log_files(line)

    def _progress_line(self, step: int, record: dict, now: float, keys: list[str]) -> str:
        elapsed = now - self._progress_start
        eta = ""
        if step > self._steps_before and self.total:
            rate = elapsed / (step - self._steps_before)
            eta = f" eta {_fmt(rate * (self.total - step))}"
        shown = [f"{k}={_short(record[k])}" for k in keys]
        width = len(str(self.total))
        return f"[{step:>{width}}/{self.total}] {_fmt(elapsed)}{eta} " + " ".join(shown)

    def rewind(self, step: int, saved: dict | None = None) -> dict:
        """Continue a resumed run after `step`: drop the lines of later steps (written after
        its checkpoint, before the interruption) from metrics.jsonl and timeline.jsonl, and
        from the trackers' view. `saved`: the record of `step` as its checkpoint kept it
        (`draft`), written where the interruption came between the checkpoint and the line.
        Returns the record of `step` ({} if none)."""
        intervals = self._timeline.rewind(step)
        kept = self._metrics.rewind(step)
        self.current_step, self._steps_before = step + 1, step
        # The timeline's clock continues after the kept intervals instead of starting at 0 again.
        self._start = time.monotonic() - max((line["end"] for line in intervals), default=0.0)
        trackers = self._open_trackers(step + 1)
        last = [r for r in kept if r.get("step") == step]
        if not last and saved:
            self._metrics.log(step, saved)
            for tracker in trackers:
                tracker.log(step, saved)
            last = [saved]
        return last[-1] if last else {}

    def close(self) -> None:
        """Close the bar, the trackers and the files, and draw the run's pictures
        (algorithms/records/plots.py: curves.png, timeline.png, trace.json); a picture that fails is
        reported, never fatal."""
        if self._bar is not None:
            self._bar.close()
        for tracker in self._trackers or []:
            tracker.close()
        self._trackers = []
        self._metrics.close()
        self._timeline.close()
        try:
            write_run_pictures(self.dir)
        except Exception as e:  # a run's results matter more than its pictures
            logger.warning("runlog: no pictures for %s (%s: %s)", self.dir, type(e).__name__, e)


def _to_log_files(line: str) -> None:
    """A progress line, already on the console, as an INFO record for the log files only
    (logging.FileHandler, e.g. Hydra's job log) on the way up from this module's logger."""
    if not logger.isEnabledFor(logging.INFO):
        return
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 0, line, (), None)
    current: logging.Logger | None = logger
    while current is not None:
        for handler in current.handlers:
            if isinstance(handler, logging.FileHandler) and record.levelno >= handler.level:
                handler.handle(record)
        current = current.parent if current.propagate else None


def _shown_keys(record: dict) -> list[str]:
    """The numeric metrics worth showing, eval and losses first."""
    keys = [k for k in record if k != "step" and not k.startswith(HIDDEN_PREFIXES) and not k.endswith(HIDDEN)
            and isinstance(record[k], (int, float))]
    keys.sort(key=lambda k: (not k.startswith("eval/"), not k.endswith("loss")))
    return keys


def _short(value: Any) -> str:
    """A metric as the lines show it: 4 significant digits; -0.0 (a mean of values summing to 0) as 0."""
    return f"{value + 0.0:.4g}" if isinstance(value, float) else str(value)


def _is_tty(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _plain(v: Any) -> Any:
    if hasattr(v, "item") and callable(v.item):
        return v.item()
    if isinstance(v, float):
        return round(v, 6)
    return v


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def timed_call(log: RunLog, role: str, group: Any, method: str, *args: Any) -> Any:
    """A colocated role's turn-taking call (offload, onload, sleep, wake_up): timed as phase
    `method`, the role busy meanwhile, its bytes and seconds logged as move/<role>_<method>_*."""
    with log.phase(method, role):
        results = group.call(method, *args)
    log.moved(role, method, results)
    return results


def record_event(out_dir: Any, event: dict) -> None:
    """One line of <run dir>/events.jsonl (restarts: what was lost, where, when)."""
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **event}
    with open(Path(out_dir) / "events.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def record_data_stats(log: RunLog, stats: dict, resume: Any) -> None:
    """load_task's counts into the run's step-0 record (RunLog sums added values into the next
    record it writes). A run resuming from a checkpoint has its step-0 record already."""
    if find_resume(log.dir, resume, report=lambda _: None) is None:
        for key, value in stats.items():
            log.add(key, value)
