"""GKD: on-policy distillation of a student from a teacher's token distributions.

    python -m algorithms.gkd +experiment=gkd_quickstart
    python -m algorithms.gkd +experiment=gkd_quickstart algorithm.logits_topk=8 algorithm.beta=0
    python -m algorithms.gkd --multirun +experiment=gkd_quickstart algorithm.beta=0,0.5,1

Each step draws prompts; with probability `lmbda` the student (rollout) generates the
completions, else the dataset's responses are used (with `seq_kd`, the teacher's own
sampled completions, written by a teacher-weight rollout in the driver process). The teacher scores every position
(top-k logprobs when `algorithm.logits_topk` is set, else the full vocabulary), the
trainer minimises the generalized JSD (`beta`, `temperature`, `sft_alpha`), and the new
weights go to the rollout. The teacher is colocated with the trainer (placement
`teacher_model`) or in its own group (`placement.teacher`); with `trainer.lora` and the
student's own model as the teacher, it is the trainer's base with the adapter off, scored
inside the train call (no teacher role). With `max_staleness` N > 0 (the rollout on devices
of its own, or on shared ones where no role takes turns), the student's generations for the
next N steps run while the teacher and trainer work (samples at most N weight versions old).
On Ray, a teacher group of its own scores an off-policy step's dataset responses during the
previous step's train call (`algorithm.score_ahead`). With `teacher.warmup_steps`, the
teacher is first trained by SFT on the task and cached. eval/accuracy (greedy, held-out) of
the student is logged at step 0, every run.eval_every steps and at the end, beside the
teacher's own accuracy. Per-step time, bytes moved and memory figures and timeline.jsonl are
as in algorithms/grpo.py.

OPSD (privileged distillation): a row with a non-empty `teacher_prompt` column shows the teacher
that text as its last user turn (e.g. the problem with a reference solution) followed by the
same response token ids the student is scored on; the teacher's distributions over the response
are moved onto the student's positions, so the loss aligns the shared response tokens. Rows
without one show the teacher the student's prompt (plain GKD). gkd/opsd_rows logs their share.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch

from algorithms import sft
from algorithms.config.checks import (check_model, check_multi_turn, check_run, check_staleness, check_trainer,
                                      vocab_size)
from algorithms.config.rules import AT_LEAST_1, FRACTION, NON_NEGATIVE, POSITIVE, require, require_all, require_roles
from algorithms.config.schema import (DriverConfig, as_dict, engine_args, fit_epochs, local_model_path, phase_run,
                                      rollout_section, warmup_steps)
from algorithms.data.answers import accuracy
from algorithms.data.loading import load_task, row_limits
from algorithms.data.prompts import PromptStream, batch_of, encode_examples, template_on
from algorithms.objectives.losses import TOPK_MODES, make_loss
from algorithms.records.runlog import RunLog
from algorithms.runtime.ahead import Prefetch, staleness
from algorithms.runtime.entry import driver_main
from algorithms.runtime.steps import Steps
from algorithms.runtime.trajectories import TrajectoryPrefetch, failed_rows, multi_turn_metrics
from algorithms.runtime.turns import first
from orchestration.base_group import Kept
from orchestration.cluster import init_cluster, set_log_level
from orchestration.launch import driver_group, start_roles
from orchestration.planner import Plan, as_started, make_plan
from roles.batch import Batch, Completions, SamplingParams
from roles.models import load_tokenizer, resolve_config
from roles.multi_turn import MultiTurnConfig
from roles.rollout import Rollout, prompt_text, prompt_token_ids
from roles.teacher import KERNEL_OPTIONS as TEACHER_KERNEL_OPTIONS, Teacher, TeacherConfig
from roles.trainer import BaseTeacher, Trainer, TrainerConfig

logger = logging.getLogger("algorithms.gkd")  # not __name__: python -m runs this module as __main__


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
    # Teacher logprobs kept per position: its k most likely tokens (ms-swift's gkd_logits_topk;
    # also accepted as placement.gkd_logits_topk); null: the full vocabulary.
    logits_topk: Optional[int] = None
    # Top-k teacher logits mode: "renorm" (both sides restricted to the k tokens) or "tail"
    # (k tokens plus one bucket for the remaining mass).
    topk_mode: str = "renorm"
    # Longest student generation in tokens.
    max_new_tokens: int = 48
    # Steps an on-policy generation may run ahead of training (the rollout on devices of its own,
    # or on shared ones where no role takes turns: sleep_level 0, no offload): with N
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
    # Multi-turn on-policy samples (docs/multi_turn.md): the student's turns with an
    # environment's, tools' or a scheduler's turns between them (ms-swift's multi_turn_scheduler,
    # e.g. math_tip_trick); max_new_tokens is a trajectory's budget; the teacher's signal counts
    # on the student's tokens only. Off while scheduler and tools are unset.
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


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
class GKDConfig(DriverConfig):
    DRIVER: ClassVar[str] = "gkd"
    # GKD options.
    algorithm: GKDAlgorithm = field(default_factory=GKDAlgorithm)
    # The teacher.
    teacher: TeacherModelConfig = field(default_factory=TeacherModelConfig)


def train(cfg: GKDConfig, plan: Plan, trainer: Any, rollout: Any, teacher: Any, train_set: list,
          eval_set: list, tokenizer: Any, log: RunLog, step0: dict | None = None, teacher_writer: Any = None) -> dict:
    """The GKD loop; roles are worker groups (or fakes in tests). Returns the last record.
    `step0` holds extra metrics for the step-0 record (the teacher's accuracy);
    `teacher_writer` (a rollout with the teacher's weights) writes off-policy completions when seq_kd."""
    algo, topk = cfg.algorithm, cfg.algorithm.logits_topk
    # The student's logprobs come from the trainer: the rollout need not report its own.
    sampling = SamplingParams(temperature=algo.temperature, max_new_tokens=algo.max_new_tokens, logprobs=False)
    # The student's own base as the teacher (LoRA, teacher None): the trainer scores each batch
    # with its adapter off inside the train call.
    base_teacher = {"teacher": BaseTeacher(topk, algo.temperature if topk else 1.0)} if teacher is None else {}
    writer = teacher_writer if algo.seq_kd else None
    # The coin of every step, drawn up front: generations may start max_staleness steps early.
    coin = random.Random(cfg.run.seed)
    on_policy = [False] + [coin.random() < algo.lmbda for _ in range(cfg.run.steps)]
    # A teacher built in the trainer's processes keeps its answer there for the train call.
    keep = "teacher_logits" if getattr(teacher, "hosted_by", None) is trainer else None
    # Top-k is taken from the tempered distribution (the loss leaves it as is); full-vocabulary
    # logprobs come at temperature 1 and the loss tempers them.
    scoring = {"temperature": algo.temperature if topk else 1.0, "dispatch": "slice", "collect": "flatten",
               "phase": "teacher"}
    # The student's top-k logprobs come at the trainer's temperature: the loss's, then.
    train_temperature = algo.temperature if student_topk(cfg, plan) else 1.0
    score_ahead = scores_ahead(cfg, plan, keep)
    with Steps(plan, {"train": trainer, "rollout": rollout, "teacher": teacher}, cfg.run, cfg.weight_sync, log,
               eval_set, data=cfg.data,
               adapter=bool(cfg.trainer.lora.rank)) as steps:
        turns = steps.turns
        # Prompts continue where a resumed run's checkpoint left them.
        stream = PromptStream(train_set, cfg.run.prompts_per_step, cfg.run.seed, steps.resumed.get("stream", 0))
        # Multi-turn: the student's on-policy samples are trajectories (turn loop inside the
        # rollout role); the loss mask keeps the teacher's signal on the student's own turns.
        multi = {"multi_turn": algo.multi_turn} if algo.multi_turn.enabled else {}
        prefetch = (TrajectoryPrefetch if multi else Prefetch)(
            rollout, log, stream, sampling, algo.max_staleness, cfg.run.steps, generates=lambda s: on_policy[s],
            seed=cfg.run.seed, first_step=steps.first_step, **multi)
        ahead: dict[int, tuple] = {}  # step -> (its batch, the teacher's answer to come), sent the step before
        for step in range(steps.first_step, cfg.run.steps + 1):
            metrics: dict = dict(step0 or {}) if step == 0 else {}
            if step > 0:
                metrics["gkd/on_policy"] = float(on_policy[step])
                if score_ahead:  # (a layout that never scores ahead leaves the metric out)
                    metrics["gkd/scored_ahead"] = float(step in ahead)
                if step in ahead:
                    # Scored ahead during the last train call: the teacher phase is the wait for it.
                    batch, view, answer = ahead.pop(step)
                    metrics["gkd/opsd_rows"] = view.rows / len(batch) if view else 0.0
                    with log.phase("teacher"):
                        scored = to_student_frame(answer.get(), view, batch)
                else:
                    # Generate: the student writes the completions (on-policy), else the dataset's
                    # responses (with seq_kd, the teacher's own samples).
                    if on_policy[step]:
                        with turns.rollout_turn(step - 1, metrics, one_call=not algo.max_staleness):
                            with log.phase("generate"):
                                examples, comps = prefetch.take(step)
                        metrics.update(staleness(comps, step, algo.max_staleness))
                        if multi:  # (failed trajectories carry an all-zero loss mask; all failed: stop)
                            failed_rows(comps, torch.zeros(len(comps)), 1)
                            metrics.update(multi_turn_metrics(comps))
                    else:
                        with log.phase("generate"):
                            examples, _ = prefetch.take(step)
                        comps = _off_policy(examples, tokenizer, writer, sampling, log, cfg.data)
                    batch = _gkd_batch(tokenizer, comps, on_policy[step])
                    # OPSD: rows with a teacher_prompt are the teacher's own sequences (its prompt,
                    # the same response ids); its answer comes back to the driver to be moved.
                    view = teacher_view(tokenizer, examples, comps, cfg.data)
                    metrics["gkd/opsd_rows"] = view.rows / len(batch) if view else 0.0
                    # Teacher: its logprobs at every position (top-k or the full vocabulary).
                    scored = to_student_frame(turns.call("teacher", "logits", view.batch if view else batch, topk,
                                                         keep=None if view else keep, **scoring),
                                              view, batch) if teacher else None
                if teacher is not None:
                    _attach_teacher(batch, scored, topk, None if view else keep)
                # Train: one update of the student on the generalized JSD; then the weights go to the
                # rollout when it samples before the next update (once generations started ahead
                # finish). The trainer's onload, the weights' send and its offload ride on the call.
                # The base as teacher of an OPSD batch scores the teacher's sequences in the same
                # turn, before the update.
                base_view = bool(base_teacher) and view is not None
                with turns.train_turn(step, prefetch, algo.max_staleness, metrics, one_call=not base_view):
                    if base_view:
                        with log.phase("teacher", "train"):
                            scored = trainer.call("base_teacher", view.batch, topk, base_teacher["teacher"].temperature,
                                                  dispatch="slice", collect="flatten")
                        _attach_teacher(batch, to_student_frame(scored, view, batch), topk, None)
                    with log.phase("train", "train"):
                        future = trainer.async_call("train_step", batch, train_temperature, dispatch="slice",
                                                    collect=first, **({} if base_view else base_teacher))
                        # Score ahead: when nothing else comes between this step and the next
                        # (off-policy) one, the teacher scores the next step's dataset responses now,
                        # beside this train call; the next step reads the answer.
                        if score_ahead and steps.quiet_after(step, prefetch):
                            examples, _ = prefetch.take(step + 1)
                            comps = _off_policy(examples, tokenizer, None, sampling, log, cfg.data)
                            nxt = _gkd_batch(tokenizer, comps, on_policy=False)
                            nxt_view = teacher_view(tokenizer, examples, comps, cfg.data)
                            ahead[step + 1] = (nxt, nxt_view, turns.call("teacher", "logits",
                                                                         nxt_view.batch if nxt_view else nxt, topk,
                                                                         ahead=True, **scoring))
                        metrics.update({f"train/{k}": v for k, v in future.get().items()})
            # (A batch drawn ahead is drawn again by a run resumed from this step.)
            steps.end_step(step, metrics, {"stream": prefetch.position() - len(ahead)})
        return steps.finish({"stream": prefetch.position()})


def scores_ahead(cfg: GKDConfig, plan: Plan, keep: Optional[str]) -> bool:
    """Whether the teacher may score the next step's dataset responses while this step trains:
    on Ray, with devices of its own (a teacher in the trainer's processes or on its devices
    waits for the trainer anyway; its call rides on the trainer's then), strictly on-policy
    generation and the dataset's own responses (not seq_kd)."""
    algo = cfg.algorithm
    return (algo.score_ahead and cfg.backend.workers == "ray" and not algo.seq_kd and not algo.max_staleness
            and keep is None and not base_teaches(cfg, plan)
            and not {"train", "rollout"} & set(plan["teacher"].colocated_with))


def base_teaches(cfg: GKDConfig, plan: Plan) -> bool:
    """Whether the teacher is the student's own base model under LoRA (self-distillation): the
    trainer then computes it with its adapter off, and no teacher role (no second copy of the
    weights) is started."""
    if not cfg.trainer.lora.rank or cfg.teacher.warmup_steps:
        return False
    teacher, student = resolve_config(teacher_spec(cfg, plan)), resolve_config(as_dict(cfg.model))
    return (teacher.path or teacher.name) == (student.path or student.name)


def _gkd_batch(tokenizer: Any, comps: Any, on_policy: bool) -> Any:
    """Completions as a training batch; sft_alpha's NLL term counts dataset responses only,
    never the student's own text."""
    batch = batch_of(tokenizer, comps)
    batch.sft_weight = torch.full((len(batch),), 0.0 if on_policy else 1.0)
    return batch


def _attach_teacher(batch: Any, answer: Any, topk: Optional[int], keep: Optional[str]) -> None:
    """`batch` with the teacher's answer: top-k (logprobs, indices), or full-vocabulary
    logprobs. An answer kept on the trainer's ranks is named there (`Kept`)."""
    if keep and topk:
        answer = (Kept(keep, 0), Kept(keep, 1))
    batch.teacher_logprobs, batch.teacher_indices = answer if topk else (answer, None)


@dataclass
class TeacherView:
    """The teacher's own sequences of an OPSD batch: `batch` holds each row's teacher prompt
    (its teacher_prompt as the last user turn; the student's prompt where it has none) followed
    by the student's response token ids; `student_starts` / `teacher_starts` are where each
    row's response begins in the student's and the teacher's sequences; `rows` counts the rows
    with a teacher_prompt."""
    batch: Batch
    student_starts: list[int]
    teacher_starts: list[int]
    rows: int


def privileged_prompt(example: Any) -> Optional[str]:
    """A row's `teacher_prompt` column (OPSD), or None when it has none or a blank one."""
    text = example.columns.get("teacher_prompt")
    return text if isinstance(text, str) and text.strip() else None


def teacher_view(tokenizer: Any, examples: list, comps: Completions, data: Any) -> Optional[TeacherView]:
    """The teacher's sequences of a batch made from `comps` (row i answers examples[i]: one
    completion per prompt), or None when no row has a teacher_prompt. A teacher prompt
    is the row's conversation with its last user turn replaced by the teacher_prompt, rendered as
    the student's prompt is (`data`: data.chat, data.enable_thinking); the response's token ids
    are the student's own, never decoded and encoded again."""
    if len(comps) != len(examples):
        raise ValueError(f"{len(comps)} completions for {len(examples)} prompts: GKD samples one per prompt")
    privileged = [privileged_prompt(ex) for ex in examples]
    if not any(privileged):
        return None
    template = template_on(tokenizer, data.chat)
    prompts = []
    for ex, own, text in zip(examples, comps.prompt_ids, privileged):
        if text is None or not own:  # (no prompt of its own: a reply the template does not extend)
            prompts.append(list(own))
            continue
        messages = ex.prompt_messages()
        last = max(j for j, m in enumerate(messages) if m["role"] == "user")
        messages[last] = {**messages[last], "content": text}
        prompts.append(prompt_token_ids(tokenizer, prompt_text(tokenizer, messages, template, data.enable_thinking),
                                        template))
    view = Completions(comps.prompt_index, prompts, comps.completion_ids, comps.texts, [], comps.finish_reasons)
    return TeacherView(batch_of(tokenizer, view), [len(p) for p in comps.prompt_ids], [len(p) for p in prompts],
                       sum(text is not None for text in privileged))


def to_student_frame(answer: Any, view: Optional[TeacherView], batch: Batch) -> Any:
    """The teacher's answer on its own sequences (top-k (values, indices), or full-vocabulary
    logprobs; aligned with view.batch) moved onto the student's positions of `batch`: row i's
    response positions, [teacher_starts[i], + its length) there, become [student_starts[i], ...)
    here; everything else holds 0. Without a view the answer as it is."""
    if view is None:
        return answer
    lengths = batch.attention_mask.sum(1).tolist()
    moved = []
    for part in (answer if isinstance(answer, tuple) else (answer,)):
        out = part.new_zeros((len(batch), batch.input_ids.shape[1], *part.shape[2:]))
        for i, (s, t) in enumerate(zip(view.student_starts, view.teacher_starts)):
            n = lengths[i] - s
            out[i, s:s + n] = part[i, t:t + n]
        moved.append(out)
    return tuple(moved) if isinstance(answer, tuple) else moved[0]


def _off_policy(examples: list, tokenizer: Any, teacher_writer: Any, sampling: SamplingParams, log: RunLog,
                data: Any) -> Any:
    """Completions of an off-policy step: the dataset's responses (prompts rendered as `data`,
    the data section, says), or with a teacher writer (sequence-level KD) the teacher's own samples."""
    if teacher_writer is None:
        return encode_examples(tokenizer, examples, pretrain=False, chat=data.chat,
                               enable_thinking=data.enable_thinking)
    with log.phase("generate", "teacher_writer"):
        comps = teacher_writer.call("generate", [ex.prompt_messages() for ex in examples], sampling,
                                    dispatch="slice", collect="flatten")
    comps.logprobs = []  # the teacher's sampling logprobs are not the student's
    return comps


def warm_teacher(cfg: GKDConfig, out_dir: Path) -> str:
    """Train the teacher by SFT on the task once; cached by everything that shapes it."""
    t = cfg.teacher
    key = json.dumps({"model": t.model, "steps": t.warmup_steps, "lr": t.warmup_lr, "batch": t.warmup_batch,
                      "data": as_dict(cfg.data), "engine": cfg.backend.train}, sort_keys=True)
    name = Path(str(t.model)).name
    path = Path(t.cache_dir).expanduser() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (path / "config.json").is_file():
        logger.info(f"gkd: teacher from cache {path}")
        return str(path)
    logger.info(f"gkd: training the teacher ({t.model}) by SFT for {t.warmup_steps} steps; cached at {path}")
    # The run's sections (engines and their options, weight sync) with the teacher's model and
    # its own optimizer settings (the cache key holds those).
    warm = sft.phase_config(cfg, model=resolve_config(t.model),
                     trainer=teacher_trainer(t),
                     run=phase_run(cfg.run, out_dir, "teacher_warmup", steps=t.warmup_steps,
                                   prompts_per_step=t.warmup_batch, eval_max_new_tokens=cfg.run.eval_max_new_tokens,
                                   save_final=True))
    plan = make_plan({"train": {"gpus": 1}})
    record = sft.run(warm, plan, out_dir / "teacher_warmup")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(record["checkpoint"], tmp, ignore=shutil.ignore_patterns("rng_state_*", "trainer_state.pt", "driver_state.json"))
    tmp.rename(path)
    return str(path)


def teacher_trainer(t: TeacherModelConfig) -> TrainerConfig:
    """The trainer section of the teacher's SFT warm-up: TrainerConfig's defaults with the
    teacher section's own learning rate and batch (the cache key holds those)."""
    return TrainerConfig(lr=t.warmup_lr, warmup_steps=warmup_steps(t.warmup_steps), total_steps=t.warmup_steps,
                         micro_batch_per_device=t.warmup_batch)


def teacher_spec(cfg: GKDConfig, plan: Plan) -> str:
    """The teacher's model (placement.teacher_model or placement.teacher.model, else teacher.model)
    as every process reads it: a folder as an absolute path (the actors of a cluster the run
    joins do not work in the driver's directory), a preset name as given."""
    return local_model_path(plan["teacher"].model or cfg.teacher.model)


def hosting(cfg: GKDConfig, plan: Plan) -> Plan:
    """The plan as started: a teacher planned in the trainer's processes
    (placement.teacher_in_trainer_process) gets processes of its own when its engine is not
    torch's (vLLM starts a distributed group of its own), with a note saying so."""
    plan, notes = as_started(plan, {"teacher": cfg.backend.teacher})
    for note in notes:
        logger.warning(note)
    return plan


def run(cfg: GKDConfig, plan: Plan, out_dir: Path) -> dict:
    set_log_level(cfg.run.log_level)
    plan = hosting(cfg, plan)
    train_set, eval_set, stats = load_task(cfg.data, row_limits(cfg, cfg.algorithm.max_new_tokens,
                                                                replies=cfg.algorithm.lmbda < 1 and not cfg.algorithm.seq_kd,
                                                                teacher=teacher_spec(cfg, plan)))
    cfg = fit_epochs(cfg, len(train_set))
    if cfg.backend.workers == "ray":  # sized for this plan before the teacher warm-up uses it
        init_cluster(cfg.cluster, plan.demand())
    teacher_model = teacher_spec(cfg, plan)
    if cfg.teacher.warmup_steps:
        teacher_model = warm_teacher(replace(cfg, teacher=replace(cfg.teacher, model=teacher_model)), out_dir)
    student = as_dict(cfg.model)
    loss = gkd_loss(cfg, plan)
    # The teacher's accuracy, for reference (the gap the student closes).
    judge = driver_group(Rollout, {"model": teacher_model, "config": rollout_section(cfg)}, "teacher_eval")
    own_base = base_teaches(cfg, plan)
    if own_base:
        logger.info("gkd: the teacher is the student's base model: the trainer scores with its LoRA adapter off "
                    "(no teacher role started)")
    # None held out (data.val_split=0): not measured.
    teacher_accuracy = accuracy(judge, eval_set, cfg.run.eval_max_new_tokens, cfg.data) if eval_set else math.nan
    if not cfg.algorithm.seq_kd:  # with seq_kd it writes the off-policy completions
        judge.shutdown()
    roles = start_roles(cfg, plan, {
        "train": (Trainer, {"model": student, "config": as_dict(cfg.trainer), "loss_fn": loss,
                            "loss_inputs": loss.loss_inputs, **engine_args(cfg, "train")}),
        "rollout": (Rollout, {"model": student, "config": rollout_section(cfg, trained=True),
                              **engine_args(cfg, "rollout")}),
        **({} if own_base else {"teacher": (Teacher, {"model": teacher_model, "config": as_dict(cfg.teacher.engine),
                                                      **engine_args(cfg, "teacher")})})},
        restarts=cfg.run.max_restarts)
    log = RunLog(out_dir, cfg.run.steps, cfg.run, resolved_config=cfg)
    topk = cfg.algorithm.logits_topk
    logger.info(f"gkd: {len(train_set)} train / {len(eval_set)} held-out examples; {cfg.run.steps} steps x "
                f"{cfg.run.prompts_per_step} prompts; teacher {teacher_model} (accuracy {teacher_accuracy:.3f}, "
                f"{'top-%d %s' % (topk, cfg.algorithm.topk_mode) if topk else 'full vocabulary'}); output {log.dir}")
    try:
        record = train(cfg, plan, roles["train"], roles["rollout"], roles.get("teacher"), train_set, eval_set,
                       load_tokenizer(student), log, step0={"teacher/eval_accuracy": teacher_accuracy, **stats},
                       teacher_writer=judge if cfg.algorithm.seq_kd else None)
        record["teacher/eval_accuracy"] = teacher_accuracy
        return record
    finally:
        log.close()
        roles.shutdown()
        if cfg.algorithm.seq_kd:
            judge.shutdown()


def validate(cfg: GKDConfig, plan: Plan) -> None:
    """Every check of a GKD run, before anything starts (shared checks: algorithms/config/checks.py)."""
    require_roles(plan, ("train", "rollout", "teacher"), "GKD", "add them (a colocated teacher: "
                  "placement.teacher_model=NAME; a teacher group: placement.teacher.gpus=N)")
    check_run(cfg, plan, classes={"train": Trainer, "rollout": Rollout, "teacher": Teacher})
    a, t = cfg.algorithm, cfg.teacher
    check_multi_turn(a.multi_turn)
    require_all(a, "algorithm", {"lmbda": FRACTION, "beta": FRACTION, "temperature": POSITIVE,
                                 "sft_alpha": NON_NEGATIVE, "max_new_tokens": AT_LEAST_1})
    require(a.topk_mode in TOPK_MODES, "algorithm.topk_mode", a.topk_mode, "is not a top-k mode",
            f"use one of {list(TOPK_MODES)}")
    require_all(t, "teacher", {"warmup_steps": NON_NEGATIVE, "warmup_lr": POSITIVE, "warmup_batch": AT_LEAST_1})
    require_all(t.engine, "teacher.engine", {"micro_batch_per_device": NON_NEGATIVE, "micro_batch_memory_mb": POSITIVE})
    for key in TEACHER_KERNEL_OPTIONS:
        require(cfg.backend.teacher == "torch" or not getattr(t.engine, key), f"teacher.engine.{key}", True,
                f"needs the torch engine (backend.teacher={cfg.backend.teacher})",
                f"set backend.teacher=torch, or teacher.engine.{key}=false")
    teacher_key = "placement.teacher_model" if plan["teacher"].model else "teacher.model"
    teacher_model = plan["teacher"].model or t.model
    check_model(teacher_key, teacher_model)
    if t.warmup_steps:
        check_trainer(teacher_trainer(t), "teacher", t.warmup_steps, "teacher.warmup_steps")
    topk = cfg.algorithm.logits_topk
    if topk is not None:
        require(topk >= 1, "algorithm.logits_topk", topk, "must be >= 1", "set it >= 1, or null for the full "
                "vocabulary")
        vocab = min(vocab_size(cfg.model), vocab_size(teacher_model))
        require(topk <= vocab, "algorithm.logits_topk", topk, f"exceeds the {vocab}-token vocabulary",
                f"set it to at most {vocab}, or null for the full vocabulary")
    if cfg.backend.teacher == "vllm":  # top-k and max_logprobs: engine_checks.check_vllm_teacher
        sleeps = plan["rollout"].sleep_level or plan["teacher"].offload_model
        require(not (cfg.backend.workers == "local" and cfg.backend.rollout == "vllm" and sleeps
                     and torch.cuda.is_available()), "backend.rollout", "vllm",
                "and backend.teacher=vllm with backend.workers=local put two GPU vLLM engines in one process, "
                "where vLLM's sleep mode would put both to sleep at once",
                "backend.workers=ray (a process per role), or keep both awake: placement.sleep_level=0 "
                "placement.offload_teacher_model=false")
    check_staleness(a.max_staleness, plan)
    gkd_loss(cfg, plan)


def student_topk(cfg: GKDConfig, plan: Plan) -> bool:
    """Whether the student's loss reads its log-softmax at the teacher's top-k tokens instead of
    its full logits: a top-k teacher, the torch trainer with fused_logprobs (which then never
    makes the [B, T, V] logits), and no SFT term (it needs the whole distribution)."""
    return (cfg.algorithm.logits_topk is not None and cfg.trainer.fused_logprobs and cfg.backend.train == "torch"
            and cfg.algorithm.sft_alpha == 0)


def gkd_loss(cfg: GKDConfig, plan: Plan):
    a = cfg.algorithm
    return make_loss("gkd", beta=a.beta, temperature=a.temperature, sft_alpha=a.sft_alpha, topk_mode=a.topk_mode,
                     teacher_temperature_applied=cfg.algorithm.logits_topk is not None,
                     student_topk=student_topk(cfg, plan))


def main() -> None:
    driver_main(GKDConfig, validate, run, shown=("eval/", "teacher/"))


if __name__ == "__main__":
    main()
