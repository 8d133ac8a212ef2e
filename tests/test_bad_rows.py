"""Bad rows never stop a run: undecodable, malformed, wrong-type, empty and over-long rows of a
user file are skipped (over-long SFT replies cut) by the rules of algorithms/data/loading.py, counted per
reason, printed as one line and written into the step-0 metrics record. In-process, no Ray."""
import io
import json
from dataclasses import replace

import pytest

from algorithms import sft
from algorithms.sft import SFTConfig
from algorithms.data.loading import DataConfig, RowLimits, load_task, model_context, row_limits
from algorithms.records.runlog import RunLog
from algorithms.records.trackers import read_metrics
from algorithms.data.tasks import Example
from algorithms.data.user_data import load_user_data
from algorithms.data.prompts import chat_prompt, encode_examples
from algorithms.data.answers import accuracy
from algorithms.records.runlog import record_data_stats
from algorithms.config.schema import LoopConfig
from orchestration.config import ConfigError
from roles.models import load_tokenizer
from roles.rollout import Rollout
from tests.driver_helpers import TINY, prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

# tiny_qwen2: a character tokenizer and a 1024-token context, so N characters are about N tokens.
CONTEXT = 1024
EVAL_NEW = 24
GEN_NEW = 48


def row(prompt="2+3", solution="2+3=5\n#### 5", **extra) -> bytes:
    return json.dumps({"prompt": prompt, "solution": solution, **extra}, ensure_ascii=False).encode()


def good_rows(n: int, start: int = 0) -> list[bytes]:
    return [row(f"{i}+1", f"{i}+1={i + 1}\n#### {i + 1}") for i in range(start, start + n)]


def write(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny_qwen2")


def limits(tokenizer, kind: str, max_length: int = CONTEXT) -> RowLimits:
    """SFT: replies trained on, no training generation; generate: GRPO/distill-like prompts."""
    if kind == "sft":
        return RowLimits(tokenizer, CONTEXT, None, EVAL_NEW, max_length, replies=True)
    return RowLimits(tokenizer, CONTEXT, GEN_NEW, EVAL_NEW, None)


# ------------------------------------------------------------------ reading: one line at a time

# (case, the line as bytes, why it is skipped; None: it is kept)
LINES = [
    ("latin-1 byte", b'{"prompt": "caf\xe9 2+2", "solution": "#### 4"}', "undecodable"),
    ("cut UTF-8 sequence", b'{"prompt": "\xe2\x82 2+2", "solution": "#### 4"}', "undecodable"),
    ("binary garbage", b"\xff\xfe\x00\x01\x80", "undecodable"),
    ("not JSON", b'{"prompt": "2+2", "solution": ', "not_json"),
    ("number for the prompt", row(prompt=7), "wrong_type"),
    ("list for the solution", row(solution=["#### 4"]), "wrong_type"),
    ("row is a list", b'["2+2", "#### 4"]', "wrong_type"),
    ("row is a string", b'"2+2"', "wrong_type"),
    ("messages is text", json.dumps({"messages": "2+2"}).encode(), "wrong_type"),
    ("message without content", json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "4"}]})
     .encode(), "wrong_type"),
    ("number content", json.dumps({"messages": [{"role": "user", "content": 4},
                                                {"role": "assistant", "content": "#### 4"}]}).encode(), "wrong_type"),
    ("unknown role", json.dumps({"messages": [{"role": "user", "content": "2+2"},
                                              {"role": "bot", "content": "#### 4"}]}).encode(), "wrong_type"),
    ("no known columns", json.dumps({"text": "2+2=4"}).encode(), "wrong_type"),
    ("one turn", json.dumps({"messages": [{"role": "user", "content": "2+2"}]}).encode(), "bad_turns"),
    ("ends with the user", json.dumps({"messages": [{"role": "assistant", "content": "hi"},
                                                    {"role": "user", "content": "2+2"}]}).encode(), "bad_turns"),
    ("empty object", b"{}", "empty"),
    ("null fields", b'{"prompt": null, "solution": null}', "empty"),
    ("blank prompt", row(prompt="   "), "empty"),
    ("blank reply", json.dumps({"messages": [{"role": "user", "content": "2+2"},
                                             {"role": "assistant", "content": ""}]}).encode(), "empty"),
    ("non-ASCII text", row(prompt="¿Cuánto es 2+2? ✓", solution="#### 4"), None),
    ("line separator inside a string", row(prompt="2+2\u2028?", solution="#### 4"), None),
    ("byte-order mark", b"\xef\xbb\xbf" + row(), None),
    ("CRLF line end", row() + b"\r", None),
]


@pytest.mark.parametrize("line,reason", [c[1:] for c in LINES], ids=[c[0] for c in LINES])
def test_a_bad_line_costs_only_itself(tmp_path, line, reason):
    path = write(tmp_path / "data.jsonl", [line, *good_rows(2), b"", b"  "])  # blank lines are no rows
    data = load_user_data(path, cache_dir=tmp_path / "cache")
    assert data.skip_reasons == ({reason: 1} if reason else {})
    assert data.skipped == (1 if reason else 0)
    assert [e.prompt for e in data.examples][-2:] == ["0+1", "1+1"]
    assert len(data.examples) == (2 if reason else 3)
    if reason:
        assert data.first_bad[reason].startswith(f"{path}:1: ")


# ------------------------------------------------------------------ lengths: skip or cut

LONG = "9" * 3000
HUGE = "7" * 20000
# (case, row, where it sits, the run's kind, what happens: kept / truncated / too_long)
LENGTHS = [
    ("SFT: 3,000-character reply is cut", row("long?", LONG), "train", "sft", "truncated"),
    ("SFT: 20,000-character reply is cut", row("huge?", HUGE), "train", "sft", "truncated"),
    ("SFT: 3,000-character prompt leaves no reply", row(LONG, "#### 1"), "train", "sft", "too_long"),
    ("SFT: reply within the context", row("long?", "9" * 900), "train", "sft", "kept"),
    ("generate: 3,000-character prompt", row(LONG, "#### 1"), "train", "generate", "too_long"),
    ("generate: prompt just over context - max_new_tokens", row("9" * 980, "#### 1"), "train", "generate", "too_long"),
    ("generate: prompt within context - max_new_tokens", row("9" * 900, "#### 1"), "train", "generate", "kept"),
    ("generate: long replies are not trained on", row("long?", LONG), "train", "generate", "kept"),
    ("held out: 3,000-character prompt", row(LONG, "#### 1"), "held", "sft", "too_long"),
    ("held out: prompt just over context - eval_max_new_tokens", row("9" * 1000, "#### 1"), "held", "generate",
     "too_long"),
    ("held out: long reply is fine", row("long?", LONG), "held", "sft", "kept"),
]


@pytest.mark.parametrize("line,where,kind,outcome", [c[1:] for c in LENGTHS], ids=[c[0] for c in LENGTHS])
def test_length_rules(tmp_path, tokenizer, line, where, kind, outcome):
    """Held-out rows are a file's last eval_size rows that fit; training rows the ones before."""
    lines = good_rows(4) + [line] + good_rows(2, 10) if where == "train" else good_rows(6) + [line]
    path = write(tmp_path / "data.jsonl", lines)
    train, held, stats = load_task(DataConfig(task="files", paths=[str(path)], eval_size=2,
                                              cache_dir=str(tmp_path / "cache")), limits(tokenizer, kind))
    assert stats["data/skipped_rows"] == stats.get("data/skipped/too_long", 0) == (outcome == "too_long")
    assert stats["data/truncated"] == (outcome == "truncated")
    assert len(held) == 2 and len(train) == 7 - len(held) - (outcome == "too_long")
    mine = json.loads(line)["prompt"]
    assert (mine in {e.prompt for e in (train if where == "train" else held)}) == (outcome != "too_long")
    # What the model gets: prompts fit with their generation budget, conversations fit the context.
    budget = EVAL_NEW if where == "held" else GEN_NEW
    for ex in held + (train if kind == "generate" else []):
        assert len(tokenizer(chat_prompt(tokenizer, ex), add_special_tokens=False)["input_ids"]) + budget \
            <= CONTEXT
    if kind == "sft":
        encoded = encode_examples(tokenizer, train, False)
        lengths = [len(p) + len(c) for p, c in zip(encoded.prompt_ids, encoded.completion_ids)]
        assert max(lengths) <= CONTEXT and min(len(c) for c in encoded.completion_ids) >= 1
        assert (max(lengths) == CONTEXT) == (outcome == "truncated")


def test_a_cut_reply_keeps_its_start(tokenizer):
    ex = Example(prompt="1+1", solution="1+1=2\n" + "9" * 200 + "\n#### 2", answer="2")
    encoded = encode_examples(tokenizer, [ex, replace(ex, max_tokens=64)], False)
    assert encoded.prompt_ids[0] == encoded.prompt_ids[1]
    whole, cut = encoded.completion_ids
    assert len(encoded.prompt_ids[1]) + len(cut) == 64 and cut == whole[:len(cut)] and len(whole) > len(cut)


def test_every_kind_of_bad_row_is_counted_and_printed_once(tmp_path, tokenizer, capsys):
    lines = [*good_rows(3), b'{"prompt": "caf\xe9", "solution": "#### 1"}', row(prompt=12), b"{}",
             row(LONG, "#### 1"), row("1+1", HUGE), b"{not json", *good_rows(3, 20), row(LONG, "#### 2")]
    path = write(tmp_path / "data.jsonl", lines)
    train, held, stats = load_task(DataConfig(task="files", paths=[str(path)], eval_size=2,
                                              cache_dir=str(tmp_path / "cache")), limits(tokenizer, "sft"))
    assert stats == {"data/skipped_rows": 6, "data/skipped/undecodable": 1, "data/skipped/not_json": 1,
                     "data/skipped/wrong_type": 1, "data/skipped/empty": 1, "data/skipped/too_long": 2,
                     "data/truncated": 1}
    assert [e.prompt for e in held] == ["21+1", "22+1"]
    assert [e.prompt for e in train] == ["0+1", "1+1", "2+1", "1+1", "20+1"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data:")]
    assert len(lines) == 1
    for part in ("5 train / 2 held-out", "skipped 6 rows", "undecodable 1", "not_json 1", "wrong_type 1", "empty 1",
                 "too_long 2", f"{path}:4: not UTF-8", "a held-out prompt of", "cut to 1024 tokens: 1"):
        assert part in lines[0]


def test_an_overlong_heldout_row_does_not_kill_the_eval(tmp_path, tokenizer):
    """The rollout refuses a prompt over its context; the length rule keeps such rows out."""
    path = write(tmp_path / "data.jsonl", good_rows(6) + [row(LONG, "#### 1")])
    data = DataConfig(task="files", paths=[str(path)], eval_size=2, cache_dir=str(tmp_path / "cache"))
    rollout = Rollout("tiny_qwen2")
    _, unchecked, _ = load_task(data)
    with pytest.raises(ValueError, match="exceed the model's max_position_embeddings"):
        accuracy(OneRank(rollout), unchecked, EVAL_NEW)
    _, held, stats = load_task(data, limits(tokenizer, "generate"))
    assert stats["data/skipped/too_long"] == 1 and len(held) == 2
    assert accuracy(OneRank(rollout), held, EVAL_NEW) in (0.0, 0.5, 1.0)


class OneRank:
    """A rollout behind the group interface that accuracy calls."""

    def __init__(self, rollout):
        self.rollout = rollout

    def call(self, method, *args, **kwargs):
        return getattr(self.rollout, method)(*args)


# ------------------------------------------------------------------ limits from a run's config

# (case, overrides, kwargs of row_limits, (context, prompt budget, max_length))
CONFIGS = [
    ("SFT: the model's context", [], {"replies": True}, (1024, None, 1024)),
    ("SFT: data.max_length", ["data.max_length=256"], {"replies": True}, (1024, None, 256)),
    ("SFT: data.max_length=0 is the context", ["data.max_length=0"], {"replies": True}, (1024, None, 1024)),
    ("SFT: never past the context", ["data.max_length=4096"], {"replies": True}, (1024, None, 1024)),
    ("SFT: a shorter model", ["model.max_position_embeddings=300"], {"replies": True}, (300, None, 300)),
    ("generate: max_new_tokens", [], {"new_tokens": 48}, (1024, 48, None)),
    ("generate: vLLM's max_model_len", ["backend.rollout=vllm", "vllm.max_model_len=512"], {"new_tokens": 48},
     (512, 48, None)),
    ("generate: a teacher with a shorter context", [], {"new_tokens": 48, "replies": True,
                                                        "teacher": {"max_position_embeddings": 200}},
     (200, 48, 200)),
]


@pytest.mark.parametrize("overrides,kwargs,want", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_row_limits_from_the_run_config(overrides, kwargs, want):
    _, typed, _ = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, *overrides])
    got = row_limits(typed, **kwargs)
    assert (got.context, got.new_tokens, got.max_length) == want
    assert got.eval_new_tokens == typed.run.eval_max_new_tokens == 12


def test_limits_refuse_what_cannot_run(tmp_path, tokenizer):
    _, typed, _ = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, "data.max_length=-5"])
    with pytest.raises(ConfigError, match="data.max_length"):
        row_limits(typed, replies=True)
    # No held-out prompt leaves room for the eval budget: one error that names the fix.
    with pytest.raises(ConfigError, match="run.eval_max_new_tokens"):
        load_task(DataConfig(train_size=20, eval_size=4), RowLimits(tokenizer, 64, None, 60, 64))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 300}))
    assert model_context(str(tmp_path / "ckpt")) == 300


# ------------------------------------------------------------------ a whole run

def test_sft_run_on_bad_rows_finishes_and_records_the_counts(tmp_path, capsys):
    """A local SFT run on a file with every kind of bad row, a 20,000-character reply that training
    draws and a 3,000-character held-out row: it trains, evaluates, and step 0 holds the counts."""
    lines = [*good_rows(4), b'{"prompt": "\xff", "solution": "#### 1"}', row(prompt=3.5), b'{"prompt": ""}',
             row(LONG, "#### 1"), row("5+5", HUGE), b"{", *good_rows(3, 20), row(LONG + "?", "#### 2")]
    path = write(tmp_path / "data.jsonl", lines)
    cfg, typed, plan = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, "backend=local",
                                               "data.task=files", f"data.paths=[{path}]",
                                               f"data.cache_dir={tmp_path / 'cache'}", "run.save_final=false"])
    sft.validate(typed, plan)
    sft.run(typed, plan, tmp_path / "run")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    first = records[0]
    assert {k: first[k] for k in first if k.startswith("data/")} == {
        "data/skipped_rows": 6, "data/skipped/undecodable": 1, "data/skipped/not_json": 1,
        "data/skipped/wrong_type": 1, "data/skipped/empty": 1, "data/skipped/too_long": 2, "data/truncated": 1}
    assert not any(k.startswith("data/") for r in records[1:] for k in r)
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in (records[0], records[-1]))
    # 5 training rows, 4 per step over 3 steps: the 20,000-character reply was trained on, cut to
    # the 1024-token context (whole, it alone would be about 20,000 tokens).
    assert 1000 < max(r["train/tokens"] for r in records[1:]) < 2000
    assert all(r["train/loss"] > 0 for r in records[1:])
    out = capsys.readouterr().out
    assert sum(line.startswith("data:") for line in out.splitlines()) == 1
    assert "sft: 5 train / 3 held-out examples" in out


def test_counts_go_into_step_0_only_of_a_fresh_run(tmp_path):
    """A run resuming from a checkpoint keeps its earlier step-0 record: the counts are not
    written again into the first step after the checkpoint."""
    stats = {"data/skipped_rows": 2, "data/skipped/empty": 2, "data/truncated": 0}
    fresh = RunLog(tmp_path / "fresh", 2, LoopConfig(), stream=io.StringIO())
    record_data_stats(fresh, stats, "auto")  # auto without a checkpoint: a fresh start
    fresh.step(0, {})
    step = tmp_path / "resumed" / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    for name in ("trainer_state.pt", "config.json"):
        (step / name).write_text("{}")
    (step / "driver_state.json").write_text(json.dumps({"step": 1}))
    resumed = RunLog(tmp_path / "resumed", 2, LoopConfig(), stream=io.StringIO())
    record_data_stats(resumed, stats, "auto")
    resumed.step(2, {})
    fresh.close(), resumed.close()
    assert read_metrics(tmp_path / "fresh" / "metrics.jsonl")[0]["data/skipped/empty"] == 2
    assert not any(k.startswith("data/") for k in read_metrics(tmp_path / "resumed" / "metrics.jsonl")[0])
