"""Typed run configs of the drivers. Defaults live here once; conf/ YAML chooses values.

Each driver's schema is `RunConfig` plus its `algorithm` section; `prepare` types the
composed config (unknown keys, types), applies a config_file and plans the placement; the
driver's `validate` (algorithms/validation.py) then checks the values, before anything starts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from algorithms.data import DataConfig
from algorithms.swift_args import epochs_to_steps, translate
from orchestration.config import (BackendConfig, ClusterConfig, ConfigError, PlacementConfig, WeightSyncConfig,
                                  apply_placement, placement_dict, read_config_file, validate)
from orchestration.planner import Plan, make_plan
from roles.engines.options import DeepSpeedOptions, MegatronOptions, VLLMOptions
from roles.models import ModelConfig, hub_cache_dir
from roles.rollout import RolloutConfig
from roles.teacher import TeacherConfig
from roles.trainer import TrainerConfig


@dataclass
class LoopConfig:
    # Optimizer steps of the run.
    steps: int = 100
    # Passes over the training rows; when set, run.steps = ceil(epochs * rows / prompts_per_step)
    # once the data is loaded (ms-swift's num_train_epochs). null: run.steps.
    epochs: Optional[float] = None
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
    # Continue an interrupted run: "auto" (the newest complete checkpoint in the run directory;
    # with Hydra, pass hydra.run.dir=<the old run's directory>; none there: start at step 0) or
    # the path of a checkpoints/step_N folder. null: start at step 0.
    resume: Optional[str] = None
    # Keep only the k newest checkpoints of the run; 0 keeps all.
    keep_last: int = 0
    # Lost workers survived (Ray only; a process that died or stopped answering): a rollout,
    # sampler, teacher, PRM or ORM rank is replaced and its call retried, up to N times per
    # role; a lost trainer rank restarts every role from the newest checkpoint, up to N times.
    # 0: the run stops with the error. Each restart is a line of events.jsonl.
    max_restarts: int = 0
    # Where each step's metrics go, several at once: jsonl (metrics.jsonl, always listed: resume
    # reads it), tensorboard (<run dir>/tensorboard), wandb (offline run in <run dir>/wandb).
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    # Print every metric every N steps (and at the first and last step); between them the
    # progress bar shows a few. 0: only the first and last step.
    log_every: int = 10
    # The run's name in TensorBoard and W&B; null: the run directory's name.
    name: Optional[str] = None
    # Tags of the run (W&B tags; a text entry in TensorBoard).
    tags: list[str] = field(default_factory=list)
    # Level of the run's Python logging (driver and workers): DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"


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
    DRIVER: ClassVar[str] = "sft"
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
    # A teacher on devices of its own (placement.teacher, sharing none with trainer or rollout;
    # on Ray) scores an off-policy step's batch during the previous step's train call when
    # nothing else comes between the two (no eval, save or generation): teacher and student
    # then work at once. Not with seq_kd or max_staleness > 0. Holds the next batch's teacher
    # logprobs beside the current ones (with full-vocabulary logits, a second batch x length x
    # vocabulary array in the object store). false: they take turns.
    score_ahead: bool = True


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
    DRIVER: ClassVar[str] = "gkd"
    # GKD options.
    algorithm: GKDAlgorithm = field(default_factory=GKDAlgorithm)
    # The teacher.
    teacher: TeacherModelConfig = field(default_factory=TeacherModelConfig)


def prepare(cfg: DictConfig | dict, schema: type, cli: Optional[list[str]] = None) -> tuple[Any, Plan]:
    """A composed config as a typed `schema` object with config_file applied, and its plan.

    The config_file's training keys are translated for the schema's driver (`schema.DRIVER`,
    algorithms/swift_args.py); `cli`: the command line's overrides (default: Hydra's, when a
    Hydra app runs), which win over the file's values. Raises ConfigError/PlanError naming the
    key. The driver's `validate(cfg, plan)` checks the values next, before anything starts.
    """
    typed = validate(cfg, schema)
    if typed.config_file:
        placement, overrides, no_effect = translate(read_config_file(typed.config_file), schema.DRIVER, typed)
        apply_placement(typed, placement)
        for key, value in overrides.items():
            try:
                OmegaConf.update(typed, key, value, merge=False)
            except OmegaConfBaseException as e:
                raise ConfigError(f"config key 'config_file'={typed.config_file!r}: its value for {key} "
                                  f"({value!r}) does not fit: {getattr(e, 'msg', e)}. Fix: correct it in the file") from None
        file_keys = list(overrides) + ["placement"] * bool(placement)
        kept = keep_command_line(typed, cfg, cli_overrides() if cli is None else cli, file_keys)
        if kept:
            print(f"config_file {typed.config_file}: the command line's {kept} win over the file's values")
        if no_effect:
            print(f"config_file {typed.config_file}: {no_effect} change nothing here (docs/ms_swift.md says why)")
        typed = validate(typed, schema)
    plan = make_plan(placement_dict(typed))
    run = OmegaConf.to_object(typed)
    run.model.path = local_model_path(run.model.path)
    return with_steps(run, run.run.steps), plan


def with_steps(run: Any, steps: int) -> Any:
    """`run` with `steps` optimizer steps and what follows from them (derived only here): the
    learning-rate schedule spans the run, warmup_ratio sets the warmup steps."""
    trainer = replace(run.trainer, total_steps=steps)
    if trainer.warmup_ratio is not None:
        trainer.warmup_steps = round(trainer.warmup_ratio * steps)
    return replace(run, run=replace(run.run, steps=steps), trainer=trainer)


def fit_epochs(run: Any, rows: int) -> Any:
    """`run` with run.steps from run.epochs (when set) over `rows` training rows, one
    run.prompts_per_step rows a step; the drivers call it once the data is loaded."""
    if run.run.epochs is None:
        return run
    steps = epochs_to_steps(run.run.epochs, rows, run.run.prompts_per_step)
    print(f"run.epochs={run.run.epochs} over {rows} training rows, {run.run.prompts_per_step} a step: {steps} steps")
    return with_steps(run, steps)


def local_model_path(path: Optional[str]) -> Optional[str]:
    """A model folder as every process reads it: absolute (workers may not share the driver's
    working directory), or a hub repo id's snapshot in the local Hugging Face cache. Anything
    else is returned as given, for validation to refuse with its key."""
    if path is None or os.path.isdir(path):
        return None if path is None else os.path.abspath(path)
    return hub_cache_dir(path) or path


def cli_overrides() -> list[str]:
    """The running Hydra app's command-line overrides; [] outside one (tests, compose())."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return []


def keep_command_line(typed: DictConfig, composed: DictConfig, cli: list[str], file_keys: list[str]) -> list[str]:
    """Put back the command line's values of the keys the config_file set (`file_keys`, dotted;
    "placement" for its whole layout). Returns the keys put back."""
    kept = []
    for override in cli:
        key = override.split("=", 1)[0].lstrip("+")
        if "=" not in override or key.startswith(("~", "hydra.")) or key in ("experiment", "config_file"):
            continue
        if any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in file_keys):
            OmegaConf.update(typed, key, OmegaConf.select(composed, key), merge=False)
            kept.append(key)
    return kept


def engine_args(cfg: RunConfig, role: str) -> dict:
    """Constructor arguments choosing a role's engine: {"engine": name, "engine_options": {...}}
    for role "train", "rollout" or "teacher" (the sampler uses the rollout's)."""
    engine = getattr(cfg.backend, role)
    options = {"deepspeed": cfg.deepspeed, "megatron": cfg.megatron, "vllm": cfg.vllm}.get(engine)
    return {"engine": engine, "engine_options": as_dict(options) if options is not None else {}}


def as_dict(section: Any) -> dict:
    """A config section as a plain dict (what crosses to a role's constructor)."""
    return OmegaConf.to_container(OmegaConf.structured(section), resolve=True)
