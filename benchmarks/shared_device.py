"""Generation and training at once on one device, against one after the other.

    python benchmarks/shared_device.py --out shared_device.json                    # one GPU, vLLM
    python benchmarks/shared_device.py --engine torch --out shared_device.json     # the torch rollout
    python benchmarks/shared_device.py --device cpu --model tiny_qwen2 --rows 8 --samples 2 \\
        --new-tokens 8 --train-rows 8 --train-tokens 16 --calls 2 --steps 2 --engine torch  # smoke test

What generating ahead on the trainer's own device (algorithm.max_staleness with a colocated
rollout that never sleeps, `+experiment=grpo_gpu_async`) relies on: a Rollout in one process
generating --rows completions of --new-tokens tokens (--samples per prompt, seeded, with the
sampled tokens' logprobs, as GRPO asks) and a Trainer in another taking train steps on random
ragged rows (--train-rows x up to --train-tokens, grpo_gpu's trainer settings on a GPU: bf16,
packing, fused AdamW), both with --model's random weights. Each runs alone first (--calls
generations, --steps train steps, after one untimed warm-up each), then both start together.
Reports seconds per call alone and together, and the together phase's wall against the sum of
the two alone (`x_serial` < 1: sharing the device saved time). Writes JSON to --out.
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
from typing import Callable

import torch

from roles.batch import SamplingParams
from roles.rollout import Rollout
from roles.trainer import Trainer
from roles.trainer_config import TrainerConfig
# Random token-id prompts, random ragged train rows and the device sync (sibling scripts).
from gpu_throughput import prompt_ids
from train_throughput import sync, train_batch


# The settings a side is started with (the script's own options, passed on).
SIDE_SETTINGS = ("model", "device", "engine", "vllm_options", "rows", "samples", "prompt_len", "new_tokens",
                 "train_rows", "train_tokens", "micro_batch")


def rollout_side(args) -> Callable[[int], None]:
    """One generation (its seed given) of the Rollout."""
    cuda = args.device.startswith("cuda")
    options = json.loads(args.vllm_options) if args.engine == "vllm" else None
    rollout = Rollout(args.model, config={"device": args.device, "dtype": "bfloat16" if cuda else None,
                                          "max_batch_size": args.rows}, engine=args.engine, engine_options=options)
    prompts = prompt_ids(args.rows // args.samples, args.prompt_len, len(rollout.tokenizer), seed=1)

    def call(seed: int) -> None:
        rollout.generate(prompts, SamplingParams(temperature=1.0, n=args.samples, seed=seed, logprobs=True,
                                                 max_new_tokens=args.new_tokens, ignore_eos=True))
    return call


def train_side(args) -> Callable[[int], None]:
    """One train step of the Trainer (the same batch each time)."""
    cuda = args.device.startswith("cuda")
    config = TrainerConfig(lr=1e-6, warmup_steps=0, schedule="constant", device=args.device,
                           dtype="bfloat16" if cuda else "float32", micro_batch_per_device=args.micro_batch,
                           packing=cuda, optimizer="adamw_fused" if cuda else "adamw")
    trainer = Trainer(args.model, config)
    batch = train_batch(args.train_rows, args.train_tokens, len(trainer.tokenizer), ragged=True, seed=0)
    return lambda seed: trainer.train_step(batch)


def run_side(args) -> None:
    """One side in this process: build, warm up, wait for --go (when given), time --count calls."""
    call = (rollout_side if args.side == "rollout" else train_side)(args)
    call(0)  # warm-up: graphs, compilation, caches
    sync(args.device)
    if args.go:
        Path(f"{args.go}.ready.{args.side}").touch()
        while not Path(args.go).exists():
            time.sleep(0.005)
    walls, began = [], time.time()  # wall-clock time: the parent compares the two sides'
    for i in range(args.count):
        start = time.perf_counter()
        call(i + 1)
        sync(args.device)
        walls.append(time.perf_counter() - start)
    Path(args.result).write_text(json.dumps({"walls_s": walls, "began": began, "ended": time.time()}))


def spawn(args, side: str, count: int, result: Path, go: Path | None) -> subprocess.Popen:
    passed = [x for k in SIDE_SETTINGS for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    cmd = [sys.executable, __file__, *passed, "--side", side, "--count", str(count), "--result", str(result)]
    return subprocess.Popen(cmd + (["--go", str(go)] if go else []))


def wait(procs: list[subprocess.Popen], timeout: float) -> None:
    """Each side's exit, 0 expected; a failed or late side stops the run, naming it."""
    for p in procs:
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = f"no exit within --timeout-s={timeout}"
        if code:
            for q in procs:
                q.kill()
            raise SystemExit(f"shared_device: a side failed ({code}): {' '.join(p.args[2:])}")


def main_run(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="shared-device-"))
    counts = {"rollout": args.calls, "train": args.steps}
    out = {"settings": {k: v for k, v in vars(args).items() if k not in ("side", "count", "result", "go")}}
    if args.device.startswith("cuda"):
        out["device"] = torch.cuda.get_device_name(0)
    for side in ("rollout", "train"):  # alone, one after the other
        wait([spawn(args, side, counts[side], work / f"{side}_alone.json", None)], args.timeout_s)
        out[f"{side}_alone_s"] = json.loads((work / f"{side}_alone.json").read_text())["walls_s"]
    go = work / "go"
    procs = [spawn(args, side, counts[side], work / f"{side}_together.json", go) for side in counts]
    deadline = time.monotonic() + args.timeout_s
    while not all(Path(f"{go}.ready.{side}").exists() for side in counts):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            codes = [p.poll() for p in procs]
            for p in procs:
                p.kill()
            raise SystemExit(f"shared_device: a side did not get ready within --timeout-s={args.timeout_s} "
                             f"(exit codes {codes}, None: still running)")
        time.sleep(0.01)
    go.touch()
    wait(procs, args.timeout_s)
    together = {side: json.loads((work / f"{side}_together.json").read_text()) for side in counts}
    # From the first side's start to the last one's end (not the processes' exits).
    out["together_wall_s"] = max(t["ended"] for t in together.values()) - min(t["began"] for t in together.values())
    for side in counts:
        out[f"{side}_together_s"] = together[side]["walls_s"]
        out[f"{side}_together_span"] = [together[side]["began"], together[side]["ended"]]
    out["serial_s"] = sum(out["rollout_alone_s"]) + sum(out["train_alone_s"])
    out["x_serial"] = out["together_wall_s"] / out["serial_s"]
    for side in counts:
        out[f"{side}_together_x_alone"] = (statistics.median(out[f"{side}_together_s"])
                                           / statistics.median(out[f"{side}_alone_s"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2_0p5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--engine", default="vllm", choices=["vllm", "torch"], help="the rollout's engine")
    p.add_argument("--vllm-options", default='{"kv_cache_gib": 4, "gpu_memory_utilization": 0.1}',
                   help="the vllm section (JSON), as grpo_gpu sets it")
    p.add_argument("--rows", type=int, default=512, help="completions per generation")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--train-rows", type=int, default=512, help="rows per train step")
    p.add_argument("--train-tokens", type=int, default=168, help="the longest row (rows are 1/4 to all of it)")
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--calls", type=int, default=4, help="timed generations per phase")
    p.add_argument("--steps", type=int, default=4, help="timed train steps per phase")
    p.add_argument("--timeout-s", type=float, default=600, help="limit per phase")
    p.add_argument("--out", default="shared_device.json")
    # One side, run by the script itself.
    p.add_argument("--side", choices=["rollout", "train"], help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--go", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        run_side(args)
        return
    out = main_run(args)
    Path(args.out).write_text(json.dumps(out, indent=1))
    med = statistics.median
    print(f"| phase | generate s (median) | train step s (median) | wall s |\n|---|---|---|---|\n"
          f"| alone, one after the other | {med(out['rollout_alone_s']):.3f} | {med(out['train_alone_s']):.3f} | "
          f"{out['serial_s']:.2f} |\n| together | {med(out['rollout_together_s']):.3f} | "
          f"{med(out['train_together_s']):.3f} | {out['together_wall_s']:.2f} ({out['x_serial']:.2f}x) |")


if __name__ == "__main__":
    main()
