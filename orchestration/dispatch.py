"""Dispatch semantics shared by the Ray and the local worker groups: ms-swift's @worker/@function
modes with their gaps fixed (docs/placement.md, "Worker groups and dispatch").

dispatch: 'slice' splits every sequence-like argument (list, tuple, tensor, array, batch
          dataclass: one that defines __len__) along its first axis, first workers taking the remainder (10 over 4 ->
          3,3,2,2); scalars, strings and dicts go whole; workers with an empty slice are
          skipped, except for methods a role lists in LOCKSTEP_METHODS (its ranks meet in
          collectives), which get the empty slice (one object shared by those ranks). 'all'
          sends the same arguments (one object for every rank: a Ray group puts it into the
          object store once). A
          callable f(n, i, *args, **kw) returns (args, kwargs) for worker i of n.
execute:  'first' runs on rank 0 only and returns its value unwrapped; 'all' runs everywhere.
collect:  'none' returns one value per worker; 'flatten' concatenates them (lists, tuples
          element-wise, tensors, arrays, batch dataclasses, dicts key-wise); a callable gets
          the list.
Tensor-parallel engines (a plan's vllm_tensor_parallel_size = k > 1): k consecutive ranks
hold one engine and count as one worker above. Each gets that worker's arguments ('first'
runs ranks 0..k-1), and only the first rank's result is collected. A callable dispatch is
still asked for every rank (n = all ranks).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Union

import numpy as np

try:  # torch is optional for the orchestration layer
    import torch
except ImportError:  # pragma: no cover - torch is a hard dependency of the package
    torch = None

Dispatch = Union[Literal["slice", "all"], Callable[..., tuple]]
Execute = Literal["first", "all"]
Collect = Union[Literal["none", "flatten"], Callable[[list], Any]]


def _is_tensor(x: Any) -> bool:
    return torch is not None and isinstance(x, torch.Tensor)


def _length(x: Any) -> int | None:
    """First-axis length of a sliceable argument, or None if it is sent whole."""
    if isinstance(x, (list, tuple)):
        return len(x)
    if _is_tensor(x) or isinstance(x, np.ndarray):
        return x.shape[0] if x.ndim > 0 else None
    if dataclasses.is_dataclass(x) and not isinstance(x, type) and hasattr(x, "__len__"):
        # A batch dataclass declares __len__; other dataclasses (options) go whole.
        lengths = {_length(getattr(x, f.name)) for f in dataclasses.fields(x)} - {None}
        if len(lengths) > 1:
            raise ValueError(f"{type(x).__name__} has fields of different lengths {sorted(lengths)}; "
                             "a batch needs one first-axis length to be sliced")
        return lengths.pop() if lengths else None
    return None


def _take(x: Any, start: int, stop: int) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type) and hasattr(x, "__len__"):
        return dataclasses.replace(x, **{
            f.name: _take(getattr(x, f.name), start, stop)
            for f in dataclasses.fields(x) if f.init and _length(getattr(x, f.name)) is not None})
    if _length(x) is None:
        return x
    return x[start:stop]


def slice_bounds(n_items: int, n_workers: int) -> list[tuple[int, int]]:
    """[start, stop) per worker; the first n_items % n_workers workers get one more."""
    base, extra = divmod(n_items, n_workers)
    bounds, start = [], 0
    for i in range(n_workers):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def split(dispatch: Dispatch, n_workers: int, args: tuple, kwargs: dict,
          keep_empty: bool = False) -> list[tuple[tuple, dict] | None]:
    """Arguments for each worker; None marks a worker that gets nothing and is skipped
    (with `keep_empty`, it gets its empty slice instead)."""
    if callable(dispatch):
        out = []
        for i in range(n_workers):
            res = dispatch(n_workers, i, *args, **kwargs)
            if not (isinstance(res, tuple) and len(res) == 2):
                raise TypeError(f"custom dispatch must return (args, kwargs), got {type(res).__name__}")
            out.append((tuple(res[0]), dict(res[1])))
        return out
    if dispatch == "all":
        return [(args, kwargs)] * n_workers
    if dispatch != "slice":
        raise ValueError(f"dispatch must be 'slice', 'all' or a callable, got {dispatch!r}")
    named = [(f"argument {i}", a) for i, a in enumerate(args)] + [(f"argument '{k}'", v) for k, v in kwargs.items()]
    lengths = {name: n for name, v in named if (n := _length(v)) is not None}
    if not lengths:
        return [(args, kwargs)] * n_workers
    if len(set(lengths.values())) > 1:
        raise ValueError(f"dispatch='slice' needs sliced arguments of one length, got {lengths}")
    n_items = next(iter(lengths.values()))
    out, empty = [], None
    for start, stop in slice_bounds(n_items, n_workers):
        if start == stop and not keep_empty:
            out.append(None)
            continue
        if start == stop and empty is not None:  # one empty share for every rank without items (sent once)
            out.append(empty)
            continue
        share = (tuple(_take(a, start, stop) for a in args), {k: _take(v, start, stop) for k, v in kwargs.items()})
        empty = share if start == stop else empty
        out.append(share)
    return out


def flatten(results: list) -> Any:
    """Concatenate per-worker results of one kind."""
    if not results:
        return []
    first = results[0]
    if all(r is None for r in results):
        return None
    if isinstance(first, tuple) and not hasattr(first, "_fields"):
        return tuple(flatten([r[i] for r in results]) for i in range(len(first)))
    if isinstance(first, list):
        return [x for r in results for x in r]
    if _is_tensor(first):
        return torch.cat([r if r.ndim else r.reshape(1) for r in results])
    if isinstance(first, np.ndarray):
        return np.concatenate([np.atleast_1d(r) for r in results])
    if isinstance(first, dict):
        return {k: flatten([r[k] for r in results]) for k in first}
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        # Per-item fields are concatenated; whole-batch fields (scalars, strings) keep rank 0's value.
        return dataclasses.replace(first, **{f.name: flatten([getattr(r, f.name) for r in results])
                                             for f in dataclasses.fields(first)
                                             if f.init and _length(getattr(first, f.name)) is not None})
    return list(results)


def collect(collect_mode: Collect, results: list) -> Any:
    if callable(collect_mode):
        return collect_mode(results)
    if collect_mode == "none":
        return results
    if collect_mode == "flatten":
        return flatten(results)
    raise ValueError(f"collect must be 'none', 'flatten' or a callable, got {collect_mode!r}")


def check_execute(execute: str) -> None:
    if execute not in ("first", "all"):
        raise ValueError(f"execute must be 'first' or 'all', got {execute!r}")
