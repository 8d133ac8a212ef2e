"""Distill / sample: best-of-N candidates scored by a PRM and an ORM, kept as a dataset.

    python -m algorithms.distill +experiment=distill_quickstart
    python -m algorithms.distill +experiment=distill_quickstart algorithm.prm_threshold=0 algorithm.sft_steps=0
    python -m algorithms.distill +experiment=distill_quickstart config_file=my_swift_sampling.yaml

The placement names three roles (ms-swift's `device_groups` form with workers `sampler`,
`prm`, `orm`; CPU groups work). Each step draws `run.prompts_per_step` training prompts;
the sampler group (the policy, `model`) writes `num_return_sequences` candidates per
prompt, the PRM group scores their steps (aggregated to one score) and the ORM group their
outcome. Per prompt the candidates rank by score = PRM + orm_weight * ORM; the best
`n_best_to_keep` with a PRM score >= `prm_threshold` become rows of `output_file`
(sampled.jsonl) in the Hydra run directory: `messages` [user, assistant],
`rejected_response` (the worst candidate), the scores, prompt and answer. metrics.jsonl gets, per step, candidates, kept
rows, mean scores and the accuracy (data.check) of all candidates and of the
kept ones, with run totals on the last line; step 0 holds the policy's greedy held-out
eval/accuracy. Optional SFT phases run algorithms.sft on the sampler's device kind:
`warmup_sft_steps` (at `warmup_lr`) first trains the policy on the task's reference
solutions, so that sampling yields a mix of right and wrong answers; `sft_steps` (at
trainer.lr) afterwards trains it on the kept rows, with the task's held-out prompts as its
eval set (accuracy before and after in the `sft/` subfolder's metrics.jsonl). On Ray the
sampler generates step k+1's candidates while the PRM and ORM score step k's.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Optional

from algorithms import sft
from algorithms.config.checks import check_run, check_scorer
from algorithms.config.rules import ANY_NUMBER, AT_LEAST_1, NON_NEGATIVE, POSITIVE, require, require_all, require_roles
from algorithms.config.schema import DriverConfig, as_dict, engine_args, phase_run, rollout_section, warmup_steps
from algorithms.data.answers import checker, correct, reference
from algorithms.data.loading import DataConfig, load_task, row_limits
from algorithms.data.prompts import PromptStream
from algorithms.data.tasks import Example
from algorithms.records.checkpoints import write_json_atomic
from algorithms.records.runlog import RunLog, record_data_stats
from algorithms.records.trackers import read_metrics
from algorithms.runtime.ahead import Pending, step_seed
from algorithms.runtime.entry import driver_main
from orchestration.cluster import init_cluster, set_log_level
from orchestration.launch import start_roles
from orchestration.planner import Plan, make_plan
from roles.batch import SamplingParams
from roles.models import resolve_config
from roles.orm import KINDS as ORM_KINDS, ORM, ORMConfig
from roles.prm import AGGREGATES, KINDS as PRM_KINDS, PRM, PRMConfig
from roles.sampler import Sampler
from roles.trainer_config import every_weight

logger = logging.getLogger("algorithms.distill")  # not __name__: python -m runs this module as __main__


# What a resumed distill run continues its sampling from (in the run directory).
SAMPLING_STATE = "sampling_state.json"


@dataclass
class DistillAlgorithm:
    # Candidates sampled per prompt.
    num_return_sequences: int = 8
    # Best candidates kept per prompt (fewer than num_return_sequences: the worst one is
    # the rejected response).
    n_best_to_keep: int = 1
    # A candidate is kept only with a PRM score (aggregated over its steps) >= this.
    prm_threshold: float = 0.0
    # Weight of the ORM score in the ranking score = PRM + orm_weight * ORM.
    orm_weight: float = 1.0
    # Drop a prompt when more than this fraction of its candidates is right by the ORM
    # (score > 0): too easy to teach anything; None keeps every prompt.
    easy_query_threshold: Optional[float] = None
    # ms-swift's sampler type: "sample" or "distill" (both sample the local `model`, a
    # bigger teacher when distilling); "mcts" is not supported.
    sampler_type: str = "sample"
    # Sampling temperature of the candidates.
    temperature: float = 1.0
    # Nucleus sampling mass of the candidates; 1.0 disables it.
    top_p: float = 1.0
    # Longest candidate in tokens.
    max_new_tokens: int = 48
    # File name of the dataset in the run directory.
    output_file: str = "sampled.jsonl"
    # SFT steps training the policy on the task's reference solutions before sampling; 0: sample from it as given.
    warmup_sft_steps: int = 0
    # Peak learning rate of that warm-up SFT (the SFT on the kept rows uses trainer.lr).
    warmup_lr: float = 3e-3
    # SFT steps training the policy on the kept rows after sampling; 0: no SFT.
    sft_steps: int = 0
    # Sequences per step of both SFT phases. Their optimizer is the trainer section's, with
    # the schedule spanning the phase and a linear warmup over its first tenth.
    sft_batch: int = 64


@dataclass
class DistillConfig(DriverConfig):
    DRIVER: ClassVar[str] = "distill"
    # Sampling and selection options.
    algorithm: DistillAlgorithm = field(default_factory=DistillAlgorithm)
    # Process reward model (rule-based arithmetic step verifier by default).
    prm: PRMConfig = field(default_factory=PRMConfig)
    # Outcome reward model (numeric '#### N' check by default; ms-swift's orm_model: math sets
    # kind=math, a plugin's reward kind=plugin); it gets each row's dataset columns.
    orm: ORMConfig = field(default_factory=ORMConfig)


def sample(cfg: DistillConfig, sampler: Any, prm: Any, orm: Any, train_set: list, eval_set: list,
           out_path: Path, log: RunLog, resumed: Optional[dict] = None) -> dict:
    """The sampling loop; roles are worker groups (or fakes in tests). Writes the kept rows
    to `out_path` and returns the last metrics record (with the run's totals). After every
    step, sampling_state.json records what a resumed run continues from (`resumed`: its
    content; the steps after it, written before an interruption, are dropped)."""
    algo, steps, n = cfg.algorithm, cfg.run.steps, cfg.algorithm.num_return_sequences
    sampling = SamplingParams(temperature=algo.temperature, top_p=algo.top_p, max_new_tokens=algo.max_new_tokens)
    first = resumed["step"] + 1 if resumed else 0
    stream = PromptStream(train_set, cfg.run.prompts_per_step, cfg.run.seed, resumed["stream"] if resumed else 0)
    # On Ray the sampler's weights never change here, so it generates step k+1's candidates
    # while the PRM and ORM score step k's (in process, one after the other anyway).
    ahead = cfg.backend.workers == "ray"

    def generating(step: int, after: Optional[Pending] = None) -> tuple[int, list, Pending]:
        """(the stream's count before the draw, `step`'s prompts, their candidates' generation,
        sent now, to run `after` the one before). Seeded by the step, so a resumed run draws what
        the uninterrupted one drew."""
        drawn, examples = stream.drawn, next(stream)
        return drawn, examples, Pending(sampler, "sample", [ex.prompt_messages() for ex in examples], n,
                                        replace(sampling, seed=step_seed(cfg.run.seed, step, 0)),
                                        dispatch="slice", collect="flatten", after=after)
    totals: Counter = Counter(resumed["totals"] if resumed else {})
    check = checker(cfg.data)
    plugin_orm = "plugin" in (cfg.orm.kind, *cfg.orm.weights)
    record: dict = log.rewind(resumed["step"]) if resumed else {}
    if resumed:
        _keep_lines(out_path, resumed["rows"])
    nxt: Optional[tuple] = None  # the next step's generation, when sent ahead
    with open(out_path, "a" if resumed else "w") as out:
        for step in range(first, steps + 1):
            metrics: dict = {}
            if step == 0:
                # Eval: greedy held-out accuracy of the policy that samples (none held out: no eval).
                if eval_set:
                    with log.phase("eval"):
                        metrics["eval/accuracy"] = greedy_accuracy(sampler, eval_set, cfg.run.eval_max_new_tokens,
                                                                   check)
            else:
                # Generate: n candidates per prompt, prompts split over the sampler ranks; the
                # next step's generation is sent before this one is waited for.
                _, examples, pending = nxt or generating(step)
                nxt = generating(step + 1, after=pending) if ahead and step < steps else None
                with log.phase("generate"):
                    comps = pending.logged(log, "sampler", "generate")
                texts = list(comps.texts)
                if len(texts) != n * len(examples):
                    raise RuntimeError(f"the sampler returned {len(texts)} candidates for {len(examples)} x {n}")
                # Score: PRM (step scores aggregated) and ORM, candidates split over each group's ranks.
                # References: the final answer when known (numeric ORM), else the reference solution.
                prompts = [ex.prompt for ex in examples for _ in range(n)]
                refs = [reference(ex) for ex in examples for _ in range(n)]
                with log.phase("score"):
                    prm_scores = prm.call("score", prompts, texts, refs, dispatch="slice", collect="flatten")
                    # The rows' dataset columns, which only a plugin ORM reads.
                    rows = ([ex.columns for ex in examples for _ in range(n)],) if plugin_orm else ()
                    orm_scores = orm.call("score", prompts, texts, refs, *rows, dispatch="slice", collect="flatten")
                # Select: best n_best_to_keep per prompt with PRM >= prm_threshold, the worst as rejected.
                with log.phase("select"):
                    right = correct(check, examples, texts)
                    rows, counts = select(examples, texts, prm_scores, orm_scores, right, algo)
                    out.writelines(json.dumps(row) + "\n" for row in rows)
                    out.flush()
                totals.update(counts)
                metrics.update(summarize(counts, "sample/"))
                if step == steps:
                    metrics.update(summarize(totals, "total/"))
            record = log.step(step, metrics)
            write_json_atomic(log.dir / SAMPLING_STATE, {"step": step, "stream": nxt[0] if nxt else stream.drawn,
                                                          "rows": int(totals["kept"]), "totals": dict(totals)})
    return record


def _keep_lines(path: Path, n: int) -> None:
    """Keep the first `n` lines of `path` (the rows of the steps a resumed run keeps)."""
    lines = path.read_text().splitlines(keepends=True) if path.is_file() else []
    if len(lines) < n:
        raise RuntimeError(f"{path} holds {len(lines)} rows, but {SAMPLING_STATE} counts {n}; it was changed "
                           "since. Start a new run (run.resume=null) in a fresh directory")
    path.write_text("".join(lines[:n]))


def select(examples: list[Example], texts: list[str], prm_scores: list[float], orm_scores: list[float],
           correct: list[float], algo: DistillAlgorithm) -> tuple[list[dict], Counter]:
    """Dataset rows of one batch (candidates of prompt i at i*n .. i*n+n-1) and the sums
    behind its metrics. `correct` is the data.check score of each candidate (metrics only)."""
    n, rows, c = algo.num_return_sequences, [], Counter()
    for i, ex in enumerate(examples):
        idx = range(i * n, (i + 1) * n)
        score = {j: prm_scores[j] + algo.orm_weight * orm_scores[j] for j in idx}
        ranked = sorted(idx, key=lambda j: -score[j])  # stable: ties keep sampling order
        worst = ranked[-1]
        c.update(prompts=1, candidates=n, correct=sum(correct[j] for j in idx),
                 solved=float(any(correct[j] > 0 for j in idx)),
                 prm=sum(prm_scores[j] for j in idx), orm=sum(orm_scores[j] for j in idx))
        easy = sum(orm_scores[j] > 0 for j in idx) / n
        if algo.easy_query_threshold is not None and easy > algo.easy_query_threshold:
            c.update(easy_skipped=1)
            continue
        keep = [j for j in ranked[:algo.n_best_to_keep] if prm_scores[j] >= algo.prm_threshold]
        c.update(kept=len(keep), prompts_kept=float(bool(keep)), kept_correct=sum(correct[j] for j in keep),
                 kept_prm=sum(prm_scores[j] for j in keep), kept_orm=sum(orm_scores[j] for j in keep))
        for j in keep:
            rows.append({"messages": ex.prompt_messages() + [{"role": "assistant", "content": texts[j]}],
                         "rejected_response": texts[worst], "prm_score": prm_scores[j], "orm_score": orm_scores[j],
                         "score": score[j], "rejected_score": score[worst], "prompt": ex.prompt, "answer": ex.answer})
    return rows, c


def summarize(c: Counter, prefix: str) -> dict:
    """Metrics from the sums of `select`; kept-row means only when something was kept."""
    out = {f"{prefix}kept": int(c["kept"]), f"{prefix}accuracy_all": c["correct"] / max(c["candidates"], 1)}
    if c["kept"]:
        out[f"{prefix}accuracy_kept"] = c["kept_correct"] / c["kept"]
    out.update({f"{prefix}pass_at_n": c["solved"] / max(c["prompts"], 1),
                f"{prefix}prm_mean": c["prm"] / max(c["candidates"], 1),
                f"{prefix}orm_mean": c["orm"] / max(c["candidates"], 1),
                f"{prefix}prompts_kept": int(c["prompts_kept"]), f"{prefix}candidates": int(c["candidates"]),
                f"{prefix}easy_skipped": int(c["easy_skipped"])})
    if c["kept"]:
        out[f"{prefix}kept_prm_mean"] = c["kept_prm"] / c["kept"]
        out[f"{prefix}kept_orm_mean"] = c["kept_orm"] / c["kept"]
    return out


def greedy_accuracy(sampler: Any, examples: list[Example], max_new_tokens: int, check: ORM) -> float:
    """Held-out accuracy of one greedy sample per prompt (`check`: data.check's scorer)."""
    comps = sampler.call("sample", [ex.prompt_messages() for ex in examples], 1,
                         SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
                         dispatch="slice", collect="flatten")
    scores = correct(check, examples, comps.texts)
    return sum(scores) / max(len(scores), 1)


def run_sft(cfg: DistillConfig, plan: Plan, model: Any, data: DataConfig, steps: int, lr: float,
            out_dir: Path, full: bool = False) -> dict:
    """algorithms.sft on the sampler's device kind (as many ranks on Ray, one locally); `full`:
    every weight trains whatever trainer.lora says (the warm-up: `every_weight`)."""
    s = plan["sampler"]
    ranks = s.world_size if cfg.backend.workers == "ray" else 1
    sft_plan = make_plan({"train": {"gpus": ranks}} if s.device == "GPU" else
                         {"device_groups": {"nproc_per_node": 1, "sft": {"device": "CPU", "ranks": ranks,
                                                                          "workers": ["train"]}}})
    trainer = replace(every_weight(cfg.trainer) if full else cfg.trainer, lr=lr, total_steps=steps,
                      warmup_steps=warmup_steps(steps))
    run = phase_run(cfg.run, Path(out_dir).parent, Path(out_dir).name, steps=steps,
                    prompts_per_step=cfg.algorithm.sft_batch, seed=cfg.run.seed,
                    eval_max_new_tokens=cfg.run.eval_max_new_tokens, resume="auto" if cfg.run.resume else None)
    sft_cfg = sft.phase_config(cfg, model=resolve_config(model), trainer=trainer, data=data, run=run)
    return sft.run(sft_cfg, sft_plan, out_dir)


def write_heldout(examples: list[Example], path: Path) -> Path:
    """Held-out examples as JSONL rows, the held-out file (data.val_paths) of the SFT phase."""
    with open(path, "w") as f:
        # A prompt-only row (no reference reply) stays one: its messages end with the user.
        f.writelines(json.dumps({"messages": ex.messages() if ex.solution else ex.prompt_messages(),
                                 "answer": ex.answer}) + "\n" for ex in examples)
    return path


def run(cfg: DistillConfig, plan: Plan, out_dir: Path) -> dict:
    """Optional warm-up SFT, sampling with the planned roles, optional SFT on the kept rows.
    Returns the sampling's last metrics record, plus the SFT results under sft/."""
    set_log_level(cfg.run.log_level)
    train_set, eval_set, stats = load_task(cfg.data, row_limits(cfg, cfg.algorithm.max_new_tokens))
    if cfg.backend.workers == "ray":  # sized for this plan before any SFT phase uses it
        init_cluster(cfg.cluster, plan.demand())
    algo, policy = cfg.algorithm, cfg.model
    if algo.warmup_sft_steps:
        logger.info(f"distill: warm-up SFT of the policy for {algo.warmup_sft_steps} steps")
        policy = run_sft(cfg, plan, policy, cfg.data, algo.warmup_sft_steps, algo.warmup_lr,
                         out_dir / "warmup_sft", full=True)["checkpoint"]
    path, state = Path(out_dir) / algo.output_file, Path(out_dir) / SAMPLING_STATE
    resumed = json.loads(state.read_text()) if cfg.run.resume and state.is_file() else None
    if resumed and resumed["step"] == cfg.run.steps:  # sampling had finished: on to the SFT phase
        logger.info(f"distill: sampling finished before ({state}); resuming after it")
        record = read_metrics(Path(out_dir) / "metrics.jsonl")[-1]
    else:
        record = sample_with_roles(cfg, plan, policy, train_set, eval_set, stats, path, resumed, out_dir)
    record["dataset"] = str(path)
    if algo.sft_steps and not record.get("total/kept"):
        logger.info("distill: no rows kept, so no SFT on them")
    elif algo.sft_steps:
        # SFT on the kept rows, evaluated on the task's held-out examples.
        heldout = write_heldout(eval_set, Path(out_dir) / "heldout.jsonl")
        data = DataConfig(task="files", paths=[str(path)], val_paths=[str(heldout)] if eval_set else [],
                          val_split=None if eval_set else 0.0, eval_size=len(eval_set),
                          cache_dir=cfg.data.cache_dir, check=cfg.data.check, check_pattern=cfg.data.check_pattern,
                          chat=cfg.data.chat, enable_thinking=cfg.data.enable_thinking)
        tuned = run_sft(cfg, plan, policy, data, algo.sft_steps, cfg.trainer.lr, out_dir / "sft")
        record.update({"sft/eval_accuracy": tuned.get("eval/accuracy"), "sft/checkpoint": tuned.get("checkpoint")})
    return record


def sample_with_roles(cfg: DistillConfig, plan: Plan, policy: Any, train_set: list, eval_set: list, stats: dict,
                      path: Path, resumed: Optional[dict], out_dir: Path) -> dict:
    """Start the sampler, PRM and ORM groups, sample (continuing from `resumed`), shut down."""
    algo = cfg.algorithm
    roles = start_roles(cfg, plan, {"sampler": (Sampler, {"model": as_dict(resolve_config(policy)),
                                                          "config": rollout_section(cfg),
                                                          **engine_args(cfg, "rollout")}),
                                    "prm": (PRM, {"config": as_dict(cfg.prm)}),
                                    "orm": (ORM, {"config": as_dict(cfg.orm)})}, restarts=cfg.run.max_restarts)
    log = RunLog(out_dir, cfg.run.steps, cfg.run, resolved_config=cfg)
    record_data_stats(log, {} if resumed else stats, None)  # a resumed sampling has its step 0
    logger.info(f"distill: {cfg.run.steps} steps x {cfg.run.prompts_per_step} prompts x {algo.num_return_sequences} "
                f"candidates from {len(train_set)} train examples over "
                f"{plan['sampler'].world_size} sampler / {plan['prm'].world_size} prm / {plan['orm'].world_size} orm "
                f"rank(s); keep {algo.n_best_to_keep} per prompt with PRM >= {algo.prm_threshold}; output {path}"
                + (f"; resuming after sampling step {resumed['step']}" if resumed else ""))
    try:
        return sample(cfg, roles["sampler"], roles["prm"], roles["orm"], train_set, eval_set, path, log, resumed)
    finally:
        log.close()
        roles.shutdown()


def validate(cfg: DistillConfig, plan: Plan) -> None:
    """Every check of a distill run, before anything starts (algorithms/config/checks.py)."""
    require_roles(plan, ("sampler", "prm", "orm"), "distill", "use +experiment=distill_quickstart or "
                  "placement.device_groups with workers [sampler] and [prm, orm]")
    require(cfg.run.resume in (None, "", "auto"), "run.resume", cfg.run.resume, "names a checkpoint, but distill "
            "resumes by phase from its run directory", "use run.resume=auto with the old run's directory")
    check_run(cfg, plan, classes={"sampler": Sampler, "prm": PRM, "orm": ORM})
    check_scorer(cfg.prm, "prm", PRM_KINDS)
    check_scorer(cfg.orm, "orm", ORM_KINDS)
    require(cfg.prm.aggregate in AGGREGATES, "prm.aggregate", cfg.prm.aggregate, "is not an aggregate",
            f"use one of {list(AGGREGATES)}")
    algo = cfg.algorithm
    require_all(algo, "algorithm", {"temperature": NON_NEGATIVE, "max_new_tokens": AT_LEAST_1,
                                    "top_p": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
                                    "warmup_sft_steps": NON_NEGATIVE, "warmup_lr": POSITIVE,
                                    "sft_steps": NON_NEGATIVE, "sft_batch": AT_LEAST_1,
                                    "prm_threshold": ANY_NUMBER, "orm_weight": ANY_NUMBER})
    require(algo.easy_query_threshold is None or 0.0 <= algo.easy_query_threshold <= 1.0,
            "algorithm.easy_query_threshold", algo.easy_query_threshold, "must be in [0, 1] or null",
            "set a fraction of right candidates, or null to keep every prompt")
    require(algo.num_return_sequences >= 2, "algorithm.num_return_sequences", algo.num_return_sequences,
            "must be >= 2 (a kept and a rejected candidate)", "sample at least 2 candidates per prompt")
    require(1 <= algo.n_best_to_keep < algo.num_return_sequences, "algorithm.n_best_to_keep", algo.n_best_to_keep,
            f"must lie in [1, num_return_sequences={algo.num_return_sequences}) (the worst candidate is the "
            "rejected response)", f"set it between 1 and {algo.num_return_sequences - 1}")
    require(algo.sampler_type in ("sample", "distill"), "algorithm.sampler_type", algo.sampler_type,
            "is not served: only 'sample' and 'distill' (best-of-N scored by the PRM and ORM) are",
            "set algorithm.sampler_type=sample")
    require(bool(algo.output_file) and "/" not in algo.output_file and "\\" not in algo.output_file,
            "algorithm.output_file", algo.output_file, "is not a file name",
            "give a bare name such as sampled.jsonl; it is written to the run directory")
    require(not cfg.trainer.warmup_steps, "trainer.warmup_steps", cfg.trainer.warmup_steps,
            "is set, but distill's SFT phases warm the learning rate up over their first tenth", "leave it at 0")
    ranks = plan["sampler"].world_size if cfg.backend.workers == "ray" else 1
    sft_phases = bool(algo.sft_steps or algo.warmup_sft_steps)
    require(not sft_phases or algo.sft_batch >= ranks, "algorithm.sft_batch", algo.sft_batch,
            f"is below the {ranks} SFT ranks (the sampler's)", f"raise it to at least {ranks}")
    tp = cfg.megatron.tensor_parallel_size if cfg.backend.train == "megatron" else 1
    require(not sft_phases or ranks % tp == 0, "megatron.tensor_parallel_size", tp,
            f"does not divide the {ranks} SFT ranks (the sampler's, 1 with backend.workers=local)",
            f"a size that divides {ranks}")


def main() -> None:
    driver_main(DistillConfig, validate, run, shown=("eval/", "total/", "sft/", "dataset"))


if __name__ == "__main__":
    main()
