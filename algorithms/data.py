"""Task selection for the drivers: `data:` config -> training and held-out examples."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from algorithms.tasks import ArithmeticConfig, Example, arithmetic_examples, gsm_examples, load_user_data
from orchestration.config import ConfigError


@dataclass
class DataConfig:
    # Task: "arithmetic" (generated chains), "gsm" (GSM8K-style word problems) or
    # "files" (user JSONL/Parquet with messages or prompt/solution columns).
    task: str = "arithmetic"
    # Difficulty of the arithmetic task.
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    # Files for task=files; held-out examples are the last `eval_size` rows.
    paths: List[str] = field(default_factory=list)
    # Training examples to draw (generated tasks) or read at most (files).
    train_size: int = 2000
    # Held-out prompts for eval/accuracy.
    eval_size: int = 64
    # Seed of the task generators.
    seed: int = 0
    # Cache folder of the `datasets` loader for task=files; None: its default.
    cache_dir: Optional[str] = None


def load_task(cfg: DataConfig) -> tuple[list[Example], list[Example], dict]:
    """(train, held-out, stats); stats count rows skipped as malformed. A task that cannot
    give the asked examples raises ConfigError naming the data. key."""
    try:
        return _load_task(cfg)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"config key 'data.{cfg.task}': {e}. Fix: change the data. keys named") from None


def _load_task(cfg: DataConfig) -> tuple[list[Example], list[Example], dict]:
    if cfg.task == "arithmetic":
        return (arithmetic_examples(cfg.train_size, seed=cfg.seed, split="train", config=cfg.arithmetic),
                arithmetic_examples(cfg.eval_size, seed=cfg.seed + 1, split="test", config=cfg.arithmetic),
                {"data/skipped_rows": 0})
    if cfg.task == "gsm":
        return (gsm_examples(cfg.train_size, seed=cfg.seed, split="train"),
                gsm_examples(cfg.eval_size, seed=cfg.seed + 1, split="test"), {"data/skipped_rows": 0})
    if cfg.task == "files":
        if not cfg.paths:
            raise ConfigError("config key 'data.paths'=[] is empty with data.task=files. "
                              "Fix: data.paths=[/path/train.jsonl]")
        data = load_user_data(list(cfg.paths), max_examples=cfg.train_size + cfg.eval_size, cache_dir=cfg.cache_dir)
        if len(data.examples) <= cfg.eval_size:
            raise ConfigError(f"config key 'data.paths': only {len(data.examples)} usable rows "
                              f"({data.skipped} skipped), need more than data.eval_size={cfg.eval_size}. Fix: add rows or lower data.eval_size")
        return data.examples[:-cfg.eval_size], data.examples[-cfg.eval_size:], {"data/skipped_rows": data.skipped}
    raise ConfigError(f"config key 'data.task'={cfg.task!r} is not a task. Fix: use arithmetic, gsm or files")
