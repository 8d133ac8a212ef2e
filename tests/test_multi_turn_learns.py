"""The shipped multi-turn example (conf/experiment/grpo_multi_turn.yaml) on CPU: its tutor
environment's turns, and its warm-start rows, token for token the trajectories its rollouts
sample. (A test of its success rate's rise waits for a run that rises: docs/multi_turn.md.)"""
import pytest

from algorithms import grpo
from algorithms.data.loading import load_task
from algorithms.data.prompts import encode_examples
from roles.batch import Completions, SamplingParams
from roles.models import load_tokenizer
from roles.multi_turn import Delta, make_scheduler, run_trajectories
from roles.plugins import envs
from roles.rollout import prompt_text, prompt_token_ids
from tests.driver_helpers import prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread
EXPERIMENT = ["+experiment=grpo_multi_turn", "backend.workers=local"]


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


def test_warm_start_rows_are_the_rollouts_trajectories(tmp_path):
    """Each multi-turn SFT row (question, a first try, the environment's hint, the right answer)
    is encoded exactly as the rollout builds the trajectory in which the model says those two
    replies, and its loss covers the tokens of the last model turn."""
    _, cfg, _ = prepared(grpo.GRPOConfig, EXPERIMENT + ["algorithm.warmup_sft_examples=12", "data.eval_size=4"])
    data = grpo.warm_start_data(cfg, tmp_path / "rows")
    rows, held, _ = load_task(data)
    assert len(held) == 4 and all(not ex.context for ex in held)
    tok = load_tokenizer("tiny_qwen2")
    multi = [ex for ex in rows if len(ex.context) == 3]
    # Each labelled example: answered right away, and after a wrong and after a right first try.
    assert len(rows) == 36 and len(multi) == 24
    assert sum(ex.context[1]["content"] == ex.solution for ex in multi) == 12
    sft = encode_examples(tok, multi, pretrain=False)
    mt = cfg.algorithm.multi_turn
    for i, ex in enumerate(multi):
        question, wrong, hint = (m["content"] for m in ex.context)
        assert hint.startswith("Hint: ") and hint[len("Hint: "):] == ex.solution.splitlines()[0]
        replies = [tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                   for text in (wrong, ex.solution)]

        def generate(ids, sampling):  # the model's two replies: the row's first try, then the right answer
            toks = replies.pop(0)
            return Completions([0], ids, [toks], [""], [[0.0] * len(toks)], ["stop"])

        prompt = [{"role": "user", "content": question}]
        out = run_trajectories(generate, lambda messages: prompt_token_ids(tok, prompt_text(tok, messages, True), True),
                               Delta(tok, True, {}), make_scheduler(mt, tok), mt, [prompt],
                               [{"solution": ex.answer, "messages": prompt}],
                               SamplingParams(max_new_tokens=cfg.algorithm.max_new_tokens), seed=i)
        assert out.finish_reasons == ["stop"] and out.rollout_infos[0]["step_rewards"] == [0.0, 1.0]
        assert out.prompt_ids[0] + out.completion_ids[0] == sft.prompt_ids[i] + sft.completion_ids[i]
        mask, last = out.completion_mask[0], len(sft.completion_ids[i])
        assert mask[-last:] == [1] * last and mask[-last - 1] == 0  # the loss: the last reply, as the SFT's

