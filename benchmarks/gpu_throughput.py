"""Throughput on one GPU: generation engines side by side and the colocated train cycle.

    python benchmarks/gpu_throughput.py generate                  # HF generate, torch Rollout, vLLM Rollout
    python benchmarks/gpu_throughput.py generate --rows 64 512 --new-tokens 256 --profile
    python benchmarks/gpu_throughput.py cycle --engine torch --rollout-engine vllm
    python benchmarks/gpu_throughput.py train --train-shape 512x320 8x1024 --train-variant '{"compile": true}'
    python benchmarks/gpu_throughput.py train --train-shape 8x1024 --train-variant '{"compile": true}' \
        --profile-dir profiles --teacher-variant '{"chunked_logprobs": true}'

generate  the same token-id prompts (`--rows` completions each, `--samples` per prompt,
          exactly `--new-tokens` new tokens: end-of-sequence is ignored) through plain HF
          `model.generate`, the torch Rollout and the vLLM Rollout, each engine (and each
          `--vllm-variant`, a JSON dict of vllm options) in a process of its own. Per engine
          and size: tokens/s (generated tokens / wall time of one generate call, prefill
          included; median of --repeats after a full-size warm-up), ms per decode step, the
          fraction of the decode floor, and the ratio to HF. Floors: compute = peak bf16
          FLOP/s / (2 * parameters) tokens/s; weight reads = rows * memory bandwidth /
          weight bytes; the decode floor is the smaller. `--profile` adds, for the first vLLM
          variant at the largest size, where an engine step's time goes: the engine's
          schedule / execute / sample / update / output-processing calls (host seconds per
          step), the device's busy time per step (torch profiler, a 32-token generate) and
          the top host functions (cProfile).
cycle     one process holds a Trainer and a Rollout (torch or vLLM) on the GPU and runs the
          colocated GRPO cycle (wake + generate + sleep, onload + train + sync + offload);
          per phase wall time and peak memory, MFU of the train step
          (6 * parameters * trained tokens / train time / peak bf16 FLOP/s).
train     train steps of a plain eager step beside the torch Trainer and its variants, each
          variant in a process of its own: see benchmarks/train_throughput.py.
Each mode writes its figures as JSON to --out and prints a table (the drivers themselves:
benchmarks/gpu_drivers.py). Needs a CUDA GPU (generate
also runs on CPU with --device cpu, for a smoke test of the script).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from algorithms.data.tasks import arithmetic_examples
from roles.batch import SamplingParams, batch_from_completions
from roles.engines import torch_decode
from roles.models import build_model
from roles.rollout import Rollout
from roles.trainer import Trainer, TrainerConfig
# The train mode and the device figures MFU and the floors divide by (a sibling script).
from train_throughput import ROOT, peak_flops, sustained, sync, train


# ----------------------------------------------------------------------------- generate

def prompt_ids(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


class HFGenerate:
    """Plain transformers `model.generate` on the same weights, the baseline."""

    def __init__(self, model: str, device: str):
        self.model = build_model(model).to(torch.bfloat16 if device.startswith("cuda") else torch.float32)
        self.model = self.model.to(device).eval()
        self.device = device

    def generate(self, prompts: list[list[int]], samples: int, new_tokens: int, seed: int) -> int:
        ids = torch.tensor(prompts, device=self.device).repeat_interleave(samples, 0)
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                      top_p=1.0, temperature=1.0, max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, pad_token_id=0)
        return int(out[:, ids.shape[1]:].numel())


# vLLM request forms besides the rollout's own ("rollout": one request per row with its seed and
# the sampled token's logprob), sent to the same engine directly: what each part costs.
REQUEST_FORMS = {"rows": dict(per_row=True, seeded=True, logprobs=True),  # the rollout's, without the Rollout
                 "rows_no_logprobs": dict(per_row=True, seeded=True, logprobs=False),
                 "rows_no_seed": dict(per_row=True, seeded=False, logprobs=True),
                 "rows_bare": dict(per_row=True, seeded=False, logprobs=False),
                 "n_per_prompt_bare": dict(per_row=False, seeded=False, logprobs=False)}


class RolloutGenerate:
    """The project's Rollout (torch or vLLM engine), fixed-length completions; for vLLM,
    `request_form` (REQUEST_FORMS) sends the engine other forms of the same requests."""

    def __init__(self, model: str, device: str, engine: str, options: dict, max_rows: int,
                 request_form: str, compile_decode: bool):
        t0 = time.perf_counter()
        config = {"device": device, "dtype": "bfloat16" if device.startswith("cuda") else None,
                  "max_batch_size": max_rows, "compile_decode": compile_decode}
        if request_form != "rollout" and (engine != "vllm" or request_form not in REQUEST_FORMS):
            raise ValueError(f"request_form={request_form!r}: vLLM only, one of {['rollout', *REQUEST_FORMS]}")
        self.rollout = Rollout(model, config=config, engine=engine, engine_options=options or None)
        self.form = request_form
        self.start_s = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], samples: int, new_tokens: int, seed: int) -> int:
        if self.form != "rollout":
            return self._direct(prompts, samples, new_tokens, seed, **REQUEST_FORMS[self.form])
        out = self.rollout.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, n=samples,
                                                            seed=seed, ignore_eos=True))
        return sum(len(c) for c in out.completion_ids)

    def _direct(self, prompts, samples: int, new_tokens: int, seed: int, per_row: bool, seeded: bool,
                logprobs: bool) -> int:
        import vllm  # optional (the vLLM engine only): imported on use
        from vllm.inputs import TokensPrompt

        base = dict(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False,
                    **({"logprobs": 0, "flat_logprobs": True} if logprobs else {}))
        if per_row:
            requests = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(samples)]
            params = [vllm.SamplingParams(**base, seed=seed * 100003 + i if seeded else None)
                      for i in range(len(requests))]
        else:
            requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            params = vllm.SamplingParams(**base, n=samples)
        outputs = self.rollout._vllm.llm.generate(requests, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)


def _wrap_timers(obj, names: list[str], totals: dict, label: str) -> None:
    """Replace obj.<name> by a wrapper adding its host seconds and calls to totals[label.name]."""
    for name in names:
        fn = getattr(obj, name, None)
        if fn is None:
            continue
        key = f"{label}.{name}"
        totals[key] = [0.0, 0]

        def timed(*a, _fn=fn, _key=key, **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                totals[_key][0] += time.perf_counter() - t0
                totals[_key][1] += 1
        setattr(obj, name, timed)


def profile_vllm(runner: RolloutGenerate, prompts, samples: int, new_tokens: int) -> dict:
    """Where a vLLM engine step's time goes, at this size (see the module notes)."""
    llm = runner.rollout._vllm.llm
    engine = llm.llm_engine
    core = getattr(engine.engine_core, "engine_core", None)  # in-process client -> EngineCore
    totals: dict = {}
    if core is not None:
        _wrap_timers(core.scheduler, ["schedule", "update_from_output"], totals, "scheduler")
        _wrap_timers(core.model_executor, ["execute_model", "sample_tokens"], totals, "executor")
    _wrap_timers(engine.output_processor, ["process_outputs"], totals, "output_processor")
    _wrap_timers(engine, ["step"], totals, "llm_engine")
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    runner.generate(prompts, samples, new_tokens, seed=123)
    prof.disable()
    wall = time.perf_counter() - t0
    steps = max(totals.get("llm_engine.step", [0, 1])[1], 1)
    out = {"wall_s": wall, "engine_steps": steps, "ms_per_step": 1e3 * wall / steps,
           "host_ms_per_step": {k: 1e3 * v[0] / steps for k, v in totals.items()}}
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:25]
    out["top_host_functions"] = [{"function": f"{Path(f[0]).name}:{f[1]}:{f[2]}", "calls": v[1],
                                  "tottime_s": round(v[2], 4), "cumtime_s": round(v[3], 4)} for f, v in rows]
    # Device busy time per step, on a short generate (the trace stays small).
    with contextlib.suppress(Exception):
        from torch.profiler import ProfilerActivity, profile
        short = 32
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            t0 = time.perf_counter()
            runner.generate(prompts, samples, short, seed=321)
            short_wall = time.perf_counter() - t0
        busy = sum(e.self_device_time_total for e in trace.key_averages()) / 1e6
        out["device_busy"] = {"new_tokens": short, "wall_s": short_wall, "device_s": busy,
                              "device_ms_per_step": 1e3 * busy / short, "wall_ms_per_step": 1e3 * short_wall / short,
                              "busy_fraction": busy / short_wall}
    return out


# Options of the benchmark itself, not passed to the engine: "vary_prompt_len" gives every
# timed call prompts of a new length (as a driver's batches have), "cudnn_sdp": false turns off
# cuDNN's attention in torch (it builds a plan for every new shape), "request_form" (vLLM) one
# of REQUEST_FORMS; torch engine: "cuda_graphs": false decodes the static-cache steps eagerly,
# "static_decode": false runs the dynamic loop (DynamicCache, one launch per kernel), "reuse_decode":
# false allocates the static cache and captures the graph in every call (as before they were kept);
# "compile_decode": true is the rollout key of that name (the decode step through torch.compile).
BENCH_OPTIONS = ("vary_prompt_len", "cudnn_sdp", "request_form", "cuda_graphs", "static_decode", "reuse_decode",
                 "compile_decode")


def generate_one(args) -> dict:
    """One engine (one variant) at every size, in this process."""
    options = json.loads(args.options) if args.options else {}
    engine_options = {k: v for k, v in options.items() if k not in BENCH_OPTIONS}
    if options.get("cudnn_sdp") is False:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if options.get("cuda_graphs") is False:
        torch_decode.CUDA_GRAPHS = False
    if options.get("static_decode") is False:
        torch_decode.STATIC_DEVICES = set()
    if options.get("reuse_decode") is False:
        torch_decode.REUSE_SLACK = 0.0  # no held buffers fit any call
    vocab = build_model(args.model).config.vocab_size
    t0 = time.perf_counter()
    runner = HFGenerate(args.model, args.device) if args.engine == "hf" else \
        RolloutGenerate(args.model, args.device, args.engine, engine_options, max(args.rows),
                        options.get("request_form", "rollout"), bool(options.get("compile_decode")))
    result = {"engine": args.engine, "options": options, "start_s": time.perf_counter() - t0, "sizes": {}}
    if args.engine == "vllm":
        result["settings"] = runner.rollout.engine_info()
    for rows in args.rows:
        prompts = prompt_ids(rows // args.samples, args.prompt_len, vocab, seed=rows)
        runner.generate(prompts, args.samples, args.new_tokens, seed=0)  # warm-up at full size
        walls = []
        for r in range(args.repeats):
            if options.get("vary_prompt_len"):
                prompts = prompt_ids(rows // args.samples, args.prompt_len + 3 * r + 1, vocab, seed=rows + r)
            sync(args.device)
            t0 = time.perf_counter()
            tokens = runner.generate(prompts, args.samples, args.new_tokens, seed=r + 1)
            sync(args.device)
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        result["sizes"][str(rows)] = {"rows": rows, "tokens": tokens, "walls_s": walls, "wall_s": wall,
                                      "tokens_per_s": tokens / wall, "ms_per_step": 1e3 * wall / args.new_tokens,
                                      "decode_calls": dict(torch_decode.COUNTS)}
        print(json.dumps({"engine": args.engine, "options": options, **result["sizes"][str(rows)]}), flush=True)
        Path(args.out).write_text(json.dumps(result))  # kept if a later size or the profile fails
    if args.profile and args.engine == "vllm":
        rows = max(args.rows)
        prompts = prompt_ids(rows // args.samples, args.prompt_len, vocab, seed=rows)
        result["profile"] = profile_vllm(runner, prompts, args.samples, args.new_tokens)
        print_profile(result["profile"])
    return result


def print_profile(profile: dict) -> None:
    print("vLLM step profile:", json.dumps({k: v for k, v in profile.items() if k != "top_host_functions"},
                                           indent=1), flush=True)
    for row in profile["top_host_functions"][:15]:
        print(f"  {row['tottime_s']:8.3f} s {row['calls']:8d}  {row['function']}", flush=True)


def generate_all(args) -> dict:
    """Every engine and vLLM variant in its own process; ratios and floors."""
    params = sum(t.numel() for t in build_model(args.model).parameters())
    flops, bandwidth = sustained()
    engines = args.engines or ["hf", "torch", "vllm"]
    runs = [("hf", None)] if "hf" in engines else []
    if "vllm" in engines:
        runs += [("vllm", v) for v in (args.vllm_variant or ["{}"])]
    if "torch" in engines:
        runs += [("torch", v) for v in (args.torch_variant or ["{}"])]
    results = []
    for i, (engine, options) in enumerate(runs):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            part = f.name
        cmd = [sys.executable, str(Path(__file__).resolve()), "generate-one", "--engine", engine, "--model", args.model,
               "--device", args.device, "--samples", str(args.samples), "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--out", part,
               "--rows", *map(str, args.rows)]
        if options:
            cmd += ["--options", options]
        if args.profile and engine == "vllm" and options == (args.vllm_variant or ["{}"])[0]:
            cmd.append("--profile")
        print("$", " ".join(cmd[1:]), flush=True)
        try:
            code = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        text = Path(part).read_text()
        result = json.loads(text) if text.strip() else {"engine": engine, "options": json.loads(options or "{}")}
        if code:
            result["error"] = code
        results.append(result)
        Path(args.out).write_text(json.dumps({"runs": results}, indent=1))  # so far, if a later engine hangs
    hf = next((r for r in results if r["engine"] == "hf" and r.get("sizes")), None)
    for r in results:
        for key, size in r.get("sizes", {}).items():
            floor = min(flops / (2 * params), size["rows"] * bandwidth / (2 * params))
            size["compute_floor_fraction"] = size["tokens_per_s"] / (flops / (2 * params))
            size["decode_floor_fraction"] = size["tokens_per_s"] / floor
            if hf and key in hf["sizes"]:
                size["x_hf"] = size["tokens_per_s"] / hf["sizes"][key]["tokens_per_s"]
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "model": args.model,
               "parameters": params, "samples": args.samples, "prompt_len": args.prompt_len,
               "new_tokens": args.new_tokens, "compute_floor_tokens_per_s": flops / (2 * params), "runs": results}
    print("\n| engine | options | rows | tokens/s | ms/step | x HF | of compute floor | of decode floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['engine']} | {json.dumps(r['options'])} | failed ({r['error']}) | | | | | |")
        for size in r.get("sizes", {}).values():
            print(f"| {r['engine']} | {json.dumps(r['options'])} | {size['rows']} | {size['tokens_per_s']:,.0f} | "
                  f"{size['ms_per_step']:.2f} | {size.get('x_hf', float('nan')):.2f} | "
                  f"{size['compute_floor_fraction']:.3f} | {size['decode_floor_fraction']:.3f} |")
    for r in results:
        if "profile" in r:
            print_profile(r["profile"])
    return summary


# ----------------------------------------------------------------------------- cycle

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


def cycle(args) -> dict:
    params = sum(t.numel() for t in build_model(args.model).parameters())
    trainer = Trainer(args.model, TrainerConfig(lr=1e-5, warmup_steps=0, schedule="constant", device="cuda",
                                                dtype="bfloat16", micro_batch_per_device=args.micro_batch),
                      engine=args.engine)
    options = json.loads(args.options) if args.options else None
    rollout = Rollout(args.model, config={"device": "cuda", "dtype": "bfloat16", "max_batch_size": 512},
                      engine=args.rollout_engine, engine_options=options)
    prompts = [ex.prompt_messages() for ex in arithmetic_examples(args.prompts * (args.steps + 1), seed=1)]
    # --fixed-length: every completion has new_tokens tokens, so every step has the same workload.
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, n=args.samples, seed=0,
                              ignore_eos=args.fixed_length)
    trainer.offload()
    rollout.sleep(args.sleep_level)
    if args.sleep_level == 2:  # level 2 dropped the weights: the trainer's go in before the first wake
        rollout.update_weights(trainer.state_dict_buckets(512, dtype="bfloat16", to_cpu=False), version=0)
    rows = []
    for step in range(args.steps + 1):
        m: dict = {"step": step}
        start = time.perf_counter()
        with Phase("generate", m):
            woke = rollout.wake_up()
            comps = rollout.generate(prompts[step * args.prompts:(step + 1) * args.prompts], sampling)
            slept = rollout.sleep(args.sleep_level)
        m["wake_s"], m["sleep_s"] = woke["seconds"], slept["seconds"]
        m["sleep_freed_gib"] = slept.get("device_bytes_freed", slept["model_bytes"]) / 2**30
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
               "engine": args.engine, "rollout_engine": args.rollout_engine, "options": options,
               "sleep_level": args.sleep_level, "prompts": args.prompts, "samples": args.samples,
               "new_tokens": args.new_tokens, "steps": args.steps}
    for key in timed[0]:
        if key != "step":
            summary[key] = sum(r[key] for r in timed) / len(timed)
    print(json.dumps(summary, indent=1))
    return {"summary": summary, "steps": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="cycle", choices=["generate", "generate-one", "cycle", "train"])
    p.add_argument("--model", default="qwen2_0p5b")
    p.add_argument("--out", default="gpu_throughput.json")
    p.add_argument("--timeout-s", type=float, default=900, help="generate, train: limit per engine's (variant's) "
                   "subprocess")
    g = p.add_argument_group("generate")
    g.add_argument("--rows", type=int, nargs="+", default=[64, 512], help="completions per generate call")
    g.add_argument("--engines", nargs="+", choices=["hf", "torch", "vllm"], help="default: all three")
    g.add_argument("--engine", default="torch", help="generate-one: hf|torch|vllm; cycle: trainer engine")
    g.add_argument("--vllm-variant", action="append", help="JSON dict of vllm options; repeat for several")
    g.add_argument("--torch-variant", action="append", help="JSON dict of benchmark options for the torch "
                   "engine (vary_prompt_len, cudnn_sdp, cuda_graphs, static_decode, reuse_decode); repeat for several")
    g.add_argument("--options", help="generate-one / cycle: JSON dict of vllm options")
    g.add_argument("--prompt-len", type=int, default=32)
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument("--profile", action="store_true")
    g.add_argument("--device", default="cuda")
    c = p.add_argument_group("cycle")
    c.add_argument("--rollout-engine", default="torch", choices=["torch", "vllm"])
    c.add_argument("--sleep-level", type=int, default=1, choices=[1, 2])
    c.add_argument("--prompts", type=int, default=64, help="prompts per step")
    c.add_argument("--samples", type=int, default=8, help="completions per prompt")
    c.add_argument("--new-tokens", type=int, default=256)
    c.add_argument("--micro-batch", type=int, default=32, help="sequences per forward/backward")
    c.add_argument("--steps", type=int, default=4, help="timed steps (cycle: after one warm-up step)")
    c.add_argument("--fixed-length", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --new-tokens per completion (eos does not stop)")
    t = p.add_argument_group("train")
    t.add_argument("--train-shape", nargs="+", default=["512x320", "8x1024"], help="ROWSxTOKENS per train step")
    t.add_argument("--train-variant", action="append", help="JSON dict of trainer keys (packing, compile, "
                   "activation_checkpointing, chunked_logprobs, optimizer, ...); repeat for several")
    t.add_argument("--vocab-size", type=int, help="the model's vocabulary (default: its tokenizer's); "
                   "151936 is Qwen2's, where the output head and log-softmax weigh")
    t.add_argument("--gkd-topk", type=int, default=0, help="train on GKD's loss against a synthetic top-k "
                   "teacher of this k (the student's top-k logprobs with fused_logprobs) instead of the NLL")
    t.add_argument("--ragged", action="store_true", help="row lengths uniform in [TOKENS/4, TOKENS]")
    t.add_argument("--variant-index", type=int, help=argparse.SUPPRESS)  # a variant's own process
    t.add_argument("--warmup-steps", type=int, default=2)
    t.add_argument("--profile-dir", help="write a torch.profiler summary of one more step per variant here")
    t.add_argument("--teacher-variant", action="append", help="JSON dict of TeacherConfig forward options "
                   "(packing, compile, chunked_logprobs); measures the plain teacher beside them; repeat for several")
    t.add_argument("--teacher-topk", type=int, default=64, help="top-k logprobs the teacher returns")
    t.add_argument("--teacher-micro-batch", type=int, default=0,
                   help="teacher rows per forward; 0: sized by its micro_batch_memory_mb, as in a run")
    args = p.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run = {"generate": generate_all, "generate-one": generate_one, "cycle": cycle, "train": train}[args.mode]
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
