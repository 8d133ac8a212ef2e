"""GRPO's SFT warm start (algorithm.warmup_sft_steps): the rows it trains on (the task's
reference solutions as single-turn rows; with a multi-turn gym environment or tools, multi-turn
and tool rows holding the turns of a rollout, encoded exactly as the rollout encodes a
trajectory) and the trainer section it trains with. The SFT run itself is algorithms/grpo.py's
`warm_start`. `cfg` here is a GRPOConfig, typed Any: a runtime module imports no driver.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from algorithms.config.schema import warmup_steps
from algorithms.data.loading import load_task
from algorithms.data.tasks import ANSWER_PREFIX, CHAT_ROLES, wrong_solution
from algorithms.runtime.trajectories import row_columns
from roles.multi_turn import MultiTurnConfig
from roles.plugins import GymEnv, envs, load_plugin
from roles.schedulers import resolve_tool
from roles.trainer_config import every_weight

logger = logging.getLogger(__name__)


def warmup_rows(data: Any, examples: int) -> dict:
    """The data. keys capping the warm start at `examples` rows (0: all): a generated task
    draws that many, a user's file is read that far."""
    if not examples:
        return {}
    return {"max_rows": examples} if data.task == "files" else {"train_size": examples}


def warm_start_trainer(cfg: Any) -> Any:
    """The trainer section of the SFT warm start: GRPO's, with the warm start's own learning
    rate, schedule and batch, training every weight (with trainer.lora, GRPO's adapter then goes
    onto the warm-started model)."""
    a = cfg.algorithm
    return replace(every_weight(cfg.trainer), lr=a.warmup_sft_lr, warmup_steps=warmup_steps(a.warmup_sft_steps),
                   total_steps=a.warmup_sft_steps, schedule=a.warmup_sft_schedule,
                   micro_batch_per_device=a.warmup_sft_batch)


# How the warm start reads the rows it writes: as a user's files, whole (no renames, no row cap).
WARM_ROWS = {"task": "files", "max_rows": None, "columns": {}}


def multi_turn_rows(examples: list, multi_turn: MultiTurnConfig, seed: int) -> tuple[list, int]:
    """SFT rows (chat `messages`) of the multi-turn warm start, in the turns a rollout of
    `multi_turn`'s gym environment holds: per example the environment's first observation and
    the reference reply, then for a wrong first reply and for the right one, when the
    environment answers it, (prompt, that reply, the environment's answer, the reference
    reply), whose loss is on the last reply (the first is context). Returns the rows and how
    many are multi-turn; an environment that is not a GymEnv gives single-turn rows."""
    rng, rows, multi = random.Random(seed), [], 0
    for i, ex in enumerate(examples):
        if not issubclass(envs[multi_turn.gym_env], GymEnv):
            rows.append({"messages": ex.messages()})
            continue
        right = {"role": "assistant", "content": ex.solution}
        for tried in (None, wrong_solution(ex, rng), ex.solution):
            env = envs[multi_turn.gym_env]({"seed": seed + i})
            question = {"role": "user", "content": _done(env.reset(row_columns(ex)))}
            if tried is None:
                rows.append({"messages": [question, right]})
                continue
            reply, _, done, _ = _done(env.step(tried))
            if not done and isinstance(reply, str):
                multi += 1
                rows.append({"messages": [question, {"role": "assistant", "content": tried},
                                          {"role": "user", "content": reply}, right]})
    return rows, multi


def tool_rows(examples: list, multi_turn: MultiTurnConfig) -> tuple[list, int]:
    """SFT rows (chat `messages`) of the warm start with tools (multi_turn.scheduler `tools`),
    with the call of the first tool of `multi_turn.tools` that passes the question as its one
    argument, in the Hermes form the tools scheduler reads: per example (question, the call,
    the tool's own result in a `tool_role` turn, '#### <result>'), whose loss is on the answer,
    and a first reply: every other example the reference reply, the others the call (question,
    the call). So the first reply calls the tool half the time, every example teaches the use
    of the result, and each row holds the turns of a rollout that says those replies. An
    example whose tool result is not its reference answer is answered directly. Returns the
    rows and how many hold the tool's result."""
    name = multi_turn.tools[0]
    fn = resolve_tool(name)
    if multi_turn.tool_role not in CHAT_ROLES:
        raise ValueError(f"algorithm.multi_turn.tool_role={multi_turn.tool_role!r}: the warm start's rows hold chat "
                         f"roles {list(CHAT_ROLES)} only. Fix: set algorithm.multi_turn.tool_role=user, or "
                         "algorithm.warmup_sft_steps=0")
    param = next(iter(inspect.signature(fn).parameters))
    rows, multi = [], 0
    for i, ex in enumerate(examples):
        call = {"role": "assistant", "content": "<tool_call>" + json.dumps(
            {"name": name.rpartition(".")[2], "arguments": {param: ex.prompt}}) + "</tool_call>"}
        try:
            result = fn(**{param: ex.prompt})
        except Exception:  # a question the tool cannot read: answered directly
            result = None
        result = result if isinstance(result, str) or result is None else json.dumps(result, default=str)
        if result is None or result.strip() != ex.answer:
            rows.append({"messages": ex.messages()})
            continue
        multi += 1
        rows += [{"messages": ex.messages() if i % 2 == 0 else [*ex.prompt_messages(), call]},
                 {"messages": [*ex.prompt_messages(), call, {"role": multi_turn.tool_role, "content": result},
                               {"role": "assistant", "content": ANSWER_PREFIX + result}]}]
    return rows, multi


def _done(value: Any) -> Any:
    """An environment call's result (its plain or async method)."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


def warm_start_data(cfg: Any, out_dir: Path) -> Any:
    """The data section of the warm start: the task's first warmup_sft_examples rows; with a
    multi-turn gym environment (multi_turn.scheduler gym_scheduler) or tools (scheduler tools),
    those rows as `multi_turn_rows` or `tool_rows` written to out_dir (held out: the task's
    held-out prompts, single-turn)."""
    a, mt = cfg.algorithm, cfg.algorithm.multi_turn
    data = replace(cfg.data, **warmup_rows(cfg.data, a.warmup_sft_examples))
    gym = mt.scheduler == "gym_scheduler" and mt.gym_env
    if not gym and not (mt.enabled and mt.scheduler_name == "tools" and mt.tools):
        return data
    for path in mt.plugins:
        load_plugin(path)
    labelled, held, _ = load_task(data)
    rows, multi = multi_turn_rows(labelled, mt, cfg.run.seed) if gym else tool_rows(labelled, mt)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows), ("held_out", [{"messages": ex.messages()} for ex in held])):
        with open(out_dir / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    logger.info(f"grpo: multi-turn warm start on {len(rows)} rows ({multi} with " + (
        f"a first try and the '{mt.gym_env}' environment's answer" if gym else f"the tool {mt.tools[0]}'s result")
        + f") in {out_dir}")
    # (No held-out prompt: no evaluation, data.val_split=0.)
    return replace(cfg.data, **WARM_ROWS, paths=[str(out_dir / "train.jsonl")],
                   val_paths=[str(out_dir / "held_out.jsonl")] if held else [], val_split=None if held else 0.0,
                   eval_size=len(held))
