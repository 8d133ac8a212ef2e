"""Overhead of WorkerGroup.call over raw Ray for a sliced batch that goes both ways.

Starts a local Ray cluster, places N echo workers (CPU processes, or fake GPUs with
--device gpu) and times, interleaved in one run:
  group: group.call("echo", batch, dispatch="slice", collect="flatten")
  raw:   the same actors' .remote() on np.array_split slices, ray.get, np.concatenate
Prints median and p90 ms per call and the ratio group/raw (target <= 1.2x); writes the
figures as JSON to --out.

    python benchmarks/dispatch_overhead.py --workers 4 --mb 4 --reps 50
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from orchestration.cluster import init_cluster
from orchestration.config import ClusterConfig
from orchestration.placement import create_placement
from orchestration.planner import make_plan
from orchestration.worker_group import WorkerGroup

TARGET = 1.2


class Echo:
    def echo(self, x):
        return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mb", type=float, default=4.0, help="batch size in MB of float32")
    p.add_argument("--reps", type=int, default=50, help="timed repetitions of each path")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu", help="gpu: simulated GPUs")
    p.add_argument("--out", default="benchmarks/results/dispatch_overhead.json")
    args = p.parse_args()

    gpu = args.device == "gpu"
    plan = make_plan({"device_groups": {
        "nproc_per_node": args.workers,
        "bench": {"device": "GPU" if gpu else "CPU", "ranks": args.workers, "workers": ["default"]}}})
    cluster = ClusterConfig(simulate_gpus=args.workers if gpu else None, num_cpus=args.workers + 1,
                            log_to_driver=False)
    ray = init_cluster(cluster, plan.demand())
    placement = create_placement(plan, cluster.placement_timeout_s)
    group = WorkerGroup(Echo, plan["default"], placement=placement)

    cols = 1024
    rows = max(args.workers, int(args.mb * 2**20 / 4 / cols))
    batch = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)

    def via_group():
        return group.call("echo", batch, dispatch="slice", collect="flatten")

    def via_raw():
        chunks = np.array_split(batch, len(group.workers))
        # A rank's answer is (value, memory figures, seconds, deferred results): the value is first.
        answers = ray.get([w.call.remote(group.key, "echo", (), (), c) for w, c in zip(group.workers, chunks)])
        return np.concatenate([a[0] for a in answers])

    np.testing.assert_array_equal(via_group(), batch)
    np.testing.assert_array_equal(via_raw(), batch)
    times: dict[str, list[float]] = {"group": [], "raw": []}
    for i in range(args.warmup + args.reps):
        # Interleaved so that drift (other load, allocator state) hits both paths alike.
        for name, fn in (("group", via_group), ("raw", via_raw)) if i % 2 else (("raw", via_raw), ("group", via_group)):
            t0 = time.perf_counter()
            fn()
            if i >= args.warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    group.shutdown()
    placement.remove()
    ray.shutdown()

    stats = {name: {"median_ms": float(np.median(t)), "p90_ms": float(np.percentile(t, 90))}
             for name, t in times.items()}
    ratio = stats["group"]["median_ms"] / stats["raw"]["median_ms"]
    print(f"dispatch overhead: {args.workers} workers, {batch.nbytes / 2**20:.2f} MB float32 {batch.shape}, "
          f"{args.reps} reps, {args.device}")
    print(f"{'path':<6} {'median ms':>10} {'p90 ms':>10}")
    for name, s in stats.items():
        print(f"{name:<6} {s['median_ms']:>10.2f} {s['p90_ms']:>10.2f}")
    met = ratio <= TARGET
    print(f"ratio group/raw (median): {ratio:.3f}x; target <= {TARGET}x: {'met' if met else 'NOT met'}")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"workers": args.workers, "batch_mb": batch.nbytes / 2**20, "shape": list(batch.shape),
                   "reps": args.reps, "warmup": args.warmup, "device": args.device, **stats,
                   "ratio": ratio, "target": TARGET, "met": met, "raw_times_ms": times}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
