"""Runs across several GPUs of one host: placements, data/tensor-parallel trainer engines and
weight sync between GPUs, each part in one command.

    python benchmarks/multi_gpu.py placement                       # 2 GPUs (gkd teacher_group: 3)
    python benchmarks/multi_gpu.py placement --modes colocate separate overlap
    python benchmarks/multi_gpu.py train --variants torch megatron_tp2 deepspeed_zero3_1 deepspeed_zero3_2
    python benchmarks/multi_gpu.py train                            # every variant (megatron_dp2_tp2: 4 GPUs)
    python benchmarks/multi_gpu.py sync                             # 2 GPUs
    python benchmarks/multi_gpu.py all --simulate 4                 # any machine: simulated GPUs, tiny models

placement  the real drivers (algorithms.grpo / algorithms.gkd, in this process, one local Ray
           cluster for every run) with the experiments <algo>_gpu_colocate_2gpu (trainer DP=2
           and rollout on both GPUs, taking turns), <algo>_gpu_separate_2gpu with
           algorithm.max_staleness 0 (separate) and --staleness (overlap), the colocated one
           with every role resident and --staleness (colocate_overlap), and for GKD
           gkd_gpu_teacher_group_3gpu (the teacher on a GPU of its own; 3 GPUs). Per run, from its
           metrics and timeline (benchmarks/colocate_vs_separate.py's summary): step time,
           trained tokens/s, seconds per phase, idle fraction per role, weight-sync time, peak
           memory; per workload the overlap's step time against colocate's as a ratio, and a
           timeline PNG with the modes one above the other.
train      the Trainer role on random tokens (--rows x --tokens, --steps steps, the first one
           untimed) as one Ray worker group per variant: torch on 1 GPU (the reference),
           Megatron TP=2 (2 GPUs) and DP=2 x TP=2 (4), DeepSpeed ZeRO-3 on 1 and 2 GPUs. Per
           variant: the loss of every step and its largest relative difference from the
           reference (within --loss-tol?), step time, tokens/s, peak device memory per GPU and
           MFU (6 x parameters x tokens / step time / (GPUs x peak bf16 FLOP/s)).
sync       trainer -> rollout weight sync (orchestration.weight_sync, timed as
           benchmarks/weight_sync.py times it) of each --models preset: between two GPUs over
           NCCL (trainer on GPU 0, rollout on GPU 1, path collective) and within one GPU (path
           cuda_ipc), against a device-to-device copy of the same bytes on one GPU and a
           GPU 0 -> GPU 1 peer copy, measured in the same run; after the timed syncs the
           rollout's weights are compared with the trainer's, bit for bit.

A part refuses to start when a selected run needs more GPUs than the host has (torch's
count, or --simulate's). `--simulate N`: a local Ray cluster with N simulated GPUs (actors
get CUDA_VISIBLE_DEVICES, compute on the CPU in fp32, gloo instead of NCCL, shm instead of
CUDA IPC) and tiny models: the same code on a machine without GPUs. Writes results.json and
table.md (plus the timeline PNGs) into --out (default outputs/multi_gpu/<time>) and prints
the tables. docs/multi_gpu.md has the commands per machine.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the project's packages
    sys.path.insert(0, str(ROOT))

from orchestration.cluster import init_cluster  # noqa: E402
from orchestration.config import ClusterConfig  # noqa: E402
from algorithms import gkd, grpo
from algorithms.records.plots import timeline
from orchestration.placement import create_placement
from orchestration.planner import make_plan
from orchestration.worker_group import WorkerGroup
from roles.batch import Batch
from roles.models import build_model
from roles.trainer import Trainer, TrainerConfig


def _benchmark(name: str):
    """A sibling benchmark script as a module (benchmarks/ is not a package); its classes travel
    to Ray workers by value."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    from ray import cloudpickle
    cloudpickle.register_pickle_by_value(module)
    return module


# ----------------------------------------------------------------------------- placement

# (algorithm, mode) -> (experiment, algorithm.max_staleness: None = --staleness, GPUs it needs).
PLACEMENTS = {
    ("grpo", "colocate"): ("grpo_gpu_colocate_2gpu", 0, 2),
    ("grpo", "separate"): ("grpo_gpu_separate_2gpu", 0, 2),
    ("grpo", "overlap"): ("grpo_gpu_separate_2gpu", None, 2),
    ("grpo", "colocate_overlap"): ("grpo_gpu_colocate_2gpu", None, 2),
    ("gkd", "colocate"): ("gkd_gpu_colocate_2gpu", 0, 2),
    ("gkd", "colocate_overlap"): ("gkd_gpu_colocate_2gpu", None, 2),
    ("gkd", "separate"): ("gkd_gpu_separate_2gpu", 0, 2),
    ("gkd", "overlap"): ("gkd_gpu_separate_2gpu", None, 2),
    ("gkd", "teacher_group"): ("gkd_gpu_teacher_group_3gpu", 0, 3),
    ("gkd", "teacher_group_overlap"): ("gkd_gpu_teacher_group_3gpu", None, 3),
}
MODES = ("colocate", "separate", "overlap", "colocate_overlap", "teacher_group", "teacher_group_overlap")
# colocate_overlap: the colocated layout with every role resident (no sleep, no offload), so the
# rollout generates ahead on the devices the trainer trains on.
MODE_OVERRIDES = {"colocate_overlap": ["placement.sleep_level=0", "placement.offload_model=false",
                                       "placement.offload_optimizer=false", "placement.offload_teacher_model=false"]}
# Simulated runs: tiny models and data, fp32 on the CPU (as tests/test_experiments_run.py shrinks them).
SIMULATE_PLACEMENT = {
    "common": ["model=tiny_qwen2", "run.prompts_per_step=4", "data.train_size=32", "data.eval_size=2",
               "run.eval_max_new_tokens=4", "rollout.dtype=float32", "trainer.micro_batch_per_device=8",
               "rollout.max_batch_size=16"],
    "grpo": ["algorithm.num_generations=2", "algorithm.max_new_tokens=8"],
    "gkd": ["algorithm.max_new_tokens=8", "teacher.model=nano_qwen2", "teacher.engine.dtype=float32",
            "teacher.engine.micro_batch_per_device=8", "teacher.cache_dir={out}/teachers"],
}


def placement_runs(args) -> list[tuple[str, str]]:
    return [(a, m) for a in args.algorithms for m in args.modes if (a, m) in PLACEMENTS]


def placement_overrides(args, algo: str, mode: str, out: Path) -> list[str]:
    experiment, staleness, _ = PLACEMENTS[(algo, mode)]
    items = [f"+experiment={experiment}", f"run.steps={args.steps}", "run.eval_every=0", "run.save_final=false",
             f"algorithm.max_staleness={args.staleness if staleness is None else staleness}",
             *MODE_OVERRIDES.get(mode, [])]
    if args.simulate:
        items += SIMULATE_PLACEMENT["common"] + [s.format(out=out) for s in SIMULATE_PLACEMENT[algo]]
        # The experiments' teacher (colocated or in its own group): a smaller preset with the tiny student's vocabulary.
        if algo == "gkd":
            items.append("placement.teacher.model=nano_qwen2" if "teacher_group" in mode
                         else "placement.teacher_model=nano_qwen2")
    return items + list(args.override)


def placement(args, out: Path) -> list[dict]:
    from hydra import initialize_config_module

    cvs = _benchmark("colocate_vs_separate")
    results = []
    for algo in args.algorithms:
        modes = [m for m in args.modes if (algo, m) in PLACEMENTS]
        for mode in modes:
            run_out = out / f"{algo}_{mode}"
            with initialize_config_module(config_module="conf", version_base=None):
                _, typed, plan = cvs.composed(algo, placement_overrides(args, algo, mode, out))
            print(f"multi_gpu: {algo} {mode} ({PLACEMENTS[(algo, mode)][0]}, "
                  f"max_staleness={typed.algorithm.max_staleness}) -> {run_out}", flush=True)
            (grpo if algo == "grpo" else gkd).run(typed, plan, run_out)
            row = cvs.summarize(algo, mode, run_out)
            row["experiment"] = PLACEMENTS[(algo, mode)][0]
            row["gpus"] = plan.demand().get("GPU", 0)
            row["ranks"] = {role: list(p.ranks) for role, p in plan.roles.items()}
            results.append(row)
        rows = {r["mode"]: r for r in results if r["algo"] == algo}
        base = rows.get("colocate")
        for r in rows.values():  # < 1: faster than colocate
            r["step_vs_colocate"] = r["step_s"] / base["step_s"] if base else float("nan")
        if args.plot and modes:
            timeline([(f"{algo} {m}", out / f"{algo}_{m}") for m in modes], out / f"timeline_{algo}.png",
                     cvs.ROLES[algo])
    return results


def placement_table(results: list[dict]) -> str:
    cvs = _benchmark("colocate_vs_separate")
    parts = []
    for algo in dict.fromkeys(r["algo"] for r in results):
        rows = [r for r in results if r["algo"] == algo]
        ratio = "\n".join(f"- {r['mode']}: step time {r['step_vs_colocate']:.2f}x colocate's" for r in rows
                          if r["mode"] != "colocate" and r["step_vs_colocate"] == r["step_vs_colocate"])
        parts.append(f"### {algo}\n\n{cvs.table(rows, algo)}\n\n{ratio}\n")
    return "\n".join(parts)


# ----------------------------------------------------------------------------- train

# Variant -> (engine, engine options, GPUs). "torch" (one GPU) is the reference of the others.
VARIANTS = {
    "torch": ("torch", {}, 1),
    "megatron_tp2": ("megatron", {"tensor_parallel_size": 2}, 2),
    "megatron_dp2_tp2": ("megatron", {"tensor_parallel_size": 2}, 4),
    "deepspeed_zero3_1": ("deepspeed", {"zero_stage": 3}, 1),
    "deepspeed_zero3_2": ("deepspeed", {"zero_stage": 3}, 2),
}


def random_batch(rows: int, tokens: int, vocab: int, seed: int):
    """Random token ids, every position trained (the same batch every step and variant)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, tokens), generator=gen)
    return Batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones(rows, tokens))


def train_variant(name: str, args, batch, params: int, peak: float) -> dict:
    engine, options, gpus = VARIANTS[name]
    device, dtype = ("cpu", "float32") if args.simulate else ("cuda", "bfloat16")
    config = TrainerConfig(lr=args.lr, warmup_steps=0, device=device, dtype=dtype,
                           micro_batch_per_device=args.micro_batch)
    plan = make_plan({"train": {"gpus": gpus}})
    place = create_placement(plan, 120)
    group = None
    steps, losses = [], []
    try:
        group = WorkerGroup(Trainer, plan["train"], {"model": args.train_model, "config": config, "engine": engine,
                                                     "engine_options": options}, placement=place, timeout_s=1800)
        visible = [i["cuda_visible_devices"] for i in group.infos]
        for _ in range(args.train_steps):
            t0 = time.perf_counter()
            metrics = group.call("train_step", batch, dispatch="slice")
            steps.append(time.perf_counter() - t0)
            losses.append(metrics[0]["loss"])
        memory = group.memory()
    finally:
        if group is not None:
            group.shutdown()
        place.remove()
    step_s = statistics.median(steps[1:])
    tokens = int(batch.attention_mask.sum())
    return {"variant": name, "engine": engine, "options": options, "gpus": gpus, "cuda_visible_devices": visible,
            "losses": losses, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "mfu": 6 * params * tokens / step_s / (gpus * peak),
            "device_peak_gib": [m["device_peak_bytes"] / 2**30 for m in memory],
            "rss_peak_gib": [m["rss_peak_bytes"] / 2**30 for m in memory]}


def train(args, out: Path) -> list[dict]:
    model = build_model(args.train_model)
    params, vocab = sum(p.numel() for p in model.parameters()), model.config.vocab_size
    del model
    peak = float("nan") if args.simulate else _benchmark("gpu_throughput").peak_flops()
    batch = random_batch(args.rows, args.tokens, vocab, seed=0)
    names = ["torch"] + [v for v in args.variants if v != "torch"]
    results = []
    for name in names:
        print(f"multi_gpu: train {name} on {VARIANTS[name][2]} GPU(s)", flush=True)
        results.append(train_variant(name, args, batch, params, peak))
    ref = results[0]["losses"]
    tol = args.loss_tol if args.loss_tol is not None else (1e-4 if args.simulate else 2e-2)
    for r in results:
        r["parameters"] = params
        r["loss_rel_diff_max"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref))
        r["loss_tol"] = tol
        r["losses_match"] = r["loss_rel_diff_max"] <= tol
    return results


def train_table(results: list[dict]) -> str:
    lines = ["| variant | GPUs | step s | tok/s | MFU | peak GiB per GPU | first / last loss | "
             "max rel. diff to torch |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        device = any(r["device_peak_gib"])  # on the CPU: each rank's peak host RSS instead
        mem = " / ".join(f"{g:.2f}" for g in r["device_peak_gib" if device else "rss_peak_gib"]) + " RSS" * (not device)
        lines.append(f"| {r['variant']} | {r['gpus']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['mfu']:.3f} | {mem} | {r['losses'][0]:.4f} / {r['losses'][-1]:.4f} | "
                     f"{r['loss_rel_diff_max']:.1e} ({'ok' if r['losses_match'] else 'OVER'} {r['loss_tol']:.0e}) |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- sync

class PeerCopy:
    """copy_ of `nbytes` from GPU 0 to GPU 1 (NVLink / PCIe peer copy), synchronised: the
    floor of a broadcast between two GPUs."""

    def __init__(self, nbytes: int):
        self.src = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
        self.dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:1")
        self.seconds: list[float] = []
        self()

    def __call__(self) -> None:
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        self.seconds.append(time.perf_counter() - t0)


# Layout -> (placement, path on GPUs, path with --simulate).
SYNC_LAYOUTS = {
    "between_gpus": ({"train": {"gpus": 1}, "rollout": {"gpus": 1}}, "collective", "collective"),
    "same_gpu": ({"colocate_groups": [["train", "rollout"]], "train": {"gpus": 1}, "rollout": {"gpus": 1}},
                 "cuda_ipc", "shm"),
}


def sync_model(model: str, args) -> list[dict]:
    ws = _benchmark("weight_sync")
    device = "cpu" if args.simulate else "cuda"
    settings = ws.WeightSyncBench(bucket_mb=args.bucket_mb, warmup=1, reps=args.reps, device=device)
    kwargs = {"model": model, "config": {"device": device}}
    rows = []
    for layout in args.layouts:
        placement_cfg, gpu_path, cpu_path = SYNC_LAYOUTS[layout]
        path = cpu_path if args.simulate else gpu_path
        plan = make_plan(placement_cfg)
        place = create_placement(plan, 120)
        trainer = rollout = None
        try:
            trainer = WorkerGroup(ws.BenchTrainer, plan["train"], kwargs, placement=place, timeout_s=1800)
            rollout = WorkerGroup(ws.BenchRollout, plan["rollout"], kwargs, placement=place, timeout_s=1800)
            gpus = [trainer.infos[0]["cuda_visible_devices"], rollout.infos[0]["cuda_visible_devices"]]
            nbytes = trainer.call("sync_bytes", args.bucket_mb, execute="first")
            memcpy = ws.Memcpy(nbytes, device)
            peer = PeerCopy(nbytes) if device == "cuda" else None
            timed = ws.time_path(trainer, rollout, path, settings, memcpy)
            if peer is not None:
                for _ in range(args.reps):
                    peer()
        finally:
            for g in (trainer, rollout):
                if g is not None:
                    g.shutdown()
            place.remove()
        mib = timed["bytes"] / 2**20
        row = {"model": model, "layout": layout, "cuda_visible_devices": gpus, **timed,
               "mb_per_s": mib / timed["median_s"], "d2d_copy_mb_per_s": mib / statistics.median(memcpy.seconds[1:]),
               "peer_copy_mb_per_s": mib / statistics.median(peer.seconds[1:]) if peer else float("nan")}
        row["ratio_to_d2d_copy"] = row["mb_per_s"] / row["d2d_copy_mb_per_s"]
        rows.append(row)
    return rows


def sync(args, out: Path) -> list[dict]:
    results = []
    for model in args.models:
        print(f"multi_gpu: sync {model} ({', '.join(args.layouts)})", flush=True)
        results += sync_model(model, args)
    return results


def sync_table(results: list[dict]) -> str:
    lines = ["| model | layout | path | GPUs (trainer, rollout) | MiB | median s | GB/s | same-GPU copy GB/s | "
             "GPU0->GPU1 copy GB/s | x same-GPU copy | exact |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        gb = lambda mbs: f"{mbs * 2**20 / 1e9:.2f}"  # noqa: E731
        lines.append(f"| {r['model']} | {r['layout']} | {r['path']} | {', '.join(r['cuda_visible_devices'])} | "
                     f"{r['bytes'] / 2**20:.0f} | {r['median_s']:.4f} | {gb(r['mb_per_s'])} | "
                     f"{gb(r['d2d_copy_mb_per_s'])} | {gb(r['peer_copy_mb_per_s'])} | "
                     f"{r['ratio_to_d2d_copy']:.2f} | {r['exact']} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

PARTS = {"placement": (placement, placement_table), "train": (train, train_table), "sync": (sync, sync_table)}


def needs(args) -> dict[str, int]:
    """GPUs each selected run needs."""
    out = {}
    if "placement" in args.parts:
        out.update({f"placement {a} {m}": PLACEMENTS[(a, m)][2] for a, m in placement_runs(args)})
    if "train" in args.parts:
        out.update({f"train {v}": VARIANTS[v][2] for v in ["torch", *args.variants]})
    if "sync" in args.parts:
        out.update({f"sync {layout}": 2 if layout == "between_gpus" else 1 for layout in args.layouts})
    return out


def parse(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", choices=[*PARTS, "all"])
    p.add_argument("--simulate", type=int, default=0, metavar="N",
                   help="N simulated GPUs on a local Ray cluster, tiny models on the CPU")
    p.add_argument("--out", help="results folder (default outputs/multi_gpu/<time>)")
    g = p.add_argument_group("placement")
    g.add_argument("--algorithms", nargs="+", default=["grpo", "gkd"], choices=["grpo", "gkd"])
    g.add_argument("--modes", nargs="+", default=["colocate", "separate", "overlap"], choices=MODES,
                   help="teacher_group / teacher_group_overlap: GKD only, 3 GPUs")
    g.add_argument("--steps", type=int, default=6, help="driver steps per run; steps 2..steps-1 are timed")
    g.add_argument("--staleness", type=int, default=1, help="algorithm.max_staleness of the overlap modes")
    g.add_argument("--override", action="append", default=[], help="extra driver override for every run")
    g.add_argument("--no-plot", dest="plot", action="store_false")
    g = p.add_argument_group("train")
    g.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v != "torch"], choices=list(VARIANTS))
    g.add_argument("--train-model", help="model preset (default qwen2_0p5b; --simulate: tiny_qwen2)")
    g.add_argument("--rows", type=int, help="sequences per step (default 16; --simulate: 8)")
    g.add_argument("--tokens", type=int, help="tokens per sequence (default 1024; --simulate: 32)")
    g.add_argument("--micro-batch", type=int, default=4, help="trainer.micro_batch_per_device")
    g.add_argument("--train-steps", type=int, default=6, help="steps per variant (the first is untimed)")
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--loss-tol", type=float, help="largest relative loss difference to torch (default 2e-2; "
                                                  "--simulate, fp32: 1e-4)")
    g = p.add_argument_group("sync")
    g.add_argument("--models", nargs="+", help="presets (default qwen2_0p5b qwen2_1p5b; --simulate: tiny_qwen2)")
    g.add_argument("--layouts", nargs="+", default=list(SYNC_LAYOUTS), choices=list(SYNC_LAYOUTS))
    g.add_argument("--bucket-mb", type=float, default=256.0)
    g.add_argument("--reps", type=int, default=5, help="timed syncs per layout (median reported)")
    args = p.parse_args(argv)
    args.parts = list(PARTS) if args.part == "all" else [args.part]
    tiny = bool(args.simulate)
    args.train_model = args.train_model or ("tiny_qwen2" if tiny else "qwen2_0p5b")
    args.rows = args.rows or (8 if tiny else 16)
    args.tokens = args.tokens or (32 if tiny else 1024)
    args.models = args.models or (["tiny_qwen2"] if tiny else ["qwen2_0p5b", "qwen2_1p5b"])
    if args.steps < 3 or args.train_steps < 2:
        p.error("--steps must be >= 3 (steps 2..steps-1 are timed) and --train-steps >= 2")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    have = args.simulate or torch.cuda.device_count()
    short = {run: n for run, n in needs(args).items() if n > have}
    if short:
        where = f"{args.simulate} simulated" if args.simulate else f"{have} (torch.cuda.device_count())"
        raise SystemExit(f"error: multi_gpu {args.part}: this host has {where} GPU(s); "
                         + ", ".join(f"{run} needs {n}" for run, n in short.items())
                         + ". Fix: run on a host with that many GPUs (docs/multi_gpu.md: 2 or 4 GPUs), "
                           "leave those runs out (--modes, --variants, --layouts) or add --simulate N")
    out = Path(args.out or ROOT / "outputs" / "multi_gpu" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    out.mkdir(parents=True, exist_ok=True)
    cluster = ClusterConfig(simulate_gpus=args.simulate or None, simulate_missing_gpus=False, log_to_driver=False,
                            object_store_mb=2048 if args.simulate else None)
    init_cluster(cluster, {"GPU": max(needs(args).values(), default=0)})
    host = {"gpus": have, "simulated": bool(args.simulate),
            "device": "cpu" if args.simulate else torch.cuda.get_device_name(0)}
    results, tables = {"host": host}, []
    for part in args.parts:
        run, table = PARTS[part]
        results[part] = run(args, out)
        tables.append(f"## {part}\n\n{table(results[part])}\n")
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))  # so far
    text = f"# multi-GPU runs on {host['gpus']} {'simulated ' * host['simulated']}GPU(s) ({host['device']})\n\n" \
        + "\n".join(tables)
    (out / "table.md").write_text(text)
    print(text)
    print(f"multi_gpu: results in {out}")
    return results


if __name__ == "__main__":
    main()
