"""SFT / pretraining on a data-parallel Trainer group.

    python -m algorithms.sft +experiment=sft_quickstart
    python -m algorithms.sft +experiment=sft_quickstart placement.train.gpus=2 cluster.simulate_gpus=2

Each step draws `run.prompts_per_step` examples, trains on their responses (every token
with algorithm.pretrain=true), and logs loss/grad norm; eval/accuracy is the greedy
accuracy of the current weights on held-out prompts (step 0, every run.eval_every steps,
and the end). Writes metrics.jsonl, resolved_config.yaml and checkpoints to the Hydra run
directory. The placement needs a `train` role (Megatron form) or `default` (device_groups).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, List, Optional

from algorithms.config.checks import check_run
from algorithms.config.rules import require, require_roles
from algorithms.config.schema import DriverConfig, as_dict, engine_args, fit_epochs, rollout_section
from algorithms.data.loading import load_task, row_limits
from algorithms.data.prompts import PromptStream, batch_of, encode_examples
from algorithms.objectives.losses import make_loss
from algorithms.records.runlog import RunLog, record_data_stats
from algorithms.runtime.entry import driver_main
from algorithms.runtime.steps import Steps
from algorithms.runtime.turns import first
from orchestration.cluster import set_log_level
from orchestration.launch import driver_group, start_roles
from roles.models import load_tokenizer
from roles.rollout import Rollout
from roles.trainer import Trainer

logger = logging.getLogger("algorithms.sft")  # not __name__: python -m runs this module as __main__


@dataclass
class SFTAlgorithm:
    # Sequences per step are run.prompts_per_step; the loss counts response tokens only
    # (prompt tokens are context), or every token with pretrain=true.
    pretrain: bool = False
    # ms-swift's gradient_accumulation_steps: when set, run.prompts_per_step becomes
    # trainer.micro_batch_per_device * this * the trainer's ranks (sequences per update, as
    # ms-swift counts them). null: run.prompts_per_step as given.
    gradient_accumulation_steps: Optional[int] = None
    # ms-swift's model_name / model_author: replace {{NAME}} / {{AUTHOR}} in the rows that carry
    # them (self-cognition data), [Chinese, English] by the row's `tag` (zh: the first), or one
    # name for both. []: placeholders stay.
    model_name: List[str] = field(default_factory=list)
    model_author: List[str] = field(default_factory=list)


@dataclass
class SFTConfig(DriverConfig):
    DRIVER: ClassVar[str] = "sft"
    # SFT / pretraining options.
    algorithm: SFTAlgorithm = field(default_factory=SFTAlgorithm)


def phase_config(cfg: DriverConfig, **changes: Any) -> SFTConfig:
    """The config of an SFT phase inside another run (GRPO's warm start, distill's SFT): every
    section of `cfg` (placement, engines and their options, weight sync, ...) with `changes`."""
    return SFTConfig(**{**{f.name: getattr(cfg, f.name) for f in fields(DriverConfig)}, **changes})


def train(cfg: SFTConfig, plan: Any, trainer: Any, evaluator: Any, train_set: list, eval_set: list,
          tokenizer: Any, log: RunLog) -> dict:
    """The SFT loop; roles are worker groups (or fakes in tests); the evaluator (a rollout)
    gets the trainer's weights before each eval. Returns the last record."""
    with Steps(plan, {"train": trainer, "rollout": evaluator}, cfg.run, cfg.weight_sync, log, eval_set,
                      rollout_behind=True, data=cfg.data,
                      adapter=bool(cfg.trainer.lora.rank)) as steps:
        turns = steps.turns
        # Examples continue where a resumed run's checkpoint left them.
        stream = PromptStream(train_set, cfg.run.prompts_per_step, cfg.run.seed, steps.resumed.get("stream", 0))
        for step in range(steps.first_step, cfg.run.steps + 1):
            metrics: dict = {}
            if step > 0:
                # Train: one optimizer update on this step's examples, split over the ranks.
                with turns.turn("train", "train"):
                    examples = encode_examples(tokenizer, next(stream), cfg.algorithm.pretrain, cfg.data.chat,
                                               cfg.data.enable_thinking)
                    batch = batch_of(tokenizer, examples)
                    metrics.update({f"train/{k}": v for k, v in
                                    trainer.call("train_step", batch, dispatch="slice", collect=first).items()})
            steps.end_step(step, metrics, {"stream": stream.drawn})
        return steps.finish({"stream": stream.drawn})


def with_accumulation(cfg: SFTConfig, ranks: int) -> SFTConfig:
    """`cfg` with run.prompts_per_step = micro-batch * gradient_accumulation_steps * `ranks`
    (the trainer's data-parallel ranks) when gradient_accumulation_steps is set."""
    steps = cfg.algorithm.gradient_accumulation_steps
    if steps is None:
        return cfg
    per_step = cfg.trainer.micro_batch_per_device * steps * ranks
    logger.info(f"sft: {cfg.trainer.micro_batch_per_device} sequences x {steps} accumulation steps x {ranks} "
                f"rank(s) = {per_step} sequences per update (run.prompts_per_step)")
    return replace(cfg, run=replace(cfg.run, prompts_per_step=per_step))


# Placeholders of ms-swift's self-cognition rows, and the SFTAlgorithm field replacing each.
IDENTITY = {"{{NAME}}": "model_name", "{{AUTHOR}}": "model_author"}


def with_identity(examples: list, algo: SFTAlgorithm) -> list:
    """The examples with {{NAME}} / {{AUTHOR}} replaced by model_name / model_author (the
    Chinese name for a row tagged zh, else the English one), as ms-swift does for its
    self-cognition rows; rows without placeholders stay as they are."""
    values = {mark: list(getattr(algo, name)) for mark, name in IDENTITY.items() if getattr(algo, name)}
    if not values:
        return examples

    def fill(text: str, zh: bool) -> str:
        for mark, names in values.items():
            text = text.replace(mark, names[0] if zh or len(names) == 1 else names[1])
        return text

    out = []
    for ex in examples:
        zh = ex.columns.get("tag") == "zh"
        out.append(replace(ex, prompt=fill(ex.prompt, zh), solution=fill(ex.solution, zh),
                           answer=fill(ex.answer, zh), steps=[fill(s, zh) for s in ex.steps],
                           context=[{**m, "content": fill(m["content"], zh)} for m in ex.context]))
    return out


def run(cfg: SFTConfig, plan: Any, out_dir: Path) -> dict:
    """Start the roles of `plan`, train, shut down. Returns the last metrics record."""
    set_log_level(cfg.run.log_level)
    role = "train" if "train" in plan.roles else "default"
    cfg = with_accumulation(cfg, plan[role].world_size)
    train_set, eval_set, stats = load_task(cfg.data, row_limits(cfg, replies=True))
    train_set, eval_set = (with_identity(s, cfg.algorithm) for s in (train_set, eval_set))
    cfg = fit_epochs(cfg, len(train_set))
    loss = make_loss("sft")
    roles = start_roles(cfg, plan, {role: (Trainer, {"model": as_dict(cfg.model), "config": as_dict(cfg.trainer),
                                                     "loss_fn": loss, "loss_inputs": loss.loss_inputs,
                                                     **engine_args(cfg, "train")})})
    evaluator = driver_group(Rollout, {"model": as_dict(cfg.model), "config": rollout_section(cfg, trained=True)},
                             "evaluator")
    log = RunLog(out_dir, cfg.run.steps, cfg.run, resolved_config=cfg)
    record_data_stats(log, stats, cfg.run.resume)
    logger.info(f"sft: {len(train_set)} train / {len(eval_set)} held-out examples; {cfg.run.steps} steps x "
                f"{cfg.run.prompts_per_step} sequences over {plan[role].world_size} {role} rank(s); output {log.dir}")
    try:
        return train(cfg, plan, roles[role], evaluator, train_set, eval_set, load_tokenizer(as_dict(cfg.model)), log)
    finally:
        log.close()
        roles.shutdown()


def validate(cfg: SFTConfig, plan: Any) -> None:
    """Every check of an SFT run, before anything starts (algorithms/config/checks.py)."""
    require_roles(plan, (("train", "default"),), "SFT", "placement.train.gpus=1 (or device_groups workers [default])")
    role = "train" if "train" in plan.roles else "default"
    algo = cfg.algorithm
    if algo.gradient_accumulation_steps is not None:
        require(algo.gradient_accumulation_steps >= 1, "algorithm.gradient_accumulation_steps",
                algo.gradient_accumulation_steps, "must be >= 1", "set it to 1 or more, or null")
        require(cfg.trainer.micro_batch_per_device >= 1, "trainer.micro_batch_per_device",
                cfg.trainer.micro_batch_per_device, "is 0 (sized by memory), but gradient_accumulation_steps "
                "counts sequences per update from it", "set per_device_train_batch_size (micro_batch_size)")
        per_step = cfg.trainer.micro_batch_per_device * algo.gradient_accumulation_steps * plan[role].world_size
        cfg = replace(cfg, run=replace(cfg.run, prompts_per_step=per_step))  # what run() derives (and logs)
    for name in IDENTITY.values():
        require(len(getattr(algo, name)) <= 2, f"algorithm.{name}", list(getattr(algo, name)),
                "holds more than two names", "give [Chinese, English], or one name for both")
    check_run(cfg, plan, classes={"train": Trainer, "default": Trainer})


def main() -> None:
    driver_main(SFTConfig, validate, run)


if __name__ == "__main__":
    main()
