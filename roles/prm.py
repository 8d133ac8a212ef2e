"""Process reward model (PRM): one score per reasoning step.

Steps: a completion is split at `step_separator` (default newline); blank pieces are
dropped. The final answer line (a piece starting with '####') is NOT a step by default —
the ORM judges the answer — and is the last step with `answer_as_step`; anything after it
is ignored either way. `split_steps` is the one place that does this, for every kind.

Kinds, chosen by `PRMConfig.kind`:

* 'arithmetic': a rule-based verifier for arithmetic chains. A step must read
  'a op b = c' (integers, possibly negative; op one of + - * /; '/' only exact division)
  and be arithmetically right. Chaining: from the second step on, `a` must be the previous
  step's result (the chains are evaluated left to right). When the prompt is itself a
  chain in the task's form ('((a+b)*c)-d', see algorithms/data/tasks.py) and `check_prompt` is
  on, step i must also use the prompt's i-th operator and operand, and there may be no
  more steps than the prompt has operations. A step scores 1.0 when it and every step
  before it are right, so scores are 0.0 from the first wrong step on. The answer step
  (with `answer_as_step`) is right when the chain so far is right and complete and the
  answer equals the last result.
* 'model': a causal LM with a scalar head (roles.scorer_model.ScalarHeadModel) read at the last
  separator token after each step; the score is sigmoid(scalar), trained with binary
  cross-entropy on 0/1 step labels by `train_steps` (a folder written by `save` as `model`
  brings its trained head).
* 'custom': `reward_fn`, a dotted path to fn(prompts, completions, references) ->
  list[list[float]].

`aggregate_steps` turns step scores into one score per completion (min, product, last, or
mean: partial credit, with the arithmetic verifier the fraction of steps right before the
first mistake; a completion without steps scores 0). No Ray here.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from roles.orm import load_reward_fn
from roles.scorer_model import HEAD_FILE, ScalarHeadModel, ScorerModelConfig, typed_config

KINDS = ("arithmetic", "model", "custom")
AGGREGATES = ("min", "product", "last", "mean")
ANSWER_MARK = "####"
STEP_RE = re.compile(r"^(-?\d+)\s*([-+*/])\s*(-?\d+)\s*=\s*(-?\d+)$")
# A prompt chain once parentheses and spaces are gone: n0 op1 n1 op2 n2 ...
CHAIN_RE = re.compile(r"^(-?\d+)((?:[-+*/]-?\d+)+)$")
LINK_RE = re.compile(r"([-+*/])(-?\d+)")


@dataclass
class PRMConfig(ScorerModelConfig):
    # What scores the steps: arithmetic | model | custom.
    kind: str = "arithmetic"
    # Text between steps.
    step_separator: str = "\n"
    # Treat the final '#### N' line as the last step (False: it is not a step).
    answer_as_step: bool = False
    # arithmetic: when the prompt is a chain in the task's form, steps must follow its operations.
    check_prompt: bool = True
    # One score per completion from its step scores (score()): min | product | last | mean.
    aggregate: str = "min"
    # custom: dotted path of fn(prompts, completions, references) -> list[list[float]].
    reward_fn: Optional[str] = None


def split_steps(completion: str, separator: str, answer_as_step: bool) -> List[str]:
    """Non-empty, stripped pieces before the answer line (plus that line if answer_as_step)."""
    steps: List[str] = []
    for piece in completion.split(separator):
        piece = piece.strip()
        if not piece:
            continue
        if piece.startswith(ANSWER_MARK):
            if answer_as_step:
                steps.append(piece)
            break
        steps.append(piece)
    return steps


def aggregate_steps(step_scores: Sequence[Sequence[float]], how: str = "min") -> List[float]:
    """One score per completion: the min, product, last or mean of its step scores (0 if none)."""
    if how not in AGGREGATES:
        raise ValueError(f"prm.aggregate='{how}'; choose one of {list(AGGREGATES)}")
    out = []
    for scores in step_scores:
        if not scores:
            out.append(0.0)
        elif how == "min":
            out.append(float(min(scores)))
        elif how == "product":
            out.append(float(math.prod(scores)))
        elif how == "mean":
            out.append(float(sum(scores) / len(scores)))
        else:
            out.append(float(scores[-1]))
    return out


def prompt_chain(prompt: str) -> Optional[Tuple[int, List[Tuple[str, int]]]]:
    """(first operand, [(op, operand), ...]) when the prompt is exactly the task's left-to-right
    form, e.g. '((31+8)-2)*16'; None otherwise (then only chaining is checked)."""
    text = "".join(prompt.split())
    m = CHAIN_RE.match(text.replace("(", "").replace(")", ""))
    if not m:
        return None
    first, links = int(m.group(1)), [(op, int(b)) for op, b in LINK_RE.findall(m.group(2))]
    # Only trust it when the parentheses say "left to right", as the task writes them.
    expr = str(first)
    for i, (op, b) in enumerate(links):
        expr = f"({expr}){op}{b}" if i > 0 else f"{expr}{op}{b}"
    return (first, links) if expr == text else None


def _apply(a: int, op: str, b: int) -> Optional[int]:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a // b if b != 0 and a % b == 0 else None


def verify_arithmetic(steps: Sequence[str], prompt: str, check_prompt: bool, answer_as_step: bool) -> List[float]:
    """Step scores of an arithmetic chain (see the module docstring for the rules)."""
    chain = prompt_chain(prompt) if check_prompt else None
    scores: List[float] = []
    prev: Optional[int] = None
    ok = True
    for i, step in enumerate(steps):
        if ok and answer_as_step and i == len(steps) - 1 and step.startswith(ANSWER_MARK):
            answer = step[len(ANSWER_MARK):].strip().replace(",", "").rstrip(".")
            complete = chain is None or i == len(chain[1])
            ok = prev is not None and complete and re.fullmatch(r"-?\d+", answer) is not None and int(answer) == prev
        elif ok:
            m = STEP_RE.match(step)
            ok = m is not None
            if ok:
                a, op, b, c = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
                ok = _apply(a, op, b) == c
                if prev is not None:
                    ok = ok and a == prev
                if chain is not None:
                    expected_a = chain[0] if i == 0 else prev
                    ok = ok and i < len(chain[1]) and (a, op, b) == (expected_a, *chain[1][i])
                prev = c
        scores.append(1.0 if ok else 0.0)
    return scores


class PRM:
    """Step scores: `score_steps(prompts, completions, references=None) -> list[list[float]]`."""
    # No state a fresh rank could not get back (weights: its model path or a sync), so a lost
    # rank may be replaced (orchestration.launch.restartable).
    RESTARTABLE = True

    def __init__(self, config: PRMConfig | Mapping[str, Any] | None = None, **overrides: Any):
        self.config = cfg = typed_config(PRMConfig, config, overrides, "prm")
        if cfg.kind not in KINDS:
            raise ValueError(f"prm.kind='{cfg.kind}'; choose one of {list(KINDS)}")
        if cfg.aggregate not in AGGREGATES:
            raise ValueError(f"prm.aggregate='{cfg.aggregate}'; choose one of {list(AGGREGATES)}")
        if not cfg.step_separator:
            raise ValueError("prm.step_separator is empty; use e.g. '\\n'")
        self.reward_fn = load_reward_fn(cfg.reward_fn, "prm.reward_fn") if cfg.kind == "custom" else None
        self.model = None
        if cfg.kind == "model":
            self.model = ScalarHeadModel(cfg.model, cfg.device, cfg.seed, cfg.use_chat_template, cfg.lr,
                                         cfg.weight_decay, cfg.max_grad_norm, cfg.micro_batch)
            # A folder written by PRM.save (HEAD_FILE beside the weights) brings its trained head.
            folder = cfg.model if isinstance(cfg.model, (str, os.PathLike)) else None
            if folder is not None and os.path.isfile(os.path.join(folder, HEAD_FILE)):
                self.model.load(folder)
            self.separator_ids = self.model.text_ids(cfg.step_separator)
            if not self.separator_ids:
                raise ValueError(f"prm.step_separator={cfg.step_separator!r} encodes to no tokens")

    def steps(self, completion: str) -> List[str]:
        return split_steps(completion, self.config.step_separator, self.config.answer_as_step)

    def score_steps(self, prompts: Sequence[str], completions: Sequence[str],
                    references: Optional[Sequence[Optional[str]]] = None) -> List[List[float]]:
        """One list per completion with one score per step (see `steps`)."""
        n = len(completions)
        if len(prompts) != n or (references is not None and len(references) != n):
            raise ValueError(f"prm.score_steps needs one prompt (and reference) per completion; got "
                             f"{len(prompts)} prompts, {n} completions")
        cfg = self.config
        if cfg.kind == "arithmetic":
            return [verify_arithmetic(self.steps(c), p, cfg.check_prompt, cfg.answer_as_step)
                    for p, c in zip(prompts, completions)]
        if cfg.kind == "custom":
            refs = list(references) if references is not None else [None] * n
            out = [[float(x) for x in s] for s in self.reward_fn(list(prompts), list(completions), refs)]
            if len(out) != n:
                raise ValueError(f"prm.reward_fn='{cfg.reward_fn}' returned {len(out)} score lists for {n} completions")
            return out
        return self._model_scores(prompts, completions)

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              references: Optional[Sequence[Optional[str]]] = None) -> List[float]:
        """One score per completion: the step scores aggregated by `aggregate`."""
        return aggregate_steps(self.score_steps(prompts, completions, references), self.config.aggregate)

    # -------------------------------------------------------------------------- model

    def _encode(self, prompt: str, completion: str) -> Tuple[List[int], List[int]]:
        """Prompt, then each step followed by the separator; returns (ids, position of the
        last separator token after each step). Steps are encoded one by one, so a step's
        score position does not depend on how the tokenizer would merge across steps."""
        m = self.model
        ids, positions = m.prompt_ids(prompt), []
        for step in self.steps(completion):
            ids = ids + m.text_ids(step) + self.separator_ids
            positions.append(len(ids) - 1)
        if m.max_length and len(ids) > m.max_length:
            raise ValueError(f"prompt + steps take {len(ids)} tokens, more than the model's "
                             f"max_position_embeddings={m.max_length}")
        return ids, positions

    def _step_logits(self, encoded: List[Tuple[List[int], List[int]]]) -> List[torch.Tensor]:
        values = self.model.values([ids for ids, _ in encoded])
        return [values[i, pos] for i, (_, pos) in enumerate(encoded)]

    @torch.no_grad()
    def _model_scores(self, prompts: Sequence[str], completions: Sequence[str]) -> List[List[float]]:
        self.model.eval()
        encoded, mb = [self._encode(p, c) for p, c in zip(prompts, completions)], self.model.micro_batch
        out: List[List[float]] = []
        for i in range(0, len(encoded), mb):
            out += [torch.sigmoid(logits).tolist() for logits in self._step_logits(encoded[i:i + mb])]
        return out

    def _require_model(self, method: str) -> ScalarHeadModel:
        if self.model is None:
            raise ValueError(f"prm.{method} needs a model; prm.kind='{self.config.kind}' has none "
                             "(set prm.kind=model and prm.model)")
        return self.model

    def train_steps(self, prompts: Sequence[str], completions: Sequence[str],
                    labels: Sequence[Sequence[float]]) -> Dict[str, float]:
        """One AdamW step on binary cross-entropy between each step's scalar and its 0/1
        label (one label per step of `steps(completion)`), averaged over all steps."""
        m = self._require_model("train_steps")
        if not (len(prompts) == len(completions) == len(labels)):
            raise ValueError("train_steps needs one prompt and one label list per completion")
        encoded = [self._encode(p, c) for p, c in zip(prompts, completions)]
        for i, ((_, pos), lab) in enumerate(zip(encoded, labels)):
            if len(pos) != len(lab):
                raise ValueError(f"completion {i} has {len(pos)} steps but {len(lab)} labels")
        total = sum(len(lab) for lab in labels)
        if total == 0:
            raise ValueError("train_steps got no labelled steps")
        m.train()
        loss_sum = correct = 0.0
        for i in range(0, len(encoded), m.micro_batch):
            logits = torch.cat(self._step_logits(encoded[i:i + m.micro_batch]))
            target = torch.tensor([x for lab in labels[i:i + m.micro_batch] for x in lab],
                                  dtype=torch.float32, device=logits.device)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="sum")
            (loss / total).backward()
            loss_sum += loss.item()
            correct += ((logits > 0) == (target > 0.5)).sum().item()
        grad_norm = m.optimizer_step()
        m.eval()
        return {"loss": loss_sum / total, "accuracy": correct / total, "grad_norm": grad_norm,
                "steps_labelled": float(total), "step": float(m.step)}

    def save(self, out_dir: str | os.PathLike) -> Path:
        return self._require_model("save").save(out_dir)

    def load(self, in_dir: str | os.PathLike) -> None:
        self._require_model("load").load(in_dir)
