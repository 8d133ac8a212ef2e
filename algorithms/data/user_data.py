"""A user's data as lists of `Example` (pure Python, no Ray).

`load_user_data` reads JSONL, JSON, CSV, Parquet files or save_to_disk folders, with the
columns ms-swift reads (messages, ShareGPT, query/response, alpaca, prompt/solution,
prompt/completion; prompt-only rows for RL). Bad rows are skipped and counted by reason
(`SKIP_REASONS`), never fatal; a path that cannot be read at all raises `UnreadableData`.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from algorithms.data.tasks import CHAT_ROLES, Example, split_solution

logger = logging.getLogger(__name__)

# Why a row of a user file is skipped (UserData.skip_reasons keys):
#   undecodable: the line is not UTF-8; not_json: the line is not JSON;
#   wrong_type: not an object, no known columns, a column of the wrong type (a message not
#     {role, content} / {from, value} with a known role and text, a question or reply not text);
#   bad_turns: a conversation that does not end with a user turn (then optionally an assistant
#     reply), or ends with the user in a row with no `solution`/`answer` to check a reply against;
#   empty: every field is null/blank, or the question or reply is blank;
#   no_reply: a prompt-only row in a run that trains on replies (decided by algorithms/data/loading.py);
#   too_long: over the run's token limits (decided by algorithms/data/loading.py, not here).
SKIP_REASONS = ("undecodable", "not_json", "wrong_type", "bad_turns", "empty", "no_reply", "too_long")

# The columns a row is read from (after data.columns renames), as ms-swift names them; see
# `_row_example` for which combinations make a row (teacher_prompt: the teacher's last user
# turn in GKD, read from Example.columns by algorithms/gkd.py).
KNOWN_COLUMNS = ("messages", "conversations", "system", "query", "response", "history", "instruction", "input",
                 "output", "prompt", "completion", "solution", "answer", "teacher_prompt")
# Columns of multimodal rows (ms-swift's images/videos/audios): refused, never dropped unseen.
MEDIA_COLUMNS = ("images", "videos", "audios")
# ShareGPT speakers (`conversations` rows' `from`) as chat roles.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
# File kinds by extension (.arrow: a split as `datasets` caches it); a folder here is one
# written by `datasets.Dataset.save_to_disk` (other folders are split into files by loading.py).
FILE_FORMATS = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


class BadRow(ValueError):
    """A row that cannot be used; `reason` is one of SKIP_REASONS."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class UnreadableData(ValueError):
    """A file or folder that cannot be read at all (unlike a bad row, it stops the run)."""

    def __init__(self, path: str, problem: str, fix: str):
        super().__init__(f"{path} {problem}")
        self.path, self.problem, self.fix = path, problem, fix


@dataclass
class UserData:
    # Examples read from the file(s).
    examples: List[Example]
    # Rows skipped because they could not be used (log it as a metric).
    skipped: int
    # Why rows were skipped: reason (one of SKIP_REASONS) -> count.
    skip_reasons: Dict[str, int]
    # The first skipped row of each reason: reason -> "path:line: what is wrong".
    first_bad: Dict[str, str] = field(default_factory=dict)


def saved_folder(path: str) -> bool:
    """Whether `path` is a folder written by save_to_disk (its marker files)."""
    return any(os.path.isfile(os.path.join(path, marker)) for marker in ("state.json", "dataset_dict.json"))


def file_format(path: str) -> str:
    """The kind of a data path ("jsonl", "json", "csv", "parquet", "arrow" or "saved" for a
    save_to_disk folder), from its name and, for a folder, its marker files; nothing is read.
    Raises UnreadableData for a missing path, an unknown extension or another folder."""
    if os.path.isdir(path):
        if saved_folder(path):
            return "saved"
        raise UnreadableData(path, "is a folder not written by datasets' save_to_disk (no state.json or "
                                   "dataset_dict.json in it)", "give the data files themselves, or a folder "
                                   "written by Dataset.save_to_disk / DatasetDict.save_to_disk")
    if not os.path.exists(path):  # a hub id was looked up before (algorithms/data/loading.py)
        raise UnreadableData(path, "does not exist", "give an existing file or folder")
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_FORMATS:
        raise UnreadableData(path, f"has an unknown extension {ext or '(none)'!r}",
                             f"use one of {sorted(FILE_FORMATS)} or a save_to_disk folder")
    return FILE_FORMATS[ext]


def _blank(value) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return value is None or (isinstance(value, (list, dict)) and not value)


def _text(row: dict, key: str, required: bool = True) -> Optional[str]:
    """Column `key` as text; None when it is absent (null) and not required."""
    value = row.get(key)
    if value is None:
        if required:
            raise BadRow("wrong_type", f"no '{key}' text")
        return None
    if not isinstance(value, str):
        raise BadRow("wrong_type", f"'{key}' is {type(value).__name__}, not text")
    return value


def _chat(row: dict) -> tuple[List[Dict[str, str]], Optional[str]]:
    """(turns ending with the user, reply or None) of a `messages` or ShareGPT `conversations` row."""
    key = "messages" if row.get("messages") is not None else "conversations"
    turns = row[key]
    if not isinstance(turns, list):
        raise BadRow("wrong_type", f"'{key}' is {type(turns).__name__}, not a list")
    out = []
    for m in turns:
        role = content = None
        if isinstance(m, dict) and "role" in m:
            role, content = m["role"], m.get("content")
        elif isinstance(m, dict):  # ShareGPT: {from: human/gpt/system, value}
            role, content = SHAREGPT_ROLES.get(m.get("from")), m.get("value")
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise BadRow("wrong_type", f"a message of '{key}' is not {{role: one of {list(CHAT_ROLES)}, content: "
                                       "text}} or {from: human/gpt/system, value: text}")
        out.append({"role": role, "content": content})
    reply = None
    if out and out[-1]["role"] == "assistant":
        reply = out.pop()["content"]
    if not out or out[-1]["role"] != "user":
        raise BadRow("bad_turns", f"'{key}' must end with a user turn (then, optionally, the assistant reply)")
    return out, reply


def _turns(row: dict) -> tuple[List[Dict[str, str]], Optional[str], bool]:
    """(turns ending with the user's question, the reply or None, whether `solution` was the reply)."""
    system = _text(row, "system", required=False)
    turns = [{"role": "system", "content": system}] if system is not None else []
    if row.get("messages") is not None or row.get("conversations") is not None:
        chat, reply = _chat(row)
        return (chat if chat[0]["role"] == "system" else turns + chat), reply, False
    if row.get("query") is not None:
        history = row.get("history") or []
        if not isinstance(history, list) or not all(
                isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(t, str) for t in pair)
                for pair in history):
            raise BadRow("wrong_type", "'history' is not a list of [question, reply] text pairs")
        for question, answer in history:
            turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return turns + [{"role": "user", "content": _text(row, "query")}], _text(row, "response", False), False
    if row.get("instruction") is not None:
        # Alpaca: the input, when there is one, follows the instruction on its own line.
        prompt, extra = _text(row, "instruction"), _text(row, "input", required=False)
        prompt = f"{prompt}\n{extra}" if extra and extra.strip() else prompt
        return turns + [{"role": "user", "content": prompt}], _text(row, "output", False), False
    if row.get("prompt") is not None:
        prompt = [{"role": "user", "content": _text(row, "prompt")}]
        if row.get("completion") is not None:
            return turns + prompt, _text(row, "completion"), False
        # The project's own prompt/solution rows: the solution is the reply.
        solution = _text(row, "solution", required=False)
        return turns + prompt, solution, solution is not None
    raise BadRow("wrong_type", f"no known columns (got {sorted(map(str, row))}; reads {list(KNOWN_COLUMNS)}); "
                               "rename yours with data.columns")


def _row_example(row, source: str, columns: Optional[Dict[str, str]] = None) -> Example:
    """An Example from one row; raises BadRow with the reason when the row is unusable.

    A row without a reply (messages ending with the user, `query` without `response`, ...) is a
    prompt-only example, as GRPO datasets hold them: its `solution` is "" and its answer comes
    from the row's `answer` or `solution` column (the reference), which it must have."""
    if not isinstance(row, dict):
        raise BadRow("wrong_type", f"the row is {type(row).__name__}, not an object")
    if columns:
        row = {columns.get(k, k): v for k, v in row.items()}
    if all(_blank(v) for v in row.values()):
        raise BadRow("empty", "every field is empty")
    turns, reply, solution_is_reply = _turns(row)
    reference = None if solution_is_reply else _text(row, "solution", required=False)
    explicit = row.get("answer")
    if not isinstance(explicit, (str, int, float)) or isinstance(explicit, bool) or not str(explicit).strip():
        explicit = None
    # A row with an environment (env_config: a multi-turn gym_env) is judged by it, not a reference.
    if reply is None and explicit is None and reference is None and _blank(row.get("env_config")):
        chat = row.get("messages") is not None or row.get("conversations") is not None
        raise BadRow("bad_turns" if chat else "wrong_type",
                     "no reply, and no 'solution' or 'answer' to check a generated one against")
    prompt = turns[-1]["content"]
    if not prompt.strip() or (reply is not None and not reply.strip()):
        raise BadRow("empty", "the question or the reply is blank")
    steps, after = split_solution(reply) if reply is not None else ([], "")
    # An explicit answer wins, then a reference solution, then the reply's '#### N', then the
    # whole reply (a bare answer such as "47").
    if explicit is not None:
        answer = str(explicit).strip()
    elif reference is not None and reference.strip():
        answer = reference.strip()
    else:
        answer = after or (reply or "").strip()
    return Example(prompt=prompt, solution=reply or "", answer=answer, steps=steps,
                   context=turns if len(turns) > 1 else [], source=source, columns=dict(row))


def _lines(path: str, cache_dir: Optional[str]):
    """(line number, row or None, BadRow or None) per non-blank line of a JSON-lines file, read
    through `datasets` in streaming mode (only a lock file goes to `cache_dir`, default:
    datasets' own).

    Lines are read as Latin-1 text, which any bytes decode to one for one, then each line is
    decoded as UTF-8 by itself: a non-UTF-8 byte, or `datasets`' JSON reader meeting a
    malformed line, would otherwise stop the whole file, and a bad line must cost only itself.
    """
    from datasets import load_dataset

    lines = load_dataset("text", data_files=path, split="train", streaming=True, cache_dir=cache_dir,
                         encoding="latin-1")
    for number, line in enumerate(lines, 1):
        raw = line["text"]
        if not raw.strip():
            continue
        try:
            # A byte-order mark some editors write is no part of the first row.
            text = raw.encode("latin-1").decode("utf-8").lstrip("\ufeff")
        except UnicodeDecodeError as err:
            yield number, None, BadRow("undecodable", f"not UTF-8 ({err.reason} at byte {err.start})")
            continue
        try:
            yield number, json.loads(text), None
        except json.JSONDecodeError as err:
            yield number, None, BadRow("not_json", f"not JSON ({err.msg})")


def _json_array(path: str) -> Optional[list]:
    """The rows of a .json file holding one JSON array; None when it holds JSON lines instead."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if not head.startswith(b"["):
        return None
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnreadableData(path, f"starts a JSON array but is not valid JSON ({err})",
                             "fix the file, or write one JSON object per line (.jsonl)") from None


def _csv_rows(path: str):
    """(line number, row) per CSV record; blank cells are absent columns, and `messages`,
    `conversations` and `history` cells hold JSON text."""
    import csv

    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames:
                raise UnreadableData(path, "has no header line", "write the column names on its first line")
            for record in reader:
                row = {k: (None if v == "" else v) for k, v in record.items() if k is not None}
                for key in ("messages", "conversations", "history"):
                    if isinstance(row.get(key), str):
                        try:
                            row[key] = json.loads(row[key])
                        except json.JSONDecodeError:
                            pass  # stays text: the row is skipped as wrong_type
                yield reader.line_num, row
    except (UnicodeDecodeError, csv.Error) as err:
        raise UnreadableData(path, f"is not readable CSV ({err})", "write it as UTF-8 CSV with a header line") \
            from None


def _table_rows(path: str, kind: str):
    """Rows of a Parquet or arrow file or a save_to_disk folder (a DatasetDict's "train" split)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
            yield from (row for batch in batches for row in batch.to_pylist())
        except Exception as err:  # pyarrow's errors for a damaged or non-Parquet file vary by cause
            raise UnreadableData(path, f"is not readable Parquet ({type(err).__name__}: {err})",
                                 "write it again, e.g. with pandas.DataFrame.to_parquet") from None
        return
    from datasets import Dataset, DatasetDict, load_from_disk

    try:
        data = Dataset.from_file(path) if kind == "arrow" else load_from_disk(path)
    except Exception as err:  # datasets' errors for a damaged folder vary by cause
        raise UnreadableData(path, f"is not a readable save_to_disk folder ({type(err).__name__}: {err})",
                             "save it again with Dataset.save_to_disk") from None
    if isinstance(data, DatasetDict):
        if "train" not in data:
            raise UnreadableData(path, f"holds the splits {list(data)} and no 'train'",
                                 "save the training rows as the 'train' split, or save that split alone")
        data = data["train"]
    yield from data


def _rows(paths: Sequence[str], cache_dir: Optional[str]):
    """(path, number, row or None, BadRow or None) per row of the files: the line for JSON
    lines and CSV, the row for JSON arrays, Parquet and save_to_disk folders. Blank lines are
    no rows: they are passed over without a count."""
    for path in paths:
        kind = file_format(path)
        rows = _json_array(path) if kind == "json" else None
        if kind == "csv":
            yield from ((path, number, row, None) for number, row in _csv_rows(path))
        elif kind in ("parquet", "arrow", "saved"):
            yield from ((path, number, row, None) for number, row in enumerate(_table_rows(path, kind), 1))
        elif rows is not None:
            yield from ((path, number, row, None) for number, row in enumerate(rows, 1))
        else:
            yield from ((path, number, row, bad) for number, row, bad in _lines(path, cache_dir))


def load_user_data(paths, max_examples: Optional[int] = None, cache_dir: Optional[str] = None,
                   columns: Optional[Dict[str, str]] = None) -> UserData:
    """Examples from JSON lines (.jsonl, .json), a JSON array (.json), CSV, Parquet or a
    `save_to_disk` folder, with columns renamed by `columns` first (data.columns).

    Rows are read the ms-swift way: `messages` ({role, content}) or ShareGPT `conversations`
    ({from, value}); `query`/`response` (+ `system`, `history` [[q, r], ...]); alpaca
    `instruction`/`input`/`output`; `prompt`/`solution`; `prompt`/`completion`; optionally
    `answer`. A row without a reply is a prompt-only example (see `_row_example`). Rows that
    cannot be used are skipped and counted in `skipped`/`skip_reasons` by reason (SKIP_REASONS),
    never raised; a path that cannot be read at all raises UnreadableData.
    """
    single = isinstance(paths, (str, os.PathLike))
    path_list = [os.fspath(paths)] if single else [os.fspath(p) for p in paths]
    examples: List[Example] = []
    reasons: Counter = Counter()
    first_bad: Dict[str, str] = {}
    for path, number, row, bad in _rows(path_list, None if cache_dir is None else os.fspath(cache_dir)):
        if max_examples is not None and len(examples) >= max_examples:
            break
        media = [c for c in MEDIA_COLUMNS if isinstance(row, dict) and not _blank(row.get(c))]
        if media:
            raise UnreadableData(path, f"row {number} carries {media[0]}: vision and audio rows are not trained "
                                 "here (the models are text causal LMs), and dropping them would change the data",
                                 f"use a text dataset, or remove the {media[0]} column where the text alone "
                                 "is the task")
        try:
            if bad is not None:
                raise bad
            examples.append(_row_example(row, source=path, columns=columns))
        except BadRow as err:
            reasons[err.reason] += 1
            first_bad.setdefault(err.reason, f"{path}:{number}: {err}")
    skipped = sum(reasons.values())
    if skipped:
        logger.debug("skipped %d bad rows of %s: %s", skipped, path_list, first_bad)
    return UserData(examples=examples, skipped=skipped, skip_reasons=dict(reasons), first_bad=first_bad)
