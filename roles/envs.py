"""Built-in environments (registered in roles.plugins.envs), for the shipped multi-turn examples:

* `arithmetic_retry`: the row's own question; a wrong '#### N' answer is told whether the
  right one is higher or lower and gets one more try. Reward 1 for a right answer (in either
  turn), else 0; `env_reward: final` makes a trajectory's reward its success.
* `arithmetic_hint`: a tutor for arithmetic chains ("(3+4)+5"): after the first answer it
  shows the chain's first step ("Hint: 3+4=7"), and the second answer, which has one step left
  to compute, is graded: reward 1 when it is right, else 0 (the first answer earns nothing, so
  a lucky first try is no better than a wrong one: the hint's use is what pays).

GRPO's multi-turn warm start (algorithms/grpo.py `multi_turn_rows`) asks the environment itself
what it says to a first reply, so its SFT rows hold the turns a rollout sees.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Tuple

from roles.orm import extract_answer, reference_number
from roles.plugins import GymEnv, envs

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


envs["arithmetic_retry"] = ArithmeticRetry
envs["arithmetic_hint"] = ArithmeticHint
