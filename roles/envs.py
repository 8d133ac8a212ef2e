"""Built-in environments (registered in roles.plugins.envs), for the shipped multi-turn example:

* `arithmetic_retry`: the row's own question; a wrong '#### N' answer is told whether the
  right one is higher or lower and gets one more try. Reward 1 for a right answer (in either
  turn), else 0; `env_reward: final` makes a trajectory's reward its success.
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from roles.orm import extract_answer, reference_number
from roles.plugins import GymEnv, envs


class ArithmeticRetry(GymEnv):

    def reset(self, row: Dict[str, Any]) -> str:
        self.want = reference_number(str(row["solution"]))
        return row["messages"][-1]["content"]

    def step(self, action: str) -> Tuple[str, float, bool, Dict[str, Any]]:
        got = extract_answer(action, fallback_last_number=True)
        if got is not None and self.want is not None and abs(got - self.want) < 1e-6:
            return "", 1.0, True, {"status": "right"}
        hint = "no answer found" if got is None else "too high" if got > self.want else "too low"
        return f"Wrong ({hint}). Try again.", 0.0, False, {"status": "wrong"}


envs["arithmetic_retry"] = ArithmeticRetry
