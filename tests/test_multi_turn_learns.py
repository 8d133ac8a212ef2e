"""The multi-turn examples on CPU. The shipped one (conf/experiment/grpo_multi_turn.yaml, a
calculator tool): the tool, its warm-start rows token for token the trajectories its rollouts
sample, and (slow) GRPO raising its success rate by 0.2. The tutor (arithmetic_hint, the earlier
example that did not learn, as overrides of it): its environment's turns and warm-start rows."""
import pytest
from hydra import compose, initialize_config_module

from algorithms import grpo
from algorithms.config.schema import prepare
from algorithms.data.loading import load_task
from algorithms.data.prompts import encode_examples
from algorithms.records.trackers import read_metrics
from algorithms.runtime.warm_start import warm_start_data
from orchestration.config import register_schema
from roles.batch import Completions, SamplingParams
from roles.models import load_tokenizer
from roles.multi_turn import Delta, make_scheduler, run_trajectories
from roles.plugins import envs, tools
from roles.rollout import prompt_text, prompt_token_ids
from tests.driver_helpers import prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread
EXPERIMENT = ["+experiment=grpo_multi_turn", "backend.workers=local"]
# The tutor example of docs/multi_turn.md: two-step addition chains in the arithmetic_hint environment.
TUTOR = EXPERIMENT + ["algorithm.multi_turn.scheduler=gym_scheduler", "algorithm.multi_turn.gym_env=arithmetic_hint",
                      "algorithm.multi_turn.tools=[]", "algorithm.multi_turn.env_reward=final",
                      "algorithm.reward_funcs=[]", "algorithm.max_new_tokens=72", "data.arithmetic.min_operands=3",
                      "data.arithmetic.max_operands=3", "data.arithmetic.min_digits=1",
                      "data.arithmetic.max_digits=1", "data.arithmetic.ops=+", "data.train_size=800"]


@pytest.mark.parametrize("first", ["3+4=7\n7+5=12\n#### 12", "3+4=8\n8+5=13\n#### 13"])
def test_the_tutor_hints_after_any_first_answer_and_grades_the_second(first):
    env = envs["arithmetic_hint"]({"seed": 0})
    row = {"solution": "12", "messages": [{"role": "user", "content": "(3+4)+5"}]}
    assert env.reset(row) == "(3+4)+5"
    assert env.step(first) == ("Hint: 3+4=7", 0.0, False, {"status": "hinted"})
    assert env.step("3+4=7\n7+5=12\n#### 12")[1:3] == (1.0, True)
    env.reset(row)
    env.step(first)
    assert env.step(first.replace("12", "13"))[1:3] == (0.0, True)


def scripted_trajectory(tok, cfg, question: str, ex, texts: tuple, seed: int):
    """The trajectory `run_trajectories` builds (the real scheduler, environment or tool, and
    chat-template delta of cfg.algorithm.multi_turn) when the model's replies are `texts`."""
    replies = [tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for text in texts]

    def generate(ids, sampling):
        toks = replies.pop(0)
        return Completions([0], ids, [toks], [""], [[0.0] * len(toks)], ["stop"])

    mt = cfg.algorithm.multi_turn
    prompt = [{"role": "user", "content": question}]
    return run_trajectories(generate, lambda messages: prompt_token_ids(tok, prompt_text(tok, messages, True), True),
                            Delta(tok, True, {}), make_scheduler(mt, tok), mt, [prompt],
                            [{"solution": ex.answer, "messages": prompt}],
                            SamplingParams(max_new_tokens=cfg.algorithm.max_new_tokens), seed=seed)


def test_warm_start_rows_are_the_rollouts_trajectories(tmp_path):
    """Each multi-turn SFT row (question, a first try, the environment's hint, the right answer)
    is encoded exactly as the rollout builds the trajectory in which the model says those two
    replies, and its loss covers the tokens of the last model turn."""
    _, cfg, _ = prepared(grpo.GRPOConfig, TUTOR + ["algorithm.warmup_sft_examples=12", "data.eval_size=4"])
    data = warm_start_data(cfg, tmp_path / "rows")
    rows, held, _ = load_task(data)
    assert len(held) == 4 and all(not ex.context for ex in held)
    tok = load_tokenizer("tiny_qwen2")
    multi = [ex for ex in rows if len(ex.context) == 3]
    # Each labelled example: answered right away, and after a wrong and after a right first try.
    assert len(rows) == 36 and len(multi) == 24
    assert sum(ex.context[1]["content"] == ex.solution for ex in multi) == 12
    sft = encode_examples(tok, multi, pretrain=False)
    for i, ex in enumerate(multi):
        question, wrong, hint = (m["content"] for m in ex.context)
        assert hint.startswith("Hint: ") and hint[len("Hint: "):] == ex.solution.splitlines()[0]
        # The model's two replies: the row's first try, then the right answer.
        out = scripted_trajectory(tok, cfg, question, ex, (wrong, ex.solution), seed=i)
        assert out.finish_reasons == ["stop"] and out.rollout_infos[0]["step_rewards"] == [0.0, 1.0]
        assert out.prompt_ids[0] + out.completion_ids[0] == sft.prompt_ids[i] + sft.completion_ids[i]
        mask, last = out.completion_mask[0], len(sft.completion_ids[i])
        assert mask[-last:] == [1] * last and mask[-last - 1] == 0  # the loss: the last reply, as the SFT's



# ----------------------------------------------------------------------------- the calculator example


def test_the_calculator_reads_integer_arithmetic_and_nothing_else():
    calculator = tools["calculator"]
    assert calculator("23*45") == "1035" and calculator(" (3+4)*-2 ") == "-14"
    for bad in ("2**3", "7/2", "1.5*2", "x*2", "__import__('os')", "3*", "9" * 65):
        with pytest.raises(ValueError):
            calculator(bad)


def test_tool_warm_start_rows_are_the_rollouts_trajectories(tmp_path):
    """Each example's row (question, the calculator call, its result, the answer) is encoded
    exactly as the rollout builds the trajectory in which the model makes that call and gives
    that answer, with the loss on the answer; the first-reply rows are half calls, half direct
    answers, and a call row is that trajectory's first model turn."""
    _, cfg, _ = prepared(grpo.GRPOConfig, EXPERIMENT + ["algorithm.warmup_sft_examples=12", "data.eval_size=4"])
    rows, held, _ = load_task(warm_start_data(cfg, tmp_path / "rows"))
    assert len(held) == 4 and len(rows) == 24
    full = [ex for ex in rows if len(ex.context) == 3]
    calls = [ex for ex in rows if not ex.context[1:] and ex.solution.startswith("<tool_call>")]
    direct = [ex for ex in rows if not ex.context[1:] and not ex.solution.startswith("<tool_call>")]
    assert len(full) == 12 and len(calls) == 6 and len(direct) == 6
    tok = load_tokenizer("tiny_qwen2")
    sft = encode_examples(tok, full, pretrain=False)
    first = encode_examples(tok, calls, pretrain=False)
    for i, ex in enumerate(full):
        question, call, result = (m["content"] for m in ex.context)
        assert result == ex.answer and ex.solution == f"#### {ex.answer}"
        # The model's two replies: the row's call, then its answer.
        out = scripted_trajectory(tok, cfg, question, ex, (call, ex.solution), seed=i)
        assert out.finish_reasons == ["stop"] and out.texts == [ex.solution]
        assert out.rollout_infos[0]["tool_calls"] == 1 and out.rollout_infos[0]["tool_errors"] == 0
        assert out.prompt_ids[0] + out.completion_ids[0] == sft.prompt_ids[i] + sft.completion_ids[i]
        mask, last = out.completion_mask[0], len(sft.completion_ids[i])
        assert mask[-last:] == [1] * last and mask[-last - 1] == 0  # the loss: the answer, as the SFT's
        for j, c in enumerate(calls):  # the call row of this question: the trajectory's first turn
            if c.prompt == question:
                turn = len(first.completion_ids[j])
                assert out.prompt_ids[0] + out.completion_ids[0][:turn] == first.prompt_ids[j] + first.completion_ids[j]
                assert mask[:turn] == [1] * turn and mask[turn] == 0


@pytest.mark.slow
def test_grpo_learns_to_call_the_calculator(tmp_path):
    """The shipped example as run from the command line (seed 0): after the warm start about
    half of the first replies call the calculator; GRPO raises the success rate (rollout/accuracy)
    by at least 0.2 from the mean of the first 5 steps to that of the last 5, the calls with it."""
    register_schema(grpo.GRPOConfig)
    with initialize_config_module(config_module="conf", version_base=None):
        cfg = compose(config_name="config", overrides=EXPERIMENT + ["run.seed=0"])
    typed, plan = prepare(cfg, grpo.GRPOConfig)
    grpo.run(typed, plan, tmp_path)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "rollout/accuracy" in r]
    assert len(records) == 30
    success = [r["rollout/accuracy"] for r in records]
    calls = [r["multi_turn/tool_calls"] / 128 for r in records]
    assert 0.3 < calls[0] < 0.7, calls
    assert sum(success[-5:]) / 5 - sum(success[:5]) / 5 >= 0.2, success
    assert sum(calls[-5:]) / 5 > 0.9, calls
