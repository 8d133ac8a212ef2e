"""Task selection for the drivers: `data:` config -> training and held-out examples.

A generated task (arithmetic, gsm) draws data.train_size training and data.eval_size held-out
examples. A user's data (task=files, read by algorithms/data/user_data.py) is a list of entries
as ms-swift's `dataset` takes them: a file, a folder, or a hub id in a local cache (roles/hub.py),
each optionally `#N`: N rows drawn from that entry alone, seeded by data.seed (ms-swift's
dataset_sample: past its size every row repeats, then the rest are drawn). Without `#N` an entry
is used whole; data.max_rows caps the rows read. Held-out rows are data.val_paths' rows, a
seeded data.val_split share of each entry's rows (0: none, and no evaluation), or else the last
data.eval_size rows; never a training row. data.eval_size caps the held-out prompts evaluated.
`check_data_files` checks the entries (a missing hub id included) before anything starts.

Bad rows never stop a run. Rows a user file cannot give (algorithms/data/user_data.py SKIP_REASONS) are
skipped, and, given the run's `RowLimits`, so are rows longer than the run's models take:

* a prompt generated from (training prompts of GRPO, GKD and distill, every held-out prompt)
  must fit the context with the generation budget: prompt tokens + max_new_tokens (held out:
  run.eval_max_new_tokens) <= context. Longer prompts are skipped: cutting one changes the task.
* a conversation trained on (SFT, GKD's dataset replies) may be data.max_length tokens long (0 or
  null: the context); a longer reply is cut at its end and counted, a row whose prompt alone
  leaves no reply token is skipped.

Lengths are counted with the run's tokenizer on the chat-rendered text, as the rollout and
`encode_examples` feed it. `load_task` prints one line with the counts per reason and returns
them as the stats the drivers write into their step-0 metrics record.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Optional

from algorithms.data.prompts import chat_prompt, chat_texts
from algorithms.data.tasks import ArithmeticConfig, Example, arithmetic_examples, gsm_examples
from algorithms.data.entries import draw, entry_files, entry_rng, hold_out
from algorithms.data.user_data import KNOWN_COLUMNS, SKIP_REASONS, UnreadableData, load_user_data
from orchestration.config import ConfigError
from roles.engines.vllm_build import vllm_options
from roles.models import load_tokenizer, resolve_config


@dataclass
class DataConfig:
    # Task: "arithmetic" (generated chains), "gsm" (GSM8K-style word problems) or
    # "files" (the user's own data in data.paths, read with ms-swift's column names).
    task: str = "arithmetic"
    # Difficulty of the arithmetic task.
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    # task=files: .jsonl, .json (array or lines), .csv, .parquet, .arrow files, save_to_disk
    # folders (a DatasetDict's "train" split), folders of such files or hub ids in a local
    # cache (their train split's files), each optionally '#N' (N rows drawn from it, with
    # repeats past its size), ms-swift's `dataset` syntax: [hf::|ms::]org/name[:subset][#N].
    paths: List[str] = field(default_factory=list)
    # task=files: entries of held-out rows, as data.paths (ms-swift's val_dataset); none is trained on.
    val_paths: List[str] = field(default_factory=list)
    # task=files: share of each data.paths entry's rows held out (at least one row), drawn by a
    # shuffle seeded with data.seed (ms-swift's split_dataset_ratio); 0: none held out and no
    # evaluation. Null, and no val_paths: the last eval_size rows.
    val_split: Optional[float] = None
    # task=files: read at most this many usable rows of data.paths, first rows first (before
    # any '#N' draw); null: all.
    max_rows: Optional[int] = None
    # Renames of a user's columns, applied to every row first (ms-swift's --columns); on the
    # command line Hydra adds keys with '+': +data.columns={question:query,answer_text:response}.
    columns: Dict[str, str] = field(default_factory=dict)
    # Training examples drawn by a generated task (arithmetic, gsm); task=files ignores it.
    train_size: int = 2000
    # Most held-out prompts evaluated (eval/accuracy); also how many of a file's last rows are
    # held out when neither val_paths nor val_split is set.
    eval_size: int = 64
    # Seed of the task generators and of val_split's shuffle.
    seed: int = 0
    # Cache folder of the `datasets` loader for task=files; None: its default.
    cache_dir: Optional[str] = None
    # Longest training conversation (prompt + reply) in tokens for SFT and GKD's dataset
    # replies; longer ones go as truncation_strategy says. 0 or null: the model's context.
    max_length: Optional[int] = None
    # What happens to a training conversation longer than max_length (ms-swift's
    # truncation_strategy): "right": its end is cut (the reply's end; no eos); "left": its start
    # is cut (the prompt's first tokens, then the reply's if need be; the loss stays on reply
    # tokens); "delete": the row is skipped (counted as too_long). A prompt too long to generate
    # from, or leaving no reply token within max_length, is skipped whatever the strategy.
    truncation_strategy: str = "right"
    # How a reply is judged right, for every logged accuracy (eval/accuracy, rollout/accuracy,
    # teacher/eval_accuracy, distill's) and GRPO's `accuracy` reward; the answer is the row's
    # `answer` (or the text after '####'), else its whole reply. "numeric": the reply's last
    # '#### N' equals it as a number; "exact": the reply equals it (whitespace runs collapsed,
    # case ignored); "last_number": the reply's last number equals it (bare-number answers);
    # "regex": check_pattern's first group (else whole match) of its last match in the reply
    # equals it; "boxed": the last \boxed{...} of the reply equals it (regex and boxed compare
    # as numbers when both are); or a dotted path 'pkg.mod.fn' to fn(prompts, completions,
    # references) -> list[float] (accuracy: the mean score). Scored by roles/orm.py's kinds.
    check: str = "numeric"
    # Regular expression of check=regex (and GRPO's `regex` reward): its first group (else the
    # whole match) is the reply's answer, e.g. 'answer: (\S+)'.
    check_pattern: Optional[str] = None
    # Prompts as every role renders them: true: the tokenizer's chat template; false: plain
    # text (the user text, a conversation's contents joined by newlines; training text is
    # prompt + reply + eos); null: the template when the run's tokenizer has one, else plain.
    chat: Optional[bool] = None
    # The chat template's thinking switch (ms-swift's enable_thinking), passed to every
    # rendering as apply_chat_template(..., enable_thinking=...): Qwen3's templates then open
    # (true) or close (false: an empty think block) the reply's reasoning. null: the
    # template's default. Needs a chat template (data.chat not false).
    enable_thinking: Optional[bool] = None
    # A system turn put before every row that has none (ms-swift's `system`): the text itself,
    # or the path of a .txt file holding it. null: rows as they are.
    system: Optional[str] = None


# data.truncation_strategy's values.
TRUNCATION_STRATEGIES = ("right", "left", "delete")


@dataclass
class RowLimits:
    """What a run's models take, in tokens; built by `row_limits` from a driver's config."""
    # The run's tokenizer (roles.models.load_tokenizer).
    tokenizer: Any
    # Longest sequence (prompt + generation) the run's models take; None: unknown, prompts
    # are not checked.
    context: Optional[int]
    # Tokens generated after a training prompt; None: training prompts are not generated from.
    new_tokens: Optional[int] = None
    # Tokens generated after a held-out prompt (run.eval_max_new_tokens).
    eval_new_tokens: int = 0
    # Longest training conversation trained on, replies cut to it; None: replies are not cut.
    max_length: Optional[int] = None
    # The run trains on the dataset's replies (SFT, GKD's dataset replies): prompt-only
    # training rows are skipped as no_reply. Held-out rows never need one.
    replies: bool = False
    # data.chat: how prompts are rendered, so lengths are counted on the text the models read.
    chat: Optional[bool] = None
    # data.enable_thinking: the template's thinking switch, for the same reason.
    enable_thinking: Optional[bool] = None
    # data.truncation_strategy: how a conversation over max_length is cut (or skipped).
    truncation: str = "right"


def model_context(spec: Any) -> Optional[int]:
    """Longest sequence of a model spec (preset, ModelConfig, mapping or checkpoint directory):
    its max_position_embeddings (config.json for a checkpoint); None when config.json has none."""
    cfg = resolve_config(spec)
    if cfg.path is None:
        return cfg.max_position_embeddings
    path = Path(cfg.path) / "config.json"
    if not path.is_file():  # validation names the missing file; nothing to measure against here
        return None
    config = json.loads(path.read_text())
    # GPT-2-style and other configs name it differently.
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def row_limits(cfg: Any, new_tokens: Optional[int] = None, replies: bool = False,
               teacher: Any = None) -> RowLimits:
    """The limits of a driver's run config `cfg` (model, run, data, backend and vllm sections):
    training prompts are generated from with `new_tokens` (None: they are not, as in SFT);
    `replies`: the run trains on the dataset's replies; `teacher`: a teacher model that reads
    the same sequences (its context counts too)."""
    contexts = [model_context(cfg.model)] + ([model_context(teacher)] if teacher is not None else [])
    # A vLLM engine's own limit, where set (null: the model's context, counted above).
    if new_tokens is not None and cfg.backend.rollout == "vllm" and vllm_options(cfg.vllm, "rollout").max_model_len:
        contexts.append(vllm_options(cfg.vllm, "rollout").max_model_len)
    if teacher is not None and cfg.backend.teacher == "vllm" and vllm_options(cfg.vllm, "teacher").max_model_len:
        # It needs one position past the sequence.
        contexts.append(vllm_options(cfg.vllm, "teacher").max_model_len - 1)
    known = [c for c in contexts if c is not None]
    context = min(known) if known else None
    max_length = None
    if replies:
        if (cfg.data.max_length or 0) < 0:
            raise ConfigError(f"config key 'data.max_length'={cfg.data.max_length} is negative. "
                              "Fix: a token count, or 0 for the model's context")
        # Never past the context: positions beyond it do not exist.
        bounds = [x for x in (cfg.data.max_length, context) if x]
        max_length = min(bounds) if bounds else None
    return RowLimits(load_tokenizer(cfg.model), context, new_tokens, cfg.run.eval_max_new_tokens, max_length,
                     replies, cfg.data.chat, cfg.data.enable_thinking, cfg.data.truncation_strategy)


class _Tally:
    """Skipped rows per reason (with the first of each) and cut replies."""

    def __init__(self, reasons: Optional[dict] = None, first: Optional[dict] = None):
        self.reasons: Counter = Counter(reasons or {})
        self.first: dict = dict(first or {})
        self.truncated = 0

    def skip(self, reason: str, where: str) -> None:
        self.reasons[reason] += 1
        self.first.setdefault(reason, where)

    def stats(self) -> dict:
        order = sorted(self.reasons, key=lambda r: SKIP_REASONS.index(r) if r in SKIP_REASONS else len(SKIP_REASONS))
        return {"data/skipped_rows": sum(self.reasons.values()),
                **{f"data/skipped/{r}": self.reasons[r] for r in order}, "data/truncated": self.truncated}


def _prompt_limit(limits: Optional[RowLimits], held_out: bool) -> Optional[int]:
    budget = None if limits is None else limits.eval_new_tokens if held_out else limits.new_tokens
    return None if budget is None or limits.context is None else limits.context - budget


def _lengths(tokenizer: Any, examples: list[Example], whole: bool, chat: Optional[bool] = None,
             enable_thinking: Optional[bool] = None) -> tuple[list[int], list[int]]:
    """Token counts of each example's rendered prompt and (whole=True, else zeros) whole conversation."""
    texts = [chat_texts(tokenizer, ex, chat, enable_thinking) if whole
             else (chat_prompt(tokenizer, ex, chat, enable_thinking), "") for ex in examples]

    def count(strings: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(strings, add_special_tokens=False)["input_ids"]] if strings else []

    return count([p for p, _ in texts]), count([f for _, f in texts]) if whole else [0] * len(texts)


def _fit(examples: list[Example], limits: Optional[RowLimits], held_out: bool, tally: _Tally,
         want: Optional[int] = None) -> list[tuple[int, Example]]:
    """(index, example) of the examples that meet the limits, in their order (replies of
    training rows cut to max_length); the others are counted as too_long. `want`: the first
    this many that meet them; no row after those is looked at."""
    prompt_limit = _prompt_limit(limits, held_out)
    max_length = None if held_out or limits is None else limits.max_length
    if prompt_limit is None and max_length is None:
        return list(enumerate(examples))[:want]
    kept: list[tuple[int, Example]] = []
    # Lengths a chunk at a time: the held-out search usually ends within its first chunk.
    chunk = max(want or 0, 256)
    for start in range(0, len(examples), chunk):
        prompts, fulls = _lengths(limits.tokenizer, examples[start:start + chunk], max_length is not None,
                                 limits.chat, limits.enable_thinking)
        for i, p, f in zip(range(start, start + chunk), prompts, fulls):
            if want is not None and len(kept) == want:
                return kept
            ex = examples[i]
            if prompt_limit is not None and p > prompt_limit:
                budget = (f"run.eval_max_new_tokens {limits.eval_new_tokens}" if held_out
                          else f"max_new_tokens {limits.new_tokens}")
                tally.skip("too_long", f"{ex.source}: a {'held-out ' if held_out else ''}prompt of {p} tokens, "
                                       f"over {prompt_limit} (context {limits.context} - {budget})")
            elif max_length is not None and p >= max_length:
                tally.skip("too_long", f"{ex.source}: a prompt of {p} tokens leaves no reply token within "
                                       f"{max_length}")
            elif max_length is not None and f > max_length and limits.truncation == "delete":
                tally.skip("too_long", f"{ex.source}: a conversation of {f} tokens, over data.max_length "
                                       f"{max_length} (data.truncation_strategy=delete)")
            else:
                if max_length is not None and f > max_length:
                    ex = replace(ex, max_tokens=max_length, cut_left=limits.truncation == "left")
                    tally.truncated += 1
                kept.append((i, ex))
    return kept


def check_data_files(cfg: DataConfig) -> None:
    """The checks of the user-data keys that need no reading: task=files has paths, every entry
    of data.paths and data.val_paths is a file of a known format, a folder with a train split or
    a hub id in a local cache (algorithms/data/entries.py), val_split, max_rows and columns are
    sound, and no user-data key is set for a generated task. Raises ConfigError."""
    if cfg.truncation_strategy not in TRUNCATION_STRATEGIES:
        raise ConfigError(f"config key 'data.truncation_strategy'={cfg.truncation_strategy!r} is not a strategy. Fix: "
                          f"use one of {list(TRUNCATION_STRATEGIES)} (ms-swift's 'split' is for pretraining "
                          "corpora and is not implemented here)")
    files = cfg.task == "files"
    for key, value in (("paths", list(cfg.paths)), ("val_paths", list(cfg.val_paths)), ("val_split", cfg.val_split),
                       ("max_rows", cfg.max_rows)):
        if not files and value not in (None, []):
            raise ConfigError(f"config key 'data.{key}'={value} is set but data.task={cfg.task} generates its "
                              "examples and reads no file. Fix: set data.task=files to train on your data, or drop "
                              f"data.{key}")
    if not files:
        return
    if not cfg.paths:
        raise ConfigError("config key 'data.paths'=[] is empty with data.task=files. Fix: data.paths=[/path/train.jsonl]")
    for key in ("paths", "val_paths"):
        for item in getattr(cfg, key):
            entry_files(key, item)
    if cfg.val_split is not None and not 0.0 <= cfg.val_split < 1.0:
        raise ConfigError(f"config key 'data.val_split'={cfg.val_split} is not a fraction in [0, 1). "
                          "Fix: e.g. data.val_split=0.05, 0 to hold out nothing (no evaluation), or null to hold out "
                          "the last data.eval_size rows")
    if cfg.val_split and cfg.val_paths:
        raise ConfigError(f"config key 'data.val_split'={cfg.val_split} is set together with data.val_paths; only "
                          "one can choose the held-out rows. Fix: drop one of them")
    if cfg.max_rows is not None and cfg.max_rows < 1:
        raise ConfigError(f"config key 'data.max_rows'={cfg.max_rows} is below 1. Fix: a row count, or null for "
                          "every row")
    for old, new in dict(cfg.columns).items():
        if new not in KNOWN_COLUMNS:
            raise ConfigError(f"config key 'data.columns.{old}'={new!r} is no column this reader knows. Fix: rename "
                              f"to one of {list(KNOWN_COLUMNS)}")


def _unreadable(key: str, err: UnreadableData) -> ConfigError:
    return ConfigError(f"config key 'data.{key}'={err.path!r} {err.problem}. Fix: {err.fix}")


def load_task(cfg: DataConfig, limits: Optional[RowLimits] = None) -> tuple[list[Example], list[Example], dict]:
    """(train, held-out, stats). Bad rows are skipped (and, with `limits`, rows over them
    skipped or cut, see the module docstring); stats count them ("data/skipped_rows",
    "data/skipped/<reason>", "data/truncated"), also printed as one line with where the rows
    came from and how the held-out ones were chosen. A task that cannot give the asked
    examples, or a path that cannot be read, raises ConfigError naming the data. key."""
    try:
        train, held, tally, origin = _load_task(cfg, limits)
    except ConfigError:
        raise
    except ValueError as e:  # a row the tokenizer or a chat template refuses: no traceback, the data named
        where = f"data.paths'={list(cfg.paths)}" if cfg.task == "files" else f"data.task'={cfg.task!r}"
        raise ConfigError(f"config key '{where} gives examples that cannot be prepared ({e}). Fix: change the "
                          "data. keys named") from None
    stats = tally.stats()
    print(_report(origin, len(train), len(held), stats, tally.first, limits))
    return train, held, stats


def _report(origin: str, n_train: int, n_held: int, stats: dict, first: dict, limits: Optional[RowLimits]) -> str:
    """The one line about the loaded data: where it comes from, kept rows, skipped rows per
    reason (with the first of each), cut replies."""
    line = f"data: {origin}: {n_train} train / {n_held} held-out examples"
    skipped = {k.rsplit("/", 1)[1]: n for k, n in stats.items() if k.startswith("data/skipped/")}
    if skipped:
        line += f"; skipped {stats['data/skipped_rows']} rows: " + ", ".join(
            f"{reason} {n} (first: {first[reason]})" if reason in first else f"{reason} {n}"
            for reason, n in skipped.items())
    else:
        line += "; no row skipped"
    if stats["data/truncated"]:
        line += f"; replies cut to {limits.max_length} tokens: {stats['data/truncated']}"
    return line


def _load_task(cfg: DataConfig, limits: Optional[RowLimits]) -> tuple[list[Example], list[Example], _Tally, str]:
    if cfg.task in ("arithmetic", "gsm"):
        check_data_files(cfg)
        drawn = {}
        for key, seed, split in (("train_size", cfg.seed, "train"), ("eval_size", cfg.seed + 1, "test")):
            n = getattr(cfg, key)
            try:
                drawn[split] = (arithmetic_examples(n, seed, split, config=cfg.arithmetic) if cfg.task == "arithmetic"
                                else gsm_examples(n, seed=seed, split=split))
            except ValueError as e:
                raise ConfigError(f"config key 'data.{key}'={n} cannot be drawn from data.task={cfg.task}: {e}. "
                                  f"Fix: lower data.{key}" + (", or raise data.arithmetic.max_digits or max_operands"
                                                              if cfg.task == "arithmetic" else "")) from None
        train, held = drawn["train"], drawn["test"]
        tally = _Tally()
        train, held = with_system(train, cfg.system), with_system(held, cfg.system)
        train = [ex for _, ex in _fit(train, limits, False, tally)]
        held = [ex for _, ex in _fit(held, limits, True, tally)]
        if not train or not held:
            _refuse(tally, limits, f"config key 'data.task'={cfg.task}: {len(train)} training and {len(held)} "
                    "held-out examples fit; need at least one of each", "change the data. keys")
        return train, held, tally, f"built-in task {cfg.task} (no data.paths given)"
    if cfg.task == "files":
        return _load_files(cfg, limits)
    raise ConfigError(f"config key 'data.task'={cfg.task!r} is not a task. Fix: use arithmetic, gsm or files")


def _read(cfg: DataConfig, key: str, tally: _Tally, max_rows: Optional[int] = None) -> list[tuple[Any, list]]:
    """(entry, its examples) of each of data.<key>'s entries, their bad rows counted into
    `tally`; `max_rows`: at most that many examples in all, first entries first."""
    paths = list(getattr(cfg, key))
    out, skipped = [], 0
    for item in paths:
        entry, files = entry_files(key, item)
        left = None if max_rows is None else max_rows - sum(len(rows) for _, rows in out)
        data = _read_files(cfg, key, files, left)
        skipped += data.skipped
        for reason, n in data.skip_reasons.items():
            tally.reasons[reason] += n
            tally.first.setdefault(reason, data.first_bad[reason])
        out.append((entry, with_system(data.examples, cfg.system)))
    if not any(rows for _, rows in out) and not skipped:
        raise ConfigError(f"config key 'data.{key}'={paths} holds no rows (an empty file, blank lines only, or a "
                          "header only). Fix: give files with rows")
    return out


def _read_files(cfg: DataConfig, key: str, paths: list[str], max_rows: Optional[int]) -> Any:
    """load_user_data of one entry's files, its errors as ConfigErrors naming data.<key>."""
    try:
        return load_user_data(paths, max_examples=max_rows, cache_dir=cfg.cache_dir, columns=dict(cfg.columns))
    except UnreadableData as err:
        raise _unreadable(key, err) from None
    except OSError as err:  # the loader's lock file (data.cache_dir), or a file the process may not read
        where = str(err.filename or "")
        if cfg.cache_dir and where.startswith(str(cfg.cache_dir)):
            raise ConfigError(f"config key 'data.cache_dir'={cfg.cache_dir!r} cannot be used ({err.strerror}: "
                              f"{where}). Fix: a folder this process may create and write, or null for the "
                              "datasets default") from None
        raise ConfigError(f"config key 'data.{key}'={paths} cannot be read ({err.strerror or err}: {where}). "
                          "Fix: give files this process may read") from None


def system_text(system: Optional[str]) -> Optional[str]:
    """data.system's text: a .txt file's content, or the value itself."""
    if system and system.endswith(".txt"):
        try:
            return Path(system).read_text().strip()
        except OSError as e:
            raise ConfigError(f"config key 'data.system'={system!r} cannot be read ({e.strerror}). "
                              "Fix: give an existing .txt file, or the system prompt itself") from None
    return system


def with_system(examples: list[Example], system: Optional[str]) -> list[Example]:
    """`examples` with a system turn first where they have none (data.system)."""
    text = system_text(system)
    if not text:
        return examples
    turn = {"role": "system", "content": text}
    return [ex if any(m["role"] == "system" for m in ex.context)
            else replace(ex, context=[turn] + (list(ex.context) or [{"role": "user", "content": ex.prompt}]))
            for ex in examples]


def _load_files(cfg: DataConfig, limits: Optional[RowLimits]) -> tuple[list[Example], list[Example], _Tally, str]:
    """A user's rows, each entry's '#N' drawn from it alone: held-out ones from val_paths, a
    seeded val_split share of each entry (0: none), or else the last eval_size usable rows;
    training rows never include a held-out row (nor rows passed over)."""
    check_data_files(cfg)
    tally = _Tally()
    read = _read(cfg, "paths", tally, cfg.max_rows)
    origin = (f"{sum(len(rows) for _, rows in read)} usable rows of data.paths"
              + (f" (data.max_rows={cfg.max_rows})" if cfg.max_rows else "")
              + ("".join(f", {e.count} drawn from {e.source}" for e, _ in read if e.count is not None)))
    if cfg.val_split:
        parts = [hold_out(rows, e.count, cfg.val_split, entry_rng("val_split", cfg.seed, i))
                 for i, (e, rows) in enumerate(read)]
        train = [ex for part, _ in parts for ex in part]
        pool = [ex for _, part in parts for ex in part]
        held = [ex for _, ex in _fit(pool, limits, True, tally, want=cfg.eval_size)]
        origin += (f", held out: {len(pool)} drawn by data.val_split={cfg.val_split} (seed data.seed={cfg.seed}; "
                   "from each entry)")
    else:
        rows = [ex for i, (e, part) in enumerate(read) for ex in draw(part, e.count, entry_rng("sample", cfg.seed, i))]
        if cfg.val_paths:
            pool = [ex for i, (e, part) in enumerate(_read(cfg, "val_paths", tally))
                    for ex in draw(part, e.count, entry_rng("sample_val", cfg.seed, i))]
            held = [ex for _, ex in _fit(pool, limits, True, tally, want=cfg.eval_size)]
            train = rows
            origin += f", held out: {len(pool)} rows of data.val_paths"
        elif cfg.val_split == 0:
            held, train = [], rows
            origin += ", none held out (data.val_split=0): no evaluation"
        else:
            # The last eval_size rows that fit the eval budget; the ones passed over are skipped,
            # those before them are the training rows (less a '#N' repeat of a held-out row).
            picked = _fit(rows[::-1], limits, True, tally, want=cfg.eval_size)
            held = [ex for _, ex in reversed(picked)]
            held_ids = {id(ex) for ex in held}
            train = [ex for ex in (rows[:len(rows) - 1 - picked[-1][0]] if picked else []) if id(ex) not in held_ids]
            origin += (f", held out: the last {len(held)} that fit (neither data.val_paths nor data.val_split set; "
                       "data.eval_size rows)")
    if limits is not None and limits.replies:
        for ex in train:
            if not ex.solution:
                tally.skip("no_reply", f"{ex.source}: the prompt-only row {ex.prompt[:60]!r}, and this run trains "
                                       "on replies")
        train = [ex for ex in train if ex.solution]
    train = [ex for _, ex in _fit(train, limits, False, tally)]
    chosen = bool(cfg.val_paths) or cfg.val_split is not None
    if cfg.val_paths and train and not held:
        _refuse(tally, limits, f"config key 'data.val_paths'={list(cfg.val_paths)} gives no usable held-out row",
                "add rows to data.val_paths, or drop it to hold out data.paths' last rows")
    no_eval = cfg.val_split == 0 and not cfg.val_paths  # nothing held out: the run evaluates nothing
    if not train or (not held and not no_eval) or (not chosen and len(held) < cfg.eval_size):
        _refuse(tally, limits, f"config key 'data.paths'={list(cfg.paths)} gives only {len(train)} training and "
                f"{len(held)} held-out rows usable ({tally.stats()['data/skipped_rows']} skipped); need at least one "
                "training row" + ("" if no_eval else " and ")
                + ("" if no_eval else "one held-out row" if chosen else f"data.eval_size={cfg.eval_size} held-out rows"),
                "add rows" + ("" if chosen else " or lower data.eval_size"))
    return train, held, tally, origin


def _refuse(tally: _Tally, limits: Optional[RowLimits], what: str, fix: str) -> None:
    """Too few rows left: one ConfigError with the counts per reason and the first of each."""
    if tally.reasons.get("too_long"):
        fix += (f", or give the rows room: the context is {limits.context} tokens; lower run.eval_max_new_tokens "
                "or algorithm.max_new_tokens, or use a model with a longer context")
    if tally.reasons.get("no_reply"):
        fix += (", or give the rows a reply (a last assistant turn, response, output or completion): this run "
                "trains on replies")
    reasons = ", ".join(f"{r} {n}" for r, n in sorted(tally.reasons.items()))
    skipped = f"; skipped: {reasons} (first: {tally.first})" if reasons else ""
    raise ConfigError(f"{what}{skipped}. Fix: {fix}")
