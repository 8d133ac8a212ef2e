"""Entries of data.paths / data.val_paths as ms-swift's `dataset` lists them: what files each
reads, and the rows drawn from each one alone.

An entry is `[hf::|ms::]path-or-id[:subset][#N]` (roles/hub.py `parse_dataset`). It reads:

* an existing file, or a save_to_disk folder, as it is;
* another existing folder, or a hub id found in a local cache (roles/hub.py): the files of its
  train split (data/train-00000-of-00001.parquet, train.jsonl, ...; no split named: every file).

`#N` draws N rows from that entry alone, as ms-swift's sample_dataset: N below its size, N
distinct rows in a seeded random order; N above, every row N // size times, then N % size more
drawn. A held-out share (data.val_split, ms-swift's split_dataset_ratio) is taken from each
entry before its draw, so a repeated row is never both trained on and held out.
"""
from __future__ import annotations

import os
import random
from typing import Any, List, Optional

from algorithms.data.user_data import FILE_FORMATS, UnreadableData, file_format, saved_folder
from orchestration.config import ConfigError
from roles.hub import DatasetEntry, HubError, find_dataset, is_repo_id, missing_dataset, parse_dataset, train_files


def entry_files(key: str, item: str) -> tuple[DatasetEntry, List[str]]:
    """An entry of data.<key> and the files it reads. Raises ConfigError naming the key: a bad
    '#N', a hub id in no local cache (with where it was looked for and how to download it), a
    folder without a train split, a file of unknown format."""
    where = f"config key 'data.{key}'={str(item)!r}"
    try:
        entry = parse_dataset(item)
    except HubError as e:
        raise ConfigError(f"{where}: {e.problem}. Fix: {e.fix}") from None
    path = os.path.expanduser(entry.source)
    folder = path if os.path.isdir(path) and not saved_folder(path) else None
    if not os.path.exists(path) and is_repo_id(entry.source):
        folder = find_dataset(entry.source, entry.hub)
        if folder is None:
            raise ConfigError(f"{where} is no local path, and {missing_dataset(entry.source, entry.hub)}")
    files = [path]
    if folder is not None:
        where += "" if folder == path else f" (found at {folder})"
        try:
            found = train_files(folder, entry.subsets)
        except HubError as e:
            raise ConfigError(f"{where} {e.problem}. Fix: {e.fix}") from None
        files = [f for f in found if os.path.splitext(f)[1].lower() in FILE_FORMATS]
        if not files:
            names = sorted({os.path.basename(f) for f in found})[:5]
            raise ConfigError(f"{where} holds no file of its train split this reader reads ({names}). "
                              f"Fix: give {sorted(FILE_FORMATS)} files")
    for name in files:
        try:
            file_format(name)
        except UnreadableData as err:
            raise ConfigError(f"config key 'data.{key}'={err.path!r} {err.problem}. Fix: {err.fix}") from None
    return entry, files


def entry_rng(what: str, seed: int, index: int) -> random.Random:
    """The random stream of one entry's draw (`what`: 'sample' or 'val_split'), from data.seed
    and its place in the list: each entry is drawn independently."""
    return random.Random(f"{what}/{seed}/{index}")


def draw(rows: List[Any], count: Optional[int], rng: random.Random) -> List[Any]:
    """`count` rows of `rows` (ms-swift's '#N'); None: `rows` as they are."""
    if count is None or not rows:
        return rows
    whole, rest = divmod(count, len(rows))
    return rows * whole + [rows[i] for i in rng.sample(range(len(rows)), rest)]


def hold_out(rows: List[Any], count: Optional[int], ratio: float, rng: random.Random) -> tuple[List[Any], List[Any]]:
    """(training, held-out) rows of one entry: int(ratio x min(size, count)) rows held out, at
    least one, drawn by `rng`; then `count` less those of the rest drawn for training (None:
    all of the rest). Both keep the file's order, but for the draw's repeats."""
    n_held = min(max(int(min(len(rows), count or len(rows)) * ratio), 1), len(rows))
    order = list(range(len(rows)))
    rng.shuffle(order)
    held_out = set(order[:n_held])
    held = [ex for i, ex in enumerate(rows) if i in held_out]
    rest = [ex for i, ex in enumerate(rows) if i not in held_out]
    return draw(rest, None if count is None else max(count - n_held, 0), rng), held
