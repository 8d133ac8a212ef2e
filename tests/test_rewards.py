"""PRM and ORM: rule-based step verification and outcome scoring, custom functions by
dotted path, tiny scalar-head models (pairwise ORM training, per-step PRM scores), and both
roles on the local backend and on Ray with identical results."""
import pytest

from algorithms.data.tasks import arithmetic_examples
from orchestration.local import LocalWorkerGroup
from orchestration.planner import make_plan
from roles.orm import ORM
from roles.prm import PRM, aggregate_steps, split_steps

CHAIN = "31+8=39\n39-2=37\n37*16=592\n#### 592"
CHAIN_PROMPT = "((31+8)-2)*16"


def my_reward(prompts, completions, references):
    """Custom reward for the dotted-path tests: the completion's length in lines."""
    return [float(len(c.splitlines())) for c in completions]


def my_step_reward(prompts, completions, references):
    return [[0.5] * len(c.splitlines()) for c in completions]


# ---------------------------------------------------------------------- rule-based PRM

@pytest.mark.parametrize("completion, prompt, expected", [
    (CHAIN, CHAIN_PROMPT, [1, 1, 1]),
    ("31+8=40\n40-2=38\n38*16=608\n#### 608", CHAIN_PROMPT, [0, 0, 0]),  # first step wrong
    ("31+8=39\n39-2=36\n36*16=576\n#### 576", CHAIN_PROMPT, [1, 0, 0]),  # second step wrong
    ("31+8=39\n39-2=37\n37*16=593\n#### 593", CHAIN_PROMPT, [1, 1, 0]),  # last step wrong
    ("31+8=39\n38-2=36\n36*16=576", CHAIN_PROMPT, [1, 0, 0]),  # right sum, broken chain
    ("31+8=39\n38-2=36\n36*16=576", "", [1, 0, 0]),  # chaining is checked without a prompt too
    ("31+8=39\n39+2=41\n41*16=656", CHAIN_PROMPT, [1, 0, 0]),  # not the prompt's operator
    ("31+8=39\n39+2=41\n41*16=656", "what is 31+8, +2, *16?", [1, 1, 1]),  # prompt not in task form
    ("31+8=39\n39-2=37\n37*16=592\n592+1=593", CHAIN_PROMPT, [1, 1, 1, 0]),  # more steps than the prompt
    ("31+8=39\nso the next one is 37\n37*16=592", CHAIN_PROMPT, [1, 0, 0]),  # not a step
    ("-5*3=-15\n-15/5=-3\n-3--4=1\n1 - 4 = -3", "", [1, 1, 1, 1]),  # negatives, division, spaces
    ("7/2=3", "", [0]),  # only exact division
    ("4/0=0", "", [0]),
    ("\n31+8=39\n\n39-2=37\n", CHAIN_PROMPT, [1, 1]),  # blank lines are not steps
    ("#### 5", "", []),
])
def test_arithmetic_prm_flags_the_first_wrong_step(completion, prompt, expected):
    assert PRM().score_steps([prompt], [completion]) == [[float(x) for x in expected]]


def test_answer_line_as_last_step():
    prm = PRM(answer_as_step=True)
    wrong_answer = CHAIN.replace("#### 592", "#### 593")
    incomplete = "31+8=39\n39-2=37\n#### 37"
    assert prm.score_steps([CHAIN_PROMPT] * 3, [CHAIN, wrong_answer, incomplete]) == [
        [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0]]
    assert split_steps(CHAIN + "\ntrailing text", "\n", False) == ["31+8=39", "39-2=37", "37*16=592"]
    assert split_steps(CHAIN, "\n", answer_as_step=True)[-1] == "#### 592"
    assert PRM(step_separator="; ").score_steps([""], ["2+2=4; 4*3=13; 13-1=12"]) == [[1, 0, 0]]


def test_generated_chains_verify_and_a_corrupted_step_is_flagged():
    examples = arithmetic_examples(40, seed=3)
    prm = PRM()
    scores = prm.score_steps([e.prompt for e in examples], [e.solution for e in examples])
    assert all(s == [1.0] * len(e.steps) for s, e in zip(scores, examples))
    for e in examples:
        k = len(e.steps) - 1  # corrupt the result of the last step
        head, _, result = e.steps[k].rpartition("=")
        bad = "\n".join(e.steps[:k] + [f"{head}={int(result) + 1}"])
        assert prm.score_steps([e.prompt], [bad]) == [[1.0] * k + [0.0]]


def test_aggregate_steps():
    scores = [[1.0, 0.5, 0.8], [], [0.9]]
    assert aggregate_steps(scores, "min") == [0.5, 0.0, 0.9]
    assert aggregate_steps(scores, "product") == pytest.approx([0.4, 0.0, 0.9])
    assert aggregate_steps(scores, "last") == [0.8, 0.0, 0.9]
    assert aggregate_steps(scores, "mean") == pytest.approx([2.3 / 3, 0.0, 0.9])
    assert PRM(aggregate="last").score([CHAIN_PROMPT], ["31+8=39\n39-2=36"]) == [0.0]
    # Partial credit: one right step of two (the verifier scores 0 from the first mistake on).
    assert PRM(aggregate="mean").score([CHAIN_PROMPT], ["31+8=39\n39-2=36"]) == [0.5]
    with pytest.raises(ValueError, match="prm.aggregate"):
        PRM(aggregate="median")


# ---------------------------------------------------------------------- rule-based ORM

@pytest.mark.parametrize("completion, reference, fallback, expected", [
    ("1000+234=1234\n#### 1,234", "#### 1234", False, 1.0),
    ("#### $1,234.", "1234", False, 1.0),
    ("#### 1,234", "#### 1,234", False, 1.0),
    ("#### 1234.50 dollars", "1,234.5", False, 1.0),
    ("#### -7", "#### -7", False, 1.0),
    ("#### 1,235", "#### 1234", False, 0.0),
    ("#### 12 then #### 1234", "1234", False, 1.0),  # the last '####' counts
    ("the answer is 1,234.", "1234", False, 0.0),  # no '####'
    ("the answer is 1,234.", "1234", True, 1.0),  # ... unless falling back to the last number
    ("I got 5, then 1234", "#### 1234", True, 1.0),
    ("#### none", "1234", True, 0.0),
    ("#### 1234", "not a number", False, 0.0),
])
def test_numeric_orm(completion, reference, fallback, expected):
    orm = ORM(kind="numeric", numeric_fallback_last_number=fallback)
    assert orm.score(["q"], [completion], [reference]) == [expected]


def test_exact_format_and_combined_orm():
    assert ORM(kind="exact").score(["q", "q"], ["  Paris \n", "Lyon"], ["paris", "Paris"]) == [1.0, 0.0]
    assert ORM(kind="exact", exact_ignore_case=False).score(["q"], ["Paris"], ["paris"]) == [0.0]
    fmt = ORM(kind="format")  # default: a last line '#### <number>'
    assert fmt.score(["q"] * 3, [CHAIN, "#### 592 because", "592"]) == [1.0, 0.0, 0.0]
    tags = ORM(kind="format", format_pattern=r"^<answer>\d+</answer>$")
    assert tags.score(["q", "q"], ["<answer>42</answer>", "answer: 42"]) == [1.0, 0.0]
    combined = ORM(kind="combined", weights={"numeric": 1.0, "format": 0.5})
    assert combined.score(["q"] * 3, [CHAIN, "592", "#### 7"], ["592"] * 3) == [1.5, 0.0, 0.5]
    with pytest.raises(ValueError, match="orm.format_pattern"):
        ORM(kind="format", format_pattern="(")
    with pytest.raises(ValueError, match="orm.weights has unknown kinds \\['nope'\\]"):
        ORM(kind="combined", weights={"nope": 1.0})
    with pytest.raises(ValueError, match="orm.kind='bleu'"):
        ORM(kind="bleu")
    with pytest.raises(ValueError, match="bad orm config.*no_such_field"):
        ORM(no_such_field=1)
    with pytest.raises(ValueError, match="needs a reference"):
        ORM(kind="numeric").score(["q"], [CHAIN])


def test_custom_reward_by_dotted_path():
    orm = ORM(kind="custom", reward_fn="tests.test_rewards.my_reward")
    assert orm.score(["q", "q"], ["a\nb", "a"], [None, None]) == [2.0, 1.0]
    prm = PRM(kind="custom", reward_fn="tests.test_rewards.my_step_reward")
    assert prm.score_steps(["q"], ["a\nb"]) == [[0.5, 0.5]]
    for path, problem in [("tests.test_rewards.nope", "has no attribute 'nope'"),
                          ("no_such_pkg.mod.fn", "cannot import module 'no_such_pkg.mod'"),
                          ("tests.test_rewards.CHAIN", "not a function"),
                          ("nodots", "expected a dotted path")]:
        with pytest.raises(ValueError, match=f"orm.reward_fn=.*{problem}"):
            ORM(kind="custom", reward_fn=path)
    with pytest.raises(ValueError, match="prm.reward_fn=None"):
        PRM(kind="custom")


# ------------------------------------------------------------------------ model-based

def _pairs(n):
    examples = arithmetic_examples(n, seed=7)
    wrong = [e.solution.replace(f"#### {e.answer}", f"#### {int(e.answer) + 3}") for e in examples]
    return [e.prompt for e in examples], [e.solution for e in examples], wrong


def test_model_orm_pairwise_training_ranks_chosen_above_rejected(tmp_path):
    prompts, chosen, rejected = _pairs(8)
    orm = ORM(kind="model", model="tiny_qwen2", device="cpu", lr=1e-3)
    untrained = zip(orm.score(prompts, chosen), orm.score(prompts, rejected))
    assert not all(g > b for g, b in untrained)  # the seed's initial head gets some pairs wrong
    first = orm.train_pairwise(chosen, rejected, prompts)
    for _ in range(11):
        last = orm.train_pairwise(chosen, rejected, prompts)
    assert last["loss"] < 0.5 * first["loss"] and last["accuracy"] == 1.0 and last["step"] == 12
    good, bad = orm.score(prompts, chosen), orm.score(prompts, rejected)
    assert all(g > b for g, b in zip(good, bad)), (good, bad)
    orm.save(tmp_path / "orm")
    again = ORM(kind="model", model="tiny_qwen2", device="cpu", seed=1)
    again.load(tmp_path / "orm")
    assert again.score(prompts, chosen) == pytest.approx(good, abs=1e-5)
    with pytest.raises(ValueError, match="orm.train_pairwise needs a model"):
        ORM().train_pairwise(chosen, rejected)


def test_model_prm_scores_each_step():
    examples = arithmetic_examples(4, seed=5)
    prm = PRM(kind="model", model="tiny_qwen2", device="cpu", lr=1e-3)
    prompts, completions = [e.prompt for e in examples], [e.solution for e in examples]
    scores = prm.score_steps(prompts, completions)
    assert [len(s) for s in scores] == [len(e.steps) for e in examples]
    assert all(0.0 < x < 1.0 for s in scores for x in s)
    labels = [[1.0] * (len(e.steps) - 1) + [0.0] for e in examples]
    first = prm.train_steps(prompts, completions, labels)
    for _ in range(8):
        last = prm.train_steps(prompts, completions, labels)
    assert last["loss"] < first["loss"]
    with pytest.raises(ValueError, match="completion 0 has"):
        prm.train_steps(prompts, completions, [[1.0]] * 4)


# ------------------------------------------------------------------ local and Ray backends

PRM_INIT = {"config": {"kind": "arithmetic"}}
RULE_WEIGHTS = {"numeric": 1.0, "format": 0.5, "custom": 0.25}
# The ORM adds a tiny model's score to the rules, so a model runs in the workers too.
ORM_INIT = {"config": {"kind": "combined", "weights": {**RULE_WEIGHTS, "model": 1.0}, "device": "cpu",
                       "reward_fn": "tests.test_rewards.my_reward", "model": "tiny_qwen2"}}


def _requests():
    examples = arithmetic_examples(7, seed=11)
    # Odd completions get a wrong first step and a wrong answer.
    completions = [e.solution if i % 2 == 0 else e.solution.replace("=", "=1", 1).replace("#### ", "#### 1")
                   for i, e in enumerate(examples)]
    return [e.prompt for e in examples], completions, [e.answer for e in examples]


def _run(prm, orm):
    prompts, completions, refs = _requests()
    return (prm.call("score_steps", prompts, completions, refs, dispatch="slice", collect="flatten"),
            orm.call("score", prompts, completions, refs, dispatch="slice", collect="flatten"))


def test_prm_and_orm_local_and_ray_agree(ray_cluster):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    # One rank each: slicing over ranks gives the same on both backends in
    # test_worker_groups::test_dispatch_semantics_identical_on_both_backends, and a 2-rank PRM/ORM
    # group scores on Ray in test_distill's Ray run.
    plan = make_plan({"device_groups": {"nproc_per_node": 1,
                                        "rm_group": {"device": "CPU", "ranks": 1, "workers": ["prm", "orm"]}}})
    local = _run(LocalWorkerGroup(PRM, plan["prm"], PRM_INIT), LocalWorkerGroup(ORM, plan["orm"], ORM_INIT))
    placement = create_placement(plan, timeout_s=30)
    groups = []
    try:
        groups.append(WorkerGroup(PRM, plan["prm"], PRM_INIT, placement=placement))
        groups.append(WorkerGroup(ORM, plan["orm"], ORM_INIT, placement=placement))
        remote = _run(*groups)
    finally:
        for g in groups:
            g.shutdown()
        placement.remove()
    # Rule scores agree exactly; the model ORM's float sums may differ in the last bit
    # between processes (torch picks its reduction order by thread count).
    assert remote[0] == local[0]
    assert remote[1] == pytest.approx(local[1], rel=1e-6)
    step_scores, outcome = local
    prompts, completions, refs = _requests()
    assert step_scores == [[1.0] * len(c.splitlines()[:-1]) if i % 2 == 0 else [0.0] * len(c.splitlines()[:-1])
                           for i, c in enumerate(completions)]
    rules = [1.0 + 0.5 + 0.25 * len(c.splitlines()) if i % 2 == 0 else 0.5 + 0.25 * len(c.splitlines())
             for i, c in enumerate(completions)]
    model = ORM(kind="model", model="tiny_qwen2", device="cpu").score(prompts, completions)
    assert outcome == pytest.approx([r + m for r, m in zip(rules, model)], abs=1e-5)
