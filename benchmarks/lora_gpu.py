"""LoRA against full-parameter training on one GPU: the trainer's memory and step time per model
shape, what each kind of weight sync moves and costs, and a colocated GRPO-shaped step.

    python benchmarks/lora_gpu.py                                  # train, sync and grpo
    python benchmarks/lora_gpu.py train --shapes qwen2_0p5b qwen2p5_7b --rows 8 --tokens 1024
    python benchmarks/lora_gpu.py sync --sync-shape qwen2_0p5b --paths shm cuda_ipc
    python benchmarks/lora_gpu.py grpo --grpo-shape qwen2p5_7b --prompts 32 --samples 8 --new-tokens 256
    python benchmarks/lora_gpu.py --tiny --device cpu              # every part at tiny shapes (a smoke test)

train  per shape, a Trainer with LoRA (rank 8, alpha 32, all linear layers) beside one that
       trains every parameter, on the same random-token batches and micro-batches: peak device
       memory over construction and steps (torch.cuda.max_memory_allocated), median step time
       after the warm-up steps, tokens/s, and the ratios LoRA / full. fp32 master weights under
       bf16 autocast and AdamW, as the Trainer runs on CUDA. A configuration that runs out of
       device memory is reported as not fitting, with the peak it reached before.
sync   a LoRA trainer (after one update, so the adapter is not zero) and a torch Rollout (bf16)
       on the same device: bytes and seconds of a full sync (every weight, the adapter merged
       in), an adapted sync (only the merged tensors the adapter changes) and an adapter sync
       (the adapter's own tensors, which the rollout merges onto its copy of the base), each as
       `state_dict_buckets` + `update_weights` in one process (the hand-off of a colocated
       driver) and through `send_weights` / `receive_weights` on each of --paths; after each,
       the largest difference between the rollout's weights and the trainer's merged ones.
grpo   a LoRA trainer and a torch Rollout colocated on the device, GRPO-shaped steps: generate
       (--samples per prompt, exactly --new-tokens each), the rollout asleep (level 1) while the
       trainer takes one update on the batch (GRPO loss with a k3 KL to the base model, the
       adapter off, as reference), then the adapter synced into the awake rollout. Tokens
       (prompt + response) per second of the whole step, and each phase's seconds.
Each configuration runs in a process of its own (no other model's memory beside it). Figures go
to --out as JSON, and markdown tables to stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from algorithms.objectives.advantages import group_advantages
from algorithms.objectives.losses import GRPOLoss
from roles.batch import SamplingParams, batch_from_completions
from roles.lora import LoraConfig
from roles.models import ModelConfig, build_model, resolve_config
from roles.rollout import Rollout
from roles.trainer import Trainer, TrainerConfig
# Step timing, random-token batches and the device's peak rate (a sibling script).
from train_throughput import ROOT, sync, timed, train_batch

# Randomly initialised shapes (nothing is downloaded): the presets with Qwen2's real vocabulary
# (their character tokenizer has ~100 symbols; the embedding and output head weigh at 151936
# rows), and Qwen2.5-7B's shape. The tiny ones serve --tiny.
SHAPES = {
    "qwen2_0p5b": {"preset": "qwen2_0p5b", "vocab_size": 151936},
    "qwen2_1p5b": {"preset": "qwen2_1p5b", "vocab_size": 151936},
    "qwen2p5_7b": {"name": "qwen2p5_7b", "arch": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                   "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 32768,
                   "rope_theta": 1e6},
    "tiny_qwen2": {"preset": "tiny_qwen2", "vocab_size": 512},
    "tiny_llama": {"preset": "tiny_llama"},
}
LORA = LoraConfig(rank=8, alpha=32.0, target_modules=["all-linear"])


def model_spec(shape: str) -> ModelConfig:
    fields = dict(SHAPES[shape])
    preset = fields.pop("preset", None)
    return dataclasses.replace(resolve_config(preset), **fields) if preset else resolve_config(fields)


def built_on(device: str):
    """Models built inside this context get their weights on `device` at once, not initialised on
    the host and copied (slow at the 7B shape); what they hold there afterwards is the same."""
    return torch.device(device) if device.startswith("cuda") else contextlib.nullcontext()


def gib(nbytes: float) -> float:
    return nbytes / 2**30


def peak_gib(cuda: bool) -> float:
    return gib(torch.cuda.max_memory_allocated()) if cuda else 0.0


def out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def sizes(spec: ModelConfig) -> tuple[int, int]:
    """Parameters and vocabulary rows of a model spec."""
    with torch.device("meta"):  # sizes only: no weights on the host beside the measured model
        model = build_model(spec)
    return sum(p.numel() for p in model.parameters()), model.config.vocab_size


# ----------------------------------------------------------------------------- train

def train_one(args, shape: str, lora: bool) -> dict:
    """One trainer (LoRA or full-parameter) at one shape, in this process."""
    cuda, spec = args.device.startswith("cuda"), model_spec(shape)
    params, vocab = sizes(spec)
    # What weights, gradients and AdamW's two moments take in fp32 (before activations): a LoRA
    # trainer keeps the frozen base in fp32 and the rest for the adapter only.
    row = {"shape": shape, "lora": lora, "parameters": params, "rows": args.rows, "tokens": args.tokens,
           "micro_batch": args.micro_batch, "state_gib": None if lora else gib(16 * params)}
    batches = [train_batch(args.rows, args.tokens, vocab, False, seed)
               for seed in range(args.warmup_steps + args.steps)]
    config = TrainerConfig(lr=1e-5, warmup_steps=0, schedule="constant", device=args.device, dtype="bfloat16",
                           micro_batch_per_device=args.micro_batch, lora=LORA if lora else LoraConfig())
    try:
        with built_on(args.device):
            trainer = Trainer(spec, config)
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        row.update(trainable=trainable, state_gib=gib(4 * params + 12 * trainable),
                   built_gib=gib(torch.cuda.memory_allocated()) if cuda else 0.0)
        walls, warmup_s, out = timed(trainer.train_step, batches, args.warmup_steps, args.device)
        wall = statistics.median(walls)
        real = int(batches[-1].attention_mask.sum())
        row.update(fits=True, step_s=wall, walls_s=walls, warmup_s=warmup_s, tokens_per_s=real / wall,
                   peak_gib=peak_gib(cuda), loss=out["loss"])
    except Exception as exc:  # out of memory is a figure (it does not fit); anything else fails the row
        if not out_of_memory(exc):
            raise
        row.update(fits=False, peak_gib_before_oom=peak_gib(cuda), error=f"{type(exc).__name__}: {exc}"[:300])
    row["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    return row


def train_table(rows: list[dict]) -> None:
    print("\n| shape | parameters | LoRA trainable | full: peak GiB, step s | LoRA: peak GiB, step s "
          "| LoRA / full: peak, step |\n|---|---|---|---|---|---|")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        full = next((r for r in rows if r["shape"] == shape and not r["lora"]), {})
        lora = next((r for r in rows if r["shape"] == shape and r["lora"]), {})

        def cell(r: dict) -> str:
            if not r:
                return "-"
            if "error" in r and r.get("fits") is not False:
                return f"failed: {r['error'][:80]}"
            if not r.get("fits"):
                return f"does not fit (OOM at {r.get('peak_gib_before_oom', 0):.1f} GiB)"
            return f"{r['peak_gib']:.1f}, {r['step_s']:.3f}"

        ratio = "-"
        if full.get("fits") and lora.get("fits"):
            peak = f"{lora['peak_gib'] / full['peak_gib']:.2f}" if full["peak_gib"] else "-"  # (0 on CPU)
            ratio = f"{peak}, {lora['step_s'] / full['step_s']:.2f}"
        params = (full or lora).get("parameters", 0)
        print(f"| {shape} | {params / 1e6:,.0f}M | {lora.get('trainable', 0) / 1e6:.1f}M | {cell(full)} | "
              f"{cell(lora)} | {ratio} |")


# ----------------------------------------------------------------------------- sync

def max_diff(rollout: Rollout, want: dict) -> float:
    have = rollout.model.state_dict()
    return max(float((have[n].float() - t.to(have[n].device, have[n].dtype).float()).abs().max())
               for n, t in want.items())


def sync_one(args) -> dict:
    """Each sync part, direct and through each path, between a LoRA trainer and a torch Rollout."""
    cuda, spec = args.device.startswith("cuda"), model_spec(args.sync_shape)
    with built_on(args.device):
        rollout = Rollout(spec, config={"device": args.device, "dtype": "bfloat16",
                                        "lora_rank": LORA.rank, "lora_alpha": LORA.alpha})
        trainer = Trainer(spec, TrainerConfig(lr=1e-3, warmup_steps=0, schedule="constant", device=args.device,
                                              dtype="bfloat16", micro_batch_per_device=args.micro_batch, lora=LORA))
    params, vocab = sizes(spec)
    trainer.train_step(train_batch(4, 64, vocab, False, seed=0))  # B != 0: the adapter changes weights
    merged = {n: t for b in trainer.state_dict_buckets(1024, to_cpu=False) for n, t in b}
    rows, version = [], 0

    def direct(part: str) -> int:
        buckets = trainer.state_dict_buckets(args.bucket_mb, args.sync_dtype, to_cpu=False, part=part)
        rollout.update_weights(buckets, version, part=part)
        return sum(t.numel() * t.element_size() for b in buckets for _, t in b)

    def through(path: str, channel: dict):
        def send_receive(part: str) -> int:
            sent = trainer.send_weights(channel, version, version, args.bucket_mb, args.checksum, args.sync_dtype,
                                        part=part)
            rollout.receive_weights(channel, sent["manifest"], sent.get("payload"))
            return sent["bytes"]
        return send_receive

    ways = [("direct", direct)]
    for path in args.paths:
        try:
            channel = trainer.open_weight_channel(f"lora-{path}", path, "127.0.0.1", 2, None, 120.0)
            ways.append((path, through(path, channel)))
        except Exception as exc:  # a path this machine cannot open is a row, not the end of the run
            rows.append({"path": path, "part": "-", "error": f"{type(exc).__name__}: {exc}"[:300]})
    for way, fn in ways:
        for part in ("full", "adapted", "adapter"):  # "adapted" builds on a whole set of merged weights
            walls = []
            try:
                if part == "adapter":  # an adapter is merged onto the base: the rollout holds it again first
                    rollout.update_weights(trainer.state_dict_buckets(1024, to_cpu=False, part="base"), version)
                for i in range(args.sync_warmup + args.sync_reps):
                    version += 1
                    sync(args.device)
                    t0 = time.perf_counter()
                    nbytes = fn(part)
                    sync(args.device)
                    if i >= args.sync_warmup:
                        walls.append(time.perf_counter() - t0)
                row = {"path": way, "part": part, "bytes": nbytes, "seconds": statistics.median(walls),
                       "walls_s": walls, "max_abs_diff": max_diff(rollout, merged)}
            except Exception as exc:
                row = {"path": way, "part": part, "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    trainer.close_weight_channels()
    rollout.close_weight_receivers()
    for row in rows:
        full = next((r for r in rows if r["path"] == row["path"] and r["part"] == "full" and "error" not in r), None)
        if full and "error" not in row:
            row["x_full_bytes"], row["x_full_seconds"] = row["bytes"] / full["bytes"], row["seconds"] / full["seconds"]
    return {"shape": args.sync_shape, "parameters": params, "bucket_mb": args.bucket_mb,
            "dtype": args.sync_dtype or "float32", "checksum": args.checksum, "rows": rows,
            "peak_gib": peak_gib(cuda), "device": torch.cuda.get_device_name() if cuda else "cpu"}


def sync_table(result: dict) -> None:
    print(f"\n{result['shape']}, sent as {result['dtype']}:\n| path | part | MiB | seconds | x full bytes | "
          "x full seconds | max abs diff |\n|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r['path']} | {r['part']} | failed: {r['error'][:100]} | | | | |")
        else:
            print(f"| {r['path']} | {r['part']} | {r['bytes'] / 2**20:,.1f} | {r['seconds']:.4f} | "
                  f"{r.get('x_full_bytes', float('nan')):.4f} | {r.get('x_full_seconds', float('nan')):.3f} | "
                  f"{r['max_abs_diff']:.2e} |")


# ----------------------------------------------------------------------------- grpo

class Phases:
    """Seconds of each phase of a step (the device synchronised at both ends of each)."""

    def __init__(self, device: str):
        self.device, self.seconds = device, {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        sync(self.device)
        start = time.perf_counter()
        yield
        sync(self.device)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def grpo_one(args) -> dict:
    """GRPO-shaped steps of a LoRA trainer colocated with a torch Rollout, in this process."""
    cuda, spec = args.device.startswith("cuda"), model_spec(args.grpo_shape)
    loss = GRPOLoss(epsilon=0.2, epsilon_high=None, beta=args.beta, loss_type="grpo")
    rows = args.prompts * args.samples
    config = TrainerConfig(lr=1e-6, warmup_steps=0, schedule="constant", device=args.device, dtype="bfloat16",
                           micro_batch_per_device=args.grpo_micro_batch, lora=LORA, **json.loads(args.grpo_trainer))
    with built_on(args.device):  # the rollout first: its fp32 build, cast to bf16, peaks before the trainer is there
        rollout = Rollout(spec, config={"device": args.device, "dtype": "bfloat16", "max_batch_size": rows,
                                        "lora_rank": LORA.rank, "lora_alpha": LORA.alpha})
        trainer = Trainer(spec, config, loss_fn=loss)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    gen = torch.Generator().manual_seed(0)
    low, high = 3, len(rollout.tokenizer)  # prompt ids the tokenizer knows; samples come from the whole vocabulary
    sampling = dict(temperature=1.0, max_new_tokens=args.new_tokens, n=args.samples, ignore_eos=True)
    steps = []
    for step in range(args.grpo_warmup + args.grpo_steps):
        phase = Phases(args.device)
        start = time.perf_counter()
        prompts = torch.randint(low, high, (args.prompts, args.prompt_len), generator=gen).tolist()
        with phase("generate"):
            done = rollout.generate(prompts, SamplingParams(**sampling, seed=step))
        if args.sleep_level:
            with phase("sleep"):
                rollout.sleep(args.sleep_level)
        batch = batch_from_completions(done, rollout.pad_id)
        batch.advantages = group_advantages(torch.randn(rows, generator=gen), args.samples, "group", False)
        with phase("train"):
            metrics = trainer.train_step(batch, reference=args.beta > 0)
        if args.sleep_level:
            with phase("wake"):
                rollout.wake_up()
        with phase("sync"):
            rollout.update_weights(trainer.state_dict_buckets(args.bucket_mb, to_cpu=False, part="adapter"),
                                   step + 1, part="adapter")
        wall = time.perf_counter() - start
        tokens = int(batch.attention_mask.sum())
        row = {"step": step, "step_s": wall, "tokens": tokens, "response_tokens": int(batch.loss_mask.sum()),
               "tokens_per_s": tokens / wall, **{f"{k}_s": v for k, v in phase.seconds.items()},
               "loss": metrics["loss"], "kl": metrics.get("kl"), "peak_gib": peak_gib(cuda)}
        steps.append(row)
        print(json.dumps(row), flush=True)
    timed_steps = steps[args.grpo_warmup:]
    mean = {k: statistics.mean(r[k] for r in timed_steps) for k in timed_steps[0]
            if (k.endswith("_s") and k != "tokens_per_s") or k == "tokens"}
    return {"shape": args.grpo_shape, "parameters": sizes(spec)[0], "prompts": args.prompts,
            "samples": args.samples, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "micro_batch": args.grpo_micro_batch, "trainer": json.loads(args.grpo_trainer), "beta": args.beta,
            "sleep_level": args.sleep_level, "steps": steps, "mean": mean,
            "tokens_per_gpu_s": mean["tokens"] / mean["step_s"], "peak_gib": peak_gib(cuda),
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def grpo_table(result: dict) -> None:
    m = result["mean"]
    phases = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in m.items() if k not in ("step_s", "tokens"))
    print("\n| shape | rows x (prompt + new) | step s | phases s | tokens/GPU/s | peak GiB |")
    print("|---|---|---|---|---|---|")
    print(f"| {result['shape']} | {result['prompts'] * result['samples']} x ({result['prompt_len']} + "
          f"{result['new_tokens']}) | {m['step_s']:.2f} | {phases} | {result['tokens_per_gpu_s']:,.0f} | "
          f"{result['peak_gib']:.1f} |")


# ----------------------------------------------------------------------------- processes

def run_child(args, job: dict) -> dict:
    """`job` measured in a process of its own; an error row if it fails or runs past --timeout-s."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        part = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), "one", "--job", json.dumps(job), "--out", part,
           *child_argv(args)]
    print("$", " ".join(cmd[1:]), flush=True)
    try:
        code = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout_s).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    text = Path(part).read_text()
    os.unlink(part)
    return json.loads(text) if text.strip() and not code else {**job, "error": f"its process exited with {code}"}


def child_argv(args) -> list[str]:
    """The parent's settings, passed on to a child (everything but the mode, --out and --job)."""
    skip = {"mode", "out", "job", "tiny"}
    argv = []
    for key, value in vars(args).items():
        if key in skip or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="all", choices=["all", "train", "sync", "grpo", "one"])
    p.add_argument("--out", default="lora_gpu.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and sizes (with --device cpu: a smoke test)")
    p.add_argument("--timeout-s", type=float, default=600, help="limit of each configuration's process")
    p.add_argument("--job", help=argparse.SUPPRESS)  # a child's configuration
    t = p.add_argument_group("train")
    t.add_argument("--shapes", nargs="+", default=["qwen2_0p5b", "qwen2_1p5b", "qwen2p5_7b"], choices=list(SHAPES))
    t.add_argument("--rows", type=int, default=8, help="sequences per train step")
    t.add_argument("--tokens", type=int, default=1024, help="tokens per sequence")
    t.add_argument("--micro-batch", type=int, default=2, help="sequences per forward/backward")
    t.add_argument("--warmup-steps", type=int, default=2)
    t.add_argument("--steps", type=int, default=3, help="timed train steps (median reported)")
    s = p.add_argument_group("sync")
    s.add_argument("--sync-shape", default="qwen2_0p5b", choices=list(SHAPES))
    s.add_argument("--paths", nargs="*", default=["shm", "cuda_ipc"], help="send_weights paths besides the direct "
                   "hand-off (each in the same process)")
    s.add_argument("--bucket-mb", type=float, default=64.0, help="MiB per weight bucket (weight_sync.bucket_mb)")
    s.add_argument("--sync-dtype", help="cast for the sync; default: the trainer's fp32, as the drivers send")
    s.add_argument("--checksum", default="sample", help="send_weights checksum: sample or full")
    s.add_argument("--sync-warmup", type=int, default=1)
    s.add_argument("--sync-reps", type=int, default=3)
    g = p.add_argument_group("grpo")
    g.add_argument("--grpo-shape", default="qwen2p5_7b", choices=list(SHAPES))
    g.add_argument("--prompts", type=int, default=32)
    g.add_argument("--samples", type=int, default=8, help="completions per prompt (GRPO's group)")
    g.add_argument("--prompt-len", type=int, default=128)
    g.add_argument("--new-tokens", type=int, default=256)
    g.add_argument("--grpo-micro-batch", type=int, default=8)
    g.add_argument("--grpo-trainer", default='{"activation_checkpointing": true}', help="JSON of more TrainerConfig "
                   "keys for the grpo trainer")
    g.add_argument("--beta", type=float, default=0.04, help="k3 KL weight to the base model (0: no reference pass)")
    g.add_argument("--sleep-level", type=int, default=1, choices=[0, 1], help="rollout asleep during the update")
    g.add_argument("--grpo-warmup", type=int, default=1)
    g.add_argument("--grpo-steps", type=int, default=2)
    args = p.parse_args()
    if args.tiny:  # small enough for a CPU; the shapes keep their kinds (a tied and an untied model)
        args.shapes, args.sync_shape, args.grpo_shape = ["tiny_qwen2", "tiny_llama"], "tiny_qwen2", "tiny_qwen2"
        args.rows, args.tokens, args.micro_batch, args.prompts, args.samples = 4, 64, 2, 2, 4
        args.prompt_len, args.new_tokens, args.grpo_micro_batch = 8, 16, 4
        args.paths = [p for p in args.paths if p != "cuda_ipc" or args.device.startswith("cuda")]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.mode == "one":
        job = json.loads(args.job)
        run = {"train": lambda: train_one(args, job["shape"], job["lora"]), "sync": lambda: sync_one(args),
               "grpo": lambda: grpo_one(args)}[job["kind"]]
        Path(args.out).write_text(json.dumps({**job, **run()}, indent=1))
        return
    result = {}
    if args.mode in ("all", "train"):
        result["train"] = [run_child(args, {"kind": "train", "shape": shape, "lora": lora})
                           for shape in args.shapes for lora in (False, True)]
        Path(args.out).write_text(json.dumps(result, indent=1))  # kept if a later part fails
    if args.mode in ("all", "sync"):
        result["sync"] = run_child(args, {"kind": "sync"})
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.mode in ("all", "grpo"):
        result["grpo"] = run_child(args, {"kind": "grpo"})
        Path(args.out).write_text(json.dumps(result, indent=1))
    if "train" in result:
        train_table(result["train"])
    if "error" not in result.get("sync", {"error": 1}):
        sync_table(result["sync"])
    if "error" not in result.get("grpo", {"error": 1}):
        grpo_table(result["grpo"])


if __name__ == "__main__":
    main()
