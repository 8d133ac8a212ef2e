"""Tasks: arithmetic chains, GSM-style problems and user data files."""
import json
import re

import pytest

from algorithms.data.tasks import ArithmeticConfig, Example, arithmetic_examples, gsm_examples, split_solution
from algorithms.data.user_data import load_user_data

STEP = re.compile(r"^(-?\d+)([+\-*])(\d+)=(-?\d+)$")
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _check_chain(ex: Example, cfg: ArithmeticConfig):
    """Every step is correct, chains from the previous result and uses the prompt's operands."""
    prompt_numbers = [int(x) for x in re.findall(r"\d+", ex.prompt)]
    assert cfg.min_operands <= len(prompt_numbers) <= cfg.max_operands
    assert len(ex.steps) == len(prompt_numbers) - 1
    value = prompt_numbers[0]
    for step, operand in zip(ex.steps, prompt_numbers[1:]):
        a, op, b, result = STEP.match(step).groups()
        assert int(a) == value and int(b) == operand and op in cfg.ops
        assert APPLY[op](int(a), int(b)) == int(result), step
        value = int(result)
        assert cfg.allow_negative or value >= 0
    assert ex.answer == str(value)
    assert ex.solution == "\n".join(ex.steps) + f"\n#### {value}"
    assert split_solution(ex.solution) == (ex.steps, ex.answer)
    # The prompt, read with its parentheses, evaluates to the answer.
    assert eval(ex.prompt, {"__builtins__": {}}) == value  # noqa: S307 (digits and + - * ( ) only)


@pytest.mark.parametrize("cfg", [
    ArithmeticConfig(),
    ArithmeticConfig(min_operands=4, max_operands=5, min_digits=2, max_digits=3, ops="+-"),
    ArithmeticConfig(min_operands=3, max_operands=3, ops="*-", allow_negative=True),
])
def test_arithmetic_steps_are_correct(cfg):
    examples = arithmetic_examples(300, seed=0, config=cfg)
    assert len(examples) == 300 and len({e.prompt for e in examples}) == 300
    for ex in examples:
        _check_chain(ex, cfg)
    ops_used = {STEP.match(s).group(2) for e in examples for s in e.steps}
    assert ops_used == set(cfg.ops)


def test_arithmetic_is_deterministic_and_heldout_never_in_train():
    assert arithmetic_examples(50, seed=3) == arithmetic_examples(50, seed=3)
    assert arithmetic_examples(50, seed=3) != arithmetic_examples(50, seed=4)
    test = arithmetic_examples(200, seed=0, split="test")
    test_prompts = {e.prompt for e in test}
    for seed in range(3):
        train = arithmetic_examples(2000, seed=seed)
        assert not test_prompts & {e.prompt for e in train}
    # Held-out problems are also correct chains.
    for ex in test:
        _check_chain(ex, ArithmeticConfig())


def test_arithmetic_refuses_impossible_requests():
    tiny = ArithmeticConfig(min_operands=2, max_operands=2, max_digits=1, ops="+")
    with pytest.raises(ValueError, match="distinct"):
        arithmetic_examples(1000, seed=0, config=tiny)
    with pytest.raises(ValueError, match="ops"):
        arithmetic_examples(1, seed=0, config=ArithmeticConfig(ops="/"))
    with pytest.raises(ValueError, match="split"):
        arithmetic_examples(1, seed=0, split="validation")


def test_example_messages_for_chat_templates():
    ex = arithmetic_examples(1, seed=0)[0]
    assert ex.prompt_messages() == [{"role": "user", "content": ex.prompt}]
    assert ex.messages()[-1] == {"role": "assistant", "content": ex.solution}


def test_gsm_fresh_variants_have_numeric_answers_and_split_by_template():
    train = gsm_examples(40, seed=0)
    assert len(train) == 40
    for ex in train:
        assert ex.solution.endswith(f"#### {ex.answer}")
        assert re.fullmatch(r"-?\d+(\.\d+)?", ex.answer), ex.answer
        assert "<<" not in ex.solution and ex.steps and ex.prompt
    assert gsm_examples(10, seed=0) == train[:10]
    # Fresh variants differ from the package's original problems.
    originals = {e.prompt for e in gsm_examples(fresh=False)}
    assert len({e.prompt for e in train} - originals) >= 20
    test = gsm_examples(20, seed=0, split="test")
    assert {e.source for e in test}.isdisjoint({e.source for e in gsm_examples(200, seed=1)})


def test_gsm_original_problems():
    train, test = gsm_examples(fresh=False), gsm_examples(fresh=False, split="test")
    assert len(train) + len(test) == 100 and len(test) > 0
    assert all(e.solution.splitlines()[-1] == f"#### {e.answer}" for e in train + test)
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    with pytest.raises(ValueError, match="seed"):
        gsm_examples(10)  # fresh variants need data.seed


def test_user_jsonl_skips_and_counts_bad_rows(tmp_path):
    rows = [
        json.dumps({"prompt": "1+1", "solution": "1+1=2\n#### 2"}),
        "{this is not json",
        json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "2*3"},
                                 {"role": "assistant", "content": "2*3=6\n#### 6"}]}),
        json.dumps({"prompt": 5, "solution": "x"}),
        json.dumps([1, 2]),
        "",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}),
        json.dumps({"prompt": "capital of France?", "solution": "Paris", "answer": "Paris"}),
        json.dumps({"prompt": "", "solution": "x"}),
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(rows) + "\n")
    data = load_user_data(path, cache_dir=tmp_path / "cache")
    assert data.skipped == 6
    assert data.skip_reasons == {"not_json": 1, "wrong_type": 3, "bad_turns": 1, "empty": 1}
    assert [e.prompt for e in data.examples] == ["1+1", "2*3", "capital of France?"]
    first, chat, free = data.examples
    assert (first.answer, first.steps, first.context) == ("2", ["1+1=2"], [])
    assert chat.answer == "6" and chat.context[0] == {"role": "system", "content": "Be brief."}
    assert chat.messages()[-1]["content"] == "2*3=6\n#### 6"
    assert free.answer == "Paris" and free.source == str(path)
    assert len(load_user_data(path, max_examples=2, cache_dir=tmp_path / "cache").examples) == 2


def test_user_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "prompt": ["3+4", None, "5*5"],
        "solution": ["3+4=7\n#### 7", "orphan", "5*5=25\n#### 25"],
    })
    path = tmp_path / "data.parquet"
    pq.write_table(table, path)
    chat = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": [
        [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "#### 3"}],
        [{"role": "assistant", "content": "no question"}, {"role": "assistant", "content": "x"}],
    ]}), chat)
    data = load_user_data([path, chat], cache_dir=tmp_path / "cache")
    assert [e.answer for e in data.examples] == ["7", "25", "3"]
    assert data.skipped == 2
