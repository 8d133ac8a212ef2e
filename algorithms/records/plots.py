"""Pictures of a run, written into its directory when it ends (and usable on any old run):

    curves.png        the learning curves the run has: reward, accuracy, loss, KL, entropy,
                      completion length against steps (one panel each)
    timeline.png      when each role was busy, coloured by phase, dotted lines at step ends
    trace.json        the same intervals as Chrome trace events (open in ui.perfetto.dev or
                      chrome://tracing): one track per role, one slice per phase

    python -m algorithms.records.plots outputs/2026-12-04/10-00-00     # draw them for a finished run
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

from algorithms.records.trackers import read_metrics

# Panels of curves.png, in order: (title, metric keys drawn in it). A panel is drawn when the
# run logged at least one of its keys.
CURVES = [("reward", ("reward/mean",)), ("accuracy", ("eval/accuracy", "rollout/accuracy", "sample/accuracy_all")),
          ("loss", ("train/loss",)), ("KL to the reference", ("train/kl",)), ("entropy", ("train/entropy",)),
          ("completion length (tokens)", ("rollout/completion_length",))]
# One colour per phase in every timeline, so runs compare at a glance.
COLOURS = {"generate": "tab:orange", "train": "tab:blue", "teacher": "tab:purple", "sync_weights": "tab:green",
           "eval": "tab:gray", "onload": "tab:brown", "offload": "tab:pink", "wake_up": "tab:olive",
           "sleep": "tab:cyan", "save": "black"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def curves(metrics: list[dict], png: Path) -> bool:
    """curves.png from metrics records; False when the run logged none of the curves."""
    panels = [(title, [k for k in keys if any(k in r for r in metrics)]) for title, keys in CURVES]
    panels = [(title, keys) for title, keys in panels if keys]
    if not panels:
        return False
    plt = _pyplot()
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in metrics if isinstance(r.get(key), (int, float))]
            ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 30 else None,
                    label=key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return True


def timeline(runs: list[tuple[str, Path]], png: Path, roles: Optional[tuple[str, ...]] = None) -> bool:
    """One panel per (title, run folder): per-role busy intervals coloured by phase, dotted
    lines at step ends, a shared time axis. `roles`: which rows, in order (default: every role
    of the first run's timeline). False when there is nothing to draw."""
    events = {out: read_metrics(out / "timeline.jsonl") if (out / "timeline.jsonl").is_file() else []
              for _, out in runs}
    if roles is None:
        roles = tuple(dict.fromkeys(e["role"] for e in events[runs[0][1]]))
    if not roles:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False,
                             figsize=(10, 0.9 + len(runs) * (0.45 + 0.3 * len(roles))))
    for ax, (title, out) in zip(axes[:, 0], runs):
        end = 0.0
        for r in read_metrics(out / "metrics.jsonl"):
            end += r.get("time/step_wall", 0.0)
            ax.axvline(end, color="grey", linestyle=":", linewidth=0.8)
        for e in events[out]:
            if e["role"] in roles:
                ax.broken_barh([(e["start"], e["end"] - e["start"])], (roles.index(e["role"]) - 0.35, 0.7),
                               color=COLOURS.get(e["phase"], "tab:red"), label=e["phase"])
        ax.set_yticks(range(len(roles)), roles)
        ax.set_ylim(len(roles) - 0.5, -0.5)
        ax.set_title(title, fontsize=9, loc="left")
    handles = {label: h for ax in axes[:, 0] for h, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=min(len(handles), 10), fontsize=8,
               frameon=False)
    axes[-1, 0].set_xlabel("seconds (dotted: end of each step)")
    fig.tight_layout(rect=(0, 0.1 if len(runs) > 1 else 0.18, 1, 1))
    fig.savefig(png, dpi=72)
    plt.close(fig)
    return True


def chrome_trace(events: list[dict]) -> dict:
    """Timeline intervals as Chrome trace events: a complete event ("X") per interval, in
    microseconds, one thread (track) per role, named by metadata events."""
    roles = list(dict.fromkeys(e["role"] for e in events))
    trace = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": role}}
             for i, role in enumerate(roles)]
    trace += [{"name": e["phase"], "cat": e["role"], "ph": "X", "pid": 1, "tid": roles.index(e["role"]),
               "ts": round(e["start"] * 1e6), "dur": round((e["end"] - e["start"]) * 1e6), "args": {"step": e["step"]}}
              for e in events]
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_run_pictures(run_dir: str | os.PathLike) -> list[Path]:
    """curves.png, timeline.png and trace.json of the run in `run_dir`; returns what was written."""
    run_dir = Path(run_dir)
    written = []
    metrics = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    if metrics and curves(metrics, run_dir / "curves.png"):
        written.append(run_dir / "curves.png")
    if (run_dir / "timeline.jsonl").is_file():
        events = read_metrics(run_dir / "timeline.jsonl")
        (run_dir / "trace.json").write_text(json.dumps(chrome_trace(events)))
        written.append(run_dir / "trace.json")
        if metrics and timeline([(f"{run_dir.name}: busy intervals per role", run_dir)], run_dir / "timeline.png"):
            written.append(run_dir / "timeline.png")
    return written


if __name__ == "__main__":
    for folder in sys.argv[1:] or ["."]:
        for path in write_run_pictures(folder):
            print(path)
