"""The typed config every driver shares. Defaults live here once; conf/ YAML chooses values.

Each driver's schema is `DriverConfig` plus its `algorithm` section, defined at the top of
the driver's own file; `prepare` types the composed config (unknown keys, types), applies a
config_file (ms-swift keys: algorithms/config/swift_keys.py) and plans the placement; the
driver's `validate` (shared checks: algorithms/config/checks.py) then checks the values,
before anything starts.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from algorithms.config.swift_keys import epochs_to_steps, translate
from algorithms.data.loading import DataConfig
from orchestration.config import (BackendConfig, ClusterConfig, ConfigError, PlacementConfig, WeightSyncConfig,
                                  apply_placement, placement_dict, read_config_file, validate)
from orchestration.planner import Plan, make_plan
from roles.engines.options import DeepSpeedOptions, MegatronOptions, VLLMOptions
from roles.models import ModelConfig, hub_cache_dir
from roles.rollout import RolloutConfig
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
class DriverConfig:
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

    def updates(self, steps: int) -> int:
        """Optimizer updates of a run of `steps` steps (one a step unless a driver says more)."""
        return steps


# Keys that moved, old spelling -> new: the command line may still give the old one.
RENAMED = {"placement.gkd_logits_topk": "algorithm.logits_topk"}


def renamed(argv: list[str]) -> list[str]:
    """The command line with each old key of RENAMED written as its new key (a note says so)."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        new = RENAMED.get(key.lstrip("+"))
        if eq and new:
            print(f"{key.lstrip('+')} is now {new}: read as {new}={value}")
            arg = f"{new}={value}"
        out.append(arg)
    return out


def prepare(cfg: DictConfig | dict, schema: type, cli: Optional[list[str]] = None) -> tuple[Any, Plan]:
    """A composed config as a typed `schema` object with config_file applied, and its plan.

    The config_file's training keys are translated for the schema's driver (`schema.DRIVER`,
    algorithms/config/swift_keys.py); `cli`: the command line's overrides (default: Hydra's, when a
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
        if any(arg.lstrip("+").startswith("run.steps=") for arg in (cli_overrides() if cli is None else cli)):
            typed.run.epochs = None  # steps named on the command line win over the file's num_train_epochs
        if no_effect:
            print(f"config_file {typed.config_file}: {no_effect} change nothing here (docs/ms_swift.md says why)")
        typed = validate(typed, schema)
    plan = make_plan(placement_dict(typed))
    run = OmegaConf.to_object(typed)
    run.model.path = local_model_path(run.model.path)
    return with_steps(run, run.run.steps), plan


def with_steps(run: Any, steps: int) -> Any:
    """`run` with `steps` steps and what follows from them (derived only here): the learning-rate
    schedule spans the run's optimizer updates, warmup_ratio sets the warmup steps."""
    updates = run.updates(steps)
    trainer = replace(run.trainer, total_steps=updates)
    if trainer.warmup_ratio is not None and math.isfinite(trainer.warmup_ratio):  # (else check_trainer refuses it)
        trainer.warmup_steps = round(trainer.warmup_ratio * updates)
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


def engine_args(cfg: DriverConfig, role: str) -> dict:
    """Constructor arguments choosing a role's engine: {"engine": name, "engine_options": {...}}
    for role "train", "rollout" or "teacher" (the sampler uses the rollout's)."""
    engine = getattr(cfg.backend, role)
    options = {"deepspeed": cfg.deepspeed, "megatron": cfg.megatron, "vllm": cfg.vllm}.get(engine)
    return {"engine": engine, "engine_options": as_dict(options) if options is not None else {}}


def as_dict(section: Any) -> dict:
    """A config section as a plain dict (what crosses to a role's constructor)."""
    return OmegaConf.to_container(OmegaConf.structured(section), resolve=True)


def rollout_section(cfg: DriverConfig, trained: bool = False) -> dict:
    """A driver's rollout section with data.chat and data.enable_thinking, so that every rollout
    and sampler of the run renders prompts as training does (checks.check_chat refuses a rollout.chat that differs).
    `trained`: the rollout takes the trainer's weights; with weight_sync.lora=adapter it is
    built to serve the trainer's LoRA adapter (its rank and alpha)."""
    section = {**as_dict(cfg.rollout), "chat": cfg.data.chat, "enable_thinking": cfg.data.enable_thinking}
    lora = cfg.trainer.lora
    if trained and lora.rank and cfg.weight_sync.lora == "adapter":
        section.update(lora_rank=lora.rank, lora_alpha=lora.alpha)
    return section


def phase_run(run: Any, out_dir: str | os.PathLike, phase: str, **loop: Any) -> Any:
    """The run section of a phase inside a run (GRPO's SFT warm start, GKD's teacher warm-up,
    distill's SFT runs) writing to <out_dir>/<phase>: its loop settings `loop`, the run's
    trackers, cadence, log level and tags (plus the phase's name), under the tracker name
    <run name>/<phase>, a run of its own beside the main one (in TensorBoard: <run
    dir>/<phase>/tensorboard/<run name>/<phase>)."""
    name = run.name or Path(out_dir).resolve().name
    return LoopConfig(loggers=list(run.loggers), log_every=run.log_every, log_level=run.log_level,
                      tags=[*run.tags, phase], name=f"{name}/{phase}", **loop)


def warmup_steps(steps: int) -> int:
    """Learning-rate warm-up of an SFT phase inside another run (GRPO's warm start, GKD's
    teacher, distill's SFT): a tenth of its steps, at most 20."""
    return min(20, steps // 10)
