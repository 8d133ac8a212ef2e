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
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from algorithms.config.checks import check_run, require_roles
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
                    examples = encode_examples(tokenizer, next(stream), cfg.algorithm.pretrain, cfg.data.chat)
                    batch = batch_of(tokenizer, examples)
                    metrics.update({f"train/{k}": v for k, v in
                                    trainer.call("train_step", batch, dispatch="slice", collect=first).items()})
            steps.end_step(step, metrics, {"stream": stream.drawn})
        return steps.finish({"stream": stream.drawn})


def run(cfg: SFTConfig, plan: Any, out_dir: Path) -> dict:
    """Start the roles of `plan`, train, shut down. Returns the last metrics record."""
    set_log_level(cfg.run.log_level)
    train_set, eval_set, stats = load_task(cfg.data, row_limits(cfg, replies=True))
    cfg = fit_epochs(cfg, len(train_set))
    role = "train" if "train" in plan.roles else "default"
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
    check_run(cfg, plan, classes={"train": Trainer, "default": Trainer})


def main() -> None:
    driver_main(SFTConfig, validate, run)


if __name__ == "__main__":
    main()
