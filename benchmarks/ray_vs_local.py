"""The same drivers with backend.workers=local and on Ray actors, interleaved in one run.

    python benchmarks/ray_vs_local.py
    python benchmarks/ray_vs_local.py --rounds 3 --steps 20 --algorithms grpo gkd
    python benchmarks/ray_vs_local.py --extra algorithm.max_new_tokens=8
    python benchmarks/ray_vs_local.py --parts drivers --algorithms gkd --ray-extra placement.teacher_in_trainer_process=true

Parts, each measured interleaved (A, B, B, A, ...) so that both sides see the machine alike:
  drivers   the GRPO and GKD quickstart experiments, shortened (--steps steps of
            --prompts prompts, --max-new-tokens tokens, no SFT warm start, eval at step 0 and at
            the end on --eval-size prompts), each round once with backend.workers=local and once
            on a local Ray cluster. Timed steps are 2..steps-1 (step 1 warms up, the last one
            evaluates). Per workload: the median step wall time of each backend and the ratio
            Ray/local (of the medians, the median of each round's own ratio, of the first quartiles and
            of the fastest steps), with the per-step breakdown from metrics.jsonl: time/driver (the driver's
            own time outside role calls), calls/remote, time/call_overhead (what the remote calls
            took beyond their methods' run on the ranks), time/sync_weights. Final eval accuracy shows both backends computed the same run.
            With --ray-extra, each round also runs Ray with those overrides (A, B, C, C, B, A, ...),
            reported as a row of its own against the same local runs.
  dispatch  a group.call(..., dispatch='all') of a --dispatch-mb MB array to --workers CPU ranks
            against a single ray.put and one .remote(ref) per rank (the floor), and against
            the argument pickled into every rank's call (what dispatch='all' did before).
  calls     where one call's time goes beside its work (--call-ms of 2-thread matmuls on one rank,
            a GKD step's batch as argument): the driver's submit, until the method starts on the
            rank, and from its end until the driver has the answer; through a worker group and
            through a bare Ray actor doing the same, interleaved.
  start     start_roles of 4 roles (one rank each; the role imports torch and builds a tiny
            model): all groups' actors created at once (start_roles) against one group after
            the other.
Prints one table per part; writes the figures as JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from algorithms import gkd, grpo
from algorithms.config.schema import prepare
from algorithms.gkd import GKDConfig
from algorithms.records.trackers import read_metrics
from orchestration.cluster import init_cluster
from orchestration.config import ClusterConfig, register_schema
from orchestration.placement import create_placement
from orchestration.planner import make_plan
from orchestration.transport import send_tensors_as_arrays
from orchestration.worker_group import WorkerGroup
from roles.batch import Batch

QUICKSTARTS = {"grpo": "grpo_quickstart", "gkd": "gkd_quickstart"}


def driver_overrides(args: argparse.Namespace, algo: str, backend: str) -> list[str]:
    items = [f"+experiment={QUICKSTARTS[algo]}", f"backend.workers={backend}", f"run.steps={args.steps}",
             f"run.prompts_per_step={args.prompts}", "run.eval_every=0", "run.save_final=false",
             f"run.eval_max_new_tokens={args.max_new_tokens}", f"data.eval_size={args.eval_size}",
             f"algorithm.max_new_tokens={args.max_new_tokens}", "run.log_every=0", "cluster.log_to_driver=false",
             "trainer.warmup_steps=0"]
    items += ["algorithm.warmup_sft_steps=0"] if algo == "grpo" else ["teacher.warmup_steps=0"]
    return items + list(args.extra)


def run_driver(algo: str, items: list[str], out: Path) -> list[dict]:
    from hydra import compose, initialize_config_module

    driver, schema = (grpo, grpo.GRPOConfig) if algo == "grpo" else (gkd, GKDConfig)
    register_schema(schema)
    with initialize_config_module("conf", version_base=None):
        cfg = compose(config_name="config", overrides=items)
    typed, plan = prepare(cfg, schema, cli=[])
    driver.validate(typed, plan)
    driver.run(typed, plan, out)
    return read_metrics(out / "metrics.jsonl")


def step_figures(records: list[dict]) -> dict:
    timed = [r for r in records if 2 <= r["step"] <= len(records) - 2]

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in timed)
    walls = sorted(r["time/step_wall"] for r in timed)
    return {"step_s": statistics.median(walls), "step_min_s": walls[0],
            # The first quartile: on a machine that stalls now and then for longer than a step,
            # the steps no stall reached.
            "step_q1_s": walls[len(walls) // 4], "driver_s": mean("time/driver"),
            "calls": mean("calls/remote"), "sync_s": mean("time/sync_weights"), "overhead_s": mean("time/call_overhead"),
            "eval_accuracy": records[-1].get("eval/accuracy")}


def sides(args: argparse.Namespace) -> tuple[str, ...]:
    """The runs of a round: local, Ray, and with --ray-extra Ray with those overrides ("ray+")."""
    return ("local", "ray", "ray+") if args.ray_extra else ("local", "ray")


def bench_drivers(args: argparse.Namespace, out: Path) -> list[dict]:
    rows = []
    for rnd in range(args.rounds):
        for algo in args.algorithms:
            for backend in sides(args) if rnd % 2 == 0 else sides(args)[::-1]:
                items = driver_overrides(args, algo, backend.rstrip("+")) + (args.ray_extra if backend == "ray+" else [])
                records = run_driver(algo, items, out / f"{algo}_{backend.replace('+', '_extra')}_{rnd}")
                rows.append({"algo": algo, "backend": backend, "round": rnd, **step_figures(records)})
                print(f"bench: round {rnd} {algo} {backend}: step {rows[-1]['step_s'] * 1e3:.1f} ms")
    return rows


def drivers_table(rows: list[dict], algos: list[str], ray_sides: tuple[str, ...] = ("ray",),
                  extra: tuple[str, ...] = ()) -> str:
    """One row per workload and Ray side ("ray+": the side with `extra` overrides), each against
    the local runs of the same rounds."""
    lines = ["| workload | local step ms | ray step ms | ray/local | ray/local, per round | ray/local, fastest quarter | ray/local, fastest steps | "
             "driver ms local/ray | remote calls/step ray | call overhead ms ray | sync ms local/ray | eval acc local/ray |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for algo, side in [(a, side) for a in algos for side in ray_sides]:
        by = {b: [r for r in rows if r["algo"] == algo and r["backend"] == (side if b == "ray" else b)]
              for b in ("local", "ray")}

        def med(b: str, k: str) -> float:
            return statistics.median(r[k] for r in by[b])
        # Each round's Ray step over the same round's local step (they ran back to back, so a machine
        # that slows down between rounds moves both), then the median over the rounds.
        paired = statistics.median(ray["step_s"] / local["step_s"] for ray, local in zip(by["ray"], by["local"]))
        lines.append(f"| {algo}{' ' + ' '.join(extra) if side == 'ray+' else ''} | {med('local', 'step_s') * 1e3:.1f} | {med('ray', 'step_s') * 1e3:.1f} | "
                     f"{med('ray', 'step_s') / med('local', 'step_s'):.2f}x | {paired:.2f}x | "
                     f"{med('ray', 'step_q1_s') / med('local', 'step_q1_s'):.2f}x | "
                     f"{med('ray', 'step_min_s') / med('local', 'step_min_s'):.2f}x | "
                     f"{med('local', 'driver_s') * 1e3:.1f} / {med('ray', 'driver_s') * 1e3:.1f} | "
                     f"{med('ray', 'calls'):.1f} | {med('ray', 'overhead_s') * 1e3:.1f} | {med('local', 'sync_s') * 1e3:.1f} / {med('ray', 'sync_s') * 1e3:.1f} | "
                     f"{by['local'][-1]['eval_accuracy']} / {by['ray'][-1]['eval_accuracy']} |")
    return "\n".join(lines)


class Sink:
    """A rank that reports what it received (its size), so nothing is sent back."""
    def size(self, x) -> int:
        return int(x.nbytes)


class TorchRole:
    """A role whose process needs torch and a tiny model, as every real role does."""
    def __init__(self):
        import torch

        self.model = torch.nn.Linear(64, 64)


class Busy:
    """Matmuls for a given time; reports when its method started and ended (wall clock)."""
    def __init__(self):
        import torch

        self.a = torch.randn(192, 192)

    def work(self, batch, ms: float) -> dict:
        started = time.time()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < ms / 1e3:
            self.a @ self.a
        return {"started": started, "ended": time.time()}


def bench_calls(args: argparse.Namespace) -> dict:
    import ray
    import torch


    @ray.remote(num_cpus=0)
    class BareBusy(Busy):
        def __init__(self, threads: int):
            send_tensors_as_arrays()
            torch.set_num_threads(threads)
            super().__init__()

    plan = make_plan({"device_groups": {"nproc_per_node": 1, "d": {"device": "CPU", "ranks": 1, "workers": ["default"]}}})
    placement = create_placement(plan, 60)
    group = WorkerGroup(Busy, plan["default"], placement=placement)
    bare = BareBusy.remote(group.threads[0])
    ids = torch.randint(0, 100, (args.prompts, 40))  # about a GKD quickstart step's batch
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones(ids.shape))
    paths = {"group": lambda: group.async_call("work", batch, args.call_ms, dispatch="slice", collect=lambda r: r[0]),
             "bare": lambda: bare.work.remote(batch, args.call_ms)}
    answers = {"group": lambda f: f.get(), "bare": ray.get}
    phases: dict[str, list] = {name: [] for name in paths}
    for i in range(args.reps * 4 + 4):
        for name in (list(paths) if i % 2 else list(paths)[::-1]):
            time.sleep(0.004)  # the driver's own work between calls
            t0 = time.time()
            future = paths[name]()
            sent = time.time()
            answer = answers[name](future)
            if i >= 4:
                phases[name].append((sent - t0, answer["started"] - t0, time.time() - answer["ended"]))
    group.shutdown()
    placement.remove()
    return {name: dict(zip(("submit_ms", "to_method_ms", "back_ms"),
                           (statistics.median(col) * 1e3 for col in zip(*rows)))) for name, rows in phases.items()}


def bench_dispatch(args: argparse.Namespace) -> dict:
    import ray


    plan = make_plan({"device_groups": {"nproc_per_node": 1,
                                        "d": {"device": "CPU", "ranks": args.workers, "workers": ["default"]}}})
    placement = create_placement(plan, 60)
    group = WorkerGroup(Sink, plan["default"], placement=placement)
    data = np.random.default_rng(0).standard_normal(int(args.dispatch_mb * 2**20 / 8))
    handles = [w.call for w in group.workers]

    def via_group():
        return group.call("size", data)

    def one_put():
        ref = ray.put(data)
        return ray.get([h.remote(group.key, "size", (), (), ref) for h in handles])

    def per_rank():
        return ray.get([h.remote(group.key, "size", (), (), data) for h in handles])
    times: dict[str, list[float]] = {"group": [], "put_once": [], "per_rank": []}
    paths = [("group", via_group), ("put_once", one_put), ("per_rank", per_rank)]
    for i in range(args.reps + 3):
        for name, fn in paths[i % 3:] + paths[:i % 3]:  # each path first as often (it pays for freeing)
            t0 = time.perf_counter()
            fn()
            if i >= 3:  # warm-up calls are not timed
                times[name].append(time.perf_counter() - t0)
    group.shutdown()
    placement.remove()
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    return {"workers": args.workers, "mb": args.dispatch_mb, **{f"{k}_ms": v * 1e3 for k, v in med.items()},
            **{f"{k}_min_ms": v * 1e3 for k, v in low.items()},
            "group_over_put_once": med["group"] / med["put_once"], "per_rank_over_put_once": med["per_rank"] / med["put_once"],
            "group_over_put_once_min": low["group"] / low["put_once"]}


def bench_start(args: argparse.Namespace) -> dict:
    names = ["train", "rollout", "teacher", "sampler"]
    plan = make_plan({"device_groups": {"nproc_per_node": 1, **{
        f"g{i}": {"device": "CPU", "ranks": 1, "workers": [r]} for i, r in enumerate(names)}}})
    times: dict[str, list[float]] = {"together": [], "one_by_one": []}
    for _ in range(args.start_rounds):
        for mode in times:
            placement = create_placement(plan, 60)
            t0 = time.perf_counter()
            groups = [WorkerGroup(TorchRole, plan[r], placement=placement, start=mode == "one_by_one")
                      for r in names]
            if mode == "together":  # what start_roles does
                for g in groups:
                    g.begin_setup()
                for g in groups:
                    g.end_setup()
            times[mode].append(time.perf_counter() - t0)
            for g in groups:
                g.shutdown()
            placement.remove()
            time.sleep(1.0)  # the killed actors' processes exit
    med = {k: statistics.median(v) for k, v in times.items()}
    return {**{f"{k}_s": v for k, v in med.items()}, "together_over_one_by_one": med["together"] / med["one_by_one"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=["drivers", "dispatch", "start"])
    p.add_argument("--algorithms", nargs="+", default=["grpo", "gkd"])
    p.add_argument("--rounds", type=int, default=3, help="interleaved local/ray rounds per workload")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (GRPO: x 8 completions)")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--eval-size", type=int, default=16)
    p.add_argument("--extra", nargs="*", default=[], help="more driver overrides, e.g. algorithm.lmbda=1.0")
    p.add_argument("--ray-extra", nargs="*", default=[],
                   help="a third run per round: Ray with these overrides too, e.g. placement.teacher_in_trainer_process=true")
    p.add_argument("--gpus", type=int, default=1, help="devices the local cluster simulates (a teacher group needs 2)")
    p.add_argument("--workers", type=int, default=4, help="ranks of the dispatch part")
    p.add_argument("--dispatch-mb", type=float, default=8.0)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--start-rounds", type=int, default=2)
    p.add_argument("--call-ms", type=float, default=25.0, help="work per call of the calls part")
    p.add_argument("--out", default="benchmarks/results/ray_vs_local.json")
    args = p.parse_args()


    # One local cluster for every part: room for the 4 start-part roles and the dispatch ranks.
    init_cluster(ClusterConfig(num_cpus=max(args.workers, 4) + 1, simulate_gpus=args.gpus, log_to_driver=False))
    results: dict = {"cores": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        if "drivers" in args.parts:
            rows = bench_drivers(args, Path(tmp))
            results["drivers"] = rows
            print(drivers_table(rows, args.algorithms, sides(args)[1:], tuple(args.ray_extra)))
    if "dispatch" in args.parts:
        d = results["dispatch"] = bench_dispatch(args)
        print(f"dispatch='all' of {d['mb']:.0f} MB to {d['workers']} ranks: group {d['group_ms']:.1f} ms, single "
              f"ray.put {d['put_once_ms']:.1f} ms, pickled per rank {d['per_rank_ms']:.1f} ms; group/put "
              f"{d['group_over_put_once']:.2f}x (fastest calls {d['group_over_put_once_min']:.2f}x), per-rank/put "
              f"{d['per_rank_over_put_once']:.2f}x")
    if "calls" in args.parts:
        c = results["calls"] = bench_calls(args)
        for name, f in c.items():
            print(f"one call through {'a worker group' if name == 'group' else 'a bare actor'}: submit "
                  f"{f['submit_ms']:.2f} ms, to the method {f['to_method_ms']:.2f} ms, back {f['back_ms']:.2f} ms "
                  f"(around {args.call_ms:.0f} ms of work)")
    if "start" in args.parts:
        s = results["start"] = bench_start(args)
        print(f"start of 4 roles: together {s['together_s']:.1f} s, one by one {s['one_by_one_s']:.1f} s "
              f"({s['together_over_one_by_one']:.2f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
