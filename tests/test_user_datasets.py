"""A user's own dataset, read the way ms-swift users write it: every file format, the column
conventions (messages, ShareGPT, query/response, alpaca, prompt/solution, prompt/completion,
renamed columns), prompt-only RL rows, the whole file with an honest held-out split, and a
ConfigError naming the path for data that cannot be read. Real files in tmp_path, in-process."""
import csv
import json
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from algorithms.data.loading import DataConfig, RowLimits, check_data_files, load_task
from algorithms.data.user_data import SKIP_REASONS, load_user_data
from algorithms.data.prompts import chat_prompt
from orchestration.config import ConfigError
from roles.models import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny_qwen2")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def files(tmp_path, paths, **kwargs) -> DataConfig:
    return DataConfig(task="files", paths=[str(p) for p in paths], cache_dir=str(tmp_path / "cache"), **kwargs)


def numbered(n: int, start: int = 0) -> list[dict]:
    return [{"query": f"{i}+1", "response": f"{i}+1={i + 1}\n#### {i + 1}"} for i in range(start, start + n)]


# ------------------------------------------------------------------ formats

# The same rows in every format (each with every column, as a table has them); the third has
# no usable columns and is skipped as wrong_type.
ROWS = [{"query": "2+3", "response": "#### 5", "system": "Be brief.", "text": None},
        {"query": "7*6", "response": "42", "system": None, "text": None},
        {"query": None, "response": None, "system": None, "text": "stray"}]


def as_jsonl(path, rows):
    return write_jsonl(path.with_suffix(".jsonl"), rows)


def as_json_array(path, rows):
    path = path.with_suffix(".json")
    path.write_text(json.dumps(rows, indent=2))
    return path


def as_json_lines(path, rows):
    return write_jsonl(path.with_suffix(".json"), rows)


def as_csv(path, rows):
    path = path.with_suffix(".csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["query", "response", "system", "text"])
        writer.writeheader()
        writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    return path


def as_parquet(path, rows):
    path = path.with_suffix(".parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def as_saved_dataset(path, rows):
    Dataset.from_list(rows).save_to_disk(str(path))
    return path


def as_saved_dataset_dict(path, rows):
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows[:1])}).save_to_disk(str(path))
    return path


WRITERS = [as_jsonl, as_json_array, as_json_lines, as_csv, as_parquet, as_saved_dataset, as_saved_dataset_dict]


@pytest.mark.parametrize("writer", WRITERS, ids=[w.__name__ for w in WRITERS])
def test_every_format_gives_the_same_examples(tmp_path, writer):
    path = writer(tmp_path / "data", ROWS)
    data = load_user_data(path, cache_dir=tmp_path / "cache")
    assert [(e.prompt, e.solution, e.answer) for e in data.examples] == [("2+3", "#### 5", "5"), ("7*6", "42", "42")]
    assert data.examples[0].context == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3"}]
    assert data.skip_reasons == {"wrong_type": 1}
    assert data.first_bad["wrong_type"].startswith(f"{path}:")


def test_csv_cells_hold_conversations_as_json(tmp_path):
    path = tmp_path / "chat.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["conversations", "solution"])
        writer.writerow([json.dumps([{"from": "human", "value": "40+7?"}, {"from": "gpt", "value": "47"}]), ""])
        writer.writerow([json.dumps([{"from": "human", "value": "6*7?"}]), "42"])
    data = load_user_data(path, cache_dir=tmp_path / "cache")
    assert [(e.prompt, e.solution, e.answer) for e in data.examples] == [("40+7?", "47", "47"), ("6*7?", "", "42")]


# ------------------------------------------------------------------ columns

SYSTEM = {"role": "system", "content": "Be brief."}
# (case, row, data.columns, (prompt, solution, answer, context))
COLUMNS = [
    ("messages", {"messages": [SYSTEM, {"role": "user", "content": "2*3"},
                               {"role": "assistant", "content": "2*3=6\n#### 6"}]}, {},
     ("2*3", "2*3=6\n#### 6", "6", [SYSTEM, {"role": "user", "content": "2*3"}])),
    ("ShareGPT conversations", {"conversations": [{"from": "system", "value": "Be brief."},
                                                  {"from": "human", "value": "2*3"}, {"from": "gpt", "value": "6"}]},
     {}, ("2*3", "6", "6", [SYSTEM, {"role": "user", "content": "2*3"}])),
    ("query/response with system and history", {"system": "Be brief.", "query": "and 2*3?", "response": "#### 6",
                                                "history": [["1+1?", "#### 2"]]}, {},
     ("and 2*3?", "#### 6", "6", [SYSTEM, {"role": "user", "content": "1+1?"},
                                  {"role": "assistant", "content": "#### 2"}, {"role": "user", "content": "and 2*3?"}])),
    ("alpaca with input", {"instruction": "Add the numbers.", "input": "40 + 7", "output": "47"}, {},
     ("Add the numbers.\n40 + 7", "47", "47", [])),
    ("alpaca with empty input", {"instruction": "Add 40 and 7.", "input": "", "output": "#### 47"}, {},
     ("Add 40 and 7.", "#### 47", "47", [])),
    ("prompt/completion", {"prompt": "3+4", "completion": "3+4=7\n#### 7"}, {}, ("3+4", "3+4=7\n#### 7", "7", [])),
    ("prompt/solution", {"prompt": "3+4", "solution": "3+4=7\n#### 7"}, {}, ("3+4", "3+4=7\n#### 7", "7", [])),
    ("bare answer reply", {"query": "40+7", "response": " 47\n"}, {}, ("40+7", " 47\n", "47", [])),
    ("explicit answer wins", {"query": "40+7", "response": "#### 46", "answer": 47}, {}, ("40+7", "#### 46", "47", [])),
    ("GRPO: messages ending with the user, solution as reference",
     {"messages": [{"role": "user", "content": "40+7?"}], "solution": "\\boxed{47}"}, {},
     ("40+7?", "", "\\boxed{47}", [])),
    ("GRPO: query and solution", {"query": "40+7?", "solution": " 47 "}, {}, ("40+7?", "", "47", [])),
    ("GRPO: system then user, answer column", {"messages": [SYSTEM, {"role": "user", "content": "40+7?"}],
                                               "answer": "47"}, {},
     ("40+7?", "", "47", [SYSTEM, {"role": "user", "content": "40+7?"}])),
    ("reply and a separate reference solution", {"messages": [{"role": "user", "content": "40+7?"},
                                                              {"role": "assistant", "content": "It is 47."}],
                                                 "solution": "47"}, {}, ("40+7?", "It is 47.", "47", [])),
    ("renamed columns", {"question": "2+2", "answer_text": "#### 4"}, {"question": "query", "answer_text": "response"},
     ("2+2", "#### 4", "4", [])),
    ("renamed to a GRPO reference", {"problem": "2+2", "ref": "4"}, {"problem": "query", "ref": "solution"},
     ("2+2", "", "4", [])),
]


@pytest.mark.parametrize("row,columns,want", [c[1:] for c in COLUMNS], ids=[c[0] for c in COLUMNS])
def test_column_conventions(tmp_path, row, columns, want):
    path = write_jsonl(tmp_path / "data.jsonl", [row])
    data = load_user_data(path, cache_dir=tmp_path / "cache", columns=columns)
    assert data.skip_reasons == {}
    ex = data.examples[0]
    assert (ex.prompt, ex.solution, ex.answer, ex.context) == want
    # What the rollout generates from ends with the question.
    assert ex.prompt_messages()[-1] == {"role": "user", "content": want[0]}


# (case, row, data.columns, why it is skipped)
BAD_COLUMNS = [
    ("prompt-only messages without a reference", {"messages": [{"role": "user", "content": "2+2"}]}, {}, "bad_turns"),
    ("query without response or reference", {"query": "2+2"}, {}, "wrong_type"),
    ("unknown ShareGPT speaker", {"conversations": [{"from": "human", "value": "2+2"}, {"from": "bot", "value": "4"}]},
     {}, "wrong_type"),
    ("history not pairs", {"query": "2+2", "response": "4", "history": ["1+1", "2"]}, {}, "wrong_type"),
    ("columns not renamed", {"question": "2+2", "answer_text": "4"}, {}, "wrong_type"),
    ("blank alpaca output", {"instruction": "2+2", "output": "  "}, {}, "empty"),
]


@pytest.mark.parametrize("row,columns,reason", [c[1:] for c in BAD_COLUMNS], ids=[c[0] for c in BAD_COLUMNS])
def test_rows_that_give_no_example_are_counted(tmp_path, row, columns, reason):
    path = write_jsonl(tmp_path / "data.jsonl", [row, {"query": "1+1", "response": "2"}])
    data = load_user_data(path, cache_dir=tmp_path / "cache", columns=columns)
    assert data.skip_reasons == {reason: 1} and reason in SKIP_REASONS
    assert [e.prompt for e in data.examples] == ["1+1"]


# ------------------------------------------------------------------ prompt-only rows and replies

def test_prompt_only_rows_are_skipped_only_where_replies_are_trained_on(tmp_path, tokenizer, capsys):
    prompt_only = [{"messages": [{"role": "user", "content": f"{i}*2?"}], "solution": str(2 * i)} for i in range(3)]
    path = write_jsonl(tmp_path / "data.jsonl", numbered(4) + prompt_only[:2] + numbered(2, 10) + prompt_only[2:])
    data = files(tmp_path, [path], eval_size=2)
    grpo = RowLimits(tokenizer, 1024, 48, 24, None)
    sft = RowLimits(tokenizer, 1024, None, 24, 1024, replies=True)
    train, held, stats = load_task(data, grpo)
    assert [e.prompt for e in held] == ["11+1", "2*2?"]  # a prompt-only row is a fine held-out prompt
    assert [e.prompt for e in train] == ["0+1", "1+1", "2+1", "3+1", "0*2?", "1*2?", "10+1"]
    assert [e.answer for e in train if not e.solution] == ["0", "2"] and stats["data/skipped_rows"] == 0
    # What the rollout generates from: the question, and no reference answer leaked into it.
    rendered = chat_prompt(tokenizer, train[5])
    assert "1*2?" in rendered and not rendered.rstrip().endswith("2")
    train, held, stats = load_task(data, sft)
    assert [e.prompt for e in held] == ["11+1", "2*2?"]
    assert [e.prompt for e in train] == ["0+1", "1+1", "2+1", "3+1", "10+1"] and all(e.solution for e in train)
    assert stats["data/skipped/no_reply"] == stats["data/skipped_rows"] == 2
    assert "no_reply 2 (first: " in capsys.readouterr().out.splitlines()[-1]


def test_a_prompt_only_file_cannot_train_on_replies(tmp_path, tokenizer):
    rows = [{"query": f"{i}+1", "solution": str(i + 1)} for i in range(6)]
    data = files(tmp_path, [write_jsonl(tmp_path / "grpo.jsonl", rows)], eval_size=2)
    with pytest.raises(ConfigError, match="no_reply 4.*give the rows a reply"):
        load_task(data, RowLimits(tokenizer, 1024, None, 24, 1024, replies=True))


# ------------------------------------------------------------------ the whole file, held-out rows

def prompts(examples) -> list[str]:
    return [e.prompt for e in examples]


def test_a_file_is_used_whole_and_max_rows_caps_it(tmp_path, capsys):
    path = write_jsonl(tmp_path / "data.jsonl", numbered(30))
    train, held, _ = load_task(files(tmp_path, [path], train_size=5, eval_size=4))
    assert len(train) == 26 and prompts(held) == ["26+1", "27+1", "28+1", "29+1"]
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("data: 30 usable rows of data.paths, held out: the last 4 that fit (neither "
                           "data.val_paths nor data.val_split set")
    train, held, _ = load_task(files(tmp_path, [path], eval_size=4, max_rows=10))
    assert prompts(train) == [f"{i}+1" for i in range(6)] and prompts(held) == [f"{i}+1" for i in range(6, 10)]
    assert "10 usable rows of data.paths (data.max_rows=10)" in capsys.readouterr().out


def test_val_paths_hold_out_their_rows(tmp_path, capsys):
    path = write_jsonl(tmp_path / "train.jsonl", numbered(10))
    val = write_jsonl(tmp_path / "val.jsonl", numbered(5, 100))
    train, held, _ = load_task(files(tmp_path, [path], val_paths=[str(val)], eval_size=3))
    assert prompts(train) == [f"{i}+1" for i in range(10)]  # every training row is trained on
    assert prompts(held) == ["100+1", "101+1", "102+1"]  # eval_size caps the evaluated prompts
    assert "held out: 5 rows of data.val_paths" in capsys.readouterr().out
    train, held, _ = load_task(files(tmp_path, [path], val_paths=[str(val)], eval_size=64))
    assert len(held) == 5 and len(train) == 10


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_val_split_never_overlaps_training(tmp_path, capsys, seed):
    path = write_jsonl(tmp_path / "data.jsonl", numbered(200))
    data = files(tmp_path, [path], val_split=0.1, eval_size=15, seed=seed)
    train, held, _ = load_task(data)
    assert len(train) == 180 and len(held) == 15
    # Rows are distinct, so no held-out row's text may appear among the training rows.
    assert not set(prompts(held)) & set(prompts(train))
    assert not {e.solution for e in held} & {e.solution for e in train}
    assert prompts(held) != [f"{i}+1" for i in range(185, 200)]  # drawn, not the file's tail
    assert "held out: 20 drawn by data.val_split=0.1 (seed data.seed=" in capsys.readouterr().out
    again, held_again, _ = load_task(data)
    assert (prompts(again), prompts(held_again)) == (prompts(train), prompts(held))
    _, other, _ = load_task(replace(data, seed=seed + 100))
    assert prompts(other) != prompts(held)


def test_a_builtin_task_says_so(capsys):
    train, held, _ = load_task(DataConfig(task="arithmetic", train_size=8, eval_size=2))
    assert (len(train), len(held)) == (8, 2)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("data: built-in task arithmetic (no data.paths given): 8 train / 2 held-out")


def test_too_long_rows_are_still_skipped_from_a_val_split(tmp_path, tokenizer):
    rows = numbered(40) + [{"query": "9" * 3000, "response": "#### 1"}]
    data = files(tmp_path, [write_jsonl(tmp_path / "data.jsonl", rows)], val_split=0.5, eval_size=64)
    train, held, stats = load_task(data, RowLimits(tokenizer, 1024, 48, 24, None))
    assert stats["data/skipped/too_long"] == 1 and len(train) + len(held) == 40
    assert not set(prompts(held)) & set(prompts(train))


# ------------------------------------------------------------------ data that cannot be read

def missing(tmp_path):
    return tmp_path / "nope.jsonl"


def unknown_extension(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text('{"query": "1", "response": "2"}\n')
    return path


def folder_without_data(tmp_path):
    # A plain folder is read for its train split's data files (a hub snapshot, a downloaded
    # dataset); one without any is refused.
    path = tmp_path / "folder"
    path.mkdir()
    (path / "README.md").write_text("no rows here\n")
    return path


def damaged_parquet(tmp_path):
    path = tmp_path / "data.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    return path


def broken_json_array(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[{"query": "1", "response": "2"},')
    return path


def latin1_csv(tmp_path):
    path = tmp_path / "data.csv"
    path.write_bytes(b"query,response\ncaf\xe9,2\n")
    return path


def dataset_dict_without_train(tmp_path):
    path = tmp_path / "saved"
    DatasetDict({"validation": Dataset.from_list(numbered(3))}).save_to_disk(str(path))
    return path


def rows_with_images(tmp_path):
    return write_jsonl(tmp_path / "vl.jsonl", [{"query": "How many cubes?", "response": "3",
                                                "images": ["/data/clevr/0001.png"]}])


# (case, writer, what the error says, whether check_data_files already finds it)
UNREADABLE = [
    ("missing path", missing, "does not exist", True),
    ("unknown extension", unknown_extension, "unknown extension '.txt'", True),
    ("folder without a data file", folder_without_data, "holds no data file of a train split", True),
    ("damaged parquet", damaged_parquet, "is not readable Parquet", False),
    ("broken JSON array", broken_json_array, "is not valid JSON", False),
    ("CSV that is not UTF-8", latin1_csv, "is not readable CSV", False),
    ("DatasetDict without a train split", dataset_dict_without_train, "no 'train'", False),
    ("rows with images", rows_with_images, "carries images: vision and audio rows are not trained", False),
]


@pytest.mark.parametrize("writer,problem,cheap", [c[1:] for c in UNREADABLE], ids=[c[0] for c in UNREADABLE])
@pytest.mark.parametrize("key", ["paths", "val_paths"])
def test_unreadable_data_stops_the_run_naming_the_path(tmp_path, writer, problem, cheap, key):
    bad = str(writer(tmp_path))
    good = str(write_jsonl(tmp_path / "good.jsonl", numbered(6)))
    data = files(tmp_path, [bad] if key == "paths" else [good], eval_size=2,
                 **({"val_paths": [bad]} if key == "val_paths" else {}))
    if cheap:
        with pytest.raises(ConfigError) as err:
            check_data_files(data)
    else:
        check_data_files(data)  # the name is fine; only reading finds the problem
        with pytest.raises(ConfigError) as err:
            load_task(data)
    message = str(err.value)
    assert message.startswith(f"config key 'data.{key}'={bad!r} ") and problem in message and ". Fix: " in message


# (case, DataConfig fields, the key named)
BAD_SETTINGS = [
    ("no paths", {"task": "files", "paths": []}, "data.paths"),
    ("val_split of 1", {"val_split": 1.0}, "data.val_split"),
    ("val_split and val_paths", {"val_split": 0.1, "val_paths": ["GOOD"]}, "data.val_split"),
    ("max_rows of 0", {"max_rows": 0}, "data.max_rows"),
    ("a column renamed to nothing known", {"columns": {"question": "querry"}}, "data.columns.question"),
    ("paths with a built-in task", {"task": "arithmetic"}, "data.paths"),
    ("val_split with a built-in task", {"task": "gsm", "paths": [], "val_split": 0.1}, "data.val_split"),
]


@pytest.mark.parametrize("fields,key", [c[1:] for c in BAD_SETTINGS], ids=[c[0] for c in BAD_SETTINGS])
def test_settings_checked_before_reading(tmp_path, fields, key):
    good = str(write_jsonl(tmp_path / "good.jsonl", numbered(6)))
    fields = {k: [good if p == "GOOD" else p for p in v] if k == "val_paths" else v for k, v in fields.items()}
    data = replace(files(tmp_path, [good]), **fields)
    with pytest.raises(ConfigError, match=f"^config key '{key}'=.*Fix: "):
        check_data_files(data)
    with pytest.raises(ConfigError, match=f"^config key '{key}'="):
        load_task(data)
    check_data_files(files(tmp_path, [good], val_split=0.2, max_rows=5, columns={"question": "query"}))


# ------------------------------------------------------------------ from the command line

def test_the_keys_compose_from_the_command_line(tmp_path, capsys):
    """The new data. keys as a user types them, through the typed config and the run's limits."""
    from algorithms.sft import SFTConfig
    from algorithms.data.loading import row_limits
    from tests.driver_helpers import TINY, prepared

    rows = [{"question": f"{i}+1", "answer_text": f"#### {i + 1}"} for i in range(12)]
    rows += [{"question": "5*5", "ref": "25"}]  # prompt-only: not for SFT
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    _, typed, _ = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, "data.task=files",
                                          f"data.paths=[{path}]", f"data.cache_dir={tmp_path / 'cache'}",
                                          "+data.columns={question:query,answer_text:response,ref:solution}",
                                          "data.val_split=0.25", "data.max_rows=13"])
    assert typed.data.columns == {"question": "query", "answer_text": "response", "ref": "solution"}
    check_data_files(typed.data)
    train, held, stats = load_task(typed.data, row_limits(typed, replies=True))
    assert len(held) == 3 and len(train) + len(held) + stats["data/skipped/no_reply"] == 13
    assert not set(prompts(held)) & set(prompts(train)) and all(e.answer for e in train + held)


@pytest.mark.parametrize("strategy", ["right", "left", "delete"])
def test_truncation_strategy_cuts_or_drops_a_long_conversation(tmp_path, strategy):
    """data.truncation_strategy (ms-swift's): a conversation over max_length loses its end
    (right) or its start (left, the loss still on reply tokens only), or is skipped (delete)."""
    from algorithms.data.loading import DataConfig, RowLimits, load_task
    from algorithms.data.prompts import encode_examples
    from roles.models import load_tokenizer

    tok = load_tokenizer("tiny_qwen2")
    rows = [{"query": "12+3?", "response": "15"}, {"query": "long question " * 20, "response": "answer " * 30}]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    full = encode_examples(tok, [load_task(DataConfig(task="files", paths=[str(path)], val_split=0.0))[0][1]],
                           pretrain=False, chat=False)
    whole = full.prompt_ids[0] + full.completion_ids[0]
    limit = len(whole) - 25
    limits = RowLimits(tok, None, max_length=limit, replies=True, chat=False, truncation=strategy)
    train, _, stats = load_task(DataConfig(task="files", paths=[str(path)], val_split=0.0), limits)
    if strategy == "delete":
        assert len(train) == 1 and stats["data/skipped/too_long"] == 1
        return
    assert len(train) == 2 and stats["data/truncated"] == 1
    cut = encode_examples(tok, [train[1]], pretrain=False, chat=False)
    ids = cut.prompt_ids[0] + cut.completion_ids[0]
    assert len(ids) == limit
    if strategy == "right":
        assert ids == whole[:limit] and cut.prompt_ids[0] == full.prompt_ids[0]
    else:
        assert ids == whole[-limit:] and cut.completion_ids[0] == full.completion_ids[0]
        assert cut.prompt_ids[0] == full.prompt_ids[0][25:]


def test_an_unknown_truncation_strategy_is_refused_before_start(tmp_path):
    from algorithms.data.loading import DataConfig, check_data_files

    path = write_jsonl(tmp_path / "data.jsonl", [{"query": "1", "response": "2"}])
    with pytest.raises(ConfigError, match=r"data.truncation_strategy'='split'.*pretraining"):
        check_data_files(DataConfig(task="files", paths=[str(path)], truncation_strategy="split"))
