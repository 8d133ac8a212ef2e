"""ms-swift's argument names in a `config_file`, translated for the drivers.

A config_file is an ms-swift YAML as its users write it for `megatron rlhf`, `swift rlhf`,
`swift sft` or `swift sample` with Ray: the placement keys of either form (read by
orchestration/config.py) plus the usual training keys. `translate` maps each training key
onto this project's dotted keys (docs/ms_swift.md lists them all). A key is either

* mapped (`MAPPED` for every driver, `DRIVER_KEYS` for one),
* without effect here (`NO_EFFECT`: a speed or memory switch of an engine that is not this
  project's; reported in one line, the run is the same without it), or
* refused: `REFUSED` says why, an unknown key gets the nearest known one. Every refused key of
  a file is listed in one ConfigError, before anything starts.
"""
from __future__ import annotations

import difflib
import json
import math
import os
from typing import Any, Callable, Mapping, Optional

import yaml

from orchestration.config import PLACEMENT_KEYS, ConfigError, split_config_file

# (the key's value, the whole file, the composed config) -> {our dotted key: value}
Mapper = Callable[[Any, Mapping, Any], dict]
DRIVERS = ("grpo", "gkd", "sft", "distill")


class Unsupported(ValueError):
    """A value this project cannot honour; the message says why and what to use."""


def to(*keys: str, convert: Callable[[Any], Any] = lambda v: v) -> Mapper:
    """The value (converted) goes to each of `keys`."""
    return lambda value, file, cfg: {k: convert(value) for k in keys}


def _path(value: Any) -> str:
    text = os.path.expanduser(str(value))
    return os.path.abspath(text) if os.path.exists(text) else text


def _split_count(item: str) -> tuple[str, Optional[int]]:
    """'path#N' -> (path, N): ms-swift's row count after a dataset path."""
    path, sep, count = str(item).rpartition("#")
    if sep and count.isdigit() and not os.path.exists(str(item)):
        return path, int(count)
    return str(item), None


def _paths(value: Any) -> list[str]:
    items = value if isinstance(value, list) else [value]
    paths = [_split_count(v)[0] for v in items]
    if any(_split_count(v)[1] is not None for v in items):
        raise Unsupported("a '#N' row count is read only on `dataset` here")
    return [_path(p) for p in paths]


def _dataset(value: Any, file: Mapping, cfg: Any) -> dict:
    items = value if isinstance(value, list) else [value]
    split = [_split_count(v) for v in items]
    counts = {n for _, n in split}
    out = {"data.task": "files", "data.paths": [_path(p) for p, _ in split]}
    if counts != {None}:
        if len(counts) != 1 or None in counts:
            raise Unsupported("'#N' row counts must be the same on every file here (one data.max_rows cap)")
        out["data.max_rows"] = counts.pop()  # the first N rows
    return out


def _split_ratio(value: Any, file: Mapping, cfg: Any) -> dict:
    # 0 (ms-swift's default: no split) keeps this project's default held-out rows.
    return {"data.val_split": float(value)} if float(value) > 0 else {}


def _columns(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise Unsupported(f"is not a JSON object of old -> new column names ({e.msg})") from None
    if not isinstance(value, dict):
        raise Unsupported("must map old column names to new ones, e.g. {question: query}")
    return dict(value)


def _model(value: Any, file: Mapping, cfg: Any) -> dict:
    # The folder (or hub id in the local cache) itself; the drivers resolve and check it.
    return {"model.path": _path(value), "model.name": os.path.basename(os.path.normpath(str(value)))}


def _rlhf_type(driver: str) -> Mapper:
    def check(value: Any, file: Mapping, cfg: Any) -> dict:
        if value != driver:
            where = f"python -m algorithms.{value}" if value in DRIVERS else "no driver here"
            raise Unsupported(f"is {value!r} but this is the {driver} driver ({where} runs it), and "
                              f"`python -m algorithms.run config_file=...` picks the driver from rlhf_type")
        return {}
    return check


def _neutral(values: tuple, why: str) -> Mapper:
    """A feature this project does not have: only its neutral values are accepted."""
    def check(value: Any, file: Mapping, cfg: Any) -> dict:
        if value not in values:
            raise Unsupported(f"{why}, only {' or '.join(repr(v) for v in values)} is accepted")
        return {}
    return check


def _use_ray(value: Any, file: Mapping, cfg: Any) -> dict:
    return {"backend.workers": "ray" if value in (True, "true", "1", 1) else "local"}


def _advantage(value: Any, file: Mapping, cfg: Any) -> dict:
    if value not in ("grpo", "rloo"):
        raise Unsupported(f"{value!r}: the estimators here are grpo and rloo (algorithm.leave_one_out)")
    return {"algorithm.leave_one_out": value == "rloo"}


def _vllm_engine_kwargs(value: Any, file: Mapping, cfg: Any) -> dict:
    value = json.loads(value) if isinstance(value, str) else dict(value)
    known = {"max_logprobs": "vllm.max_logprobs", "max_num_seqs": "vllm.max_num_seqs",
             "max_num_batched_tokens": "vllm.max_num_batched_tokens", "enforce_eager": "vllm.enforce_eager"}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise Unsupported(f"{unknown}: the vLLM arguments read here are {sorted(known)} (vllm.*)")
    return {known[k]: v for k, v in value.items()}


def _sampler_engine(value: Any, file: Mapping, cfg: Any) -> dict:
    engines = {"vllm": "vllm", "transformers": "torch", "pt": "torch"}
    if value not in engines:
        raise Unsupported(f"{value!r}: the sampler runs on a local engine here: vllm, or transformers (torch)")
    return {"backend.rollout": engines[value]}


def _train_type(value: Any, file: Mapping, cfg: Any) -> dict:
    if value != "full":
        raise Unsupported(f"{value!r}: only full-parameter training is supported (train_type: full)")
    return {}


def _loggers(value: Any, file: Mapping, cfg: Any) -> dict:
    names = value if isinstance(value, list) else [v.strip() for v in str(value).split(",")]
    if names in (["none"], []):
        return {"run.loggers": ["jsonl"]}
    if names == ["all"]:
        names = ["tensorboard", "wandb"]
    unknown = [n for n in names if n not in ("jsonl", "tensorboard", "wandb", "mlflow")]
    if unknown:
        raise Unsupported(f"{unknown}: the trackers here are tensorboard, wandb and mlflow (run.loggers)")
    return {"run.loggers": ["jsonl"] + [n for n in names if n != "jsonl"]}


def _use_vllm(value: Any, file: Mapping, cfg: Any) -> dict:
    return {"backend.rollout": "vllm" if value else "torch"}


def _vllm_mode(value: Any, file: Mapping, cfg: Any) -> dict:
    if value != "colocate":
        raise Unsupported(f"{value!r}: the rollout is a role on planned devices, never an external vLLM "
                          "server: place it on its own devices instead (colocate_groups without rollout, "
                          "or its own device group)")
    return {}


def _deepspeed(value: Any, file: Mapping, cfg: Any) -> dict:
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


def _dtype(value: Any) -> str:
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "auto"}
    return names.get(str(value), str(value))


def _flag_dtype(name: str) -> Mapper:
    return lambda value, file, cfg: {"trainer.dtype": name} if value else {}


def _attn(value: Any) -> str:
    return {"flash_attn": "flash_attention_2", "flash_attention_2": "flash_attention_2",
            "sdpa": "sdpa", "eager": "eager"}.get(str(value), str(value))


def _tensor_parallel(value: Any, file: Mapping, cfg: Any) -> dict:
    if int(value) == 1:
        return {}
    return {"backend.train": "megatron", "megatron.tensor_parallel_size": int(value)}


def _vllm_tp(value: Any, file: Mapping, cfg: Any) -> dict:
    if "device_groups" in file:
        raise Unsupported("with device_groups, set vllm_tensor_parallel_size inside the rollout's device group")
    return {"placement.rollout.vllm_tensor_parallel_size": int(value)}


def _global_batch(driver: str) -> Mapper:
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


def _generation_batch(value: Any, file: Mapping, cfg: Any) -> dict:
    G = int(file.get("num_generations", cfg.algorithm.num_generations))
    if int(value) % G:
        raise Unsupported(f"{value} completions is not a whole number of prompts of num_generations={G}")
    return {"run.prompts_per_step": int(value) // G}


def _no_key(value: Any, file: Mapping, cfg: Any) -> dict:
    # Read before Hydra starts (`output_run_dir`): the run directory is <value>/<time>.
    return {}


def _beta(index: int) -> Mapper:
    """adam_beta1 / adam_beta2: one of trainer.betas (the other from the file or the config)."""
    def convert(value: Any, file: Mapping, cfg: Any) -> dict:
        betas = [float(file.get(f"adam_beta{i + 1}", cfg.trainer.betas[i])) for i in (0, 1)]
        betas[index] = float(value)
        return {"trainer.betas": betas}
    return convert


def _optim(value: Any, file: Mapping, cfg: Any) -> dict:
    kernels = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw_fused", "adamw": "adamw", "adam": "adamw"}
    if value not in kernels:
        raise Unsupported(f"{value!r}: the optimizer here is AdamW (adamw_torch, adamw_torch_fused; "
                          "trainer.optimizer picks its kernel)")
    return {"trainer.optimizer": kernels[value]}


def _warmup_fraction(value: Any, file: Mapping, cfg: Any) -> dict:
    return {"trainer.warmup_ratio": float(value)}


# Keys every driver reads (the ms-swift name, and its Megatron or Hugging Face alias).
MAPPED: dict[str, Mapper] = {
    "model": _model,
    "dataset": _dataset,
    "val_dataset": to("data.val_paths", convert=_paths),
    "split_dataset_ratio": _split_ratio,
    "columns": to("data.columns", convert=_columns),
    "max_length": to("data.max_length", convert=int),
    "system": to("data.system", convert=lambda v: _path(v) if str(v).endswith(".txt") else str(v)),
    "seed": to("run.seed", "data.seed", "trainer.seed", convert=int),
    "data_seed": to("data.seed", convert=int),
    "lr": to("trainer.lr", convert=float),
    "learning_rate": to("trainer.lr", convert=float),
    "min_lr": to("trainer.min_lr", convert=float),
    "lr_warmup_iters": to("trainer.warmup_steps", convert=int),
    "warmup_steps": to("trainer.warmup_steps", convert=int),
    "lr_warmup_fraction": _warmup_fraction,
    "warmup_ratio": _warmup_fraction,
    "lr_decay_style": to("trainer.schedule"),
    "lr_scheduler_type": to("trainer.schedule"),
    "weight_decay": to("trainer.weight_decay", convert=float),
    "adam_epsilon": to("trainer.adam_eps", convert=float),
    "adam_eps": to("trainer.adam_eps", convert=float),
    "adam_beta1": _beta(0),
    "adam_beta2": _beta(1),
    "optim": _optim,
    "clip_grad": to("trainer.grad_clip", convert=float),
    "max_grad_norm": to("trainer.grad_clip", convert=float),
    "micro_batch_size": to("trainer.micro_batch_per_device", convert=int),
    "per_device_train_batch_size": to("trainer.micro_batch_per_device", convert=int),
    "train_iters": to("run.steps", convert=int),
    "max_steps": to("run.steps", convert=int),
    "num_train_epochs": to("run.epochs", convert=float),
    "save_interval": to("run.save_every", convert=int),
    "save_steps": to("run.save_every", convert=int),
    "save_total_limit": to("run.keep_last", convert=int),
    "eval_interval": to("run.eval_every", convert=int),
    "eval_steps": to("run.eval_every", convert=int),
    "log_interval": to("run.log_every", convert=int),
    "logging_steps": to("run.log_every", convert=int),
    "report_to": _loggers,
    "torch_dtype": to("model.dtype", convert=_dtype),
    "bf16": _flag_dtype("bfloat16"),
    "fp16": _flag_dtype("float16"),
    "attn_impl": to("model.attn_implementation", convert=_attn),
    "train_type": _train_type,
    "tuner_type": _train_type,
    "use_ray": _use_ray,
    "save": _no_key,
    "output_dir": _no_key,
    "vllm_engine_kwargs": _vllm_engine_kwargs,
    "deepspeed": _deepspeed,
    "tensor_model_parallel_size": _tensor_parallel,
    "pipeline_model_parallel_size": _neutral((1,), "there is no pipeline parallelism here"),
    "context_parallel_size": _neutral((1,), "there is no context parallelism here"),
    "expert_model_parallel_size": _neutral((1,), "there is no expert parallelism here"),
    "sequence_parallel": _neutral((False,), "there is no sequence parallelism here"),
    "use_vllm": _use_vllm,
    "vllm_mode": _vllm_mode,
    "vllm_gpu_memory_utilization": to("vllm.gpu_memory_utilization", convert=float),
    "vllm_max_model_len": to("vllm.max_model_len", convert=int),
    "vllm_enable_prefix_caching": to("vllm.enable_prefix_caching", convert=bool),
    "vllm_max_num_seqs": to("vllm.max_num_seqs", convert=int),
    "vllm_enforce_eager": to("vllm.enforce_eager", convert=bool),
    "vllm_tensor_parallel_size": _vllm_tp,
}

# Keys of one driver.
DRIVER_KEYS: dict[str, dict[str, Mapper]] = {
    "grpo": {
        "rlhf_type": _rlhf_type("grpo"),
        "num_generations": to("algorithm.num_generations", convert=int),
        "global_batch_size": _global_batch("grpo"),
        "generation_batch_size": _generation_batch,
        "steps_per_generation": to("algorithm.steps_per_generation", convert=int),
        "max_completion_length": to("algorithm.max_new_tokens", convert=int),
        "temperature": to("algorithm.temperature", convert=float),
        "beta": to("algorithm.beta", convert=float),
        "epsilon": to("algorithm.epsilon", convert=float),
        "epsilon_high": to("algorithm.epsilon_high", convert=float),
        "loss_type": to("algorithm.loss_type"),
        "scale_rewards": to("algorithm.scale_rewards", convert=lambda v: {True: "group", False: "none"}.get(v, v)),
        "dynamic_sample": to("algorithm.dynamic_sample", convert=bool),
        "max_resample_times": to("algorithm.max_resample_times", convert=int),
        "reward_funcs": to("algorithm.reward_funcs", convert=lambda v: v if isinstance(v, list) else [v]),
        "reward_weights": to("algorithm.reward_weights", convert=lambda v: [float(x) for x in v]),
        "advantage_estimator": _advantage,
        "importance_sampling_level": _neutral(("token",), "sequence-level ratios (GSPO) are not implemented"),
        "overlong_filter": _neutral((False,), "truncated completions are not filtered from the loss here"),
        "top_k": _neutral((-1, 0, None), "GRPO samples the full distribution (temperature only) here"),
        "top_p": _neutral((1.0, 1, None), "GRPO samples the full distribution (temperature only) here"),
        "repetition_penalty": _neutral((1.0, 1, None), "no repetition penalty in generation here"),
        "num_iterations": _neutral((1,), "each generation is trained on once per update here "
                                   "(steps_per_generation splits it)"),
    },
    "gkd": {
        "rlhf_type": _rlhf_type("gkd"),
        "global_batch_size": _global_batch("gkd"),
        "max_completion_length": to("algorithm.max_new_tokens", convert=int),
        "temperature": to("algorithm.temperature", convert=float),
        "lmbda": to("algorithm.lmbda", convert=float),
        "beta": to("algorithm.beta", convert=float),
        "seq_kd": to("algorithm.seq_kd", convert=bool),
        "sft_alpha": to("algorithm.sft_alpha", convert=float),
    },
    "sft": {
        "global_batch_size": _global_batch("sft"),
    },
    "distill": {
        **{k: to(f"algorithm.{k}") for k in ("num_return_sequences", "n_best_to_keep", "prm_threshold",
                                            "easy_query_threshold", "sampler_type", "temperature", "top_p",
                                            "output_file")},
        "max_new_tokens": to("algorithm.max_new_tokens", convert=int),
        "max_completion_length": to("algorithm.max_new_tokens", convert=int),
        "sampler_engine": _sampler_engine,
        "num_sampling_batch_size": to("run.prompts_per_step", convert=int),
        "num_sampling_per_gpu_batch_size": to("run.prompts_per_step", convert=int),
        "num_sampling_batches": to("run.steps", convert=int),
        "num_sampling_per_gpu_batches": to("run.steps", convert=int),
    },
}

# Switches of ms-swift's engines (Megatron's kernels and recompute, its data loader) that change
# speed or memory there and nothing here: the run is the same with or without them.
NO_EFFECT: dict[str, str] = {
    **{k: "Megatron activation recompute" for k in ("recompute_granularity", "recompute_method",
                                                     "recompute_num_layers")},
    **{k: "a fused kernel of Megatron" for k in ("cross_entropy_loss_fusion", "masked_softmax_fusion",
                                                  "bias_dropout_fusion", "gradient_accumulation_fusion",
                                                  "apply_rope_fusion", "use_liger_kernel")},
    "attention_backend": "Megatron's attention kernel choice (attn_impl picks ours)",
    "padding_free": "batches here are padded to their longest row, trimmed per micro-batch",
    "gradient_checkpointing": "activation recompute of the Hugging Face trainer",
    "dataloader_num_workers": "rows are read once in the driver",
    "dataset_num_proc": "rows are read once in the driver",
    "load_from_cache_file": "rows are read once in the driver",
    "no_save_optim": "checkpoints here always hold the optimizer (resume needs it)",
    "no_save_rng": "checkpoints here always hold the RNG states (resume needs it)",
    "finetune": "a model folder here is always loaded as the start of a new run",
    "use_distributed_optimizer": "ZeRO-1 style sharding is deepspeed's choice here (deepspeed: zero1)",
    "overlap_grad_reduce": "Megatron communication overlap",
    "overlap_param_gather": "Megatron communication overlap",
    "log_completions": "samples are not logged as tables here",
    "log_rollout_offpolicy_metrics": "the rollout's own logprobs are always used for the ratio here",
    "logging_first_step": "the first step is always logged here",
    "add_version": "the Hydra run directory is already unique",
    "move_model_batches": "weights move in weight_sync.bucket_mb buckets here",
    "gc_collect_after_offload": "memory is freed after every offload here",
    "load_args": "arguments are never read from a checkpoint folder here",
    "override_exist_file": "the sampled rows go to a new file in the run directory",
}

# Keys with a reason why they cannot be honoured (and what to use instead).
REFUSED: dict[str, str] = {
    "model_type": "the architecture comes from the model folder's config.json, remove it",
    "template": "prompts use the tokenizer's own chat template (data.chat=false: plain text)",
    "gradient_accumulation_steps": "set global_batch_size (sequences per update), accumulation follows from "
                                   "micro_batch_size",
    "streaming": "user files are read whole (data.max_rows caps them)",
    "truncation_strategy": "too-long prompts are skipped and too-long replies cut (data.max_length), always",
    "lora_rank": "only full-parameter training is supported",
    "lora_alpha": "only full-parameter training is supported",
    "target_modules": "only full-parameter training is supported",
    "reward_model": "set GRPO's reward model as an orm role (reward_funcs with a planned orm)",
    "teacher_model_server": "the teacher is a role on planned devices, never an external server",
    "vllm_server_host": "the rollout is a role on planned devices, never an external vLLM server",
    "vllm_server_port": "the rollout is a role on planned devices, never an external vLLM server",
    "sampler_engine": "the sampler runs backend.rollout's engine (torch or vllm)",
    "prm_model": "set prm.kind / prm.model (a local folder) on the command line",
    "orm_model": "set orm.kind / orm.model (a local folder) on the command line",
    "resume_from_checkpoint": "use run.resume=<checkpoints/step_N folder> (or auto)",
    "external_plugins": "rewards are named by dotted path in reward_funcs (pkg.mod.fn) here",
    "teacher_kl_coef": "on-policy distillation inside GRPO is not implemented, use the gkd driver",
    "enable_thinking": "templates get no thinking switch here, use a tokenizer whose template does what you want",
    "multi_turn_scheduler": "multi-turn rollouts are not implemented",
    "max_turns": "multi-turn rollouts are not implemented",
    "gym_env": "multi-turn rollouts are not implemented",
    "use_gym_env": "multi-turn rollouts are not implemented",
    "delta": "two-sided clipping is not implemented (epsilon / epsilon_high)",
    "kl_in_reward": "the KL term is in the loss (beta) here",
}


def known_keys(driver: str) -> dict[str, Mapper]:
    return {**MAPPED, **DRIVER_KEYS[driver]}


def translate(file: Mapping, driver: str, cfg: Any) -> tuple[dict, dict, list[str]]:
    """(placement keys, our dotted key -> value, keys without effect) of an ms-swift file for
    `driver`. `cfg`: the composed config (the defaults of keys the file leaves out). Raises
    one ConfigError listing every key that cannot be honoured."""
    keys = known_keys(driver)
    placement, items = split_config_file(file)
    flat = {key: value for _, key, value in items}  # what a mapper may look up
    out: dict[str, Any] = {}
    source: dict[str, str] = {}
    no_effect, problems = [], []
    for where, key, value in items:
        if key in keys:
            try:
                mapped = keys[key](value, flat, cfg)
            except (Unsupported, ValueError, TypeError) as e:
                problems.append(f"{where}={value!r}: {e}")
                continue
            for ours, v in mapped.items():
                if ours in out and out[ours] != v:
                    problems.append(f"{where}={value!r}: {source[ours]} already set {ours}={out[ours]!r}, and one "
                                    f"value serves every role here, give them the same one")
                out[ours], source[ours] = v, where
        elif key in NO_EFFECT:
            no_effect.append(where)
        elif key in REFUSED:
            problems.append(f"{where}: not supported: {REFUSED[key]}")
        else:
            problems.append(f"{where}: unknown to the {driver} driver{nearest(key, driver)}")
    if "run.steps" in out:  # ms-swift: train_iters / max_steps win over num_train_epochs
        out.pop("run.epochs", None)
    if problems:
        raise ConfigError(f"config key 'config_file' has {len(problems)} key(s) this run cannot honour: "
                          + "; ".join(problems) + ". Fix: change or remove them (docs/ms_swift.md lists every "
                          "key read), nothing has started")
    return placement, out, no_effect


def output_run_dir(argv: list[str]) -> list[str]:
    """The command line with `hydra.run.dir=<save>/<time>` added when its config_file names an
    output folder (`output_dir`, `save`, or train.output_dir) and the command line sets no run
    directory: ms-swift writes a run into that folder, so does this project."""
    files = [a.split("=", 1)[1] for a in argv if a.startswith(("config_file=", "+config_file="))]
    if not files or any(a.startswith("hydra.run.dir=") for a in argv) or "--multirun" in argv or "-m" in argv:
        return argv
    try:
        with open(files[-1]) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return argv  # the driver reports the file with its path
    train = data.get("train") if isinstance(data.get("train"), Mapping) else {}
    folder = data.get("output_dir") or data.get("save") or train.get("output_dir") or train.get("save")
    if not folder:
        return argv
    return argv + [f"hydra.run.dir={os.path.abspath(str(folder))}/${{now:%Y-%m-%d_%H-%M-%S}}"]


def nearest(key: str, driver: str) -> str:
    """', did you mean X?' with the closest key of this driver or of another one, else ''."""
    own = list(known_keys(driver)) + sorted(PLACEMENT_KEYS) + list(NO_EFFECT)
    close = difflib.get_close_matches(key, own, n=1, cutoff=0.6)
    if close:
        return f", did you mean '{close[0]}'?"
    for other in DRIVERS:
        if other != driver and key in DRIVER_KEYS[other]:
            return f" (it is a key of the {other} driver)"
    return ""


def epochs_to_steps(epochs: float, rows: int, per_step: int) -> int:
    """Optimizer steps of `epochs` passes over `rows` training rows, `per_step` rows a step."""
    return max(1, math.ceil(epochs * rows / per_step))
