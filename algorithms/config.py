"""Typed run configs of the drivers. Defaults live here once; conf/ YAML chooses values.

Each driver's schema is `RunConfig` plus its `algorithm` section; `prepare` validates
the composed config (unknown keys, types, placement) before any actor starts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from algorithms.data import DataConfig
from orchestration.config import (BackendConfig, ClusterConfig, ConfigError, PlacementConfig, WeightSyncConfig,
                                  apply_swift_yaml, placement_dict, validate)
from orchestration.planner import Plan, make_plan
from orchestration.weight_sync import check_settings as check_weight_sync
from roles.engines.options import (ROLLOUT_ENGINES, TEACHER_ENGINES, TRAIN_ENGINES, DeepSpeedOptions,
                                   MegatronOptions, VLLMOptions)
from roles.models import ModelConfig, check_config, resolve_config
from roles.rollout import RolloutConfig
from roles.teacher import TeacherConfig
from roles.trainer import TrainerConfig, resolve_trainer_config


@dataclass
class LoopConfig:
    # Optimizer steps of the run.
    steps: int = 100
    # Prompts drawn from the training set per step.
    prompts_per_step: int = 16
    # Measure eval/accuracy every N steps (always at step 0 and at the end); 0: only those.
    eval_every: int = 0
    # Longest completion (tokens) when generating for eval.
    eval_max_new_tokens: int = 48
    # Save a checkpoint every N steps; 0: only the final one.
    save_every: int = 0
    # Save a checkpoint (HF format + optimizer) at the end of the run.
    save_final: bool = True
    # Seed of the driver's sampling of prompts and coin flips.
    seed: int = 0


@dataclass
class RunConfig:
    """What every driver reads."""
    # Placement in either ms-swift form.
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    # Ray cluster to start or join.
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # Worker backend.
    backend: BackendConfig = field(default_factory=BackendConfig)
    # An ms-swift YAML file (either form) applied over this config.
    config_file: Optional[str] = None
    # Policy / student model.
    model: ModelConfig = field(default_factory=ModelConfig)
    # Trainer engine settings (optimizer, schedule, micro-batching).
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # Rollout engine settings.
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    # Task and data.
    data: DataConfig = field(default_factory=DataConfig)
    # Loop lengths, eval and checkpoint cadence.
    run: LoopConfig = field(default_factory=LoopConfig)
    # How trainer weights reach the rollout/sampler/teacher groups (path, bucket size, checks).
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    # DeepSpeed trainer options (backend.train=deepspeed).
    deepspeed: DeepSpeedOptions = field(default_factory=DeepSpeedOptions)
    # Megatron-core trainer/teacher options (backend.train=megatron, backend.teacher=megatron).
    megatron: MegatronOptions = field(default_factory=MegatronOptions)
    # vLLM rollout/teacher options (backend.rollout=vllm, backend.teacher=vllm).
    vllm: VLLMOptions = field(default_factory=VLLMOptions)


@dataclass
class SFTAlgorithm:
    # Sequences per step are run.prompts_per_step; the loss counts response tokens only
    # (prompt tokens are context), or every token with pretrain=true.
    pretrain: bool = False


@dataclass
class SFTRunConfig(RunConfig):
    # SFT / pretraining options.
    algorithm: SFTAlgorithm = field(default_factory=SFTAlgorithm)


def sft_phase(cfg: RunConfig, **changes: Any) -> SFTRunConfig:
    """The config of an SFT phase inside another run (GRPO's warm start, distill's SFT): every
    section of `cfg` (placement, engines and their options, weight sync, ...) with `changes`."""
    return SFTRunConfig(**{**{f.name: getattr(cfg, f.name) for f in fields(RunConfig)}, **changes})


@dataclass
class GKDAlgorithm:
    # Fraction of steps trained on the student's own generations (on-policy); the rest
    # use the dataset's responses.
    lmbda: float = 0.5
    # Generalized JSD interpolation: 0 forward KL(teacher||student), 1 reverse KL.
    beta: float = 0.5
    # Softmax temperature on both sides of the divergence, and for student generation.
    temperature: float = 0.9
    # Weight of an added NLL term on the batch's responses.
    sft_alpha: float = 0.0
    # Off-policy steps use teacher generations instead of dataset responses.
    seq_kd: bool = False
    # Top-k teacher logits mode: "renorm" (both sides restricted to the k tokens) or "tail"
    # (k tokens plus one bucket for the remaining mass). Top-k itself is
    # placement.gkd_logits_topk (null: full vocabulary).
    topk_mode: str = "renorm"
    # Longest student generation in tokens.
    max_new_tokens: int = 48
    # Steps an on-policy generation may run ahead of training (separate placement only): with N
    # the rollout generates for steps k+1..k+N while the teacher and trainer work on step k, so
    # the student's samples are up to N weight versions old. 0: strictly on-policy.
    max_staleness: int = 0


@dataclass
class TeacherModelConfig:
    # Teacher model: a preset name (conf/model/) or a local HF directory;
    # placement.teacher_model / placement.teacher.model override it when set.
    model: str = "small_qwen2"
    # Teacher engine settings.
    engine: TeacherConfig = field(default_factory=TeacherConfig)
    # Train the teacher by SFT first (cached by its config): steps; 0 uses it as given.
    warmup_steps: int = 0
    # Learning rate of that teacher SFT.
    warmup_lr: float = 3e-3
    # Sequences per teacher SFT step.
    warmup_batch: int = 64
    # Folder where warmed-up teachers are cached.
    cache_dir: str = "~/.cache/rayroles/teachers"


@dataclass
class GKDRunConfig(RunConfig):
    # GKD options.
    algorithm: GKDAlgorithm = field(default_factory=GKDAlgorithm)
    # The teacher.
    teacher: TeacherModelConfig = field(default_factory=TeacherModelConfig)


# ms-swift keys a driver understands in a config_file, mapped onto our dotted keys.
SWIFT_COMMON_KEYS = {"learning_rate": "trainer.lr", "max_steps": "run.steps", "seed": "run.seed",
                     "warmup_steps": "trainer.warmup_steps", "max_grad_norm": "trainer.grad_clip",
                     "weight_decay": "trainer.weight_decay", "model": "model.path",
                     "per_device_train_batch_size": "trainer.micro_batch_per_device"}
SWIFT_GKD_KEYS = {**SWIFT_COMMON_KEYS, "lmbda": "algorithm.lmbda", "beta": "algorithm.beta",
                  "temperature": "algorithm.temperature", "sft_alpha": "algorithm.sft_alpha",
                  "seq_kd": "algorithm.seq_kd", "max_completion_length": "algorithm.max_new_tokens"}


def prepare(cfg: DictConfig | dict, schema: type, swift_keys: dict[str, str]) -> tuple[Any, Plan]:
    """Validate a composed config against `schema`, apply config_file, plan the placement.

    Returns (typed config object, plan). Raises ConfigError/PlanError naming the key.
    """
    typed = validate(cfg, schema)
    if typed.config_file:
        apply_swift_yaml(typed, swift_keys)
        typed = validate(typed, schema)
    plan = make_plan(placement_dict(typed))
    run = OmegaConf.to_object(typed)
    # Derived once here: the learning-rate schedule spans the run.
    run.trainer.total_steps = run.run.steps
    try:  # the roles' own checks, run here so nothing starts with a config they refuse
        resolve_trainer_config(run.trainer)
        check_config(resolve_config(run.model))
    except ValueError as e:
        raise ConfigError(f"{e}. Fix: change the named trainer./model. key") from None
    for role, choices in (("train", TRAIN_ENGINES), ("rollout", ROLLOUT_ENGINES), ("teacher", TEACHER_ENGINES)):
        if getattr(run.backend, role) not in choices:
            raise ConfigError(f"config key 'backend.{role}'={getattr(run.backend, role)!r}. "
                              f"Fix: use one of {list(choices)}")
    check_weight_sync(run.weight_sync)
    check_vllm_tensor_parallel(run, plan)
    if run.run.steps < 1 or run.run.prompts_per_step < 1:
        raise ConfigError("config keys 'run.steps' and 'run.prompts_per_step' must be >= 1")
    trainer_ranks = max((plan[r].world_size for r in ("train", "default") if r in plan.roles), default=1)
    if run.run.prompts_per_step < trainer_ranks:
        # A rank without a share would wait forever in the gradient all-reduce.
        raise ConfigError(f"config key 'run.prompts_per_step'={run.run.prompts_per_step} is below the "
                          f"{trainer_ranks} trainer ranks. Fix: raise it to at least {trainer_ranks}")
    return run, plan


def check_vllm_tensor_parallel(cfg: RunConfig, plan: Plan) -> None:
    """`<role>.vllm_tensor_parallel_size` > 1 needs a vLLM engine, one process per rank, and a
    model whose attention heads split evenly over the engine's ranks."""
    for role, entry in plan.roles.items():
        tp = entry.tensor_parallel_size
        if tp == 1:
            continue
        where = f"device_groups.{entry.group}" if plan.form == "device_groups" else role
        key = f"placement key '{where}.vllm_tensor_parallel_size'={tp}"
        backend = "teacher" if role == "teacher" else "rollout"  # the sampler runs the rollout's engine
        if getattr(cfg.backend, backend) != "vllm":
            raise ConfigError(f"{key}: only a vLLM engine spans several ranks; the {role} runs "
                              f"{getattr(cfg.backend, backend)}. Fix: set backend.{backend}=vllm, or set it to 1")
        if cfg.backend.workers != "ray":
            raise ConfigError(f"{key}: the ranks of one engine are separate processes. Fix: set "
                              "backend.workers=ray, or set it to 1")
        model = resolve_config(entry.model or (cfg.teacher.model if role == "teacher" else cfg.model))
        heads = (json.loads((Path(model.path) / "config.json").read_text())["num_attention_heads"] if model.path
                 else model.num_attention_heads)
        if heads % tp:
            raise ConfigError(f"{key} does not divide the model's {heads} attention heads. Fix: use a divisor "
                              f"of {heads}")


def engine_args(cfg: RunConfig, role: str) -> dict:
    """Constructor arguments choosing a role's engine: {"engine": name, "engine_options": {...}}
    for role "train", "rollout" or "teacher" (the sampler uses the rollout's)."""
    engine = getattr(cfg.backend, role)
    options = {"deepspeed": cfg.deepspeed, "megatron": cfg.megatron, "vllm": cfg.vllm}.get(engine)
    return {"engine": engine, "engine_options": as_dict(options) if options is not None else {}}


def as_dict(section: Any) -> dict:
    """A config section as a plain dict (what crosses to a role's constructor)."""
    return OmegaConf.to_container(OmegaConf.structured(section), resolve=True)
