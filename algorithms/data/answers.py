"""The answer check of every accuracy (data.check): the ORM that scores a reply right or wrong,
what a reply is checked against, and greedy accuracy on held-out examples."""
from __future__ import annotations

from typing import Any, Optional

from algorithms.data.loading import DataConfig
from algorithms.data.tasks import Example
from roles.batch import SamplingParams
from roles.orm import ANSWER_KINDS, ORM
from roles.plugins import is_plugin_spec


def check_orm_config(data: Any = None, check: Optional[str] = None) -> dict:
    """The ORM config (roles/orm.py) of data.check, or of `check` (a kind of ANSWER_KINDS or a
    dotted path) with data's pattern: what every logged accuracy and GRPO's `accuracy` reward
    score with. `data`: the run's DataConfig; None: its defaults."""
    if data is None:
        data = DataConfig()
    check = check or data.check
    if check == "regex":
        return {"kind": "regex", "answer_pattern": data.check_pattern}
    if check in ANSWER_KINDS:
        return {"kind": check}
    if is_plugin_spec(check):
        return {"kind": "plugin", "plugin": check}
    return {"kind": "custom", "reward_fn": check}


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
