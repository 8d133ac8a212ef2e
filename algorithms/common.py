"""Pieces every driver uses: rendering prompts (data.chat) and encoding examples into
batches, the prompt stream, the answer check of every accuracy (data.check), the warm-up rule
of inner SFT phases, restarts after a lost worker (events.jsonl), and the Hydra entry-point
wrapper that turns config errors into one line. Turn-taking, weight sync and the end of a
step: algorithms/turns.py."""
from __future__ import annotations

import functools
import json
import logging
import random
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

from algorithms.tasks import Example
from roles.batch import Batch, Completions, batch_from_completions
from roles.batch import SamplingParams
from orchestration.config import ConfigError
from roles.orm import ANSWER_KINDS, ORM, compile_pattern
from roles.rollout import prompt_text, prompt_token_ids, uses_template


def template_on(tokenizer: Any, chat: Optional[bool]) -> bool:
    """Whether the run renders prompts with `tokenizer`'s chat template, as data.chat says
    (null: when it has one); data.chat=true without a template is refused."""
    try:
        return uses_template(tokenizer, chat, "data.chat")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def chat_prompt(tokenizer: Any, ex: Example, chat: Optional[bool] = None) -> str:
    """An example's prompt as the rollout renders it (data.chat): chat template with the
    generation prompt, or plain text."""
    return prompt_text(tokenizer, ex.prompt_messages(), template_on(tokenizer, chat))


def chat_texts(tokenizer: Any, ex: Example, chat: Optional[bool] = None) -> tuple[str, str]:
    """(prompt, whole conversation with the reply) of an example, rendered as training reads
    them; plain text: the prompt followed by the reply (encode_examples adds the eos token)."""
    prompt = chat_prompt(tokenizer, ex, chat)
    if template_on(tokenizer, chat):
        return prompt, tokenizer.apply_chat_template(ex.messages(), tokenize=False)
    return prompt, prompt + ex.solution


def encode_examples(tokenizer: Any, examples: list[Example], pretrain: bool,
                    chat: Optional[bool] = None) -> Completions:
    """Dataset responses as completions: prompt ids + response ids + eos, the prompt rendered
    as the rollout renders it (`chat`: data.chat). An example with `max_tokens` (a reply too
    long for the run) is cut to that many tokens. With `pretrain` every token but the first is
    a completion token (SFT's algorithm.pretrain)."""
    template = template_on(tokenizer, chat)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    prompt_ids, completion_ids = [], []
    for ex in examples:
        p = prompt_token_ids(tokenizer, prompt_text(tokenizer, ex.prompt_messages(), template), template)
        if template:
            f = tokenizer(tokenizer.apply_chat_template(ex.messages(), tokenize=False),
                          add_special_tokens=False)["input_ids"]
            if f[:len(p)] != p:  # the template must extend the prompt; else train on the whole text
                p = []
        else:
            # Plain text: the reply's own tokens after the prompt's, as generation continues them,
            # and eos so that generation learns to stop.
            f = p + tokenizer(ex.solution, add_special_tokens=False)["input_ids"] + eos
        if pretrain:
            p, f = f[:1], f
        if ex.max_tokens is not None:
            # Cut like a max_length truncation: the reply's end goes, no eos is added.
            f = f[:ex.max_tokens]
        prompt_ids.append(p)
        completion_ids.append(f[len(p):])
    n = len(examples)
    return Completions(list(range(n)), prompt_ids, completion_ids, [""] * n, [], ["stop"] * n, [0] * n)


def rollout_config(cfg: Any) -> dict:
    """A driver's rollout section with data.chat, so that every rollout and sampler of the run
    renders prompts as training does. rollout.chat set otherwise, or data.chat=true for a
    tokenizer without a template, is refused."""
    from algorithms.config import as_dict
    from roles.models import load_tokenizer

    chat, own = cfg.data.chat, cfg.rollout.chat
    if own is not None and own != chat:
        raise ConfigError(f"config key 'rollout.chat'={own} differs from data.chat={chat}; a run renders its "
                          f"prompts as data.chat says. Fix: set data.chat={str(own).lower()} and leave "
                          "rollout.chat unset")
    template_on(load_tokenizer(cfg.model), chat)
    return {**as_dict(cfg.rollout), "chat": chat}


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


def check_orm_config(data: Any = None, check: Optional[str] = None) -> dict:
    """The ORM config (roles/orm.py) of data.check, or of `check` (a kind of ANSWER_KINDS or a
    dotted path) with data's pattern: what every logged accuracy and GRPO's `accuracy` reward
    score with. `data`: the run's DataConfig; None: its defaults."""
    if data is None:
        from algorithms.data import DataConfig
        data = DataConfig()
    check = check or data.check
    if check == "regex":
        return {"kind": "regex", "answer_pattern": data.check_pattern}
    if check in ANSWER_KINDS:
        return {"kind": check}
    return {"kind": "custom", "reward_fn": check}


def validate_check(data: Any, check: Optional[str] = None) -> None:
    """data.check (or `check`, a GRPO reward named by kind) can score: a known kind, a regex
    that compiles, a dotted path that imports."""
    from algorithms.validation import check_importable, require

    check = check or data.check
    require(check != "model", "data.check", check, "is not offered: a reward model's score ranks replies, it does "
            "not say right or wrong", "use a dotted path 'pkg.mod.fn' to fn(prompts, completions, references) -> "
            "list[float] giving 1.0 for a right reply (it may ask a judge model)")
    require(check in ANSWER_KINDS or "." in check, "data.check", check, "is not a check",
            f"use one of {list(ANSWER_KINDS)} or a dotted path 'pkg.mod.fn' to fn(prompts, completions, "
            "references) -> list[float]")
    if check not in ANSWER_KINDS:
        check_importable("data.check", check)
    if check == "regex":
        try:
            compile_pattern(data.check_pattern, "data.check_pattern")
        except ValueError as e:
            require(False, "data.check_pattern", data.check_pattern, f"does not serve check=regex ({e})",
                    r"set it to a regular expression whose first group is the answer, e.g. 'answer: (\S+)'")


def checker(data: Any = None) -> ORM:
    """The scorer of data.check (`data`: the run's DataConfig; None: its defaults)."""
    return ORM(check_orm_config(data))


def reference(ex: Example) -> str:
    """What a reply is checked against: the example's final answer, else its whole solution
    (a bare answer like '47')."""
    return ex.answer or ex.solution


def correct(check: ORM, examples: list[Example], texts: list[str]) -> list[float]:
    """data.check's score of each reply; `texts` holds the same number of replies per example,
    consecutive."""
    n = len(texts) // max(len(examples), 1)
    return check.score([ex.prompt for ex in examples for _ in range(n)], texts,
                       [reference(ex) for ex in examples for _ in range(n)])


def accuracy(rollout: Any, examples: list[Example], max_new_tokens: int, data: Any = None) -> float:
    """Greedy accuracy on `examples`: the mean data.check score of the replies (`data`: the
    run's DataConfig; None: its defaults)."""
    prompts = [ex.prompt_messages() for ex in examples]
    comps = rollout.call("generate", prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
                         dispatch="slice", collect="flatten")
    scores = correct(checker(data), examples, comps.texts)
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


def run_with_restarts(run: Callable, cfg: Any, plan: Any, out_dir: Any) -> dict:
    """`run(cfg, plan, out_dir)`; a rank lost beyond what its group replaces (a
    trainer rank, or a role's restarts used up) restarts every role from the run's newest
    checkpoint, up to run.max_restarts times."""
    from orchestration.base_group import WorkerError

    left = cfg.run.max_restarts
    while True:
        try:
            return run(cfg, plan, out_dir)
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
