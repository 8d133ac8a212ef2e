"""The GRPO and GKD drivers on one GPU with each rollout engine, side by side in one run.

    python benchmarks/gpu_drivers.py --rollout-engines torch vllm --steps 4
    python benchmarks/gpu_drivers.py --algorithms grpo --override run.prompts_per_step=32
    python benchmarks/gpu_drivers.py --algorithms grpo grpo_async --rollout-engines vllm

Each run is the real driver (`python -m algorithms.grpo +experiment=grpo_gpu`, `algorithms.gkd
+experiment=gkd_gpu`, grpo_async `algorithms.grpo +experiment=grpo_gpu_async`: Ray actors
sharing the GPU) as a subprocess, with the engine's overrides below; from each run's
metrics.jsonl, the step time and its phases averaged over the steps after the first and
before the last (GKD: on- and off-policy steps apart). Writes the figures as JSON to --out
(after every run) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DRIVER_RUNS = {
    "grpo": ("algorithms.grpo", "+experiment=grpo_gpu"),
    "gkd": ("algorithms.gkd", "+experiment=gkd_gpu"),
    # Generation one step ahead on the same GPU (both roles resident, the rollout never sleeps).
    "grpo_async": ("algorithms.grpo", "+experiment=grpo_gpu_async"),
}
# Per-engine overrides of the GPU experiments (which ship with vLLM: it sleeps at level 2, so
# updates wake only its weights and load device to device, and serves the GKD teacher too;
# grpo_async keeps the rollout awake throughout).
ENGINE_OVERRIDES = {"torch": {"grpo": ["backend.rollout=torch", "placement.sleep_level=1"],
                              "gkd": ["backend.rollout=torch", "backend.teacher=torch", "placement.sleep_level=1"],
                              "grpo_async": ["backend.rollout=torch"]},
                    "vllm": {"grpo": ["backend.rollout=vllm", "placement.sleep_level=2"],
                             "gkd": ["backend.rollout=vllm", "backend.teacher=vllm", "placement.sleep_level=2"],
                             "grpo_async": ["backend.rollout=vllm"]}}


# The trainer-rollout gap metrics shown (train/rollout_correction/<key>).
GAP, GAP_KEYS = "train/rollout_correction/", ("kl", "k3_kl", "log_ppl_abs_diff", "chi2_token", "chi2_seq",
                                             "is_weight_mean", "clipped_frac")


def _means(records: list[dict]) -> dict:
    keys = sorted({k for r in records for k in r if k.startswith(("time/", GAP)) or k.endswith("_s")})
    return {k: statistics.mean(r[k] for r in records if k in r) for k in keys}


def drivers(args) -> dict:
    out_root = Path(args.run_root or tempfile.mkdtemp(prefix="gpu-drivers-"))
    results = []
    for algo in args.algorithms:
        for engine in args.rollout_engines:
            module, experiment = DRIVER_RUNS[algo]
            run_dir = out_root / f"{algo}_{engine}"
            grpo_only = args.grpo_override if module == "algorithms.grpo" else []
            cmd = [sys.executable, "-m", module, experiment, f"run.steps={args.steps}", f"hydra.run.dir={run_dir}",
                   *ENGINE_OVERRIDES[engine][algo], *args.override, *grpo_only]
            print("$", " ".join(cmd[1:]), flush=True)
            t0 = time.perf_counter()
            try:
                code = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout_s).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            entry = {"algorithm": algo, "rollout_engine": engine, "command": " ".join(cmd[1:]),
                     "wall_s": time.perf_counter() - t0, "exit": code}
            metrics = run_dir / "metrics.jsonl"
            if metrics.is_file():
                records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
                last = max((r.get("step", 0) for r in records), default=0)
                # Steps after the first (one-off costs), before the last (it also evaluates).
                steps = [r for r in records if 2 <= r.get("step", 0) < last] or \
                    [r for r in records if r.get("step", 0) >= 2]
                entry["steps"] = records
                if steps:
                    entry["mean_after_step_1"] = _means(steps)
                # GKD: on-policy steps generate, off-policy ones do not; each kind on its own.
                for kind, flag in (("on_policy", 1.0), ("off_policy", 0.0)):
                    picked = [r for r in steps if r.get("gkd/on_policy") == flag]
                    if picked:
                        entry[f"mean_{kind}"] = _means(picked)
            results.append(entry)
            Path(args.out).write_text(json.dumps({"runs": results}, indent=1))  # so far
    print("\n| run | rollout engine | steps | step s | generate s | teacher s | train s | sync s | swap s |")
    print("|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for e in results:
        for kind in ("mean_after_step_1", "mean_on_policy", "mean_off_policy"):
            m = e.get(kind)
            if m is None:
                continue
            swap = sum(m.get(k, 0.0) for k in ("time/wake_up", "time/sleep", "time/onload", "time/offload"))
            print(f"| {e['algorithm']} | {e['rollout_engine']} | {kind[5:]} | {m.get('time/step', nan):.2f} | "
                  f"{m.get('time/generate', nan):.2f} | {m.get('time/teacher', nan):.2f} | "
                  f"{m.get('time/train', nan):.2f} | {m.get('time/sync_weights', nan):.2f} | {swap:.2f} |")
        if e["exit"]:
            print(f"| {e['algorithm']} | {e['rollout_engine']} | failed: exit {e['exit']} | | | | | | |")
    # The trainer-rollout gap on the sampled tokens (GRPO with algorithm.log_rollout_offpolicy_metrics).
    gaps = [(e, e["mean_after_step_1"]) for e in results if any(k.startswith(GAP) for k in e.get("mean_after_step_1", {}))]
    if gaps:
        print(f"\n| run | rollout engine | {' | '.join(GAP_KEYS)} |")
        print("|---|---|" + "---|" * len(GAP_KEYS))
        for e, m in gaps:
            print(f"| {e['algorithm']} | {e['rollout_engine']} | " +
                  " | ".join(f"{m.get(GAP + k, nan):.4g}" for k in GAP_KEYS) + " |")
    return {"runs": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algorithms", nargs="+", default=["grpo", "gkd"], choices=sorted(DRIVER_RUNS))
    p.add_argument("--rollout-engines", nargs="+", default=["torch", "vllm"], choices=sorted(ENGINE_OVERRIDES))
    p.add_argument("--steps", type=int, default=4, help="driver steps per run")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override for every driver run")
    p.add_argument("--grpo-override", action="append", default=[], help="extra Hydra override for the GRPO runs, "
                   "e.g. algorithm.log_rollout_offpolicy_metrics=true")
    p.add_argument("--run-root", help="folder of the driver runs (default: a temporary one)")
    p.add_argument("--timeout-s", type=float, default=900, help="limit per driver run")
    p.add_argument("--out", default="gpu_drivers.json")
    args = p.parse_args()
    result = drivers(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
