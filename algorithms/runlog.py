"""Run outputs shared by the drivers: metrics.jsonl, the resolved config, a per-step
progress line with ETA, one timer per phase, and timeline.jsonl (when each role was busy).

    log = RunLog(out_dir, total_steps=cfg.run.steps)
    with log.phase("generate", "rollout"): ...   # time/generate; the rollout busy meanwhile
    log.moved("train", "offload", results)       # move/train_offload_{bytes,s}
    log.memory("train", results)                 # mem/train_{rss,rss_peak,device_peak}_bytes
    log.step(step, {"train/loss": 0.3})          # writes one JSON line, prints progress

Times in timeline.jsonl are seconds since the RunLog was created (this process's monotonic
clock; a resumed run continues after the intervals it kept), one line per busy interval:
{"step", "role", "phase", "start", "end"}. `close()` draws curves.png, timeline.png and
trace.json (algorithms/plots.py).
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
# Metric families left out of the progress line for the same reason.
HIDDEN_PREFIXES = ("time/", "mem/", "move/")


class RunLog:
    def __init__(self, out_dir: str | os.PathLike, total_steps: int, stream=None, resolved_config: Any = None):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.path = self.dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._phases: dict[str, float] = {}
        self._sums: dict[str, float] = {}
        self._start = time.monotonic()
        self._steps_before = 0  # steps of an earlier, resumed-from run (for the ETA)
        self._step_started = self._start
        self.current_step = 0  # the step being run: timeline lines without an explicit step get it
        self.timeline_path = self.dir / "timeline.jsonl"
        self._timeline = open(self.timeline_path, "a", buffering=1)
        if resolved_config is not None:
            from omegaconf import OmegaConf

            OmegaConf.save(resolved_config, self.dir / "resolved_config.yaml", resolve=True)

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
        self._timeline.write(json.dumps(line) + "\n")

    def add(self, key: str, value: float) -> None:
        """Add `value` to metric `key` of the current step (summed until the step is written)."""
        self._sums[key] = self._sums.get(key, 0.0) + float(value)

    def moved(self, role: str, op: str, results: Any) -> None:
        """Bytes and seconds of an offload/onload/sleep/wake_up call (one result per rank, or
        one result): bytes summed over ranks, seconds (where the role reports them) of the
        slowest rank."""
        per_rank = [r for r in (results if isinstance(results, list) else [results]) if isinstance(r, dict)]
        if per_rank:
            self.add(f"move/{role}_{op}_bytes", sum(v for r in per_rank for k, v in r.items() if k.endswith("bytes")))
        if any("seconds" in r for r in per_rank):
            self.add(f"move/{role}_{op}_s", max(float(r.get("seconds", 0.0)) for r in per_rank))

    def memory(self, role: str, results: Any) -> None:
        """A role's memory() figures, the largest over its ranks, as mem/<role>_<figure>."""
        per_rank = [r for r in (results if isinstance(results, list) else [results]) if isinstance(r, dict)]
        for key in sorted({k for r in per_rank for k in r}):
            self._sums[f"mem/{role}_{key}"] = max(r.get(key, 0) for r in per_rank)

    def step(self, step: int, metrics: dict[str, Any], quiet: bool = False) -> dict[str, Any]:
        """Write one JSON line for `step` with `metrics` and the phase timings; print progress."""
        now = time.monotonic()
        record = {"step": step, **{k: _plain(v) for k, v in {**self._sums, **metrics}.items()},
                  **{f"time/{k}": round(v, 4) for k, v in self._phases.items()}}
        record["time/step"] = round(sum(self._phases.values()), 4)
        # Wall time since the previous record: with overlap, phases of different roles
        # run at once and no longer add up to it.
        record["time/step_wall"] = round(now - self._step_started, 4)
        self._phases, self._sums, self._step_started = {}, {}, now
        self.current_step = step + 1
        self._file.write(json.dumps(record) + "\n")
        if not quiet:
            self.stream.write(self._progress_line(step, record, now) + "\n")
            self.stream.flush()
        return record

    def _progress_line(self, step: int, record: dict, now: float) -> str:
        elapsed = now - self._start
        eta = ""
        if step > self._steps_before and self.total:
            rate = elapsed / (step - self._steps_before)
            eta = f" eta {_fmt(rate * (self.total - step))}"
        keys = [k for k in record if k != "step" and not k.startswith(HIDDEN_PREFIXES) and not k.endswith(HIDDEN)
                and isinstance(record[k], (int, float))]
        keys.sort(key=lambda k: (not k.startswith("eval/"), not k.endswith("loss")))
        shown = [f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}" for k in keys[:5]]
        width = len(str(self.total))
        return f"[{step:>{width}}/{self.total}] {_fmt(elapsed)}{eta} " + " ".join(shown)

    def rewind(self, step: int) -> dict:
        """Continue a resumed run after `step`: drop the lines of later steps (written after
        its checkpoint, before the interruption) from metrics.jsonl and timeline.jsonl. Returns
        the record of `step` ({} if none)."""
        kept: dict[Path, list[str]] = {}
        for f in (self._file, self._timeline):
            f.close()
        for path in (self.path, self.timeline_path):
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            kept[path] = [line for line in lines if json.loads(line).get("step", 0) <= step]
            path.write_text("".join(line + "\n" for line in kept[path]))
        self._file = open(self.path, "a", buffering=1)
        self._timeline = open(self.timeline_path, "a", buffering=1)
        self.current_step, self._steps_before = step + 1, step
        # The timeline's clock continues after the kept intervals instead of starting at 0 again.
        self._start = time.monotonic() - max((json.loads(line)["end"] for line in kept[self.timeline_path]),
                                             default=0.0)
        last = [json.loads(line) for line in kept[self.path] if json.loads(line).get("step") == step]
        return last[-1] if last else {}

    def close(self) -> None:
        """Close the files and draw the run's pictures (algorithms/plots.py: curves.png,
        timeline.png, trace.json); a picture that fails is reported, never fatal."""
        self._file.close()
        self._timeline.close()
        try:
            from algorithms.plots import write_run_pictures

            write_run_pictures(self.dir)
        except Exception as e:  # a run's results matter more than its pictures
            print(f"runlog: no pictures for {self.dir} ({type(e).__name__}: {e})", file=sys.stderr)


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
    """The lines of a metrics.jsonl or timeline.jsonl file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def timed_call(log: RunLog, role: str, group: Any, method: str, *args: Any) -> Any:
    """A colocated role's turn-taking call (offload, onload, sleep, wake_up): timed as phase
    `method`, the role busy meanwhile, its bytes and seconds logged as move/<role>_<method>_*."""
    with log.phase(method, role):
        results = group.call(method, *args)
    log.moved(role, method, results)
    return results
