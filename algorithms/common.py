"""Pieces every driver uses: encoding examples into batches, the prompt stream, eval
accuracy, the warm-up rule of inner SFT phases, restarts after a lost worker (events.jsonl),
and the Hydra entry-point wrapper that turns config errors into one line. Turn-taking, weight
sync and the end of a step: algorithms/turns.py."""
from __future__ import annotations

import functools
import json
import logging
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from algorithms.tasks import Example
from roles.batch import Batch, Completions, batch_from_completions
from roles.batch import SamplingParams
from roles.orm import ORM


def chat_prompt(tokenizer: Any, ex: Example) -> str:
    """An example's prompt as the rollout encodes it: chat-rendered with the generation prompt."""
    return tokenizer.apply_chat_template(ex.prompt_messages(), add_generation_prompt=True, tokenize=False)


def chat_texts(tokenizer: Any, ex: Example) -> tuple[str, str]:
    """(prompt, whole conversation with the reply) of an example, rendered as training reads them."""
    return chat_prompt(tokenizer, ex), tokenizer.apply_chat_template(ex.messages(), tokenize=False)


def encode_examples(tokenizer: Any, examples: list[Example], pretrain: bool) -> Completions:
    """Dataset responses as completions: chat-rendered prompt ids + response ids + eos. An
    example with `max_tokens` (a reply too long for the run) is cut to that many tokens.
    With `pretrain` every token but the first is a completion token (SFT's algorithm.pretrain)."""
    prompt_ids, completion_ids = [], []
    for ex in examples:
        prompt, full = chat_texts(tokenizer, ex)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        f = tokenizer(full, add_special_tokens=False)["input_ids"]
        if f[:len(p)] != p:  # the template must extend the prompt; else train on the whole text
            p = []
        if pretrain:
            p, f = f[:1], f
        if ex.max_tokens is not None:
            # Cut like a max_length truncation: the reply's end goes, no eos is added.
            f = f[:ex.max_tokens]
        prompt_ids.append(p)
        completion_ids.append(f[len(p):])
    n = len(examples)
    return Completions(list(range(n)), prompt_ids, completion_ids, [""] * n, [], ["stop"] * n, [0] * n)


def record_data_stats(log: Any, stats: dict, resume: Any) -> None:
    """load_task's counts into the run's step-0 record (RunLog sums added values into the next
    record it writes). A run resuming from a checkpoint has its step-0 record already."""
    from algorithms.checkpoints import find_resume

    if find_resume(log.dir, resume, report=lambda _: None) is None:
        for key, value in stats.items():
            log.add(key, value)


def batch_of(tokenizer: Any, completions: Completions) -> Batch:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return batch_from_completions(completions, pad)


class PromptStream:
    """Endless shuffled epochs of `per_step` examples. `drawn` counts the batches handed out;
    a stream made with `skip=k` continues exactly where one that handed out k batches stood
    (the same epoch, order and offset), which is how a resumed run gets the same prompts."""

    def __init__(self, examples: list[Example], per_step: int, seed: int, skip: int = 0):
        self.examples, self.per_step = examples, per_step
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self.drawn = 0
        for _ in range(skip):
            self._next_indices()

    def _next_indices(self) -> list[int]:
        if len(self._order) < self.per_step:
            fresh = list(range(len(self.examples)))
            self._rng.shuffle(fresh)
            self._order += fresh
        picked, self._order = self._order[:self.per_step], self._order[self.per_step:]
        self.drawn += 1
        return picked

    def __iter__(self) -> "PromptStream":
        return self

    def __next__(self) -> list[Example]:
        return [self.examples[i] for i in self._next_indices()]


# The task's "#### N" answer check, for the accuracies every driver logs.
NUMERIC = ORM(kind="numeric")


def accuracy(rollout: Any, examples: list[Example], max_new_tokens: int) -> float:
    """Greedy accuracy on `examples`: the completion's '#### N' equals the reference answer."""
    prompts = [ex.prompt_messages() for ex in examples]
    comps = rollout.call("generate", prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
                         dispatch="slice", collect="flatten")
    scores = NUMERIC.score([ex.prompt for ex in examples], comps.texts, [ex.answer for ex in examples])
    return sum(scores) / max(len(scores), 1)


def first(results: list) -> Any:
    """collect= for calls whose ranks all return the same (already all-reduced) value."""
    return results[0]


def warmup_steps(steps: int) -> int:
    """Learning-rate warm-up of an SFT phase inside another run (GRPO's warm start, GKD's
    teacher, distill's SFT): a tenth of its steps, at most 20."""
    return min(20, steps // 10)


def record_event(out_dir: Any, event: dict) -> None:
    """One line of <run dir>/events.jsonl (restarts: what was lost, where, when)."""
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **event}
    with open(Path(out_dir) / "events.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def run_with_restarts(run: Callable, cfg: Any, plan: Any, out_dir: Any, resolved: Any = None) -> dict:
    """`run(cfg, plan, out_dir, resolved)`; a rank lost beyond what its group replaces (a
    trainer rank, or a role's restarts used up) restarts every role from the run's newest
    checkpoint, up to run.max_restarts times."""
    from orchestration.base_group import WorkerError

    left = cfg.run.max_restarts
    while True:
        try:
            return run(cfg, plan, out_dir, resolved)
        except WorkerError as e:
            if not e.lost or left <= 0:
                raise
            left -= 1
            logging.getLogger(__name__).warning(f"{e.role} rank {e.rank} was lost in {e.method}(); restarting every "
                                                f"role from the newest checkpoint ({left} restart(s) left)")
            record_event(out_dir, {"event": "restart", "scope": "run", "role": e.role, "rank": e.rank,
                                   "method": e.method, "error": str(e).splitlines()[0]})
            cfg = replace(cfg, run=replace(cfg.run, resume="auto"))


def friendly_errors(main: Callable) -> Callable:
    """Config, plan, data and placement errors exit 2 with one line naming the key and the fix."""
    from orchestration.config import ConfigError
    from orchestration.placement import PlacementError
    from orchestration.planner import PlanError

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (ConfigError, PlanError, PlacementError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper
