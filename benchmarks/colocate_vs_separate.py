"""Colocated vs separate placement, with and without overlap, on the same GRPO and GKD workloads.

    python benchmarks/colocate_vs_separate.py
    python benchmarks/colocate_vs_separate.py algorithms=[grpo] steps=10 prompts_per_step=32
    python benchmarks/colocate_vs_separate.py 'grpo=["algorithm.max_new_tokens=32"]' modes=[separate,overlap]
    python benchmarks/colocate_vs_separate.py --multirun overlap_staleness=1,2

Modes, each one run of the real driver (algorithms.grpo / algorithms.gkd) on a local Ray
cluster (simulated GPUs on a machine without one: each role computes on the CPU in its own
process):
  colocate  trainer and rollout share one device and take turns (wake/generate/sleep,
            onload/train/offload); GKD's teacher shares the trainer's device too.
  separate  every role on its own device, algorithm.max_staleness=0 (strictly on-policy).
  overlap   separate, max_staleness=overlap_staleness: generation of the next steps runs
            while the trainer (and teacher) work on the current one.
GRPO starts from one SFT warm start shared by its modes; GKD's teacher is trained once and
cached. Timed steps are 2..steps-1 (step 1 warms up and has nothing to overlap with; the last
step also evaluates). Prints one table per workload (step time, trained tokens/s, seconds per
phase, idle fraction per role, weight-sync time and MB/s, peak host RSS per role, final
eval accuracy); writes table.md, results.json, one timeline_<algo>_<mode>.png per run and
timeline_<algo>.png with the modes one above the other (drawn by algorithms/records/plots.py) into
the run directory, each run's own metrics.jsonl and timeline.jsonl under <algo>_<mode>/.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import hydra
from hydra import compose
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from algorithms import gkd, grpo
from algorithms.gkd import GKDConfig
from algorithms.config.schema import prepare
from algorithms.records.plots import timeline
from algorithms.records.trackers import read_metrics
from algorithms.records.runlog import run_dir
from orchestration.cluster import init_cluster
from orchestration.config import ClusterConfig, register_schema

MODES = ("colocate", "separate", "overlap")
# Placement overrides of the separate modes, on top of the workload's quickstart experiment
# (colocated); GKD's teacher then gets a device of its own (see `composed`).
SEPARATE = {"grpo": ["placement.colocate_groups=null"],
            "gkd": ["placement.colocate_groups=null", "placement.teacher_model=null",
                    "placement.offload_teacher_model=false"]}
ROLES = {"grpo": ("train", "rollout"), "gkd": ("train", "rollout", "teacher")}
# Seconds-per-step columns: (header, metrics whose per-step values add up to it).
# generate: the rollout's own generation time (with overlap it runs beside the others);
# swap: turn-taking of colocated roles; wait: the driver waiting for generations.
PHASES = [("generate", ("rollout/generate_s",)), ("train", ("time/train",)), ("teacher", ("time/teacher",)),
          ("swap", ("time/onload", "time/offload", "time/wake_up", "time/sleep")),
          ("wait", ("time/generate", "time/wait_rollout"))]


@dataclass
class BenchConfig:
    # Workloads, in order: grpo (+experiment=grpo_quickstart) and/or gkd (+experiment=gkd_quickstart).
    algorithms: List[str] = field(default_factory=lambda: ["grpo", "gkd"])
    # Modes, in order: colocate, separate (max_staleness 0), overlap (separate, max_staleness > 0).
    modes: List[str] = field(default_factory=lambda: list(MODES))
    # algorithm.max_staleness of the overlap mode.
    overlap_staleness: int = 1
    # Training steps per run; steps 2..steps-1 are timed, so at least 3.
    steps: int = 8
    # Prompts per step (GRPO samples algorithm.num_generations completions of each).
    prompts_per_step: int = 16
    # SFT steps of the GRPO policy's warm start, run once and shared by the modes; 0: random weights.
    grpo_warmup_steps: int = 100
    # SFT steps of the GKD teacher, run once (cached in teacher.cache_dir); 0: the untrained preset.
    gkd_teacher_steps: int = 300
    # Extra overrides of the GRPO workload, driver command-line syntax, e.g. ["algorithm.beta=0.1"].
    grpo: List[str] = field(default_factory=list)
    # Extra overrides of the GKD workload; by default every step is on-policy (the student
    # generates), the steps where placement matters.
    gkd: List[str] = field(default_factory=lambda: ["algorithm.lmbda=1.0"])
    # One PNG per run with its per-role timeline.
    plot: bool = True
    # Local Ray cluster; its simulated GPUs default to what the largest layout needs.
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


ConfigStore.instance().store(name="colocate_vs_separate", node=BenchConfig)


def overrides(bench: BenchConfig, algo: str, mode: str, warm: str | None) -> list[str]:
    """Driver overrides of one run."""
    common = [f"run.steps={bench.steps}", f"run.prompts_per_step={bench.prompts_per_step}", "run.eval_every=0",
              "run.save_final=false", "trainer.warmup_steps=0", f"algorithm.max_staleness={bench.overlap_staleness if mode == 'overlap' else 0}"]
    if algo == "grpo":
        common += ["algorithm.warmup_sft_steps=0"] + ([f"model.path={warm}"] if warm else [])
    else:
        common += [f"teacher.warmup_steps={bench.gkd_teacher_steps}"]
    return ([f"+experiment={algo}_quickstart"] + (SEPARATE[algo] if mode != "colocate" else [])
            + common + list(getattr(bench, algo)))


def composed(algo: str, items: list[str], separate_teacher: bool = False):
    """(composed config, typed config, plan) as the driver's main builds them, checks included."""
    driver, schema = (grpo, grpo.GRPOConfig) if algo == "grpo" else (gkd, GKDConfig)
    register_schema(schema)
    cfg = compose(config_name="config", overrides=items + ["placement.teacher.gpus=1"] * separate_teacher)
    typed, plan = prepare(cfg, schema)
    driver.validate(typed, plan)
    return cfg, typed, plan


def grpo_warm_start(bench: BenchConfig, out: Path) -> str | None:
    """The GRPO policy's SFT warm start, once for every mode."""
    if not bench.grpo_warmup_steps:
        return None
    _, typed, plan = composed("grpo", overrides(bench, "grpo", "colocate", None)
                              + [f"algorithm.warmup_sft_steps={bench.grpo_warmup_steps}"])
    return grpo.warm_start(typed, plan["train"].world_size, out)


# ----------------------------------------------------------------------------- figures of one run

def busy_union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by at least one interval."""
    total, reach = 0.0, lo
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if end > max(start, reach):
            total += end - max(start, reach)
            reach = end
    return total


def summarize(algo: str, mode: str, out: Path) -> dict:
    records = read_metrics(out / "metrics.jsonl")
    timeline = read_metrics(out / "timeline.jsonl")
    ends, t = [], 0.0
    for r in records:  # each record's wall time ends its step: step k ends at ends[k]
        t += r["time/step_wall"]
        ends.append(t)
    timed = [r for r in records if 2 <= r["step"] <= len(records) - 2]
    lo, hi = ends[1], ends[len(records) - 2]
    wall = sum(r["time/step_wall"] for r in timed)
    res = {"algo": algo, "mode": mode, "timed_steps": len(timed), "step_s": wall / len(timed),
           "tokens_per_s": sum(r.get("train/tokens", 0.0) for r in timed) / wall,
           "eval_accuracy": records[-1].get("eval/accuracy"),
           "staleness_max": max((r.get("staleness/max", 0.0) for r in records), default=0.0),
           "staleness_mean": statistics.mean(r.get("staleness/mean", 0.0) for r in timed)}
    for name, keys in PHASES:
        res[f"{name}_s"] = statistics.mean(sum(r.get(k, 0.0) for k in keys) for r in timed)
    for role in ROLES[algo]:
        spans = [(e["start"], e["end"]) for e in timeline if e["role"] == role]
        res[f"idle_{role}"] = 1.0 - busy_union(spans, lo, hi) / max(hi - lo, 1e-9)
        res[f"rss_peak_mb_{role}"] = max(r.get(f"mem/{role}_rss_peak_bytes", 0) for r in records) / 2**20
        res[f"device_peak_mb_{role}"] = max(r.get(f"mem/{role}_device_peak_bytes", 0) for r in records) / 2**20
    sync = [r for r in timed if "sync/rollout/seconds" in r]
    res["sync_s"] = statistics.mean(r["sync/rollout/seconds"] if sync else r.get("time/sync_weights", 0.0)
                                    for r in (sync or timed))
    res["sync_mb_per_s"] = statistics.mean(r["sync/rollout/mb_per_s"] for r in sync) if sync else float("nan")
    res["moved_mb_per_step"] = statistics.mean(
        sum(v for k, v in r.items() if k.startswith("move/") and k.endswith("_bytes")) for r in timed) / 2**20
    return res


def table(rows: list[dict], algo: str) -> str:
    """A markdown table, one row per mode; device-memory columns only where a device was used."""
    roles = ROLES[algo]
    phases = [n for n, _ in PHASES if algo == "gkd" or n != "teacher"]
    device = any(r[f"device_peak_mb_{x}"] for r in rows for x in roles)
    head = (["mode", "step s", "tok/s"] + [("gen wait" if n == "wait" else n) + " s" for n in phases]
            + [f"idle {x}" for x in roles] + ["sync s", "sync MB/s", "swap MB/step"]
            + [f"RSS {x} MB" for x in roles] + ([f"dev {x} MB" for x in roles] if device else [])
            + ["stale max", "eval acc"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = ([r["mode"], f"{r['step_s']:.3f}", f"{r['tokens_per_s']:.0f}"]
                 + [f"{r[f'{n}_s']:.3f}" for n in phases]
                 + [f"{r[f'idle_{x}']:.2f}" for x in roles]
                 + [f"{r['sync_s']:.3f}", f"{r['sync_mb_per_s']:.0f}", f"{r['moved_mb_per_step']:.1f}"]
                 + [f"{r[f'rss_peak_mb_{x}']:.0f}" for x in roles]
                 + ([f"{r[f'device_peak_mb_{x}']:.0f}" for x in roles] if device else [])
                 + [f"{r['staleness_max']:.0f}", "-" if r["eval_accuracy"] is None else f"{r['eval_accuracy']:.3f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

@hydra.main(config_path="pkg://conf", config_name="colocate_vs_separate", version_base=None)
def main(cfg) -> None:
    bench: BenchConfig = OmegaConf.to_object(cfg)
    unknown = sorted(set(bench.algorithms) - set(ROLES)) + sorted(set(bench.modes) - set(MODES))
    if unknown or bench.steps < 3 or bench.overlap_staleness < 1:
        raise SystemExit(f"error: algorithms must be in {sorted(ROLES)}, modes in {list(MODES)}, steps >= 3 and "
                         f"overlap_staleness >= 1 (got unknown {unknown}, steps={bench.steps}, "
                         f"overlap_staleness={bench.overlap_staleness})")
    out = run_dir()
    # One cluster for every run, with the GPUs of the largest layout (GKD separate: 3).
    need = max(len(ROLES[a]) for a in bench.algorithms)
    if bench.cluster.simulate_gpus is None:
        bench.cluster.simulate_gpus = need
    init_cluster(bench.cluster, {"GPU": need})
    results = []
    for algo in bench.algorithms:
        warm = grpo_warm_start(bench, out / "grpo_warmup") if algo == "grpo" else None
        for mode in bench.modes:
            run_out = out / f"{algo}_{mode}"
            _, typed, plan = composed(algo, overrides(bench, algo, mode, warm),
                                             separate_teacher=algo == "gkd" and mode != "colocate")
            print(f"bench: {algo} {mode} (max_staleness={typed.algorithm.max_staleness}) -> {run_out}")
            (grpo if algo == "grpo" else gkd).run(typed, plan, run_out)
            results.append(summarize(algo, mode, run_out))
            if bench.plot:
                timeline([(f"{algo} {mode}: busy intervals per role", run_out)], out / f"timeline_{algo}_{mode}.png",
                         ROLES[algo])
        if bench.plot:  # the modes one above the other
            timeline([(f"{algo} {mode}", out / f"{algo}_{mode}") for mode in bench.modes],
                     out / f"timeline_{algo}.png", ROLES[algo])
    tables = [f"### {algo}\n\n{table([r for r in results if r['algo'] == algo], algo)}\n"
              for algo in bench.algorithms]
    text = "\n".join(tables)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(text)
    print(f"bench: results in {out}")


if __name__ == "__main__":
    main()
