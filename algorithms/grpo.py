"""GRPO: group-relative policy optimisation of a policy against rule-based rewards.

    python -m algorithms.grpo +experiment=grpo_quickstart
    python -m algorithms.grpo +experiment=grpo_quickstart algorithm.beta=0.04 algorithm.loss_type=dapo
    python -m algorithms.grpo --multirun +experiment=grpo_quickstart algorithm.scale_rewards=group,none

Each step draws `run.prompts_per_step` prompts; the rollout samples `num_generations`
completions of each, and the reward functions (`reward_funcs` with `reward_weights`:
accuracy by data.check, format regex, the rule-based arithmetic PRM, or a dotted path) score
them. Advantages are relative to the prompt's group (`scale_rewards`, `leave_one_out`);
with `dynamic_sample`, groups whose rewards are all equal are dropped and fresh prompts
generated. The trainer takes `steps_per_generation` clipped-ratio updates on the batch
(ratios against the rollout's own sampling logprobs, so stale weights stay correct; with
`rollout_importance_sampling_mode`, against the trainer's own, each token weighed by the
truncated or masked trainer/rollout probability ratio: ms-swift's mismatch correction), with
a k3 KL penalty to the initial weights when `beta` > 0 (the reference policy: a role on
the trainer's devices and engine, offloaded between uses when the trainer offloads; with
`trainer.lora`, the trainer's own base with the adapter off, inside its train call), and
the new weights go to the rollout. With `max_staleness` N > 0 the rollout generates the
batches of the next N steps while the trainer trains (samples at most N weight versions
old; staleness/max and staleness/mean are logged): on devices of its own, or on the
trainer's when neither takes turns there (sleep_level 0, no offload; ms-swift's
async_generate). With
`warmup_sft_steps`, the policy is first trained by SFT on the task's reference solutions
and GRPO starts from that checkpoint. eval/accuracy (greedy, held-out) is logged at step
0, every run.eval_every steps and at the end. Per step: time/<phase>,
move/<role>_<op>_{bytes,s} (offload, onload, sleep, wake_up) and mem/<role>_* (host RSS,
peak device memory); timeline.jsonl holds when each role was busy. Rewards run in this
process, or on the planned `orm`/`prm` roles.

On-policy distillation as RL (ms-swift's OPD-RL): with `teacher_kl_coef` > 0 a teacher (a
role: placement.teacher_model colocated with the trainer, or placement.teacher.{gpus,model};
with `trainer.lora` and the policy's own model as the teacher, the trainer's base with the
adapter off) scores each sampled token, and each completion token's advantage gains
teacher_kl_coef * (teacher logprob - the rollout's sampling logprob) of that token, after the
rewards' group normalisation (grpo/teacher_log_ratio and grpo/teacher_kl are logged). With
`num_generations` 1 and no `reward_funcs` it is pure distillation: the teacher's signal alone.

    python -m algorithms.grpo +experiment=grpo_quickstart algorithm.teacher_kl_coef=1.0 \
        placement.teacher_model=small_qwen2 algorithm.warmup_sft_steps=0
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, List, Optional

import torch

from algorithms import sft
from algorithms.config.checks import (check_importable, check_multi_turn, check_opd_teacher, check_rollout_correction,
                                      check_run, check_staleness, check_trainer, validate_check)
from algorithms.config.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, require, require_all, require_roles
from algorithms.config.schema import (DriverConfig, as_dict, engine_args, fit_epochs, local_model_path, phase_run,
                                      rollout_section)
from algorithms.data.answers import checker, correct, reference
from algorithms.data.loading import load_task, row_limits
from algorithms.data.prompts import PromptStream, batch_of
from algorithms.objectives.advantages import (SCALE_REWARDS, group_advantages, teacher_token_advantages,
                                              zero_variance_groups)
from algorithms.objectives.losses import LOSS_TYPES, k3_kl, make_loss
from algorithms.objectives.rewards import Rewards, planned_reward_configs, reward_specs
from algorithms.objectives.rollout_correction import RolloutCorrection
from algorithms.records.runlog import RunLog, record_data_stats
from algorithms.runtime.ahead import Prefetch, staleness
from algorithms.runtime.entry import driver_main
from algorithms.runtime.steps import Steps
from algorithms.runtime.trajectories import TrajectoryPrefetch, env_rewards, failed_rows, multi_turn_metrics
from algorithms.runtime.turns import first
from algorithms.runtime.warm_start import warm_start_data, warm_start_trainer
from orchestration.cluster import init_cluster, set_log_level
from orchestration.dispatch import flatten, slice_bounds
from orchestration.launch import start_roles
from orchestration.planner import Plan, as_started, make_plan, with_colocated_role
from roles.batch import Completions, SamplingParams, slice_batch
from roles.models import load_tokenizer, resolve_config
from roles.multi_turn import MultiTurnConfig
from roles.orm import ANSWER_KINDS, ORM
from roles.prm import AGGREGATES, PRM
from roles.rollout import Rollout
from roles.teacher import Teacher, TeacherConfig
from roles.trainer import Trainer

logger = logging.getLogger("algorithms.grpo")  # not __name__: python -m runs this module as __main__


@dataclass
class GRPOAlgorithm:
    # Completions sampled per prompt (a group); a step trains on run.prompts_per_step * num_generations.
    num_generations: int = 8
    # Advantage scale: "group" (std of the prompt's group), "batch" (std of the whole step) or "none".
    scale_rewards: str = "group"
    # Baseline of a completion: the mean of the other num_generations - 1 rewards (RLOO) instead of the group mean.
    leave_one_out: bool = False
    # Lower clip of the importance ratio: 1 - epsilon.
    epsilon: float = 0.2
    # Upper clip: 1 + epsilon_high; None: epsilon (DAPO's clip-higher uses e.g. 0.28).
    epsilon_high: Optional[float] = None
    # Weight of the k3 KL penalty to the reference policy (the initial weights); 0 skips the reference.
    beta: float = 0.0
    # Loss aggregation: grpo (mean of per-sequence token means), bnpo (token mean per micro-batch),
    # dr_grpo (token sum / max_new_tokens), dapo (token mean over the whole step).
    loss_type: str = "grpo"
    # Optimizer updates per generated batch: the batch is split into this many parts, one update each.
    steps_per_generation: int = 1
    # Drop groups whose rewards are all equal (zero advantage) and generate for fresh prompts instead.
    dynamic_sample: bool = False
    # Extra generation rounds per step for dynamic_sample; still short after them, the step is
    # topped up with zero-variance groups.
    max_resample_times: int = 3
    # Steps a generation may run ahead of training (the rollout on devices of its own, or on the
    # trainer's with neither taking turns: placement.sleep_level 0, no offload): with N the
    # rollout generates the batches of steps k+1..k+N while the trainer trains on step k's, so
    # samples are up to N weight versions old (the ratio uses their own sampling logprobs; with a
    # rollout_importance_sampling_mode the trainer's current ones, the weight then covering the
    # lag too: decoupled PPO). 0: on-policy.
    max_staleness: int = 0
    # Training-inference mismatch correction (ms-swift's; docs/drivers.md): none keeps the ratio
    # against the rollout's sampling logprobs. token_truncate, token_mask, sequence_truncate or
    # sequence_mask take the ratio against the trainer's own logprobs before the update (one extra
    # trainer forward when steps_per_generation > 1) and weigh each token's loss by
    # w = exp(trainer - rollout logprob) (sequence_*: the row's geometric mean), truncated at the
    # threshold (min(w, threshold)) or 0 where w is above it (masked).
    rollout_importance_sampling_mode: str = "none"
    # The threshold of those weights (ms-swift's C).
    rollout_importance_sampling_threshold: float = 2.0
    # Log the rollout_correction/ metrics (trainer-rollout KL, perplexities, chi2) without a
    # correction; a mode logs them anyway.
    log_rollout_offpolicy_metrics: bool = False
    # Completions whose mean (rollout - current trainer logprob) over their tokens exceeds this and
    # whose advantage is negative leave the loss (ms-swift's, from DeepSeek-V3.2); null: off.
    off_policy_sequence_mask_delta: Optional[float] = None
    # Where the ratio's old-policy logprobs come from: "rollout" (the engine's own sampling
    # logprobs) or "trainer" (the rollout reports none, which spares vLLM computing them; the
    # trainer's before the update: with one update per generation its detached current ones, at
    # no cost; with more, one trainer forward). "trainer" needs max_staleness 0, no
    # rollout_importance_sampling_mode, log_rollout_offpolicy_metrics, off_policy_sequence_mask_delta
    # or teacher_kl_coef: each reads the rollout's.
    old_logprobs: str = "rollout"
    # Sampling temperature; the trainer's logprobs use it too, so ratios compare like with like.
    temperature: float = 1.0
    # Sample among the top_k most likely tokens only (ms-swift's top_k); 0 or -1: no cut. The
    # behaviour logprob stays that of the temperature-scaled distribution before the cut, as
    # the trainer computes it (docs/engines.md).
    top_k: int = 0
    # Sample from the smallest set of tokens holding top_p of the mass (nucleus); 1.0: no cut.
    # Its logprobs as top_k's.
    top_p: float = 1.0
    # Longest completion in tokens.
    max_new_tokens: int = 48
    # Completions cut at max_new_tokens (finish_reason "length") take no part in the loss
    # (ms-swift's overlong_filter); they still count in their group's advantages.
    overlong_filter: bool = False
    # Weight of a teacher's per-token signal (on-policy distillation as RL; ms-swift's
    # teacher_kl_coef): each completion token's advantage gains teacher_kl_coef * (the
    # teacher's logprob - the rollout's sampling logprob) of that token, at `temperature`, added
    # after the rewards' normalisation. 0: off; > 0 needs a teacher model in the placement
    # (placement.teacher_model, or placement.teacher.gpus with placement.teacher.model), and
    # then allows num_generations 1 and empty reward_funcs (pure distillation).
    teacher_kl_coef: float = 0.0
    # Reward functions: accuracy (data.check against the reference), an answer check named by
    # its kind (numeric, exact, last_number, regex with data.check_pattern, boxed: see
    # data.check), format (regex format_pattern), prm (rule-based arithmetic step verifier, the
    # '#### N' line counted as the last step, aggregated by prm_aggregate: with min, 1 only for
    # a fully right derivation),
    # or a dotted path 'pkg.mod.fn' to fn(prompts, completions, references) -> list[float].
    reward_funcs: List[str] = field(default_factory=lambda: ["accuracy"])
    # Weight of each reward function, in order; empty: 1.0 each. The reward is the weighted sum.
    reward_weights: List[float] = field(default_factory=list)
    # Regular expression of the format reward; None: the ORM's default (a last line '#### <number>').
    format_pattern: Optional[str] = None
    # prm reward: one score per completion from its step scores (min, product, last, or mean:
    # partial credit for the steps right before the first mistake).
    prm_aggregate: str = "min"
    # SFT steps on the task's reference solutions before GRPO (a warm start); 0 starts from the model as given.
    warmup_sft_steps: int = 0
    # Learning rate of that SFT.
    warmup_sft_lr: float = 5e-3
    # Learning-rate schedule of that SFT (see trainer.schedule).
    warmup_sft_schedule: str = "cosine"
    # Sequences per SFT step.
    warmup_sft_batch: int = 64
    # SFT on only the first N training examples (a small labelled set; GRPO needs only the
    # answers of the rest); 0: all of them.
    warmup_sft_examples: int = 0
    # GRPO continues with the warm start's AdamW moments (its own lr and schedule): a fresh
    # optimizer's first updates move every weight by ~lr whatever the gradient's noise. (With
    # trainer.lora the warm start trains every weight, standing for the pretrained model a LoRA
    # run starts from, and GRPO's new adapter starts with a fresh optimizer.)
    warmup_keep_optimizer: bool = True
    # Multi-turn rollouts (docs/multi_turn.md): a scheduler, environment or tools make each
    # sample a trajectory of model and environment turns; max_new_tokens is then its budget
    # across turns, the loss counts the model's tokens only, and the environment's reward
    # (multi_turn.env_reward) joins the reward functions'. Off while scheduler and tools are unset.
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


@dataclass
class GRPOTeacher:
    # Engine settings of the teacher role (algorithm.teacher_kl_coef > 0); its model comes from
    # the placement (placement.teacher_model or placement.teacher.model).
    engine: TeacherConfig = field(default_factory=TeacherConfig)


@dataclass
class GRPOConfig(DriverConfig):
    DRIVER: ClassVar[str] = "grpo"
    # GRPO options.
    algorithm: GRPOAlgorithm = field(default_factory=GRPOAlgorithm)
    # The teacher of algorithm.teacher_kl_coef.
    teacher: GRPOTeacher = field(default_factory=GRPOTeacher)

    def updates(self, steps: int) -> int:
        """steps_per_generation optimizer updates a step."""
        return steps * self.algorithm.steps_per_generation


# ----------------------------------------------------------------------------- the loop

def train(cfg: GRPOConfig, plan: Plan, trainer: Any, rollout: Any, reference: Any, rewards: Rewards,
          train_set: list, eval_set: list, tokenizer: Any, log: RunLog, teacher: Any = None) -> dict:
    """The GRPO loop; roles are worker groups (or fakes in tests), `reference` is None when
    beta = 0 or with LoRA (the trainer's base with the adapter off is the reference then);
    `teacher` scores the sampled tokens when algorithm.teacher_kl_coef > 0 (None then: the
    trainer's base with the adapter off, under LoRA). Returns the last record."""
    algo, G = cfg.algorithm, cfg.algorithm.num_generations
    base_reference = {"reference": True} if algo.beta and cfg.trainer.lora.rank else {}
    # The teacher's scores come from the trainer's own base (adapter off) in its train turn.
    base_teacher = bool(algo.teacher_kl_coef) and teacher is None
    sampling = SamplingParams(temperature=algo.temperature, top_k=max(algo.top_k, 0), top_p=algo.top_p,
                              max_new_tokens=algo.max_new_tokens, n=G, logprobs=algo.old_logprobs == "rollout")
    check = checker(cfg.data)
    with Steps(plan, {"train": trainer, "rollout": rollout, "reference": reference, "teacher": teacher}, cfg.run,
                      cfg.weight_sync, log, eval_set, data=cfg.data,
                      adapter=bool(cfg.trainer.lora.rank)) as steps:
        turns = steps.turns
        # Prompts continue where a resumed run's checkpoint left them; step k's generation starts
        # up to max_staleness steps early (0: after step k-1's weight sync).
        stream = PromptStream(train_set, cfg.run.prompts_per_step, cfg.run.seed, steps.resumed.get("stream", 0))
        # Multi-turn: each sample is a trajectory, its turn loop run inside the rollout role.
        ahead, extra = (TrajectoryPrefetch, {"multi_turn": algo.multi_turn}) if algo.multi_turn.enabled else (Prefetch, {})
        prefetch = ahead(rollout, log, stream, sampling, algo.max_staleness, cfg.run.steps,
                         seed=cfg.run.seed, first_step=steps.first_step, **extra)
        for step in range(steps.first_step, cfg.run.steps + 1):
            metrics: dict = {}
            if step > 0:
                # Generate + score: G completions per prompt and their rewards (with dynamic_sample,
                # rounds of fresh prompts until prompts_per_step groups have reward variance).
                # One generate call (no extra rounds, none ahead) carries the rollout's sleep too.
                with turns.rollout_turn(step - 1, metrics, one_call=not (algo.dynamic_sample or algo.max_staleness)):
                    rounds = _generate_and_score(algo, cfg.run.prompts_per_step, prefetch, rewards, check, step,
                                                 log, metrics)
                comps, scores = _pick_groups(rounds, cfg.run.prompts_per_step, G, algo.dynamic_sample)
                # Staleness: trainer version minus each sample's; the ratio below uses the samples'
                # own (behaviour) logprobs, so stale samples stay correctly weighted.
                metrics.update(staleness(comps, step, algo.max_staleness))
                # Advantages: each reward against its prompt's group.
                batch = batch_of(tokenizer, comps)
                batch.rewards = scores
                batch.advantages = group_advantages(scores, G, algo.scale_rewards, algo.leave_one_out)
                if algo.overlong_filter:
                    metrics["grpo/overlong_filtered"] = filter_overlong(batch, comps.finish_reasons)
                # Reference logprobs: the initial policy's, for the KL penalty (with LoRA, the
                # trainer's own base with the adapter off, inside its train call).
                if reference is not None:
                    batch.ref_logprobs = turns.call("reference", "logprobs", batch, algo.temperature, dispatch="slice",
                                                    collect="flatten", phase="ref_logprobs")
                # Teacher: its logprob of each sampled token joins that token's advantage.
                if teacher is not None and algo.teacher_kl_coef:
                    scored = turns.call("teacher", "token_logprobs", batch, algo.temperature, dispatch="slice",
                                        collect="flatten", phase="teacher")
                    metrics.update(add_teacher_signal(batch, scored, algo.teacher_kl_coef))
                # Train: steps_per_generation updates, each on its part of the batch; then the weights
                # go to the rollout (once generations started ahead finish). With one update, the
                # trainer's onload, the weights' send and its offload ride on its call (the base
                # as teacher adds a call before it).
                with turns.train_turn(step, prefetch, algo.max_staleness, metrics,
                                      one_call=algo.steps_per_generation == 1 and not base_teacher):
                    if base_teacher:
                        with log.phase("teacher", "train"):
                            scored = trainer.call("base_logprobs", batch, algo.temperature, dispatch="slice",
                                                  collect="flatten")
                        metrics.update(add_teacher_signal(batch, scored, algo.teacher_kl_coef))
                    # Mismatch correction, or no rollout logprobs: the ratio's old policy is the trainer's
                    # own (the batch's logprobs before the first update; with one update, the detached
                    # current ones).
                    if algo.rollout_importance_sampling_mode != "none" or algo.old_logprobs == "trainer":
                        batch.rollout_logprobs, batch.old_logprobs = batch.old_logprobs, None
                        if algo.steps_per_generation > 1:
                            with log.phase("old_logprobs", "train"):
                                batch.old_logprobs = trainer.call("logprobs", batch, algo.temperature,
                                                                  dispatch="slice", collect="flatten")
                    metrics.update(advantage_metrics(batch))
                    with log.phase("train", "train"):
                        results = [trainer.call("train_step", part, algo.temperature, dispatch="slice",
                                                collect=first, **base_reference)
                                   for part in _parts(batch, algo.steps_per_generation)]
                        metrics.update({f"train/{k}": sum(r[k] for r in results) / len(results) for k in results[0]})
                        metrics["train/step"] = results[-1]["step"]
            steps.end_step(step, metrics, {"stream": prefetch.position()})
        return steps.finish({"stream": prefetch.position()})


# Sources of the ratio's old-policy logprobs (algorithm.old_logprobs).
OLD_LOGPROBS = ("rollout", "trainer")


def rollout_correction(algo: GRPOAlgorithm) -> Optional[RolloutCorrection]:
    """The loss's rollout correction of `algo`; None when every part of it is off (the loss is
    then as without it)."""
    if algo.rollout_importance_sampling_mode == "none" and not algo.log_rollout_offpolicy_metrics \
            and algo.off_policy_sequence_mask_delta is None:
        return None
    return RolloutCorrection(algo.rollout_importance_sampling_mode, algo.rollout_importance_sampling_threshold,
                             algo.log_rollout_offpolicy_metrics, algo.off_policy_sequence_mask_delta)


def add_teacher_signal(batch: Any, teacher_logprobs: torch.Tensor, coef: float) -> dict:
    """`batch.advantages` made per token with the teacher's signal (`teacher_token_advantages`,
    against the rollout's sampling logprobs, over the loss tokens); returns the mean log-ratio
    teacher - student (k1) and the mean k3 estimate of KL(student || teacher) over those tokens."""
    mask = batch.loss_mask
    batch.advantages = teacher_token_advantages(batch.advantages, teacher_logprobs, batch.old_logprobs, mask, coef)
    tokens = mask.sum().clamp(min=1)
    ratio = torch.where(mask > 0, teacher_logprobs - batch.old_logprobs, 0.0)
    kl = torch.where(mask > 0, k3_kl(batch.old_logprobs, teacher_logprobs), 0.0)
    return {"grpo/teacher_log_ratio": float(ratio.sum() / tokens), "grpo/teacher_kl": float(kl.sum() / tokens)}


def advantage_metrics(batch: Any) -> dict:
    """mean, std, min and max of the advantages: per sequence, or per loss token when they
    are per token (the teacher's signal)."""
    adv = batch.advantages
    values = adv[batch.loss_mask > 0] if adv.ndim == 2 else adv
    if not len(values):
        return {}
    return {"advantages/mean": float(values.mean()), "advantages/std": float(values.std()) if len(values) > 1 else 0.0,
            "advantages/min": float(values.min()), "advantages/max": float(values.max())}


def _generate_and_score(algo: GRPOAlgorithm, want: int, prefetch: Any, rewards: Rewards, check: ORM, step: int,
                        log: RunLog, metrics: dict) -> list:
    """Generation rounds of `step`: [(completions, scores, zero-variance groups)], one round,
    or with dynamic_sample up to 1 + max_resample_times until `want` groups have reward
    variance. The first round's samples, as drawn, give the rollout/ and reward/ metrics."""
    G, rounds, varied = algo.num_generations, [], 0
    for r in range(1 + (algo.max_resample_times if algo.dynamic_sample else 0)):
        with log.phase("generate"):
            examples, comps = prefetch.take(step) if r == 0 else prefetch.extra(step)
        with log.phase("score", "reward"):
            scores, means = rewards.score([ex.prompt for ex in examples for _ in range(G)], comps.texts,
                                          [reference(ex) for ex in examples for _ in range(G)],
                                          rows=[ex.columns for ex in examples for _ in range(G)])
        if algo.multi_turn.enabled:  # the environment's reward; failed trajectories leave the statistics
            env = env_rewards(comps, algo.multi_turn.env_reward)
            scores, means["env"] = failed_rows(comps, scores + env, G), float(env.mean())
            if r == 0:
                metrics.update(multi_turn_metrics(comps))
        zero = zero_variance_groups(scores, G)
        rounds.append((comps, scores, zero))
        varied += int((~zero).sum())
        if r == 0:
            metrics.update(_sample_metrics(comps, scores, means, zero, correct(check, examples, comps.texts)))
        if not algo.dynamic_sample or varied >= want:
            break
    metrics["grpo/generation_rounds"] = len(rounds)
    return rounds


def _sample_metrics(comps: Completions, scores: torch.Tensor, means: dict, zero: torch.Tensor,
                    correct: list) -> dict:
    """What the current policy's samples look like: rewards, accuracy (data.check), length, flat groups."""
    lengths = [len(c) for c in comps.completion_ids]
    return {"reward/mean": float(scores.mean()), "rollout/accuracy": sum(correct) / len(correct),
            "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            **{f"reward/{k}": v for k, v in means.items()},
            "rollout/completion_length": sum(lengths) / len(lengths),
            "rollout/truncated": sum(r == "length" for r in comps.finish_reasons) / len(lengths),
            "grpo/zero_std_groups": float(zero.float().mean())}


def filter_overlong(batch: Any, finish_reasons: list) -> float:
    """Rows whose completion was cut at the length limit leave the loss (their loss mask is
    cleared); returns their fraction."""
    cut = torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)
    batch.loss_mask[cut] = 0
    return float(cut.float().mean()) if len(cut) else 0.0


def _group(comps: Completions, g: int, G: int) -> Completions:
    """Completions of group g (rows g*G .. g*G+G-1: completion j belongs to prompt j // G)."""
    return replace(comps, **{f.name: getattr(comps, f.name)[g * G:(g + 1) * G] for f in dataclasses.fields(comps)})


def _pick_groups(rounds: list, want: int, G: int, dynamic: bool) -> tuple[Completions, torch.Tensor]:
    """The training groups: all of the single round, or with dynamic sampling the first `want`
    groups with reward variance over the rounds, topped up with zero-variance ones."""
    if not dynamic:
        comps, scores, _ = rounds[0]
        return comps, scores
    varied, flat = [], []
    for comps, scores, zero in rounds:
        for g in range(len(zero)):
            (flat if zero[g] else varied).append((_group(comps, g, G), scores[g * G:(g + 1) * G]))
    picked = (varied + flat)[:want]
    return flatten([c for c, _ in picked]), torch.cat([s for _, s in picked])


def _parts(batch: Any, n: int) -> list:
    """`batch` split into n consecutive parts (the first take the remainder)."""
    return [slice_batch(batch, start, stop) for start, stop in slice_bounds(len(batch), n) if stop > start]


# ----------------------------------------------------------------------------- run

def warm_start(cfg: GRPOConfig, train_ranks: int, out_dir: Path) -> str:
    """SFT on the task's reference solutions (`warm_start_data`) with GRPO's engine, engine
    options and number of trainer ranks (so its optimizer moments fit GRPO's trainer); returns
    its checkpoint."""
    a = cfg.algorithm
    warm = sft.phase_config(cfg, trainer=warm_start_trainer(cfg),
                     data=warm_start_data(cfg, out_dir / "sft_warmup_rows"),
                     run=phase_run(cfg.run, out_dir, "sft_warmup", steps=a.warmup_sft_steps,
                                   prompts_per_step=a.warmup_sft_batch, eval_max_new_tokens=cfg.run.eval_max_new_tokens,
                                   save_final=True, seed=cfg.run.seed, resume="auto" if cfg.run.resume else None))
    logger.info(f"grpo: SFT warm start of {cfg.model.name} for {a.warmup_sft_steps} steps")
    record = sft.run(warm, make_plan({"train": {"gpus": train_ranks}}), out_dir / "sft_warmup")
    return record["checkpoint"]


def base_teaches(cfg: GRPOConfig, plan: Plan) -> bool:
    """Whether the teacher of algorithm.teacher_kl_coef is the policy's own base model under
    LoRA (the same model, no warm start): the trainer then scores with its adapter off, and no
    teacher role (no second copy of the weights) is started."""
    if not (cfg.algorithm.teacher_kl_coef and cfg.trainer.lora.rank) or cfg.algorithm.warmup_sft_steps:
        return False
    teacher, student = resolve_config(plan["teacher"].model), resolve_config(as_dict(cfg.model))
    return (teacher.path or teacher.name) == (student.path or student.name)


def run(cfg: GRPOConfig, plan: Plan, out_dir: Path) -> dict:
    """Warm start (optional), start the roles of `plan`, train, shut down. Returns the last record."""
    set_log_level(cfg.run.log_level)
    out_dir = Path(out_dir)
    if "teacher" in plan.roles:  # a teacher planned in the trainer's processes runs there on torch only
        plan, notes = as_started(plan, {"teacher": cfg.backend.teacher})
        for note in notes:
            logger.warning(note)
    train_set, eval_set, stats = load_task(cfg.data, row_limits(cfg, cfg.algorithm.max_new_tokens))
    cfg = fit_epochs(cfg, len(train_set))
    if cfg.backend.workers == "ray":  # sized for this plan before the warm start uses it
        init_cluster(cfg.cluster, plan.demand())
    a = cfg.algorithm
    model = as_dict(cfg.model)
    if warm := warm_start(cfg, plan["train"].world_size, out_dir) if a.warmup_sft_steps else None:
        model["path"] = warm
    loss = make_loss("grpo", epsilon=a.epsilon, epsilon_high=a.epsilon_high, beta=a.beta, loss_type=a.loss_type,
                     max_completion_length=a.max_new_tokens, correction=rollout_correction(a))
    trainer_cfg = as_dict(cfg.trainer)  # (its schedule spans cfg.updates(run.steps) updates: prepare)
    specs = reward_specs(a, cfg.data)
    planned = planned_reward_configs(specs, plan)
    if a.beta and not cfg.trainer.lora.rank:  # the initial policy for the KL term, on the trainer's devices and
        # with its engine (with LoRA it is the trainer's base: the adapter off, no second copy)
        plan = with_colocated_role(plan, "reference", "train", offload_model=plan["train"].offload_model)
    policy = {"model": model, "config": trainer_cfg, **engine_args(cfg, "train")}
    own_base = base_teaches(cfg, plan)
    if own_base:
        logger.info("grpo: the teacher is the policy's base model: the trainer scores with its LoRA adapter off "
                    "(no teacher role started)")
    teaches = bool(a.teacher_kl_coef) and not own_base
    roles = start_roles(cfg, plan, {
        "train": (Trainer, {**policy, "loss_fn": loss, "loss_inputs": ("entropy",)}),
        "rollout": (Rollout, {"model": model, "config": rollout_section(cfg, trained=True),
                              **engine_args(cfg, "rollout")}),
        **({"reference": (Trainer, policy)} if "reference" in plan.roles else {}),
        **({"teacher": (Teacher, {"model": local_model_path(plan["teacher"].model),
                                  "config": as_dict(cfg.teacher.engine), **engine_args(cfg, "teacher")})}
           if teaches else {}),
        **{role: ({"orm": ORM, "prm": PRM}[role], {"config": c}) for role, c in planned.items()}},
        restarts=cfg.run.max_restarts)
    if warm and a.warmup_keep_optimizer and not cfg.trainer.lora.rank:  # (a new adapter: its own moments)
        roles["train"].call("load_optimizer_moments", warm)
    rewards = Rewards(specs, {role: roles[role] for role in planned})
    reference = roles["reference"] if "reference" in plan.roles else None
    log = RunLog(out_dir, cfg.run.steps, cfg.run, resolved_config=cfg)
    record_data_stats(log, stats, cfg.run.resume)
    logger.info(f"grpo: {len(train_set)} train / {len(eval_set)} held-out examples; {cfg.run.steps} steps x "
                f"{cfg.run.prompts_per_step} prompts x {a.num_generations} completions = "
                f"{cfg.run.prompts_per_step * a.num_generations} sequences in {a.steps_per_generation} update(s); "
                f"rewards {[(label, w) for label, w, _ in rewards.parts]}; output {log.dir}")
    try:
        return train(cfg, plan, roles["train"], roles["rollout"], reference, rewards, train_set, eval_set,
                     load_tokenizer(model), log, teacher=roles["teacher"] if teaches else None)
    finally:
        log.close()
        rewards.shutdown()
        roles.shutdown()


def validate(cfg: GRPOConfig, plan: Plan) -> None:
    """Every check of a GRPO run, before anything starts (shared checks: algorithms/config/checks.py)."""
    a = cfg.algorithm
    require_roles(plan, ("train", "rollout"), "GRPO", "add them, e.g. placement.train.gpus=1 placement.rollout.gpus=1, "
                  "or placement=colocate")
    check_run(cfg, plan, updates=cfg.updates(cfg.run.steps),
              classes={"train": Trainer, "rollout": Rollout, **({"teacher": Teacher} if a.teacher_kl_coef else {})})
    check_opd_teacher(cfg, plan)
    # The teacher's signal needs no group: one completion per prompt is pure distillation.
    groups = (lambda v: v >= 1, ">= 1") if a.teacher_kl_coef else (
        lambda v: v >= 2, ">= 2 (a group compares its completions; 1 only with algorithm.teacher_kl_coef > 0)")
    require_all(a, "algorithm", {"epsilon": POSITIVE, "beta": NON_NEGATIVE, "temperature": POSITIVE,
                                 "max_new_tokens": AT_LEAST_1, "warmup_sft_steps": NON_NEGATIVE,
                                 "warmup_sft_lr": POSITIVE, "warmup_sft_batch": AT_LEAST_1,
                                 "warmup_sft_examples": NON_NEGATIVE, "max_resample_times": NON_NEGATIVE,
                                 "top_k": (lambda v: v >= -1, ">= 1, or 0 or -1 for no cut"),
                                 "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1] (1.0: no cut)"),
                                 "num_generations": groups})
    require(not a.leave_one_out or a.num_generations >= 2, "algorithm.leave_one_out", True,
            f"needs num_generations >= 2 (the baseline is the mean of the others; it is {a.num_generations})",
            "set algorithm.leave_one_out=false, or algorithm.num_generations >= 2")
    require(a.epsilon_high is None or a.epsilon_high >= a.epsilon, "algorithm.epsilon_high", a.epsilon_high,
            f"is below algorithm.epsilon={a.epsilon}", "set it >= epsilon, or null to use epsilon")
    if a.warmup_sft_steps:
        check_trainer(warm_start_trainer(cfg), "trainer", a.warmup_sft_steps, "algorithm.warmup_sft_steps")
    require(a.scale_rewards in SCALE_REWARDS, "algorithm.scale_rewards", a.scale_rewards, "is not a scale",
            f"use one of {list(SCALE_REWARDS)}")
    require(a.loss_type in LOSS_TYPES, "algorithm.loss_type", a.loss_type, "is not a loss type",
            f"use one of {list(LOSS_TYPES)}")
    require(a.prm_aggregate in AGGREGATES, "algorithm.prm_aggregate", a.prm_aggregate, "is not an aggregate",
            f"use one of {list(AGGREGATES)}")
    check_multi_turn(a.multi_turn)
    env_rewarded = a.multi_turn.enabled and a.multi_turn.env_reward != "none"
    require(bool(a.reward_funcs) or bool(a.teacher_kl_coef) or env_rewarded, "algorithm.reward_funcs",
            list(a.reward_funcs), "is empty", "e.g. algorithm.reward_funcs=[accuracy] (empty only with "
            "algorithm.teacher_kl_coef > 0, or an environment's reward: algorithm.multi_turn)")
    require(all(math.isfinite(w) for w in a.reward_weights), "algorithm.reward_weights", list(a.reward_weights),
            "holds a weight that is not a finite number", "give finite weights, or [] for 1.0 each")
    require(not a.reward_weights or len(a.reward_weights) == len(a.reward_funcs), "algorithm.reward_weights",
            list(a.reward_weights), f"has {len(a.reward_weights)} weights for {len(a.reward_funcs)} reward_funcs",
            "give one weight per function, or [] for 1.0 each")
    bad = [f for f in a.reward_funcs if f not in ("accuracy", "format", "prm", *ANSWER_KINDS) and "." not in f]
    require(not bad, "algorithm.reward_funcs", list(a.reward_funcs), f"names unknown functions {bad}",
            f"use accuracy, format, prm, one of {list(ANSWER_KINDS)} or a dotted path 'pkg.mod.fn'")
    for f in a.reward_funcs:
        if "." in f:
            check_importable("algorithm.reward_funcs", f)
        elif f in ANSWER_KINDS:
            validate_check(cfg.data, f)
    if a.format_pattern is not None:
        try:
            re.compile(a.format_pattern)
        except re.error as e:
            require(False, "algorithm.format_pattern", a.format_pattern, f"is not a regular expression ({e})",
                    "correct it, or null for the default")
    kinds = [c["kind"] for _, _, cls, c in reward_specs(a, cfg.data) if cls is ORM]
    require("orm" not in plan.roles or len(set(kinds)) == len(kinds), "algorithm.reward_funcs", list(a.reward_funcs),
            "repeats a kind, but a planned orm role combines the ORM functions by kind (at most one dotted path)",
            "drop the repeats or remove orm from the placement")
    require(sum(f == "prm" for f in a.reward_funcs) <= 1, "algorithm.reward_funcs", list(a.reward_funcs),
            "lists prm twice", "list it once")
    for role, used in (("orm", bool(kinds)), ("prm", "prm" in a.reward_funcs)):
        require(role not in plan.roles or used, "algorithm.reward_funcs", list(a.reward_funcs),
                f"uses no function that the planned {role} role serves",
                f"add a reward function it serves, or remove {role} from the placement")
    n = plan["train"].world_size
    require(not a.warmup_sft_steps or a.warmup_sft_batch >= n, "algorithm.warmup_sft_batch", a.warmup_sft_batch,
            f"is below the {n} trainer ranks", f"raise it to at least {n}")
    per_update = cfg.run.prompts_per_step * a.num_generations // max(a.steps_per_generation, 1)
    require(a.steps_per_generation >= 1 and per_update >= n, "algorithm.steps_per_generation",
            a.steps_per_generation, f"leaves an update without a sequence for each of the {n} trainer ranks",
            f"use 1 to {cfg.run.prompts_per_step * a.num_generations // n}")
    check_staleness(a.max_staleness, plan)
    check_rollout_correction(a)
    require(a.old_logprobs in OLD_LOGPROBS, "algorithm.old_logprobs", a.old_logprobs, "is not a source of logprobs",
            f"use one of {list(OLD_LOGPROBS)}")
    if a.old_logprobs == "trainer":
        readers = {"max_staleness": a.max_staleness, "rollout_importance_sampling_mode":
                   a.rollout_importance_sampling_mode != "none", "log_rollout_offpolicy_metrics":
                   a.log_rollout_offpolicy_metrics, "off_policy_sequence_mask_delta":
                   a.off_policy_sequence_mask_delta is not None, "teacher_kl_coef": a.teacher_kl_coef}
        using = [k for k, on in readers.items() if on]
        require(not using, "algorithm.old_logprobs", a.old_logprobs, f"leaves no rollout logprobs, which "
                f"{', '.join('algorithm.' + k for k in using)} read", "set algorithm.old_logprobs=rollout")


def main() -> None:
    driver_main(GRPOConfig, validate, run)


if __name__ == "__main__":
    main()
