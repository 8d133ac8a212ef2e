"""Ray worker groups: one actor per rank of a planned role, on its placement bundles.

`ray.remote` is applied here, to a small host actor that builds the plain role class in
its own process after RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT are set, so a
role may start torch.distributed in its constructor. Calls go through
`BaseWorkerGroup.call` (dispatch/execute/collect). The ranks of a tensor-parallel engine
(vllm_tensor_parallel_size > 1) also get ENGINE_TP_SIZE/RANK/MASTER_ADDR/MASTER_PORT:
where they meet, on the first rank of their engine. Failures come back as `WorkerError`
naming role, rank and method, with the remote traceback; a dead actor is reported, not
waited for.
"""
from __future__ import annotations

import os
import socket
from typing import Any

import ray

from orchestration.base_group import BaseWorkerGroup, WorkerError
from orchestration.placement import Placement
from orchestration.planner import RolePlan


class _RoleHost:
    """Actor body: holds one instance of a plain role class."""

    def node_info(self) -> dict:
        with socket.socket() as s, socket.socket() as t:  # the role's group, a tensor-parallel engine's
            s.bind(("", 0))
            t.bind(("", 0))
            port, tp_port = s.getsockname()[1], t.getsockname()[1]
        return {"ip": ray.util.get_node_ip_address(), "port": port, "tp_port": tp_port, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    def setup(self, role_cls: type, env: dict[str, str], args: tuple, kwargs: dict) -> None:
        os.environ.update(env)
        self.instance = role_cls(*args, **kwargs)

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.instance, method)(*args, **kwargs)


_RemoteHost = ray.remote(_RoleHost)


class WorkerGroup(BaseWorkerGroup):
    def __init__(self, role_cls: type, plan_entry: RolePlan, init_kwargs: dict | None = None, *,
                 placement: Placement, init_args: tuple = (), env: dict[str, str] | None = None,
                 timeout_s: float | None = None):
        self.role, self.plan_entry = plan_entry.role, plan_entry
        self.world_size = plan_entry.world_size
        self.tensor_parallel = plan_entry.tensor_parallel_size
        self.lockstep = frozenset(getattr(role_cls, "LOCKSTEP_METHODS", ()))
        self.timeout_s = timeout_s
        self.workers = [
            _RemoteHost.options(name=None, max_concurrency=1, **placement.slot(plan_entry, i).actor_options()).remote()
            for i in range(self.world_size)]
        self.infos = self._wait([w.node_info.remote() for w in self.workers], "node_info",
                                list(range(self.world_size)), timeout_s)
        master = self.infos[0]
        envs = [{**(env or {}), "RANK": str(i), "WORLD_SIZE": str(self.world_size),
                 "LOCAL_RANK": str(plan_entry.local_devices[i]), "MASTER_ADDR": master["ip"],
                 "MASTER_PORT": str(master["port"]), "ROLE_NAME": self.role, **self._engine_env(i)}
                for i in range(self.world_size)]
        refs = [w.setup.remote(role_cls, envs[i], init_args, init_kwargs or {}) for i, w in enumerate(self.workers)]
        self._wait(refs, "__init__", list(range(self.world_size)), timeout_s)

    def _engine_env(self, rank: int) -> dict[str, str]:
        """Where rank `rank` meets the other ranks of its tensor-parallel engine (none at size 1)."""
        tp = self.tensor_parallel
        if tp == 1:
            return {}
        leader = self.infos[rank - rank % tp]
        return {"ENGINE_TP_SIZE": str(tp), "ENGINE_TP_RANK": str(rank % tp),
                "ENGINE_TP_MASTER_ADDR": leader["ip"], "ENGINE_TP_MASTER_PORT": str(leader["tp_port"])}

    def _submit(self, index: int, method: str, args: tuple, kwargs: dict) -> Any:
        return self.workers[index].call.remote(method, args, kwargs)

    def _wait(self, handles: list, method: str, indices: list[int], timeout: float | None) -> list:
        timeout = self.timeout_s if timeout is None else timeout
        try:  # fast path: everything succeeds
            return ray.get(handles, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(self.role, indices[0], method, f"no result after {timeout}s") from None
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError):
            pass
        # Name the first failing rank, in rank order among the finished ones.
        ready, _ = ray.wait(handles, num_returns=len(handles), timeout=0)
        ready = set(ready)
        for ref, index in zip(handles, indices):
            if ref not in ready:
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if getattr(e, "cause", None) is not None else e
                raise WorkerError(self.role, index, method, f"{type(cause).__name__}: {cause}",
                                  str(e)) from None
            except ray.exceptions.RayActorError as e:
                raise WorkerError(self.role, index, method, f"the actor process died ({e.__class__.__name__}); "
                                  "check its log for an out-of-memory kill or a crash", str(e)) from None
        raise WorkerError(self.role, indices[0], method, "failed, but no rank reported the error")

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
