"""Where a Trainer step leaves the device idle: the step's host phases marked for the torch
profiler, a trace of a few steps, and per step the device's busy time, when its first kernel
started, and its idle gaps charged to the host phase that was running when each began.

    python benchmarks/step_profile.py --vocab-size 151936 \
        --variant '{"compile": true, "packing": true, "optimizer": "adamw_fused", "fused_logprobs": true}'
    python benchmarks/step_profile.py --device cpu --model tiny_qwen2 --tokens 64   # host phases only

Steps are timed after --warmup-steps (compile happens there), then --profile-steps more are
traced. Prints one summary per traced step and writes them (and the timed steps) as JSON to
--out; --trace keeps the chrome trace (gzip) for a closer look.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import roles.engines.torch_trainer as torch_trainer  # noqa: E402
import roles.engines.train_kernels as train_kernels  # noqa: E402
import roles.trainer as trainer_module  # noqa: E402
from roles.models import resolve_config  # noqa: E402
from gpu_throughput import sync  # noqa: E402
from train_throughput import train_batch  # noqa: E402

# (module or class, function) marked as a phase of the step: what the host runs between kernels.
PHASES = [(trainer_module.Trainer, "train_step"), (trainer_module.Trainer, "_forward"),
          (trainer_module, "batch_to"), (trainer_module, "host_floats"), (train_kernels, "pack"),
          (torch_trainer.TorchTrainEngine, "backward"), (torch_trainer.TorchTrainEngine, "optimizer_step"),
          (torch_trainer.TorchTrainEngine, "all_reduce_sum")]
STEP = "step"
DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


@contextlib.contextmanager
def marked_phases():
    """Each PHASES function runs inside a record_function of its name while the block runs."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in PHASES]
    for owner, name, fn in saved:
        def wrapped(*a, _fn=fn, _name=name, **k):
            with record_function(_name):
                return _fn(*a, **k)
        setattr(owner, name, functools.wraps(fn)(wrapped))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def step_summaries(trace: dict) -> list[dict]:
    """Per traced step (a `STEP` span): its wall, the device's busy time (kernels, copies and
    sets merged where they overlap), the first kernel's start, and the idle gaps' total by the
    innermost marked host phase running when each gap began."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_KINDS), key=lambda e: e["ts"])
    marks = [e for e in events if e.get("cat") == "user_annotation" and e["name"] != STEP]
    out = []
    for step in sorted((e for e in events if e["name"] == STEP), key=lambda e: e["ts"]):
        start, end = step["ts"], step["ts"] + step["dur"]
        work = [e for e in device if start <= e["ts"] <= end]
        busy, gaps, cursor = 0.0, collections.Counter(), None
        for e in work:
            if cursor is not None and e["ts"] > cursor:
                running = [m for m in marks if m["ts"] <= cursor <= m["ts"] + m["dur"]]
                inner = min(running, key=lambda m: m["dur"])["name"] if running else "-"
                gaps[inner] += e["ts"] - cursor
            stop = e["ts"] + e["dur"]
            busy += max(0.0, stop - max(e["ts"], cursor or e["ts"]))
            cursor = max(cursor or stop, stop)
        phases = collections.Counter()
        for m in marks:
            if start <= m["ts"] <= end:
                phases[m["name"]] += m["dur"]
        out.append({"wall_ms": step["dur"] / 1e3, "device_busy_ms": busy / 1e3,
                    "first_kernel_ms": (work[0]["ts"] - start) / 1e3 if work else None,
                    "idle_ms": sum(gaps.values()) / 1e3,
                    "idle_by_phase_ms": {k: round(v / 1e3, 2) for k, v in gaps.most_common()},
                    "host_phase_ms": {k: round(v / 1e3, 2) for k, v in phases.most_common()}})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2_0p5b")
    p.add_argument("--vocab-size", type=int, help="the model's vocabulary (default: its tokenizer's)")
    p.add_argument("--variant", default="{}", help="JSON dict of trainer keys")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--steps", type=int, default=12, help="timed steps before the traced ones")
    p.add_argument("--profile-steps", type=int, default=3, help="traced steps (the first may recompile under the profiler)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="step_profile.json")
    p.add_argument("--trace", help="keep the chrome trace here (.json.gz)")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    model = resolve_config(args.model)
    if args.vocab_size:
        model = dataclasses.replace(model, vocab_size=args.vocab_size)
    config = trainer_module.TrainerConfig(lr=1e-5, warmup_steps=0, schedule="constant", device=args.device,
                                          dtype="bfloat16" if cuda else "float32",
                                          micro_batch_per_device=args.micro_batch, **json.loads(args.variant))
    trainer = trainer_module.Trainer(model, config)
    batches = [train_batch(args.rows, args.tokens, trainer.model.config.vocab_size, False, seed)
               for seed in range(args.warmup_steps + args.steps + args.profile_steps)]
    walls = []
    for i, batch in enumerate(batches[:args.warmup_steps + args.steps]):
        sync(args.device)
        start = time.perf_counter()
        trainer.train_step(batch)
        sync(args.device)
        if i >= args.warmup_steps:
            walls.append((time.perf_counter() - start) * 1e3)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with marked_phases(), profile(activities=activities) as prof:
        for batch in batches[args.warmup_steps + args.steps:]:
            with record_function(STEP):
                trainer.train_step(batch)
            sync(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    if args.trace:
        with gzip.open(args.trace, "wt") as f:
            json.dump(trace, f)
    result = {"variant": json.loads(args.variant), "shape": f"{args.rows}x{args.tokens}",
              "vocab": trainer.model.config.vocab_size, "step_ms_median": statistics.median(walls),
              "step_ms": walls, "traced": step_summaries(trace)}
    print(f"{args.rows}x{args.tokens}, vocabulary {result['vocab']}, {args.variant}: "
          f"median step {result['step_ms_median']:.1f} ms over {len(walls)}")
    for s in result["traced"]:
        print(json.dumps(s))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
