"""Local backend: the worker-group API in the driver process, rank by rank, without Ray.

Used by `backend=local` for debugging with breakpoints and for fast tests. Each rank is
an instance of the role class; while a rank is constructed or called, its RANK,
WORLD_SIZE and LOCAL_RANK are in os.environ, as they would be in its own process. Every
device is visible here, so a GPU rank's LOCAL_RANK is its planned device's index on the
node. An ObjectRef passed as a top-level argument arrives resolved, as on Ray.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from typing import Any

from orchestration.base_group import CALLS, BaseWorkerGroup, ResultOf, WorkerError
from orchestration.plan_types import RolePlan


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _resolved(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Top-level ObjectRefs and ResultOfs replaced by their values, as a Ray rank sees them."""
    ray = sys.modules.get("ray")  # no ObjectRef can exist without Ray imported

    def get(x: Any) -> Any:
        if isinstance(x, ResultOf):
            status, value, carried = x.future.handles[0]  # an in-process call's handle
            if status == "error":
                raise value
            return x.pick(value, carried)
        return ray.get(x) if ray is not None and isinstance(x, ray.ObjectRef) else x
    return tuple(get(a) for a in args), {k: get(v) for k, v in kwargs.items()}


class LocalWorkerGroup(BaseWorkerGroup):
    def __init__(self, role_cls: type, plan_entry: RolePlan, init_kwargs: dict | None = None,
                 init_args: tuple = (), env: dict[str, str] | list[dict] | None = None):
        self.role, self.plan_entry = plan_entry.role, plan_entry
        self.world_size = plan_entry.world_size
        if plan_entry.tensor_parallel_size > 1:
            raise ValueError(f"{self.role}: vllm_tensor_parallel_size={plan_entry.tensor_parallel_size} needs one "
                             "process per rank; use backend.workers=ray, or set the size to 1")
        self.lockstep = frozenset(getattr(role_cls, "LOCKSTEP_METHODS", ()))
        extra = env if isinstance(env, list) else [env or {}] * self.world_size  # per rank, or for all
        gpu = plan_entry.device == "GPU"
        self._envs = [{**extra[i], "RANK": str(i), "WORLD_SIZE": str(self.world_size),
                       "LOCAL_RANK": str(plan_entry.local_devices[i] if gpu else i)}
                      for i in range(self.world_size)]
        self.workers = []
        self._carried: dict[int, dict] = {}  # rank -> results of the deferred methods its latest call ran
        for i in range(self.world_size):
            try:
                with _environ(self._envs[i]):
                    self.workers.append(role_cls(*init_args, **(init_kwargs or {})))
            except Exception as e:
                raise WorkerError.raised(self.role, i, "__init__", e, traceback.format_exc()) from e

    def _submit(self, index: int, method: str, args: tuple, kwargs: dict, before: tuple = (), deps: tuple = (),
                then: tuple = ()) -> Any:
        start = time.perf_counter()
        try:
            args, kwargs = _resolved(args, kwargs)
            with _environ(self._envs[index]):
                worker = self.workers[index]
                carried = {m: getattr(worker, m)(*_resolved(a, {})[0]) for m, a in before}
                value = getattr(worker, method)(*args, **kwargs)
                carried.update({m: getattr(worker, m)(*_resolved(a, {})[0]) for m, a in then})
                if carried:
                    self._carried[index] = carried
                return ("ok", value, carried)
        except Exception as e:
            label = "+".join([m for m, _ in before] + [method] + [m for m, _ in then])  # as the Ray group names a call
            return ("error", WorkerError.raised(self.role, index, label, e, traceback.format_exc()), {})
        finally:
            spent = time.perf_counter() - start
            CALLS.spent(spent, spent)

    def _wait(self, handles: list, method: str, indices: list[int], timeout: float | None) -> list:
        for status, value, _ in handles:
            if status == "error":
                raise value
        return [value for _, value, _ in handles]

    def shutdown(self) -> None:
        self.workers = []
