"""What the Ray and the local worker groups share: the call API, futures and errors.

A subclass supplies `_submit(index, method, args, kwargs) -> handle` and
`_wait(handles, method, indices) -> results`; everything about dispatch, execute and
collect lives here once, so both backends give identical results.
"""
from __future__ import annotations

from typing import Any, Callable

from orchestration import dispatch as dsp


class WorkerError(RuntimeError):
    """A worker failed or died. Names the role, rank and method; carries the remote traceback.
    `lost`: the rank's process died or stopped answering (a restart may help), rather than its
    code raising (a restart would raise again)."""

    def __init__(self, role: str, rank: int, method: str, problem: str, traceback: str = "", lost: bool = False):
        self.role, self.rank, self.method, self.lost = role, rank, method, lost
        msg = f"{role} rank {rank} failed in {method}(): {problem}"
        if traceback:
            msg += f"\n--- remote traceback ({role} rank {rank}) ---\n{traceback.rstrip()}"
        super().__init__(msg)


class GroupFuture:
    """Result of `async_call`: `get()` waits, collects and returns like `call` would."""

    def __init__(self, finish: Callable[[float | None], Any]):
        self._finish = finish
        self._done = False
        self._value: Any = None

    def get(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._value = self._finish(timeout)
            self._done = True
        return self._value

    result = get


class BaseWorkerGroup:
    role: str
    world_size: int
    # Ranks per engine (the plan's vllm_tensor_parallel_size): consecutive ranks that hold
    # one model together. They get identical arguments and only the first one's result is
    # collected, so a group of 4 ranks with 2 per engine takes data as 2 members.
    tensor_parallel: int = 1
    # Methods of the role class (its LOCKSTEP_METHODS) whose ranks meet in collectives: every
    # rank is called, an empty slice included, since a skipped rank would leave the others
    # waiting.
    lockstep: frozenset = frozenset()

    def call(self, method: str, *args: Any, dispatch: dsp.Dispatch = "all", execute: dsp.Execute = "all",
             collect: dsp.Collect = "none", **kwargs: Any) -> Any:
        """Run `method` on the workers and wait. See `orchestration.dispatch` for the modes."""
        return self.async_call(method, *args, dispatch=dispatch, execute=execute, collect=collect, **kwargs).get()

    def async_call(self, method: str, *args: Any, dispatch: dsp.Dispatch = "all", execute: dsp.Execute = "all",
                   collect: dsp.Collect = "none", **kwargs: Any) -> GroupFuture:
        dsp.check_execute(execute)
        tp = self.tensor_parallel
        if execute == "first":  # the first engine: rank 0 and its tensor-parallel peers
            handles = [self._submit(i, method, args, kwargs) for i in range(tp)]
            return GroupFuture(lambda timeout: self._wait(handles, method, list(range(tp)), timeout)[0])
        if callable(dispatch):  # a custom dispatch is asked for every rank
            per_worker = dsp.split(dispatch, self.world_size, args, kwargs)
        else:  # one share per engine, the same for each of its ranks
            shares = dsp.split(dispatch, self.world_size // tp, args, kwargs, keep_empty=method in self.lockstep)
            per_worker = [shares[i // tp] for i in range(self.world_size)]
        indices = [i for i, a in enumerate(per_worker) if a is not None]
        handles = [self._submit(i, method, *per_worker[i]) for i in indices]

        def finish(timeout: float | None) -> Any:
            results = self._wait(handles, method, indices, timeout)
            return dsp.collect(collect, [r for i, r in zip(indices, results) if i % tp == 0])
        return GroupFuture(finish)

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` on rank `rank` alone and wait (e.g. weights for a rank just restarted)."""
        return self._wait([self._submit(rank, method, args, kwargs)], method, [rank], None)[0]

    def _submit(self, index: int, method: str, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def _wait(self, handles: list, method: str, indices: list[int], timeout: float | None) -> list:
        raise NotImplementedError
