"""data.check: how a reply is judged right, for every logged accuracy and GRPO's `accuracy`
reward. Each kind on a table of replies, bare-number answers of a user file, the greedy
accuracy of a real tiny rollout, GRPO's rewards named by kind, and the refusals before a run."""
import json

import pytest

from algorithms import grpo
from algorithms.config.schema import LoopConfig
from algorithms.data.loading import DataConfig
from algorithms.data.tasks import Example
from algorithms.data.user_data import load_user_data
from algorithms.config.checks import check_data
from algorithms.data.answers import accuracy, checker, correct
from orchestration.config import ConfigError
from orchestration.launch import driver_group
from orchestration.planner import make_plan
from roles.batch import SamplingParams
from roles.rollout import Rollout

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

ANSWER = Example(prompt="q", solution="2+45=47\n#### 47", answer="47")
BARE = Example(prompt="q", solution="47", answer="")  # a user row whose reply is the bare answer
PARIS = Example(prompt="capital?", solution="Paris", answer="")
HALF = Example(prompt="q", solution=r"\frac{1}{2}", answer="")


def mentions_reference(prompts, completions, references):
    """A custom check: 1.0 when the reply contains the reference."""
    return [float(r in c) for c, r in zip(completions, references)]


# (check, check_pattern, example, reply, score)
TABLE = [
    ("numeric", None, ANSWER, "45+2=47\n#### 47", 1.0),
    ("numeric", None, ANSWER, "#### $47.", 1.0),
    ("numeric", None, ANSWER, "#### 48", 0.0),
    ("numeric", None, BARE, "47", 0.0),  # no '#### N' line in the reply
    ("exact", None, PARIS, "  paris \n", 1.0),
    ("exact", None, PARIS, "Paris!", 0.0),
    ("last_number", None, BARE, "The sum is 47.", 1.0),
    ("last_number", None, BARE, "47", 1.0),
    ("last_number", None, BARE, "47, no: 48", 0.0),
    ("last_number", None, Example(prompt="q", solution="1234", answer=""), "so 1,234", 1.0),
    ("last_number", None, ANSWER, "45 then 47", 1.0),  # against the '#### N' answer
    ("last_number", None, BARE, "no number", 0.0),
    ("regex", r"answer: (\w+)", PARIS, "answer: Rome, no, answer: Paris", 1.0),
    ("regex", r"answer: (\w+)", PARIS, "answer: Paris, no, answer: Rome", 0.0),  # the last match counts
    ("regex", r"answer: (\w+)", BARE, "answer: 47.0", 1.0),  # numbers compare as numbers
    ("regex", r"\d+$", BARE, "it is 47", 1.0),  # no group: the whole match
    ("regex", r"answer: (\w+)", PARIS, "Paris", 0.0),
    ("boxed", None, HALF, r"so \boxed{\frac{1}{2}}", 1.0),
    ("boxed", None, BARE, r"\boxed{46} or rather \boxed{47.0}", 1.0),
    ("boxed", None, BARE, r"\boxed{47", 0.0),
    ("boxed", None, BARE, "47", 0.0),
    ("tests.test_checks.mentions_reference", None, PARIS, "It is Paris.", 1.0),
    ("tests.test_checks.mentions_reference", None, PARIS, "It is Rome.", 0.0),
]


@pytest.mark.parametrize("check, pattern, example, reply, score", TABLE)
def test_each_check_kind(check, pattern, example, reply, score):
    data = DataConfig(check=check, check_pattern=pattern)
    check_data(data)
    assert correct(checker(data), [example], [reply]) == [score]


def test_bare_answers_of_a_user_file_read_right(tmp_path):
    """Rows with a bare answer ('47', no '#### N'): correct replies read 1.0 with last_number,
    where the numeric check reads 0 on the same replies."""
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+40", "solution": str(i + 40)}) + "\n" for i in range(4)))
    examples = load_user_data([str(path)], max_examples=4, cache_dir=str(tmp_path / "cache")).examples
    replies = [f"{i}+40 is {i + 40}" for i in range(4)]
    assert correct(checker(DataConfig(check="last_number")), examples, replies) == [1.0] * 4
    assert correct(checker(DataConfig()), examples, replies) == [0.0] * 4
    wrong = [f"{i}+40 is {i + 41}" for i in range(4)]
    assert correct(checker(DataConfig(check="last_number")), examples, wrong) == [0.0] * 4


def test_accuracy_of_a_real_rollout_uses_data_check():
    """accuracy (eval/accuracy, teacher/eval_accuracy) generates greedily and scores by
    data.check: references that are the model's own greedy replies read 1.0 with exact."""
    rollout = driver_group(Rollout, {"model": "tiny_qwen2"}, "checks_rollout")
    try:
        prompts = [Example(prompt=p, solution="", answer="") for p in ("1+2", "3+4", "5+6")]
        replies = rollout.call("generate", [ex.prompt_messages() for ex in prompts],
                               SamplingParams(temperature=0.0, max_new_tokens=6), dispatch="slice",
                               collect="flatten").texts
        examples = [Example(prompt=ex.prompt, solution=r, answer="") for ex, r in zip(prompts, replies)]
        assert accuracy(rollout, examples, 6, DataConfig(check="exact")) == 1.0
        shifted = [Example(prompt=ex.prompt, solution=r + " x", answer="") for ex, r in zip(prompts, replies)]
        assert accuracy(rollout, shifted, 6, DataConfig(check="exact")) == 0.0
        assert accuracy(rollout, examples, 6, DataConfig()) == 0.0  # no '#### N' in the replies
    finally:
        rollout.shutdown()


def test_grpo_rewards_by_data_check_and_by_kind():
    data = DataConfig(check="last_number", check_pattern=r"answer: (\w+)")
    algo = grpo.GRPOAlgorithm(reward_funcs=["accuracy", "regex", "numeric"])
    specs = grpo.reward_specs(algo, data)
    assert [c for _, _, _, c in specs] == [{"kind": "last_number"}, {"kind": "regex", "answer_pattern": r"answer: (\w+)"},
                                          {"kind": "numeric"}]
    rewards = grpo.Rewards(specs, {})
    try:
        total, means = rewards.score(["q"] * 3, ["answer: 47", "#### 47", "48"], ["47"] * 3)
    finally:
        rewards.shutdown()
    assert total.tolist() == pytest.approx([2.0, 2.0, 0.0])
    assert means == pytest.approx({"accuracy": 2 / 3, "regex": 1 / 3, "numeric": 1 / 3})


# (data fields, the key named, a part of the message)
BAD = [
    (dict(check="nope"), "data.check", "is not a check"),
    (dict(check="model"), "data.check", "is not offered"),
    (dict(check="regex"), "data.check_pattern", "unset"),
    (dict(check="regex", check_pattern="(unclosed"), "data.check_pattern", "not a valid regex"),
    (dict(check="no_such_package.mod.fn"), "data.check", "cannot import module"),
    (dict(check="tests.test_checks.no_such_fn"), "data.check", "names no function"),
]


@pytest.mark.parametrize("fields, key, problem", BAD)
def test_bad_checks_are_refused_before_a_run(fields, key, problem):
    with pytest.raises(ConfigError, match=f"config key '{key}'.*{problem}.*Fix:"):
        check_data(DataConfig(**fields))


def test_grpo_refuses_a_regex_reward_without_a_pattern():
    plan = make_plan({"train": {"gpus": 1}, "rollout": {"gpus": 1}})
    cfg = grpo.GRPOConfig(run=LoopConfig(prompts_per_step=4),
                             algorithm=grpo.GRPOAlgorithm(reward_funcs=["accuracy", "regex"]))
    with pytest.raises(ConfigError, match="data.check_pattern"):
        grpo.validate(cfg, plan)
    cfg.data.check_pattern = r"answer: (\w+)"
    grpo.validate(cfg, plan)
