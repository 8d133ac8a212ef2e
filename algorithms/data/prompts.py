"""How examples become what the roles read: prompts rendered as the rollout renders them
(data.chat: the tokenizer's chat template or plain text; data.enable_thinking: the
template's thinking switch), dataset replies encoded as
completions, batches padded from completions, and the endless shuffled prompt stream whose
position a resumed run continues from."""
from __future__ import annotations

import random
from typing import Any, Optional

from algorithms.data.tasks import Example
from orchestration.config import ConfigError
from roles.batch import Batch, Completions, batch_from_completions
from roles.rollout import prompt_text, prompt_token_ids, template_switches, uses_template


def template_on(tokenizer: Any, chat: Optional[bool]) -> bool:
    """Whether the run renders prompts with `tokenizer`'s chat template, as data.chat says
    (null: when it has one); data.chat=true without a template is refused."""
    try:
        return uses_template(tokenizer, chat, "data.chat")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def chat_prompt(tokenizer: Any, ex: Example, chat: Optional[bool] = None,
                enable_thinking: Optional[bool] = None) -> str:
    """An example's prompt as the rollout renders it (data.chat, data.enable_thinking): chat
    template with the generation prompt, or plain text."""
    return prompt_text(tokenizer, ex.prompt_messages(), template_on(tokenizer, chat), enable_thinking)


def chat_texts(tokenizer: Any, ex: Example, chat: Optional[bool] = None,
               enable_thinking: Optional[bool] = None) -> tuple[str, str]:
    """(prompt, whole conversation with the reply) of an example, rendered as training reads
    them; plain text: the prompt followed by the reply (encode_examples adds the eos token)."""
    prompt = chat_prompt(tokenizer, ex, chat, enable_thinking)
    if template_on(tokenizer, chat):
        return prompt, tokenizer.apply_chat_template(ex.messages(), tokenize=False,
                                                     **template_switches(enable_thinking))
    return prompt, prompt + ex.solution


def encode_examples(tokenizer: Any, examples: list[Example], pretrain: bool,
                    chat: Optional[bool] = None, enable_thinking: Optional[bool] = None) -> Completions:
    """Dataset responses as completions: prompt ids + response ids + eos, the prompt rendered
    as the rollout renders it (`chat`: data.chat; `enable_thinking`: data.enable_thinking). An example with `max_tokens` (a conversation
    too long for the run) is cut to that many tokens: its end, or its start with `cut_left`. With `pretrain` every token but the first is
    a completion token (SFT's algorithm.pretrain)."""
    template = template_on(tokenizer, chat)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    prompt_ids, completion_ids = [], []
    for ex in examples:
        p = prompt_token_ids(tokenizer, prompt_text(tokenizer, ex.prompt_messages(), template, enable_thinking),
                             template)
        if template:
            whole = tokenizer.apply_chat_template(ex.messages(), tokenize=False, **template_switches(enable_thinking))
            f = tokenizer(whole, add_special_tokens=False)["input_ids"]
            if f[:len(p)] != p:  # the template must extend the prompt; else train on the whole text
                p = []
        else:
            # Plain text: the reply's own tokens after the prompt's, as generation continues them,
            # and eos so that generation learns to stop.
            f = p + tokenizer(ex.solution, add_special_tokens=False)["input_ids"] + eos
        if pretrain:
            p, f = f[:1], f
        if ex.max_tokens is not None and ex.cut_left:
            # The conversation's first tokens go: the prompt's, then the reply's if need be.
            cut = max(0, len(f) - ex.max_tokens)
            f, p = f[cut:], p[cut:]
        elif ex.max_tokens is not None:
            # Cut like a max_length truncation: the reply's end goes, no eos is added.
            f = f[:ex.max_tokens]
        prompt_ids.append(p)
        completion_ids.append(f[len(p):])
    n = len(examples)
    return Completions(list(range(n)), prompt_ids, completion_ids, [""] * n, [], ["stop"] * n, [0] * n)


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
