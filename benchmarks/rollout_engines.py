"""Rollout engines side by side on RL-shaped workloads, each engine in a process of its own.

    python benchmarks/rollout_engines.py --out rollout_engines.json                 # one GPU
    python benchmarks/rollout_engines.py --device cpu --model tiny_qwen2 --rows 16 --samples 4 \\
        --new-tokens 16 --long-tail-max 64 --turn-tokens 8 --engines vllm torch  # smoke test of the script

Model: --model's shape with a --vocab-size vocabulary (default 151,936, Qwen2's), random
weights, written once to a checkpoint folder that every engine loads. Its stop token's output
row is set so that a sampled completion meets it after --mean-length tokens on average
(lengths near geometric: most rows stop early, a few run long).

Workloads (the same token-id prompts, --samples completions each, temperature 1):
  fixed       --rows completions of exactly --new-tokens tokens (end-of-sequence ignored)
  long_tail   --rows completions ending at the stop token, at most --long-tail-max tokens
  multi_turn  --rows trajectories of --turns model turns of --turn-tokens tokens each, a no-op
              environment answering each turn (algorithm.multi_turn with gym_scheduler);
              `single_turn` beside it: the same rows generating turns x turn-tokens tokens in
              one turn
  mismatch    the fixed workload's completions with the rollout's sampling logprobs, scored by
              a Trainer of the same weights (GRPO's, as grpo_gpu runs it): GRPO's
              rollout_correction metrics (trainer-rollout KL, chi2, largest ratio) per engine
Engines (one process each): `vllm` runs, on one engine, raw `vllm.LLM.generate` (a request
per prompt with n, no seeds, no logprobs: vLLM alone), the project's vLLM Rollout, and the
Rollout without logprobs; `torch` the project's torch Rollout (static decoder), `torch_compiled`
the same with compile_decode, `hf` transformers' `generate` (fixed and long_tail only).
Per engine and workload: tokens/s (generated tokens / wall time of one call, median of
--repeats rounds after a warm-up call; one engine's variants take turns within a round, so a
slow stretch of a shared machine falls on each alike), ms per decode step (wall / the longest completion), the
completions' lengths, and the ratio to raw vLLM's tokens/s. Writes JSON to --out (after every
engine) and prints a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from algorithms.plugins import GymEnv, envs
from algorithms.objectives.rollout_correction import rollout_offpolicy_metrics
from roles.batch import SamplingParams, batch_from_completions
from roles.engines import torch_decode
from roles.engines.torch_generate import generate_batch
from roles.models import build_model, load_tokenizer, resolve_config, save_checkpoint
from roles.multi_turn import MultiTurnConfig
from roles.rollout import Rollout
from roles.trainer import Trainer
# Random token-id prompts and the device sync (sibling scripts).
from gpu_throughput import prompt_ids
from train_throughput import ROOT, sync

ENGINES = ("vllm", "torch", "torch_compiled", "hf")
WORKLOADS = ("fixed", "long_tail", "multi_turn", "single_turn", "mismatch")


class NoOp(GymEnv):
    """Answers every turn with the same short observation; never done (max_turns ends it)."""

    def reset(self, row):
        return "go on"

    def step(self, action):
        return "go on", 0.0, False, {}


envs["benchmark_noop"] = NoOp


# ----------------------------------------------------------------------------- the model

def write_checkpoint(args, folder: Path) -> dict:
    """--model at --vocab-size with its stop token's output row set for --mean-length; returns
    the stop token and the calibration figures."""
    spec = dataclasses.replace(resolve_config(args.model), vocab_size=args.vocab_size or None)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build_model(spec).to(args.device, dtype).eval()
    vocab = model.config.vocab_size
    stop = vocab - 1
    if "long_tail" not in args.workloads:  # the stop row stays as initialised: no calibration
        save_checkpoint(model, load_tokenizer(spec), folder)
        return {"stop_token": stop, "vocab_size": vocab, "stop_scale": None, "calibration": [],
                "parameters": sum(t.numel() for t in model.parameters())}
    # The workload's own prompts (rollout_calls): each row keeps its own stop rate.
    ids = torch.tensor(prompt_ids(args.rows // args.samples, args.prompt_len, vocab, seed=1), device=args.device)
    with torch.inference_mode():
        # Hidden states where the model's own samples are read.
        seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                              temperature=1.0, max_new_tokens=64, min_new_tokens=64, pad_token_id=0)
        hidden = model.model(seqs).last_hidden_state[:, args.prompt_len:].float().flatten(0, 1)
        head = model.get_output_embeddings().weight
        logits = hidden @ head.float().T
        logits[:, stop] = float("-inf")
        others = torch.logsumexp(logits, -1)
        # The stop row along the direction in which the states' projection varies least for its
        # mean (covariance^-1 mean): its logit is c * (a number near 1). A random model's states
        # follow their prompt, so each row keeps its own stop rate: c is set so that the mean of
        # the rows' expected lengths, min(geometric(rate), long_tail_max), is --mean-length.
        mean = hidden.mean(0)
        cov = torch.cov(hidden.T) + 1e-3 * torch.eye(hidden.shape[1], device=hidden.device)
        direction = torch.linalg.solve(cov, mean)
        direction = direction / (mean @ direction)
        along = (hidden @ direction).view(ids.shape[0], -1)
        others = others.view(ids.shape[0], -1)
        cap = args.long_tail_max

        def lengths(c: float) -> torch.Tensor:
            rate = torch.sigmoid(c * along - others).mean(1).clamp(min=1e-12)
            return (1 - (1 - rate) ** cap) / rate

        low, high = -200.0, 200.0
        for _ in range(100):
            c = (low + high) / 2
            low, high = (low, c) if lengths(c).mean().item() < args.mean_length else (c, high)
        expected = lengths(c)

        def sampled(scale: float) -> list[int]:
            # The states drift as a sequence grows, so the estimate above runs long (on an H100 most
            # rows reached the cap): the scale is then corrected on the model's own samples.
            head[stop] = (scale * direction).to(head.dtype)
            out = generate_batch(model, ids.tolist(), temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=cap,
                                 stop_ids=[stop], pad_id=0, generators=None)
            return [len(t) for t in out.tokens]

        low, high, tries = c, c + 16.0, []
        for _ in range(args.calibration_rounds):
            got = sampled(high)
            tries.append((high, statistics.mean(got)))
            if tries[-1][1] <= args.mean_length:
                break
            low, high = high, high + 16.0
        for _ in range(args.calibration_rounds):
            c = (low + high) / 2
            got = sampled(c)
            tries.append((c, statistics.mean(got)))
            low, high = (c, high) if tries[-1][1] > args.mean_length else (low, c)
        c = min(tries, key=lambda t: abs(t[1] - args.mean_length))[0]
        head[stop] = (c * direction).to(head.dtype)
    save_checkpoint(model, load_tokenizer(spec), folder)
    return {"stop_token": stop, "vocab_size": vocab, "stop_scale": c, "estimated_length_mean": expected.mean().item(),
            "calibration": [{"scale": s, "sampled_length_mean": m} for s, m in tries],
            "parameters": sum(t.numel() for t in model.parameters())}


# ----------------------------------------------------------------------------- one engine

def rollout_calls(rollout: Rollout, args, stop: int) -> dict[str, Callable[[int], list[list[int]]]]:
    """workload -> call(seed) returning the completions' token ids, for the project's Rollout."""
    prompts = prompt_ids(args.rows // args.samples, args.prompt_len, rollout._vocab, seed=1)
    chats = [[{"role": "user", "content": f"task {i}"}] for i in range(args.rows // args.samples)]
    turns = MultiTurnConfig(scheduler="gym_scheduler", gym_env="benchmark_noop", max_turns=args.turns,
                            max_turn_tokens=args.turn_tokens)
    budget = args.turns * args.turn_tokens + 64 * args.turns  # model turns plus the environment's tokens

    def sampling(seed: int, **kw) -> SamplingParams:
        return SamplingParams(temperature=1.0, n=args.samples, seed=seed, logprobs=rollout._logprobs, **kw)

    return {
        "fixed": lambda s: rollout.generate(prompts, sampling(s, max_new_tokens=args.new_tokens,
                                                              ignore_eos=True)).completion_ids,
        "long_tail": lambda s: rollout.generate(prompts, sampling(s, max_new_tokens=args.long_tail_max,
                                                                  stop_token_ids=(stop,))).completion_ids,
        "multi_turn": lambda s: [
            [t for t, m in zip(ids, mask) if m] for ids, mask in zip(*_trajectories(rollout, chats, sampling(
                s, max_new_tokens=budget, ignore_eos=True), turns))],
        "single_turn": lambda s: rollout.generate([rollout._encode(c, True) for c in chats], sampling(
            s, max_new_tokens=args.turns * args.turn_tokens, ignore_eos=True)).completion_ids,
    }


def _trajectories(rollout: Rollout, chats, sampling: SamplingParams, turns: MultiTurnConfig):
    out = rollout.generate_trajectories(chats, sampling, turns, [{} for _ in chats], chat=True)
    return out.completion_ids, out.completion_mask


def raw_vllm_calls(rollout: Rollout, args, stop: int) -> dict[str, Callable[[int], list[list[int]]]]:
    """The same fixed and long-tail requests straight to the rollout's `vllm.LLM`: one request
    per prompt with n, no seeds, no logprobs."""
    import vllm  # optional (the vLLM engine only): imported on use
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in prompt_ids(args.rows // args.samples, args.prompt_len, rollout._vocab, seed=1)]
    chats = [TokensPrompt(prompt_token_ids=rollout._encode([{"role": "user", "content": f"task {i}"}], True))
             for i in range(args.rows // args.samples)]

    def call(requests, **kw):
        outs = rollout._vllm.llm.generate(requests, vllm.SamplingParams(n=args.samples, temperature=1.0,
                                                                          detokenize=False, **kw), use_tqdm=False)
        return [list(c.token_ids) for o in outs for c in o.outputs]

    return {"fixed": lambda s: call(prompts, max_tokens=args.new_tokens, ignore_eos=True),
            "long_tail": lambda s: call(prompts, max_tokens=args.long_tail_max, stop_token_ids=[stop]),
            "single_turn": lambda s: call(chats, max_tokens=args.turns * args.turn_tokens, ignore_eos=True)}


def hf_calls(folder: str, args, stop: int) -> dict[str, Callable[[int], list[list[int]]]]:
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build_model(folder).to(args.device, dtype).eval()
    ids = torch.tensor(prompt_ids(args.rows // args.samples, args.prompt_len, model.config.vocab_size, seed=1),
                       device=args.device).repeat_interleave(args.samples, 0)

    def call(seed: int, new_tokens: int, fixed: bool):
        torch.manual_seed(seed)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                                 top_p=1.0, temperature=1.0, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens if fixed else 0, eos_token_id=None if fixed else stop,
                                 pad_token_id=0)
        rows = out[:, ids.shape[1]:].tolist()
        return [r if fixed or stop not in r else r[:r.index(stop) + 1] for r in rows]

    return {"fixed": lambda s: call(s, args.new_tokens, True), "long_tail": lambda s: call(s, args.long_tail_max, False)}


def mismatch(rollout: Rollout, folder: str, args) -> dict:
    """The trainer-rollout gap on the fixed workload's samples (GRPO's rollout_correction metrics)."""
    prompts = prompt_ids(args.rows // args.samples, args.prompt_len, rollout._vocab, seed=1)
    out = rollout.generate(prompts, SamplingParams(temperature=1.0, n=args.samples, seed=1,
                                                   max_new_tokens=args.new_tokens, ignore_eos=True))
    batch = batch_from_completions(out, rollout.pad_id)
    trainer = Trainer(folder, {"device": args.device, "micro_batch_per_device": 16})
    figures = rollout_offpolicy_metrics(trainer.logprobs(batch, 1.0), batch.old_logprobs, batch.loss_mask)
    return {k: float(v) for k, v in figures.items()}


def timed(calls: dict[str, Callable[[int], list[list[int]]]], args) -> dict[str, dict]:
    """Each variant's call (one engine's variants of one workload), warmed up once at full size
    (graphs, compilation, caches), then timed in --repeats rounds that take the variants in turn,
    each round starting one later, so that a slow stretch of the machine falls on every variant
    alike; the median wall per variant. A variant that raises is reported and left out after."""
    figures, walls, lengths = {}, {name: [] for name in calls}, {}
    live = []
    for name, fn in calls.items():
        try:
            fn(0)
            live.append(name)
        except Exception as e:  # one variant's failure is reported, the others still run
            figures[name] = {"error": f"{type(e).__name__}: {e}"}
    for r in range(args.repeats):
        start = r % len(live) if live else 0
        for name in live[start:] + live[:start]:
            if name in figures:
                continue
            sync(args.device)
            t0 = time.perf_counter()
            try:
                rows = calls[name](r + 1)
            except Exception as e:
                figures[name] = {"error": f"{type(e).__name__}: {e}"}
                continue
            sync(args.device)
            walls[name].append(time.perf_counter() - t0)
            lengths[name] = [len(x) for x in rows]
    for name in live:
        if name in figures:
            continue
        wall, ordered = statistics.median(walls[name]), sorted(lengths[name])
        figures[name] = {"rows": len(ordered), "tokens": sum(ordered), "walls_s": walls[name], "wall_s": wall,
                         "tokens_per_s": sum(ordered) / wall, "ms_per_step": 1e3 * wall / max(ordered[-1], 1),
                         "length_mean": statistics.mean(ordered), "length_p50": ordered[len(ordered) // 2],
                         "length_p90": ordered[int(0.9 * (len(ordered) - 1))], "length_max": ordered[-1]}
    return figures


def run_engine(args) -> dict:
    """One engine at every workload, in this process."""
    folder, stop = args.checkpoint, args.stop_token
    dtype = "bfloat16" if args.device.startswith("cuda") else None
    results: dict = {}
    variants: list[tuple[str, dict]] = []
    if args.engine == "hf":
        variants.append(("hf", hf_calls(folder, args, stop)))
    else:
        engine = "vllm" if args.engine == "vllm" else "torch"
        config = {"device": args.device, "dtype": dtype, "max_batch_size": args.rows,
                  "compile_decode": args.engine == "torch_compiled", "chat": True}
        rollout = Rollout(folder, config=config, engine=engine,
                          engine_options=json.loads(args.vllm_options) if engine == "vllm" else None)
        rollout._vocab, rollout._logprobs = build_model_vocab(folder), True
        if engine == "vllm":
            results["settings"] = rollout.engine_info()
            variants.append(("vllm_raw", raw_vllm_calls(rollout, args, stop)))
        variants.append((args.engine if engine == "torch" else "vllm_rollout", rollout_calls(rollout, args, stop)))
        if engine == "vllm":
            bare = rollout_calls(rollout, args, stop)
            variants.append(("vllm_rollout_no_logprobs", {k: _without_logprobs(rollout, f) for k, f in bare.items()}))
    for workload in args.workloads:
        calls = {name: c[workload] for name, c in variants if workload in c and workload != "mismatch"}
        before = dict(torch_decode.COUNTS)
        timings = timed(calls, args)
        # The torch decoder's counts over the workload (the torch engines run one variant each).
        counts = {k: torch_decode.COUNTS[k] - before.get(k, 0) for k in torch_decode.COUNTS}
        for name, figures in timings.items():
            figures["decode_counts"] = counts
            results.setdefault(name, {})[workload] = figures
            print(json.dumps({"engine": name, "workload": workload, **figures}), flush=True)
        Path(args.out).write_text(json.dumps(results))
    if "mismatch" in args.workloads and args.engine != "hf":
        try:
            results["mismatch"] = mismatch(rollout, folder, args)
        except Exception as e:  # reported beside the timings
            results["mismatch"] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({"engine": args.engine, "mismatch": results["mismatch"]}), flush=True)
        Path(args.out).write_text(json.dumps(results))
    return results


def _without_logprobs(rollout: Rollout, fn: Callable) -> Callable:
    def call(seed: int):
        rollout._logprobs = False
        try:
            return fn(seed)
        finally:
            rollout._logprobs = True
    return call


def build_model_vocab(folder: str) -> int:
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(folder, local_files_only=True).vocab_size


# ----------------------------------------------------------------------------- all engines

def run_all(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="rollout-engines-"))
    folder = work / "model"
    t0 = time.perf_counter()
    model = write_checkpoint(args, folder)
    summary = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "model": args.model, **model, "checkpoint_s": time.perf_counter() - t0,
               "settings": {k: v for k, v in vars(args).items() if k not in ("mode", "out")}, "engines": {}}
    print(json.dumps({k: v for k, v in summary.items() if k != "engines"}), flush=True)
    for engine in args.engines:
        part = work / f"{engine}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "one", "--engine", engine, "--checkpoint", str(folder),
               "--stop-token", str(model["stop_token"]), "--out", str(part), *_passed(args)]
        print("$", " ".join(cmd[1:]), flush=True)
        t0 = time.perf_counter()
        try:
            code = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        result = json.loads(part.read_text()) if part.is_file() and part.read_text().strip() else {}
        result["process"] = {"exit": code, "wall_s": time.perf_counter() - t0}
        summary["engines"][engine] = result
        Path(args.out).write_text(json.dumps(summary, indent=1))
    ratios(summary)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print_table(summary)
    return summary


def _passed(args) -> list[str]:
    out = []
    for key in ("device", "rows", "samples", "prompt_len", "new_tokens", "long_tail_max", "turns", "turn_tokens",
                "repeats", "vllm_options"):
        out += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return out + ["--workloads", *args.workloads]


def ratios(summary: dict) -> None:
    """Each variant's tokens/s over raw vLLM's (same workload) and raw vLLM's wall over its own
    (where the samples differ in length, the long tail's, the two tell different stories: tokens
    made per second, and the time a call of the same prompts takes), and multi-turn over single-turn."""
    engines = summary["engines"]
    raw_runs = (engines["vllm"].get("vllm_raw") if "vllm" in engines else None) or {}
    for result in summary["engines"].values():
        for name, workloads in result.items():
            if not isinstance(workloads, dict) or name in ("settings", "process", "mismatch"):
                continue
            for workload, figures in workloads.items():
                raw = raw_runs.get(workload, {})
                if raw.get("tokens_per_s") and "tokens_per_s" in figures:
                    figures["x_raw_vllm"] = figures["tokens_per_s"] / raw["tokens_per_s"]
                    figures["x_raw_vllm_wall"] = raw["wall_s"] / figures["wall_s"]
            multi, single = workloads.get("multi_turn", {}), workloads.get("single_turn", {})
            if "wall_s" in multi and "wall_s" in single:
                multi["x_single_turn_time"] = multi["wall_s"] / single["wall_s"]


def print_table(summary: dict) -> None:
    print(f"\n{summary['device']}, {summary['model']} shape, vocabulary {summary['vocab_size']:,}")
    print("| engine | workload | tokens/s | ms/step | x raw vLLM | wall x raw vLLM | lengths mean / p50 / max | "
          "multi / single time |")
    print("|---|---|---|---|---|---|---|---|")
    for result in summary["engines"].values():
        for name, workloads in result.items():
            if name in ("settings", "process", "mismatch") or not isinstance(workloads, dict):
                continue
            for workload, f in workloads.items():
                if "error" in f:
                    print(f"| {name} | {workload} | failed: {f['error'][:80]} | | | | | |")
                    continue
                print(f"| {name} | {workload} | {f['tokens_per_s']:,.0f} | {f['ms_per_step']:.2f} | "
                      f"{f.get('x_raw_vllm', float('nan')):.2f} | {f.get('x_raw_vllm_wall', float('nan')):.2f} | "
                      f"{f['length_mean']:.0f} / {f['length_p50']} / "
                      f"{f['length_max']} | {f.get('x_single_turn_time', float('nan')):.2f} |")
        if "mismatch" in result:
            print(f"| {result['mismatch']} |")
        if result.get("process", {}).get("exit"):
            print(f"| process exit {result['process']['exit']} | | | | | | | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="all", choices=["all", "one"])
    p.add_argument("--model", default="qwen2_0p5b")
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--mean-length", type=float, default=80.0, help="long_tail: the expected mean tokens before the "
                   "stop token from the calibration (the lengths measured are reported)")
    p.add_argument("--calibration-rounds", type=int, default=4, help="long_tail: generations (one row per prompt) that "
                   "correct the stop token's scale on the model's own samples, per search phase")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=512, help="completions (trajectories) per call")
    p.add_argument("--samples", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256, help="fixed: tokens per completion")
    p.add_argument("--long-tail-max", type=int, default=1024, help="long_tail: most tokens per completion")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds (each after one warm-up call per variant)")
    p.add_argument("--vllm-options", default='{"kv_cache_gib": 8}', help="JSON dict of vllm options for the vLLM "
                   "engine (a fixed KV cache leaves the rest of the device to the mismatch workload's trainer)")
    p.add_argument("--timeout-s", type=float, default=420, help="limit per engine's process")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--stop-token", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", default="rollout_engines.json")
    args = p.parse_args()
    if args.mode == "one":
        run_engine(args)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
