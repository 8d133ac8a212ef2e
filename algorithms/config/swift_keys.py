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
import math
import os
from typing import Any, Mapping

import yaml

from algorithms.config import swift_values as conv
from orchestration.config import PLACEMENT_KEYS, ConfigError, split_config_file
from roles.engines.options import VLLM_ROLE_SECTIONS

# Keys every driver reads (the ms-swift name, and its Megatron or Hugging Face alias).
MAPPED: dict[str, conv.Mapper] = {
    "model": conv.model,
    "dataset": conv.dataset,
    "val_dataset": conv.to("data.val_paths", convert=conv.paths),
    "split_dataset_ratio": conv.split_ratio,
    "columns": conv.to("data.columns", convert=conv.columns),
    "max_length": conv.to("data.max_length", convert=conv.integer),
    "truncation_strategy": conv.truncation,
    "system": conv.to("data.system", convert=lambda s: conv.path(s) if conv.text(s).endswith(".txt") else conv.text(s)),
    "enable_thinking": conv.to("data.enable_thinking", convert=conv.optional(conv.flag)),
    "seed": conv.to("run.seed", "data.seed", "trainer.seed", convert=conv.integer),
    "data_seed": conv.to("data.seed", convert=conv.integer),
    "lr": conv.to("trainer.lr", convert=conv.number),
    "learning_rate": conv.to("trainer.lr", convert=conv.number),
    "min_lr": conv.to("trainer.min_lr", convert=conv.number),
    "lr_warmup_iters": conv.to("trainer.warmup_steps", convert=conv.integer),
    "warmup_steps": conv.to("trainer.warmup_steps", convert=conv.integer),
    "lr_warmup_fraction": conv.warmup_fraction,
    "warmup_ratio": conv.warmup_fraction,
    "lr_decay_style": conv.to("trainer.schedule", convert=conv.text),
    "lr_scheduler_type": conv.to("trainer.schedule", convert=conv.text),
    "weight_decay": conv.to("trainer.weight_decay", convert=conv.number),
    "adam_epsilon": conv.to("trainer.adam_eps", convert=conv.number),
    "adam_eps": conv.to("trainer.adam_eps", convert=conv.number),
    "adam_beta1": conv.beta(0),
    "adam_beta2": conv.beta(1),
    "optim": conv.optim,
    "clip_grad": conv.to("trainer.grad_clip", convert=conv.number),
    "max_grad_norm": conv.to("trainer.grad_clip", convert=conv.number),
    "micro_batch_size": conv.to("trainer.micro_batch_per_device", convert=conv.integer),
    "per_device_train_batch_size": conv.to("trainer.micro_batch_per_device", convert=conv.integer),
    "train_iters": conv.to("run.steps", convert=conv.integer),
    "max_steps": conv.to("run.steps", convert=conv.integer),
    "num_train_epochs": conv.to("run.epochs", convert=conv.number),
    "save_interval": conv.to("run.save_every", convert=conv.integer),
    "save_steps": conv.to("run.save_every", convert=conv.integer),
    "save_total_limit": conv.to("run.keep_last", convert=conv.integer),
    "eval_interval": conv.to("run.eval_every", convert=conv.integer),
    "eval_steps": conv.to("run.eval_every", convert=conv.integer),
    "log_interval": conv.to("run.log_every", convert=conv.integer),
    "logging_steps": conv.to("run.log_every", convert=conv.integer),
    "report_to": conv.loggers_swanlab,
    "external_plugins": conv.external_plugins,
    "torch_dtype": conv.to("model.dtype", convert=conv.dtype),
    "bf16": conv.flag_dtype("bfloat16"),
    "fp16": conv.flag_dtype("float16"),
    "attn_impl": conv.to("model.attn_implementation", convert=conv.attn),
    "train_type": conv.train_type,
    "tuner_type": conv.train_type,
    "lora_rank": conv.lora_key("rank", conv.integer),
    "lora_alpha": conv.lora_key("alpha", conv.number),
    "lora_dropout": conv.lora_key("dropout", conv.number),
    "target_modules": conv.lora_key("target_modules", conv.texts),
    "modules_to_save": conv.lora_key("modules_to_save", conv.texts),
    "lora_bias": conv.neutral(("none",), "LoRA adapters here have no bias"),
    "use_rslora": conv.neutral((False,), "the LoRA scale here is lora_alpha / lora_rank"),
    "use_dora": conv.neutral((False,), "DoRA is not implemented here"),
    "vllm_enable_lora": conv.vllm_enable_lora,
    "use_ray": conv.use_ray,
    "save": conv.no_key,
    "output_dir": conv.no_key,
    "vllm_engine_kwargs": conv.vllm_engine_kwargs,
    "deepspeed": conv.deepspeed,
    "tensor_model_parallel_size": conv.tensor_parallel,
    "pipeline_model_parallel_size": conv.neutral((1,), "there is no pipeline parallelism here"),
    "context_parallel_size": conv.neutral((1,), "there is no context parallelism here"),
    "expert_model_parallel_size": conv.neutral((1,), "there is no expert parallelism here"),
    "sequence_parallel": conv.to("megatron.sequence_parallel", convert=conv.flag),
    "use_vllm": conv.use_vllm,
    "vllm_mode": conv.vllm_mode,
    "vllm_gpu_memory_utilization": conv.to("vllm.gpu_memory_utilization", convert=conv.number),
    "vllm_max_model_len": conv.to("vllm.max_model_len", convert=conv.integer),
    "vllm_enable_prefix_caching": conv.to("vllm.enable_prefix_caching", convert=conv.flag),
    "vllm_max_num_seqs": conv.to("vllm.max_num_seqs", convert=conv.integer),
    "vllm_enforce_eager": conv.to("vllm.enforce_eager", convert=conv.flag),
    "vllm_tensor_parallel_size": conv.vllm_tp,
}

# Multi-turn rollouts (GRPO and GKD: algorithm.multi_turn).
MULTI_TURN: dict[str, conv.Mapper] = {
    "multi_turn_scheduler": conv.multi_turn("scheduler", conv.text),
    "max_turns": conv.multi_turn("max_turns", conv.integer),
    "gym_env": conv.multi_turn("gym_env", conv.text),
    "use_gym_env": conv.use_gym_env,
}

# Keys of one driver.
DRIVER_KEYS: dict[str, dict[str, conv.Mapper]] = {
    "grpo": {
        **MULTI_TURN,
        # Sampling.
        "rlhf_type": conv.rlhf_type("grpo"),
        "num_generations": conv.to("algorithm.num_generations", convert=conv.integer),
        "temperature": conv.to("algorithm.temperature", convert=conv.number),
        "top_k": conv.to("algorithm.top_k", convert=conv.integer),
        "top_p": conv.to("algorithm.top_p", convert=conv.number),
        "repetition_penalty": conv.neutral((1.0, 1, None), "no repetition penalty in generation here"),
        "max_completion_length": conv.to("algorithm.max_new_tokens", convert=conv.integer),
        # Batches and updates.
        "global_batch_size": conv.global_batch("grpo"),
        "generation_batch_size": conv.generation_batch,
        "steps_per_generation": conv.to("algorithm.steps_per_generation", convert=conv.integer),
        "num_iterations": conv.neutral((1,), "each generation is trained on once per update here "
                                   "(steps_per_generation splits it)"),
        # The loss.
        "beta": conv.to("algorithm.beta", convert=conv.number),
        "epsilon": conv.to("algorithm.epsilon", convert=conv.number),
        "epsilon_high": conv.to("algorithm.epsilon_high", convert=conv.number),
        "loss_type": conv.to("algorithm.loss_type", convert=conv.text),
        "importance_sampling_level": conv.neutral(("token",), "sequence-level ratios (GSPO) are not implemented"),
        "overlong_filter": conv.to("algorithm.overlong_filter", convert=conv.flag),
        # Training-inference mismatch correction; ms-swift's null mode is none here.
        "rollout_importance_sampling_mode": conv.to("algorithm.rollout_importance_sampling_mode",
                                                    convert=lambda v: "none" if v is None else conv.text(v)),
        "rollout_importance_sampling_threshold": conv.to("algorithm.rollout_importance_sampling_threshold",
                                                         convert=conv.number),
        "log_rollout_offpolicy_metrics": conv.to("algorithm.log_rollout_offpolicy_metrics", convert=conv.flag),
        "off_policy_sequence_mask_delta": conv.to("algorithm.off_policy_sequence_mask_delta",
                                                  convert=conv.optional(conv.number)),
        # Advantages and sampling rounds.
        "scale_rewards": conv.to("algorithm.scale_rewards", convert=conv.scale),
        "advantage_estimator": conv.advantage,
        "dynamic_sample": conv.to("algorithm.dynamic_sample", convert=conv.flag),
        "max_resample_times": conv.to("algorithm.max_resample_times", convert=conv.integer),
        # Generation one step ahead of training.
        "async_generate": conv.async_generate,
        # Rewards.
        "reward_funcs": conv.reward_funcs,
        "reward_weights": conv.to("algorithm.reward_weights", convert=conv.numbers),
        # On-policy distillation as RL (a teacher_model in the placement); as in ms-swift, a file
        # without reward_funcs then trains on the teacher's signal alone.
        "teacher_kl_coef": lambda value, file, cfg: {
            "algorithm.teacher_kl_coef": conv.number(value),
            **({"algorithm.reward_funcs": []} if conv.number(value) > 0 and "reward_funcs" not in file else {})},
    },
    "gkd": {
        **MULTI_TURN,
        "rlhf_type": conv.rlhf_type("gkd"),
        "global_batch_size": conv.global_batch("gkd"),
        "max_completion_length": conv.to("algorithm.max_new_tokens", convert=conv.integer),
        "temperature": conv.to("algorithm.temperature", convert=conv.number),
        "lmbda": conv.to("algorithm.lmbda", convert=conv.number),
        "beta": conv.to("algorithm.beta", convert=conv.number),
        "seq_kd": conv.to("algorithm.seq_kd", convert=conv.flag),
        "sft_alpha": conv.to("algorithm.sft_alpha", convert=conv.number),
        "gkd_logits_topk": conv.to("algorithm.logits_topk", convert=conv.optional(conv.integer)),
    },
    "sft": {
        "global_batch_size": conv.global_batch("sft"),
        "gradient_accumulation_steps": conv.accumulation,
        "model_name": conv.to("algorithm.model_name", convert=conv.texts),
        "model_author": conv.to("algorithm.model_author", convert=conv.texts),
    },
    "distill": {
        **{k: conv.to(f"algorithm.{k}", convert=conv.integer) for k in ("num_return_sequences", "n_best_to_keep")},
        **{k: conv.to(f"algorithm.{k}", convert=conv.number) for k in ("prm_threshold", "temperature", "top_p")},
        **{k: conv.to(f"algorithm.{k}", convert=conv.text) for k in ("sampler_type", "output_file")},
        "easy_query_threshold": conv.to("algorithm.easy_query_threshold", convert=conv.optional(conv.number)),
        "max_new_tokens": conv.to("algorithm.max_new_tokens", convert=conv.integer),
        "max_completion_length": conv.to("algorithm.max_new_tokens", convert=conv.integer),
        "sampler_engine": conv.local_sampler,
        "engine_kwargs": conv.engine_kwargs,
        "stream": conv.stream,
        "orm_model": conv.orm_model,
        "prm_model": conv.prm_model,
        "num_sampling_batch_size": conv.to("run.prompts_per_step", convert=conv.integer),
        "num_sampling_per_gpu_batch_size": conv.to("run.prompts_per_step", convert=conv.integer),
        "num_sampling_batches": conv.to("run.steps", convert=conv.integer),
        "num_sampling_per_gpu_batches": conv.to("run.steps", convert=conv.integer),
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
    "use_distributed_optimizer": "optimizer-state sharding is deepspeed's choice here (deepspeed: zero2)",
    "overlap_grad_reduce": "Megatron communication overlap",
    "overlap_param_gather": "Megatron communication overlap",
    "log_completions": "samples are not logged as tables here",
    "logging_first_step": "the first step is always logged here",
    "add_version": "the Hydra run directory is already unique",
    "move_model_batches": "weights move in weight_sync.bucket_mb buckets here",
    "gc_collect_after_offload": "memory is freed after every offload here",
    "load_args": "arguments are never read from a checkpoint folder here",
    "override_exist_file": "the sampled rows go to a new file in the run directory",
    "per_device_eval_batch_size": "eval here is greedy generation on held-out prompts (rollout.max_batch_size "
                                  "rows at a time), no eval-loss batches",
}

# Keys with a reason why they cannot be honoured (and what to use instead).
REFUSED: dict[str, str] = {
    "model_type": "the architecture comes from the model folder's config.json, remove it",
    "template": "prompts use the tokenizer's own chat template (data.chat=false: plain text)",
    "gradient_accumulation_steps": "set global_batch_size (sequences per update), accumulation follows from "
                                   "micro_batch_size (the sft driver reads it)",
    "streaming": "user files are read whole (data.max_rows caps them)",
    "reward_model": "set GRPO's reward model as an orm role (reward_funcs with a planned orm)",
    "teacher_model_server": "the teacher is a role on planned devices, never an external server",
    "vllm_server_host": "the rollout is a role on planned devices, never an external vLLM server",
    "vllm_server_port": "the rollout is a role on planned devices, never an external vLLM server",
    "resume_from_checkpoint": "use run.resume=<checkpoints/step_N folder> (or auto)",
    "delta": "two-sided clipping is not implemented (epsilon / epsilon_high)",
    "kl_in_reward": "the KL term is in the loss (beta) here",
}


def known_keys(driver: str) -> dict[str, conv.Mapper]:
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
            except (conv.Unsupported, ValueError, TypeError) as e:
                problems.append(f"{where}={value!r}: {e}")
                continue
            for ours, v in mapped.items():
                ours = role_key(where, ours)
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
    if driver == "grpo" and "rlhf_type" in flat and "reward_funcs" not in flat:
        out["algorithm.reward_funcs"] = []  # a GRPO run file without reward_funcs: ms-swift's default, none
    if "run.steps" in out:  # ms-swift: train_iters / max_steps win over num_train_epochs
        out.pop("run.epochs", None)
    out.update(teacher_engine(placement, out))
    if problems:
        path = getattr(cfg, "config_file", None)
        raise ConfigError(f"config key 'config_file'{'' if path is None else f'={path!r}'} has {len(problems)} key(s) "
                          "this run cannot honour: "
                          + "; ".join(problems) + ". Fix: change or remove them (docs/ms_swift.md lists every "
                          "key read), nothing has started")
    return placement, out, no_effect


def role_key(where: str, ours: str) -> str:
    """Our key for a value read at `where`: a vLLM setting inside a rollout: or teacher: section
    (`teacher.vllm_gpu_memory_utilization`) is that role's own, `vllm.roles.<role>.*`; any other
    key, and one at the top level, serves every role."""
    role = where.split(".", 1)[0] if "." in where else None
    if role in VLLM_ROLE_SECTIONS and ours.startswith("vllm."):
        return f"vllm.roles.{role}.{ours[len('vllm.'):]}"
    return ours


def teacher_engine(placement: Mapping, out: Mapping) -> dict:
    """A teacher group on devices of its own (`teacher: {gpus: N}`) in a file with use_vllm: true
    is ms-swift's teacher replicas, vLLM engines serving prompt top-k logprobs: backend.teacher=vllm,
    its max_logprobs the file's (vllm_engine_kwargs) else gkd_logits_topk. A colocated
    teacher_model stays on the torch engine, as in ms-swift (full-vocabulary logits need it)."""
    group = placement.get("teacher")
    if out.get("backend.rollout") != "vllm" or not isinstance(group, Mapping) or not group.get("gpus"):
        return {}
    topk = out.get("algorithm.logits_topk")
    given = {"vllm.max_logprobs", "vllm.roles.teacher.max_logprobs"} & set(out)
    return {"backend.teacher": "vllm", **({"vllm.roles.teacher.max_logprobs": topk} if topk and not given else {})}


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
    if not isinstance(data, Mapping):
        return argv  # the driver reports it (read_config_file: a mapping of keys)
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
    for other in conv.DRIVERS:
        if other != driver and key in DRIVER_KEYS[other]:
            return f" (it is a key of the {other} driver)"
    return ""


def epochs_to_steps(epochs: float, rows: int, per_step: int) -> int:
    """Optimizer steps of `epochs` passes over `rows` training rows, `per_step` rows a step."""
    return max(1, math.ceil(epochs * rows / per_step))
