"""Built-in environments (registered in roles.plugins.envs) and tools (roles.plugins.tools), for
the shipped multi-turn examples:

* `arithmetic_retry`: the row's own question; a wrong '#### N' answer is told whether the
  right one is higher or lower and gets one more try. Reward 1 for a right answer (in either
  turn), else 0; `env_reward: final` makes a trajectory's reward its success.
* `arithmetic_hint`: a tutor for arithmetic chains ("(3+4)+5"): after the first answer it
  shows the chain's first step ("Hint: 3+4=7"), and the second answer, which has one step left
  to compute, is graded: reward 1 when it is right, else 0 (the first answer earns nothing, so
  a lucky first try is no better than a wrong one: the hint's use is what pays).

* `calculator(expression)`: the value of an integer expression of + - * and parentheses
  ("23*45" -> "1035"), read as a syntax tree (no code runs); anything else is a ValueError,
  which the model reads as an error turn.

GRPO's multi-turn warm start (algorithms/runtime/warm_start.py `multi_turn_rows`, `tool_rows`) asks the
environment or the tool itself what it says to a reply, so its SFT rows hold the turns a rollout
sees.
"""
from __future__ import annotations

import ast
import operator
import re
from typing import Any, Dict, Tuple

from roles.orm import extract_answer, reference_number
from roles.plugins import GymEnv, envs, tools

# A chain's first step: the innermost 'a op b' of its prompt ("(3+4)*5" -> 3, +, 4).
FIRST_STEP = re.compile(r"(\d+)\s*([-+*])\s*(\d+)")


class ArithmeticRetry(GymEnv):

    def reset(self, row: Dict[str, Any]) -> str:
        self.want = reference_number(str(row["solution"]))
        return row["messages"][-1]["content"]

    def right(self, action: str) -> bool:
        got = extract_answer(action, fallback_last_number=True)
        return got is not None and self.want is not None and abs(got - self.want) < 1e-6

    def step(self, action: str) -> Tuple[str, float, bool, Dict[str, Any]]:
        if self.right(action):
            return "", 1.0, True, {"status": "right"}
        got = extract_answer(action, fallback_last_number=True)
        hint = "no answer found" if got is None else "too high" if got > self.want else "too low"
        return f"Wrong ({hint}). Try again.", 0.0, False, {"status": "wrong"}


class ArithmeticHint(ArithmeticRetry):

    def reset(self, row: Dict[str, Any]) -> str:
        question = super().reset(row)
        m = FIRST_STEP.search(question)
        if m is None:
            raise ValueError(f"arithmetic_hint reads arithmetic chains such as '(3+4)*5'; the prompt {question!r} "
                             "has no 'a op b' step")
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        self.first = f"{a}{op}{b}={a + b if op == '+' else a - b if op == '-' else a * b}"
        self.hinted = False
        return question

    def step(self, action: str) -> Tuple[str, float, bool, Dict[str, Any]]:
        if not self.hinted:
            self.hinted = True
            return f"Hint: {self.first}", 0.0, False, {"status": "hinted"}
        right = self.right(action)
        return "", float(right), True, {"status": "right" if right else "wrong"}


# The calculator's operators.
CALCULATOR_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
# Longest expression the calculator reads (a model's runaway call is an error, not a slow tool).
CALCULATOR_MAX_CHARS = 64


def calculator(expression: str) -> str:
    """The value of an integer expression of + - * and parentheses, as text."""
    if not isinstance(expression, str) or len(expression) > CALCULATOR_MAX_CHARS:
        raise ValueError(f"the calculator reads a text of at most {CALCULATOR_MAX_CHARS} characters")

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in CALCULATOR_OPS:
            return CALCULATOR_OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"the calculator reads integers, + - * and parentheses, not {ast.dump(node)[:40]}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {expression!r}") from e
    return str(value(tree.body))


envs["arithmetic_retry"] = ArithmeticRetry
envs["arithmetic_hint"] = ArithmeticHint
tools["calculator"] = calculator
