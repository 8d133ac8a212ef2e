"""Colocated rollout + trainer on one GPU: generation and training throughput, MFU, memory.

One process holds a Rollout and a Trainer on the same GPU and runs the colocated cycle of
the GRPO/GKD drivers: rollout wakes and generates, sleeps; trainer onloads, takes one
update on the generated sequences, syncs its weights into the rollout, offloads. Per phase
it measures wall time and peak device memory; it reports generated tokens/s, trained
tokens/s and the training step's model FLOPs utilisation
(MFU = 6 * parameters * trained tokens / step time / peak bf16 FLOP/s of the card).

    python benchmarks/gpu_throughput.py --model qwen2_0p5b --engine torch --steps 4
    python benchmarks/gpu_throughput.py --engine deepspeed   # or megatron

Writes the figures as JSON to --out. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from algorithms.tasks import arithmetic_examples
from roles.batch import SamplingParams, batch_from_completions
from roles.models import build_model
from roles.rollout import Rollout
from roles.trainer import Trainer, TrainerConfig

# Dense bf16 peak FLOP/s by device name (datasheet figures, no sparsity).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops() -> float:
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), float("nan"))


class Phase:
    """Wall time and peak device memory of a block (CUDA synchronised at both ends)."""

    def __init__(self, name: str, out: dict):
        self.name, self.out = name, out

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.out[f"time/{self.name}"] = time.perf_counter() - self.start
        self.out[f"peak_gib/{self.name}"] = torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2_0p5b")
    p.add_argument("--engine", default="torch", choices=["torch", "deepspeed", "megatron"])
    p.add_argument("--prompts", type=int, default=64, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=32, help="sequences per forward/backward")
    p.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up step)")
    p.add_argument("--fixed-length", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --new-tokens per completion (eos does not stop)")
    p.add_argument("--out", default="gpu_throughput.json")
    args = p.parse_args()

    params = sum(t.numel() for t in build_model(args.model).parameters())
    trainer = Trainer(args.model, TrainerConfig(lr=1e-5, warmup_steps=0, schedule="constant", device="cuda",
                                                dtype="bfloat16", micro_batch_per_device=args.micro_batch),
                      engine=args.engine)
    rollout = Rollout(args.model, config={"device": "cuda", "dtype": "bfloat16", "max_batch_size": 512})
    prompts = [ex.prompt_messages() for ex in arithmetic_examples(args.prompts * (args.steps + 1), seed=1)]
    # Random-init weights hit eos after a few dozen tokens; with --fixed-length eos does not
    # stop a completion, so every step has the same workload (new_tokens per completion).
    if args.fixed_length:
        rollout.eos_ids = set()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.samples, seed=0)
    trainer.offload()
    rollout.sleep(1)
    rows = []
    for step in range(args.steps + 1):
        m: dict = {"step": step}
        start = time.perf_counter()
        with Phase("generate", m):
            rollout.wake_up()
            comps = rollout.generate(prompts[step * args.prompts:(step + 1) * args.prompts], sampling)
            rollout.sleep(1)
        batch = batch_from_completions(comps, rollout.pad_id)
        with Phase("train", m):
            trainer.onload()
            result = trainer.train_step(batch)
        with Phase("sync", m):
            rollout.update_weights(trainer.state_dict_buckets(512, dtype="bfloat16", to_cpu=False), version=step + 1)
        with Phase("offload", m):
            trainer.offload()
        m["time/step"] = time.perf_counter() - start
        m["generated_tokens"] = sum(len(c) for c in comps.completion_ids)
        m["trained_tokens"] = int(batch.attention_mask.sum())
        m["generate_tokens_per_s"] = m["generated_tokens"] / m["time/generate"]
        m["train_tokens_per_s"] = m["trained_tokens"] / m["time/train"]
        m["mfu/train"] = 6 * params * m["trained_tokens"] / m["time/train"] / peak_flops()
        m["loss"] = result["loss"]
        rows.append(m)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()}), flush=True)
    timed = rows[1:]
    summary = {"device": torch.cuda.get_device_name(), "model": args.model, "parameters": params,
               "engine": args.engine, "prompts": args.prompts, "samples": args.samples,
               "new_tokens": args.new_tokens, "steps": args.steps}
    for key in timed[0]:
        if key != "step":
            summary[key] = sum(r[key] for r in timed) / len(timed)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "steps": rows}, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
