"""Train-step throughput on one GPU: a plain eager step beside the torch Trainer and its
variants, each in a process of its own. Run through `gpu_throughput.py train`:

    python benchmarks/gpu_throughput.py train --train-shape 512x320 8x1024 --train-variant '{"compile": true}'
    python benchmarks/gpu_throughput.py train --train-shape 8x1024 --train-variant '{"compile": true}' \\
        --profile-dir profiles --teacher-variant '{"chunked_logprobs": true}'

Train steps on random tokens at each --train-shape ROWSxTOKENS (`--ragged`: row
lengths uniform in [TOKENS/4, TOKENS], right-padded): a plain eager step (fp32 master weights under bf16 autocast, a full float32 log-softmax, AdamW,
the same micro-batches) beside the project's torch Trainer, plain and with each
--train-variant (JSON of trainer keys: the kernel options, optimizer, ...). Per
variant and shape: trained (real) tokens/s (median of --steps after
--warmup-steps), model TFLOP/s (6 x parameters + causal attention per token), MFU
against the peak bf16 rate and the same against the sustained matmul rate, peak GiB,
the ratio to the plain eager step and the loss of the last step. Each variant runs in a
process of its own, at every shape (as a run has it: no other variant's memory, compiled
code or guards beside it); the teacher forward runs in the parent.
`--profile-dir DIR`: one more step of each variant under torch.profiler, its summary
written to DIR/train_<variant>_<shape>.json (top CUDA kernels by device time, the
shares of matmul / attention / elementwise / optimizer / copy / other kernels, device
busy time against the step's wall time). `--teacher-variant` (JSON of
TeacherConfig's packing / compile / chunked_logprobs; repeatable) adds, per shape,
the teacher's forward (top-`--teacher-topk` logprobs and tail mass) plain and with
each variant: tokens/s, MFU (a third of the train step's FLOPs per token), peak GiB,
rows per forward, and the largest difference from the plain teacher's values
(profiled too with --profile-dir: DIR/teacher_<variant>_<shape>.json).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from algorithms.objectives.losses import GKDLoss, gkd_loss
from roles.batch import Batch, fitting_rows, token_bytes
from roles.models import build_model, resolve_config
from roles.teacher import Teacher, TeacherConfig
from roles.trainer import Trainer, TrainerConfig


# GKD's loss settings in --gkd-topk runs (the quickstart's beta and temperature, renorm top-k).
GKD = dict(beta=0.5, temperature=0.9, sft_alpha=0.0, topk_mode="renorm", teacher_temperature_applied=True)
# Dense bf16 peak FLOP/s by device name (datasheet figures, no sparsity): MFU's denominator.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}
# What one H200 sustains in practice (bf16 GEMMs at about 790 TFLOP/s, HBM reads at about
# 4.3 TB/s): the decode floors' numerators (gpu_throughput.py's generate mode).
SUSTAINED = {"H200": (790e12, 4.3e12), "H100": (790e12, 3.0e12)}
ROOT = Path(__file__).resolve().parent.parent


def peak_flops() -> float:
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16.items() if k in name), float("nan"))


def sustained() -> tuple[float, float]:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for k, v in SUSTAINED.items() if k in name), (float("nan"), float("nan")))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_batch(rows: int, tokens: int, vocab: int, ragged: bool, seed: int, gkd_topk: int = 0) -> Batch:
    """Random tokens; with `gkd_topk` also a top-k teacher's values and token ids per position."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, tokens), generator=gen)
    lengths = torch.randint(tokens // 4, tokens + 1, (rows,), generator=gen) if ragged else torch.full((rows,), tokens)
    mask = (torch.arange(tokens)[None] < lengths[:, None]).long()
    batch = Batch(input_ids=ids * mask, attention_mask=mask, loss_mask=mask.float())
    if gkd_topk:  # sorted values holding 90% of the mass, as a teacher's top k would
        batch.loss_mask[:, 0] = 0  # nothing predicts the first token (GKD's loss would compare a zero row)
        values = torch.log_softmax(torch.randn(rows, tokens, gkd_topk, generator=gen), -1) + math.log(0.9)
        batch.teacher_logprobs = values.sort(-1, descending=True).values
        batch.teacher_indices = torch.randint(0, vocab, (rows, tokens, gkd_topk), generator=gen)
    return batch


class PlainStep:
    """The baseline: plain eager torch, no project code in the step."""

    def __init__(self, model: str, micro_batch: int, device: str, gkd: bool = False):
        self.model = build_model(model).to(device, torch.float32).train()
        self.device = device
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.micro_batch = micro_batch
        self.gkd = gkd  # the loss: GKD against the batch's top-k teacher (full logits), else the NLL

    def train_step(self, batch: Batch) -> dict:
        total, loss_sum = float(batch.loss_mask.sum()), 0.0
        for s in range(0, len(batch), self.micro_batch):
            ids = batch.input_ids[s:s + self.micro_batch].to(self.device)
            mask = batch.attention_mask[s:s + self.micro_batch].to(self.device)
            with torch.autocast(torch.device(self.device).type, dtype=torch.bfloat16):
                logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            mask = batch.loss_mask[s:s + self.micro_batch, 1:].to(self.device)
            if self.gkd:
                teacher = (batch.teacher_logprobs, batch.teacher_indices)
                t_values, t_ids = (t[s:s + self.micro_batch, 1:].to(self.device) for t in teacher)
                loss = gkd_loss(logits[:, :-1].float(), t_values, mask, teacher_indices=t_ids, reduction="sum",
                                **{k: v for k, v in GKD.items() if k != "sft_alpha"})[0] / total
            else:
                logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
                loss = -(logp * mask).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_sum}


def train_flops_per_token(params: int, config, tokens: int) -> float:
    """Forward + backward FLOPs per trained token of rows `tokens` long: 6 x parameters (every
    weight is a matmul operand, a tied output head once) plus causal attention's scores and
    weighted sums (2 matmuls x 2 FLOPs x 3 passes x layers x hidden x the mean key count, tokens / 2)."""
    return 6 * params + 12 * config.num_hidden_layers * config.hidden_size * tokens / 2


# Kernel (on CPU: aten op) names by what they compute; the first pattern that matches wins.
# "optimizer" holds AdamW's and gradient clipping's multi-tensor kernels.
KERNEL_KINDS = (
    ("attention", r"flash|fmha|attention|attn|sdpa|scaled_dot_product|varlen"),
    ("optimizer", r"adam|multi_tensor_apply|foreach|clip_grad"),
    ("matmul", r"gemm|gemv|cutlass|cublas|xmma|nvjet|matmul|splitk|aten::(mm|addmm|bmm|linear)$|_mm$|_mm_"),
    ("copy", r"memcpy|memset|aten::(copy_|to|_to_copy|clone|contiguous)$"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce|softmax|triton|norm|index|gather|scatter|cat|fill|"
                    r"silu|mul|add|exp|log|where|embedding|neg|rsqrt|pow|mean|sum|^aten::"),
)


def timed(fn, batches: list, warmup_steps: int, device: str) -> tuple[list[float], float, object]:
    """`fn(batch)` on each batch, each call timed between two device syncs: (the walls of the calls
    after the first `warmup_steps`, the seconds the warm-up calls took, the last call's value)."""
    walls, warmup_s, t0, value = [], 0.0, time.perf_counter(), None
    for i, batch in enumerate(batches):
        sync(device)
        start = time.perf_counter()
        value = fn(batch)
        sync(device)
        if i >= warmup_steps:
            walls.append(time.perf_counter() - start)
        elif i == warmup_steps - 1:
            warmup_s = time.perf_counter() - t0
    return walls, warmup_s, value


def fastest_quarter(walls: list[float]) -> float:
    """The first quartile of the step times (their minimum below 4 steps)."""
    return statistics.quantiles(walls, n=4)[0] if len(walls) >= 4 else min(walls)


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")


def device_times(events) -> dict:
    """{name: [device seconds, count]} of every kernel, memcpy and memset among profiler events.
    A region annotated on the host (`Optimizer.step#AdamW.step`) also appears on the device's
    timeline, spanning the kernels it launched: it is left out, not counted twice."""
    from torch.autograd import DeviceType

    times: dict = {}
    for e in events:
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            t = times.setdefault(e.name, [0.0, 0])
            t[0] += e.device_time_total / 1e6
            t[1] += 1
    return times


def profile_call(fn, path: Path, cuda: bool, top: int = 30) -> dict:
    """Run `fn` once under torch.profiler and write a summary to `path`: the top kernels by
    device time (CPU: aten ops by self CPU time), the time share of each KERNEL_KINDS kind, and
    the device's busy time against the call's wall time. Returns the summary without the list."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as trace:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    times: dict = {}
    if cuda:
        times = device_times(trace.events())
    else:
        for e in trace.key_averages():
            if e.self_cpu_time_total > 0:
                times[e.key] = [e.self_cpu_time_total / 1e6, e.count]
    total = sum(t for t, _ in times.values()) or float("nan")
    shares: dict = {}
    for name, (t, _) in times.items():
        shares[kernel_kind(name)] = shares.get(kernel_kind(name), 0.0) + t / total
    ranked = sorted(times.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    summary = {"wall_s": wall, "device": "cuda" if cuda else "cpu (aten ops, self CPU time)",
               "busy_s": total, "busy_fraction": total / wall,
               "shares": {k: round(v, 4) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
               "top": [{"name": n[:200], "kind": kernel_kind(n), "s": round(t, 6), "calls": c,
                        "share": round(t / total, 4)} for n, (t, c) in ranked]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    return {k: v for k, v in summary.items() if k != "top"}


def slug(text: str) -> str:
    """A file-name part for a variant: 'trainer {"compile": true}' -> 'trainer_compile'."""
    return "_".join(re.findall(r"[a-z_]+", text.replace("true", "").replace("false", "off"))) or "plain"


def teacher_forward(args, rows: int, tokens: int, batches: list, flops_per_token: float, cuda: bool) -> list:
    """The teacher's forward (top-k logprobs and tail mass) plain and with each --teacher-variant,
    on the train batches of this shape; see the module notes."""
    results, reference = [], None
    for variant in ["{}"] + list(args.teacher_variant or []):
        name = f"teacher {variant}"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            config = TeacherConfig(device=args.device, dtype="bfloat16" if cuda else None,
                                   micro_batch_per_device=args.teacher_micro_batch, **json.loads(variant))
            teacher = Teacher(train_model(args), config)
            per_token = token_bytes(teacher.model, backward=False, logits=not config.chunked_logprobs)
            micro = config.micro_batch_per_device or fitting_rows(rows, tokens, per_token, config.micro_batch_memory_mb)
            walls, warm, (values, _, _) = timed(lambda b: teacher.logits(b, topk=args.teacher_topk, tail=True),
                                                batches, args.warmup_steps, args.device)
            wall = statistics.median(walls)
            real = int(batches[-1].attention_mask.sum())
            reference = values if reference is None else reference
            row = {"variant": name, "rows": rows, "tokens": tokens, "micro_batch": micro, "topk": args.teacher_topk,
                   "forward_s": wall, "walls_s": walls, "warmup_s": warm, "tokens_per_s": real / wall,
                   "mfu": flops_per_token * real / wall / (peak_flops() if cuda else float("nan")),
                   "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                   "max_abs_diff_vs_plain": float((values - reference).abs().max())}
            if args.profile_dir:
                path = Path(args.profile_dir) / f"teacher_{slug(variant)}_{rows}x{tokens}.json"
                row["profile"] = profile_call(lambda: teacher.logits(batches[-1], topk=args.teacher_topk, tail=True),
                                              path, cuda)
            del teacher
        except Exception as exc:  # one variant failing leaves the others' figures
            row = {"variant": name, "rows": rows, "tokens": tokens, "error": f"{type(exc).__name__}: {exc}"[:500]}
        results.append(row)
        print(json.dumps(row), flush=True)
    for r in results:
        if "error" not in r and "error" not in results[0]:
            r["x_plain"] = r["tokens_per_s"] / results[0]["tokens_per_s"]
    return results


def print_table(header: list[str], rows: list[dict], cells) -> None:
    """A markdown table: each row's variant and shape, then `cells(row)`, or the error of a failed row."""
    print("\n| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|")
    for r in rows:
        rest = [f"failed: {r['error'][:120]}"] + [""] * (len(header) - 3) if "error" in r else cells(r)
        print("| " + " | ".join([r["variant"], f"{r['rows']}x{r['tokens']}", *rest]) + " |")


def train_model(args):
    """The model spec trained: --model, its vocabulary replaced by --vocab-size where given
    (a preset with the character tokenizer has about 100 tokens; a real Qwen2 has 151936)."""
    if not args.vocab_size:
        return args.model
    return dataclasses.replace(resolve_config(args.model), vocab_size=args.vocab_size)


def variants(args) -> list[tuple[str, Optional[str]]]:
    """(kind, trainer keys as JSON) of every variant: the plain step, the Trainer plain, then --train-variant."""
    return [("plain", None), ("trainer", "{}")] + [("trainer", v) for v in args.train_variant or []]


def train_variants(args) -> list[dict]:
    """A row per shape for each variant, each variant measured in a process of its own (as a run
    has it: no other model's memory, compiled code or guards beside it), in shape order."""
    runs = []
    for index, (kind, variant) in enumerate(variants(args)):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            part = f.name
        cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_throughput.py"), *sys.argv[1:],
               "--variant-index", str(index), "--out", part]
        try:
            code = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        text = Path(part).read_text()
        rows = json.loads(text)["runs"] if text.strip() else []
        if code or not rows:
            rows = [{"variant": kind if variant is None else f"trainer {variant}", "rows": r, "tokens": t,
                     "error": f"its process exited with {code}"} for r, t in
                    [map(int, shape.split("x")) for shape in args.train_shape]]
        runs.append(rows)
    return [row for shape in zip(*runs) for row in shape]


def train(args) -> dict:
    # Size and vocabulary from a copy without weights: a 2 GB model held on the host beside the
    # measured one made the compiled 8 x 1024 step 1.2x slower on an H200 (72.5 ms against 59.4).
    with torch.device("meta"):
        model = build_model(train_model(args))
    params, vocab = sum(t.numel() for t in model.parameters()), model.config.vocab_size
    if args.variant_index is None:
        results, own = train_variants(args), []  # the teacher forward runs here
    else:
        results, own = [], variants(args)[args.variant_index:args.variant_index + 1]
    teachers = []
    for rows, tokens in [map(int, shape.split("x")) for shape in args.train_shape]:
        micro = min(rows, args.micro_batch * 320 // tokens or 1)  # about the same tokens per micro-batch
        batches = [train_batch(rows, tokens, vocab, args.ragged, seed, args.gkd_topk)
                   for seed in range(args.warmup_steps + args.steps)]
        for kind, variant in own:
            cuda = args.device.startswith("cuda")
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            step = None
            if kind == "plain":
                runner = PlainStep(train_model(args), micro, args.device, gkd=bool(args.gkd_topk))
            else:  # the variant's keys are TrainerConfig fields (kernel options, optimizer, ...)
                config = TrainerConfig(lr=1e-5, warmup_steps=0, schedule="constant", device=args.device,
                                       dtype="bfloat16", micro_batch_per_device=micro, **json.loads(variant))
                loss = {}
                if args.gkd_topk:  # the student's top-k logprobs where the GKD driver would ask for them
                    fn = GKDLoss(**GKD, student_topk=config.fused_logprobs)
                    loss = dict(loss_fn=fn, loss_inputs=fn.loss_inputs)
                    step = lambda b: runner.train_step(b, GKD["temperature"] if fn.student_topk else 1.0)  # noqa: E731
                runner = Trainer(train_model(args), config, **loss)
            step = step or runner.train_step
            try:
                walls, warmup_s, out = timed(step, batches, args.warmup_steps, args.device)
                wall = statistics.median(walls)
                real = int(batches[-1].attention_mask.sum())
                flops = train_flops_per_token(params, model.config, tokens) * real / wall
                row = {"variant": kind if variant is None else f"trainer {variant}", "rows": rows, "tokens": tokens,
                       "micro_batch": micro, "ragged": args.ragged, "step_s": wall, "walls_s": walls,
                       "warmup_s": warmup_s, "tokens_per_s": real / wall,
                       "tflops": flops / 1e12, "mfu": flops / (peak_flops() if cuda else float("nan")),
                       "of_sustained": flops / (sustained()[0] if cuda else float("nan")),
                       # The same at the fastest quarter of the steps: what a host without other load gives.
                       "of_sustained_fast": flops * wall / fastest_quarter(walls) / (sustained()[0] if cuda else float("nan")),
                       "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0, "loss": out["loss"]}
                if args.profile_dir:  # one more step, traced (after the figures above)
                    path = Path(args.profile_dir) / f"train_{slug(row['variant'])}_{rows}x{tokens}.json"
                    row["profile"] = profile_call(lambda: step(batches[-1]), path, cuda)
            except Exception as exc:  # one variant failing leaves the others' figures
                row = {"variant": kind if variant is None else f"trainer {variant}", "rows": rows, "tokens": tokens,
                       "error": f"{type(exc).__name__}: {exc}"[:500]}
            del runner
            results.append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps({"runs": results}, indent=1))
        if args.teacher_variant and args.variant_index is None:  # a forward is a third of a train step's FLOPs
            flops_per_token = train_flops_per_token(params, model.config, tokens) / 3
            teachers += teacher_forward(args, rows, tokens, batches, flops_per_token, args.device.startswith("cuda"))
            Path(args.out).write_text(json.dumps({"runs": results, "teacher": teachers}, indent=1))
    if args.variant_index is not None:
        return {"runs": results}
    for row in results:
        base = next((r for r in results if r["variant"] == "plain" and r["rows"] == row["rows"]
                     and r["tokens"] == row["tokens"] and "error" not in r), None)
        if base and "error" not in row:
            row["x_plain"] = row["tokens_per_s"] / base["tokens_per_s"]
    print_table(["variant", "rows x tokens", "tokens/s", "x plain", "TFLOP/s", "MFU (peak)", "of sustained matmul",
                 "of sustained, fastest quarter", "peak GiB", "step s", "loss"], results,
                lambda r: [f"{r['tokens_per_s']:,.0f}", f"{r.get('x_plain', 0):.2f}", f"{r['tflops']:.0f}",
                           f"{r['mfu']:.1%}", f"{r['of_sustained']:.1%}", f"{r['of_sustained_fast']:.1%}",
                           f"{r['peak_gib']:.1f}", f"{r['step_s']:.3f}", f"{r['loss']:.4f}"])
    for r in results:
        if "profile" in r:
            prof = r["profile"]
            print(f"profile {r['variant']} {r['rows']}x{r['tokens']}: device busy {prof['busy_fraction']:.0%} "
                  f"of {prof['wall_s']:.3f} s; shares {json.dumps(prof['shares'])}")
    if teachers:
        print_table(["teacher variant", "rows x tokens", "tokens/s", "x plain", "MFU", "peak GiB", "rows per forward",
                     "max diff"], teachers,
                    lambda r: [f"{r['tokens_per_s']:,.0f}", f"{r.get('x_plain', 0):.2f}", f"{r['mfu']:.1%}",
                               f"{r['peak_gib']:.1f}", str(r["micro_batch"]), f"{r['max_abs_diff_vs_plain']:.2e}"])
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "model": args.model, "parameters": params, "runs": results, "teacher": teachers}


