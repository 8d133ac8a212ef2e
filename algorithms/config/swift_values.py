"""How the value of each ms-swift key becomes this project's: the converters that
algorithms/config/swift_keys.py's key tables name (paths with ms-swift's '#N' row counts, dataset
columns, dtypes, the DeepSpeed preset, vLLM arguments, batch sizes, ...). Each takes the
key's value, the whole file and the composed config, and returns {our dotted key: value}, or
raises `Unsupported` with why and what to use."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, Optional

# (the key's value, the whole file, the composed config) -> {our dotted key: value}
Mapper = Callable[[Any, Mapping, Any], dict]
# The drivers that read a config_file.
DRIVERS = ("grpo", "gkd", "sft", "distill")


class Unsupported(ValueError):
    """A value this project cannot honour; the message says why and what to use."""


def to(*keys: str, convert: Callable[[Any], Any] = lambda v: v) -> Mapper:
    """The value (converted) goes to each of `keys`."""
    return lambda value, file, cfg: {k: convert(value) for k in keys}


def path(value: Any) -> str:
    text = os.path.expanduser(str(value))
    return os.path.abspath(text) if os.path.exists(text) else text


def split_count(item: str) -> tuple[str, Optional[int]]:
    """'path#N' -> (path, N): ms-swift's row count after a dataset path."""
    head, sep, count = str(item).rpartition("#")
    if sep and count.isdigit() and not os.path.exists(str(item)):
        return head, int(count)
    return str(item), None


def paths(value: Any) -> list[str]:
    items = value if isinstance(value, list) else [value]
    if any(split_count(v)[1] is not None for v in items):
        raise Unsupported("a '#N' row count is read only on `dataset` here")
    return [path(v) for v in items]


def dataset(value: Any, file: Mapping, cfg: Any) -> dict:
    items = value if isinstance(value, list) else [value]
    split = [split_count(v) for v in items]
    counts = {n for _, n in split}
    out = {"data.task": "files", "data.paths": [path(p) for p, _ in split]}
    if counts != {None}:
        if len(counts) != 1 or None in counts:
            raise Unsupported("'#N' row counts must be the same on every file here (one data.max_rows cap)")
        out["data.max_rows"] = counts.pop()  # the first N rows
    return out


def split_ratio(value: Any, file: Mapping, cfg: Any) -> dict:
    # 0 (ms-swift's default: no split) keeps this project's default held-out rows.
    return {"data.val_split": float(value)} if float(value) > 0 else {}


def columns(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise Unsupported(f"is not a JSON object of old -> new column names ({e.msg})") from None
    if not isinstance(value, dict):
        raise Unsupported("must map old column names to new ones, e.g. {question: query}")
    return dict(value)


def model(value: Any, file: Mapping, cfg: Any) -> dict:
    # The folder (or hub id in the local cache) itself; the drivers resolve and check it.
    return {"model.path": path(value), "model.name": os.path.basename(os.path.normpath(str(value)))}


def rlhf_type(driver: str) -> Mapper:
    def check(value: Any, file: Mapping, cfg: Any) -> dict:
        if value != driver:
            where = f"python -m algorithms.{value}" if value in DRIVERS else "no driver here"
            raise Unsupported(f"is {value!r} but this is the {driver} driver ({where} runs it), and "
                              f"`python -m algorithms.cli config_file=...` picks the driver from rlhf_type")
        return {}
    return check


def neutral(values: tuple, why: str) -> Mapper:
    """A feature this project does not have: only its neutral values are accepted."""
    def check(value: Any, file: Mapping, cfg: Any) -> dict:
        if value not in values:
            raise Unsupported(f"{why}, only {' or '.join(repr(v) for v in values)} is accepted")
        return {}
    return check


def use_ray(value: Any, file: Mapping, cfg: Any) -> dict:
    return {"backend.workers": "ray" if value in (True, "true", "1", 1) else "local"}


def advantage(value: Any, file: Mapping, cfg: Any) -> dict:
    if value not in ("grpo", "rloo"):
        raise Unsupported(f"{value!r}: the estimators here are grpo and rloo (algorithm.leave_one_out)")
    return {"algorithm.leave_one_out": value == "rloo"}


def vllm_engine_kwargs(value: Any, file: Mapping, cfg: Any) -> dict:
    value = json.loads(value) if isinstance(value, str) else dict(value)
    known = {"max_logprobs": "vllm.max_logprobs", "max_num_seqs": "vllm.max_num_seqs",
             "max_num_batched_tokens": "vllm.max_num_batched_tokens", "enforce_eager": "vllm.enforce_eager"}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise Unsupported(f"{unknown}: the vLLM arguments read here are {sorted(known)} (vllm.*)")
    return {known[k]: v for k, v in value.items()}


def sampler_engine(value: Any, file: Mapping, cfg: Any) -> dict:
    engines = {"vllm": "vllm", "transformers": "torch", "pt": "torch"}
    if value not in engines:
        raise Unsupported(f"{value!r}: the sampler runs on a local engine here: vllm, or transformers (torch)")
    return {"backend.rollout": engines[value]}


def train_type(value: Any, file: Mapping, cfg: Any) -> dict:
    if value != "full":
        raise Unsupported(f"{value!r}: only full-parameter training is supported (train_type: full)")
    return {}


def loggers(value: Any, file: Mapping, cfg: Any) -> dict:
    names = value if isinstance(value, list) else [v.strip() for v in str(value).split(",")]
    if names in (["none"], []):
        return {"run.loggers": ["jsonl"]}
    if names == ["all"]:
        names = ["tensorboard", "wandb"]
    unknown = [n for n in names if n not in ("jsonl", "tensorboard", "wandb", "mlflow")]
    if unknown:
        raise Unsupported(f"{unknown}: the trackers here are tensorboard, wandb and mlflow (run.loggers)")
    return {"run.loggers": ["jsonl"] + [n for n in names if n != "jsonl"]}


def use_vllm(value: Any, file: Mapping, cfg: Any) -> dict:
    return {"backend.rollout": "vllm" if value else "torch"}


def vllm_mode(value: Any, file: Mapping, cfg: Any) -> dict:
    if value != "colocate":
        raise Unsupported(f"{value!r}: the rollout is a role on planned devices, never an external vLLM "
                          "server: place it on its own devices instead (colocate_groups without rollout, "
                          "or its own device group)")
    return {}


def deepspeed(value: Any, file: Mapping, cfg: Any) -> dict:
    text = str(value)
    stages = {"zero0": 0, "zero1": 1, "zero2": 2, "zero3": 3}
    base = text.removesuffix("_offload")
    if base not in stages:
        raise Unsupported(f"{text!r}: name a ZeRO preset (zero0..zero3, zero2_offload, zero3_offload), "
                          "a DeepSpeed JSON file is not read, set deepspeed.* keys instead")
    out = {"backend.train": "deepspeed", "deepspeed.zero_stage": stages[base]}
    if text.endswith("_offload"):
        out["deepspeed.offload_optimizer"] = True
        out["deepspeed.offload_param"] = base == "zero3"
    return out


def dtype(value: Any) -> str:
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "auto"}
    return names.get(str(value), str(value))


def flag_dtype(name: str) -> Mapper:
    return lambda value, file, cfg: {"trainer.dtype": name} if value else {}


def attn(value: Any) -> str:
    return {"flash_attn": "flash_attention_2", "flash_attention_2": "flash_attention_2",
            "sdpa": "sdpa", "eager": "eager"}.get(str(value), str(value))


def tensor_parallel(value: Any, file: Mapping, cfg: Any) -> dict:
    if int(value) == 1:
        return {}
    return {"backend.train": "megatron", "megatron.tensor_parallel_size": int(value)}


def vllm_tp(value: Any, file: Mapping, cfg: Any) -> dict:
    if "device_groups" in file:
        raise Unsupported("with device_groups, set vllm_tensor_parallel_size inside the rollout's device group")
    return {"placement.rollout.vllm_tensor_parallel_size": int(value)}


def global_batch(driver: str) -> Mapper:
    """global_batch_size: sequences per optimizer update. GRPO's are completions: prompts per
    step = global_batch_size * steps_per_generation / num_generations."""
    def convert(value: Any, file: Mapping, cfg: Any) -> dict:
        if driver != "grpo":
            return {"run.prompts_per_step": int(value)}
        G = int(file.get("num_generations", cfg.algorithm.num_generations))
        spg = int(file.get("steps_per_generation", cfg.algorithm.steps_per_generation))
        completions = int(value) * spg
        if completions % G:
            raise Unsupported(f"{value} * steps_per_generation {spg} = {completions} completions per generation "
                              f"is not a whole number of prompts of num_generations={G}, use a multiple of {G}")
        return {"run.prompts_per_step": completions // G}
    return convert


def generation_batch(value: Any, file: Mapping, cfg: Any) -> dict:
    G = int(file.get("num_generations", cfg.algorithm.num_generations))
    if int(value) % G:
        raise Unsupported(f"{value} completions is not a whole number of prompts of num_generations={G}")
    return {"run.prompts_per_step": int(value) // G}


def no_key(value: Any, file: Mapping, cfg: Any) -> dict:
    # Read before Hydra starts (`output_run_dir`): the run directory is <value>/<time>.
    return {}


def beta(index: int) -> Mapper:
    """adam_beta1 / adam_beta2: one of trainer.betas (the other from the file or the config)."""
    def convert(value: Any, file: Mapping, cfg: Any) -> dict:
        betas = [float(file.get(f"adam_beta{i + 1}", cfg.trainer.betas[i])) for i in (0, 1)]
        betas[index] = float(value)
        return {"trainer.betas": betas}
    return convert


def optim(value: Any, file: Mapping, cfg: Any) -> dict:
    kernels = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw_fused", "adamw": "adamw", "adam": "adamw"}
    if value not in kernels:
        raise Unsupported(f"{value!r}: the optimizer here is AdamW (adamw_torch, adamw_torch_fused; "
                          "trainer.optimizer picks its kernel)")
    return {"trainer.optimizer": kernels[value]}


def warmup_fraction(value: Any, file: Mapping, cfg: Any) -> dict:
    return {"trainer.warmup_ratio": float(value)}
