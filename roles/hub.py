"""Hub ids read offline: a model or dataset id ("org/name") found in the local caches of
ModelScope and Hugging Face, never downloaded.

ms-swift reads an id from ModelScope unless USE_HF=1; so does this module (USE_HF=1: Hugging
Face first). A dataset entry may also name its hub and subsets and a row count, as ms-swift
writes it: `[hf::|ms::]org/name[:subset[/subset]][#N]` (see `parse_dataset`). Where each
cache keeps a repo:

* ModelScope (MODELSCOPE_CACHE, else ~/.cache/modelscope/hub): models/<org>/<name> (older
  clients: <org>/<name>) and datasets/<org>/<name>, a '.' of the name written '___'; its
  loaded datasets as `datasets` caches them, datasets/<org>___<name>/.
* Hugging Face hub (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub):
  models--<org>--<name>/snapshots/<revision> (datasets--<org>--<name>/... for datasets), the
  revision named by refs/main.
* `datasets`' cache of loaded datasets (HF_DATASETS_CACHE, else HF_HOME/datasets, else
  ~/.cache/huggingface/datasets): <org>___<name>/<subset>/<version>/<hash>/<name>-train*.arrow.

A path that exists is never taken for an id. No Ray, no network.
"""
from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from huggingface_hub import constants as hf_constants

# An id as both hubs spell them: owner and name, each of letters, digits, '.', '_' and '-'.
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
HUBS = {"ms": "ModelScope", "hf": "Hugging Face"}
# Files of a dataset repo that hold no rows: what `datasets` ignores (FILES_TO_IGNORE), and
# ModelScope's configuration.json and ms-swift's renamed dataset_infos.json.
METADATA_FILES = {"README.md", "config.json", "dataset_info.json", "dataset_infos.json", "dummy_data.zip",
                  "dataset_dict.json", "configuration.json", "dataset_infos.json_bak"}
# Subsets taken when a dataset has several and the entry names none (ms-swift's registry
# names `main` for gsm8k; `datasets` takes `default`).
DEFAULT_SUBSETS = ("default", "main")


class HubError(ValueError):
    """A dataset folder whose rows cannot be chosen: what is wrong (`problem`) and what to do (`fix`)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix


@dataclass(frozen=True)
class DatasetEntry:
    """One entry of a dataset list, as ms-swift's `dataset` takes it."""
    # A local path or a hub id (the part before the subsets and the row count).
    source: str
    # Subsets of a hub dataset ('org/name:main'); (): its only or default one.
    subsets: tuple = ()
    # Rows drawn from this dataset alone ('#N', ms-swift's dataset_sample); None: every row.
    count: Optional[int] = None
    # The one hub looked in ('hf::' or 'ms::' before the id); None: both, in the default order.
    hub: Optional[str] = None


def parse_dataset(text: str) -> DatasetEntry:
    """A DatasetEntry from `[hf::|ms::]path-or-id[:subsets][#N]`. An existing path is taken
    whole. Raises HubError for a '#' count that is no whole number >= 1."""
    text = str(text).strip()
    if os.path.exists(os.path.expanduser(text)):
        return DatasetEntry(text)
    hub = None
    prefix, sep, rest = text.partition("::")
    if sep and prefix.lower() in HUBS:
        hub, text = prefix.lower(), rest
    count = None
    head, sep, tail = text.rpartition("#")
    if sep and not os.path.exists(os.path.expanduser(text)):
        if re.fullmatch(r"-?\d+", tail):
            if int(tail) < 1:
                raise HubError(f"'#{tail}' after {head!r} is no row count",
                               f"write {head}#N with N >= 1 (N rows drawn from it), or {head} alone for every row")
            text, count = head, int(tail)
        elif os.path.exists(os.path.expanduser(head)):
            raise HubError(f"'#{tail}' after {head!r} is no row count",
                           f"write {head}#N with N a whole number >= 1, or {head} alone for every row")
    name, sep, subsets = text.partition(":")
    if sep and REPO_ID.fullmatch(name) and not os.path.exists(os.path.expanduser(text)):
        return DatasetEntry(name, tuple(s.strip() for s in subsets.split("/") if s.strip()), count, hub)
    return DatasetEntry(text, (), count, hub)


def is_repo_id(text: str) -> bool:
    """Whether `text` is spelled as a hub id and names no existing path."""
    return bool(REPO_ID.fullmatch(text)) and not os.path.exists(text)


def hub_order(hub: Optional[str] = None) -> List[str]:
    """The hubs to look in, first first: `hub` alone, else ModelScope then Hugging Face
    (Hugging Face first under USE_HF=1, as ms-swift)."""
    if hub is not None:
        return [hub]
    return ["hf", "ms"] if os.environ.get("USE_HF", "0").strip().lower() in ("1", "true", "yes") else ["ms", "hf"]


def modelscope_cache() -> str:
    return os.path.expanduser(os.environ.get("MODELSCOPE_CACHE") or "~/.cache/modelscope/hub")


def hf_hub_cache() -> str:
    """The Hugging Face hub cache, read from the environment at each call."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return hf_constants.HF_HUB_CACHE  # ~/.cache/huggingface/hub, or what the legacy variables said


def hf_datasets_cache() -> str:
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.path.expanduser(os.environ["HF_DATASETS_CACHE"])
    home = os.path.expanduser(os.environ.get("HF_HOME") or "~/.cache/huggingface")
    return os.path.join(home, "datasets")


def _ms_names(name: str) -> List[str]:
    # ModelScope writes a '.' of a repo name as '___' on disk; a folder copied by hand keeps it.
    return list(dict.fromkeys([name.replace(".", "___"), name]))


def _snapshot(repo_dir: str) -> str:
    """A hub cache repo's snapshot: the one refs/main names, else the newest; the snapshots
    folder itself when it has none (then it is reported as looked in)."""
    snapshots = os.path.join(repo_dir, "snapshots")
    ref = os.path.join(repo_dir, "refs", "main")
    if os.path.isfile(ref):
        named = os.path.join(snapshots, Path(ref).read_text().strip())
        if os.path.isdir(named):
            return named
    found = sorted(Path(snapshots).iterdir(), key=lambda p: p.stat().st_mtime) if os.path.isdir(snapshots) else []
    return str(found[-1]) if found else snapshots


def model_places(repo_id: str, hub: Optional[str] = None) -> List[str]:
    """The folders a model id may be in, in the order they are tried."""
    org, name = repo_id.split("/")
    places = {"ms": [os.path.join(modelscope_cache(), *parts, n) for parts in (("models", org), (org,))
                     for n in _ms_names(name)],
              "hf": [_snapshot(os.path.join(hf_hub_cache(), f"models--{org}--{name}"))]}
    return [p for h in hub_order(hub) for p in places[h]]


def dataset_places(repo_id: str, hub: Optional[str] = None) -> List[str]:
    """The folders a dataset id may be in, in the order they are tried: downloaded repos first,
    then `datasets`' caches of loaded ones."""
    org, name = repo_id.split("/")
    ms_root = os.path.join(modelscope_cache(), "datasets")
    places = {"ms": [os.path.join(ms_root, org, n) for n in _ms_names(name)]
              + [os.path.join(ms_root, f"{org}___{name}")],
              "hf": [_snapshot(os.path.join(hf_hub_cache(), f"datasets--{org}--{name}")),
                     os.path.join(hf_datasets_cache(), f"{org}___{name}")]}
    return [p for h in hub_order(hub) for p in places[h]]


def find_model(repo_id: str, hub: Optional[str] = None) -> Optional[str]:
    """The cached folder (with config.json) of a model id; None when no cache holds it or
    `repo_id` is no id."""
    if not is_repo_id(repo_id):
        return None
    return next((p for p in model_places(repo_id, hub) if os.path.isfile(os.path.join(p, "config.json"))), None)


def find_dataset(repo_id: str, hub: Optional[str] = None) -> Optional[str]:
    """The cached folder of a dataset id that holds files; None when no cache holds it."""
    if not is_repo_id(repo_id):
        return None
    return next((p for p in dataset_places(repo_id, hub) if os.path.isdir(p) and any(_files(p))), None)


# Files a dataset folder may hold before it is taken for something else (a home or root folder,
# whose search would take minutes).
MAX_FOLDER_FILES = 20000


def _files(folder: str):
    """The files under `folder`, hidden ones and hidden folders left out."""
    for root, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        yield from (os.path.join(root, n) for n in names if not n.startswith("."))


def _where(places: Sequence[str]) -> str:
    return ", ".join(places)


def missing_model(repo_id: str) -> str:
    """Why a model id cannot be used, and the commands that download it (one line)."""
    return (f"the model {repo_id} is in no local cache (looked in: {_where(model_places(repo_id))}); nothing is "
            f"downloaded here. Fix: where a network is, `modelscope download --model {repo_id}` (into "
            f"MODELSCOPE_CACHE) or `hf download {repo_id}` (older clients: `huggingface-cli download {repo_id}`; "
            "into HF_HUB_CACHE) and bring that cache here, or download with --local_dir / --local-dir DIR and give DIR")


def missing_dataset(repo_id: str, hub: Optional[str] = None) -> str:
    """Why a dataset id cannot be used, and the commands that download it (one line)."""
    commands = {"ms": f"`modelscope download --dataset {repo_id}` (into MODELSCOPE_CACHE)",
                "hf": f"`hf download --repo-type dataset {repo_id}` (older clients: `huggingface-cli download "
                      f"--repo-type dataset {repo_id}`; into HF_HUB_CACHE)"}
    return (f"the dataset {repo_id} is in no local cache (looked in: {_where(dataset_places(repo_id, hub))}); "
            f"nothing is downloaded here. Fix: where a network is, {' or '.join(commands[h] for h in hub_order(hub))} "
            "and bring that cache here, or download with --local_dir / --local-dir DIR and give DIR")


def train_files(folder: str, subsets: Sequence[str] = ()) -> List[str]:
    """The files of a dataset folder's train split (what ms-swift and `datasets` read), of
    `subsets` (('all',): every subset). A downloaded repo's files are split by name as
    `datasets` splits them (data/train-00000-of-00001.parquet, train.jsonl, train/...; no
    split in any name: every file); a `datasets` cache's by its arrow files. Raises HubError."""
    cached = sorted(Path(folder).glob("*/*/*/dataset_info.json"))
    if cached:
        groups = {}
        for info in sorted(cached, key=lambda p: p.stat().st_mtime):  # the newest of a subset wins
            arrows = sorted(str(p) for p in info.parent.glob("*-train*.arrow"))
            if arrows:
                groups[info.parent.parent.parent.name] = arrows
    else:
        groups = _split_groups(folder)
    if not groups:
        raise HubError("holds no data file of a train split", "give a folder with data files (train.jsonl, "
                       "data/train-*.parquet, ...) or a file")
    return _pick(folder, groups, subsets)


def _split_groups(folder: str) -> dict:
    """The train split's files of a downloaded repo by their first folder ('' at the top)."""
    # lazy: `datasets` takes seconds to import, and every process imports this module (roles.models)
    from datasets.data_files import get_data_patterns, resolve_pattern

    if sum(1 for _ in itertools.islice(_files(folder), MAX_FOLDER_FILES + 1)) > MAX_FOLDER_FILES:
        raise HubError(f"holds more than {MAX_FOLDER_FILES} files, more than a dataset folder does",
                       "give the dataset's own folder or its data files")
    try:
        patterns = get_data_patterns(os.path.abspath(folder)).get("train", [])
    except Exception:  # datasets' EmptyDatasetError (no data file at all) and the like: no train split
        return {}
    files = set()
    for pattern in patterns:
        try:
            files.update(resolve_pattern(pattern, os.path.abspath(folder)))
        except FileNotFoundError:  # a split pattern no file matches
            pass
    groups: dict = {}
    for path in sorted(files):
        rel = os.path.relpath(path, folder)
        if os.path.basename(rel) in METADATA_FILES or any(part.startswith(".") for part in Path(rel).parts):
            continue
        parts = Path(rel).parts
        groups.setdefault(parts[0] if len(parts) > 1 else "", []).append(path)
    return groups


def _pick(folder: str, groups: dict, subsets: Sequence[str]) -> List[str]:
    """The files of the subsets asked for; with none asked, of the only one, else of a default one."""
    names = sorted(g for g in groups if g)
    if list(subsets) == ["all"]:
        return [f for g in sorted(groups) for f in groups[g]]
    if subsets:
        unknown = [s for s in subsets if s not in groups]
        if unknown:
            raise HubError(f"has no subset {unknown} (its subsets: {names or 'none'})",
                           f"name one of {names} after ':' (org/name:{names[0] if names else 'main'}), or none")
        return [f for s in subsets for f in groups[s]]
    if len(groups) == 1:
        return next(iter(groups.values()))
    default = next((s for s in DEFAULT_SUBSETS if s in groups), None)
    if default is None:
        raise HubError(f"holds several subsets {names} and none is named",
                       f"name one after ':' (e.g. org/name:{names[0]}), or ':all' for every one")
    return groups[default]
