"""Ray worker groups: one actor per rank of a planned role, on its placement bundles.

`ray.remote` is applied here, to a small host actor that builds the plain role class in
its own process after RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT are set, so a
role may start torch.distributed in its constructor. LOCAL_RANK is the rank's GPU among the
devices it sees (0: Ray shows each actor its own GPU), so torch.cuda.set_device(LOCAL_RANK)
works on every rank. Arguments reach the role's method as top-level arguments of the actor
call, so an ObjectRef passed as one arrives resolved, as in any Ray call. Calls go through
`BaseWorkerGroup.call` (dispatch/execute/collect). The ranks of a tensor-parallel engine
(vllm_tensor_parallel_size > 1) also get ENGINE_TP_SIZE/RANK/MASTER_ADDR/MASTER_PORT:
where they meet, on the first rank of their engine. In a local run (every Ray node on this
host) they meet on 127.0.0.1 and gloo/NCCL bind the loopback interface; the first rank serves
its group's TCPStore on a socket bound there (torch.distributed would listen on every
address). Failures come back as `WorkerError`
naming role, rank and method, with the remote traceback; a dead actor is reported, not
waited for, and so is a rank that stays silent past `timeout_s` (cluster.call_timeout_s).

A group built with `restarts` > 0 (roles whose ranks hold no state but their weights and meet
in no collective: rollout, sampler, teacher, PRM, ORM) replaces a rank that died or went
silent with a fresh actor on the same bundle, calls `on_restart(group, rank)` (the driver
gives a rollout its current weights there) and runs the rank's share of the call again.

Threads: each rank sets torch's intra-op threads (and OMP_NUM_THREADS/MKL_NUM_THREADS for what
it starts) to its role's `num_cpus` in the plan, or, unset, to its share of its node's cores:
the cores it may use divided by the processes planned on that node (colocated roles share a
process slot and take turns, so they count once).
Ray itself would leave every actor one thread.
A group built with `host` (another group of the same ranks; the plan's `RolePlan.host`, e.g. a
colocated teacher with placement.teacher_in_trainer_process) holds its role in the host's
processes: one process per rank for both roles, calls reaching the role by name, and an answer
kept there (`keep`, base_group.Kept) read by the host's next call without crossing to the driver.
A rank's memory() figures and the seconds its method ran come back with each call it answers,
so the driver reads them (`memory()`) without a call of its own. `start_roles` starts the groups
of a run together: every actor is created before any is waited for, so their processes start
(and import torch) at the same time. How arguments and answers travel (numpy arrays, shared
arguments put once, the keyword arguments Ray resolves first): orchestration/transport.py.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

import ray

from orchestration import rank_process as rp
from orchestration.base_group import CALLS, KEEP_KEY, BaseWorkerGroup, ResultOf, WorkerError, pick
from orchestration.cluster import LOG_LEVEL_ENV, cluster_is_local, log_level_env, loopback_env, set_log_level
from orchestration.placement import Placement
from orchestration.plan_types import RolePlan
from orchestration.transport import (AFTER_PREFIX, GUESTS_KEY, LIFTED_PREFIX, RESULTS_KEY, GuestFailed, Rider, fill,
                                     lift, put_large, resolve_kept, send_tensors_as_arrays, sent)


class _RoleHost:
    """Actor body: holds the instance of a plain role class, and those of the roles it hosts
    (`add_role`), by role name."""

    def __init__(self, name: str):
        self.name = name
        self.instances: dict[str, Any] = {}
        self.memories: dict[str, Optional[Callable]] = {}  # role -> its memory() (None: it has none)
        self.kept: dict[str, Any] = {}  # answers kept on this rank (transport.KEEP_KEY), by name
        send_tensors_as_arrays()

    def node_info(self, local: bool) -> dict:
        """Where this rank runs and two ports it holds until setup (its group's, its tensor-parallel
        engine's), on 127.0.0.1 in a local run so nothing it opens is reachable from the network."""
        ip = "127.0.0.1" if local else ray.util.get_node_ip_address()
        self.sockets = [socket.socket(), socket.socket()]
        for s in self.sockets:
            s.bind(("127.0.0.1" if local else "", 0))
        return {"ip": ip, "port": self.sockets[0].getsockname()[1], "tp_port": self.sockets[1].getsockname()[1],
                "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "visible_index": rp.visible_index()}

    def setup(self, role: str, role_cls: type, env: dict[str, str], args: tuple, kwargs: dict,
              serve: tuple[bool, bool] = (False, False), threads: tuple[float | None, int] = (None, 1)) -> int:
        """Build the role; returns the torch threads this rank computes with."""
        os.environ.update(env)
        self.threads = rp.set_threads(*threads)
        if LOG_LEVEL_ENV in env:  # run.log_level, as the driver set it
            set_log_level(env[LOG_LEVEL_ENV])
        # The store torch.distributed would open on *:port for the group (engine) whose first rank
        # this is runs here on the held socket instead; torch joins a store already serving its port.
        self.stores = []
        for sock, wanted in zip(self.sockets, serve):
            if wanted:
                self.stores.append(rp.store_on(sock))
            else:
                sock.close()
        return self.add_role(role, role_cls, args, kwargs)

    def add_role(self, role: str, role_cls: type, args: tuple, kwargs: dict) -> int:
        """Build `role` in this process beside the roles it holds (a hosted role: it takes their
        environment and threads); returns the torch threads this rank computes with."""
        self.instances[role] = instance = role_cls(*args, **kwargs)
        memory = getattr(instance, "memory", None)
        self.memories[role] = memory if callable(memory) else None
        return self.threads

    def call(self, role: str, method: str, before: tuple, then: tuple, /, *args: Any,
             **kwargs: Any) -> tuple[Any, Any, float, dict, list]:
        """On `role`'s instance: the `before` methods ((method, args) pairs, e.g. a turn's onload),
        then `method`, then the `then` methods (a turn's offload); returns its value (None when it
        is kept, KEEP_KEY), this rank's memory() figures after it all (None: the role has none),
        the seconds all of it ran, {method: result} of the `before` and `then` ones, and the same
        four for each call of a hosted role that rode on this one (GUESTS_KEY; run first)."""
        guests = [self._guest(*guest) for guest in kwargs.pop(GUESTS_KEY, ())]
        # Arguments arrive top-level, so Ray resolves an ObjectRef passed as one (nested ones stay refs).
        start = time.perf_counter()
        for key in [k for k in kwargs if k.startswith(AFTER_PREFIX)]:  # calls waited for (`after`), done
            del kwargs[key]
        if RESULTS_KEY in kwargs:  # arguments that are other calls' answers (ResultOf): their values
            args = list(args)
            for where, (key, carried_method) in kwargs.pop(RESULTS_KEY).items():
                holder = args if isinstance(where, int) else kwargs
                holder[where] = pick(holder[where][0], holder[where][3], key, carried_method)  # from the answer
            lifted = {k: kwargs.pop(k) for k in [k for k in kwargs if k.startswith(LIFTED_PREFIX)]}
            before, then = fill(before, lifted), fill(then, lifted)
        return (*self._run(role, method, before, then, tuple(args), kwargs, start), guests)

    def _run(self, role: str, method: str, before: tuple, then: tuple, args: tuple, kwargs: dict,
             start: float) -> tuple[Any, Any, float, dict]:
        instance, keep = self.instances[role], kwargs.pop(KEEP_KEY, None)
        args, kwargs, used = resolve_kept(args, kwargs, self.kept)  # answers kept here it names (Kept)
        carried = {name: getattr(instance, name)(*margs) for name, margs in before}
        value = getattr(instance, method)(*args, **kwargs)
        carried.update({name: getattr(instance, name)(*margs) for name, margs in then})
        for key in used:  # taken: the memory is free again
            del self.kept[key]
        if keep is not None:
            self.kept[keep], value = value, None
        spent = time.perf_counter() - start
        memory = self.memories[role]
        return value, (value if method == "memory" else memory() if memory else None), spent, carried

    def _guest(self, role: str, method: str, before: tuple, then: tuple, args: tuple,
               kwargs: dict) -> tuple[Any, Any, float, dict]:
        """A hosted role's call that rode on the host's: its failure names that role and method."""
        try:
            return self._run(role, method, before, then, args, dict(kwargs), time.perf_counter())
        except Exception as e:
            raise GuestFailed(role, "+".join([m for m, _ in before] + [method] + [m for m, _ in then]), e) from e

    def __repr__(self) -> str:
        # Ray prefixes each line a worker prints with this: "(train rank 1 pid=...)".
        return self.name


_RemoteHost = ray.remote(_RoleHost)


class WorkerGroup(BaseWorkerGroup):
    keeps_answers = True

    def __init__(self, role_cls: type, plan_entry: RolePlan, init_kwargs: dict | None = None, *,
                 placement: Placement, init_args: tuple = (), env: dict[str, str] | list[dict] | None = None,
                 timeout_s: float | None = None, restarts: int = 0, start: bool = True,
                 host: Optional["WorkerGroup"] = None):
        """With `start` False the actors are created but not yet set up: `begin_setup()` and
        `end_setup()` finish the start (start_roles does so for several groups at once). With
        `host` (a group of the same ranks, its setup begun first) the role is built in the host's
        processes instead of actors of its own: it takes their environment and threads (`env` is
        not used), is never restarted, and its calls reach it there (`hosted_by`)."""
        self.role, self.plan_entry, self.placement = plan_entry.role, plan_entry, placement
        send_tensors_as_arrays()
        self.world_size = plan_entry.world_size
        self.tensor_parallel = plan_entry.tensor_parallel_size
        self.lockstep = frozenset(getattr(role_cls, "LOCKSTEP_METHODS", ()))
        self.timeout_s = timeout_s or None  # 0 or None: no bound
        self.restarts_left = restarts
        self.on_restart: Optional[Callable[["WorkerGroup", int], None]] = None
        # pending ref -> (rank, method, args, kwargs, before, deps, then, the rank's restarts when sent)
        self._calls: dict[Any, tuple] = {}
        self._restarted: dict[int, int] = {}  # rank -> times its process was replaced
        # Threads that wait on calls of the same lost rank (calls sent ahead) replace it once.
        self._replacing = threading.Lock()
        self._memory: dict[int, Any] = {}  # rank -> its memory() figures after its latest call
        self._carried: dict[int, dict] = {}  # rank -> results of the deferred methods its latest call carried
        self._riders: dict[int, list[Rider]] = {}  # rank -> hosted roles' kept calls its next call carries
        self._init = (role_cls, init_args, init_kwargs or {}, env)
        self.key = self.role  # the name the ranks hold this role's instance under (an alias keeps it)
        self.hosted_by = host
        self._local = cluster_is_local()
        if host is not None:
            # A restarted host process would come back without the hosted role (and its riders).
            if restarts or host.restarts_left or host.world_size != self.world_size or host.tensor_parallel != 1 \
                    or self.tensor_parallel != 1:
                raise ValueError(f"{self.role} cannot be hosted by {host.role}: a hosted role needs the host's ranks "
                                 "(same world size, tensor parallel size 1) and no restarts of either")
            self.workers, self._pending = host.workers, []
        else:
            self.workers = [
                _RemoteHost.options(name=None, max_concurrency=1, **placement.slot(plan_entry, i).actor_options())
                .remote(f"{self.role} rank {i}") for i in range(self.world_size)]
            self._pending = [w.node_info.remote(self._local) for w in self.workers]
        if start:
            self.begin_setup()
            self.end_setup()

    def begin_setup(self) -> None:
        """Wait until every rank's process runs, then ask each to build its role."""
        role_cls, init_args, init_kwargs, env = self._init
        if self.hosted_by is not None:
            self.infos = self.hosted_by.infos
            self._pending = [w.add_role.remote(self.key, role_cls, init_args, init_kwargs) for w in self.workers]
            return
        local = self._local
        self.infos = self._wait_once(self._pending, "node_info", list(range(self.world_size)), None)
        master = self.infos[0]
        extra = env if isinstance(env, list) else [env or {}] * self.world_size  # per rank, or for all
        envs = [{**(loopback_env() if local else {}), **extra[i], "RANK": str(i),
                 "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self._local_rank(i)),
                 "MASTER_ADDR": master["ip"], "MASTER_PORT": str(master["port"]), "ROLE_NAME": self.role,
                 **self._engine_env(i), **log_level_env()}
                for i in range(self.world_size)]
        tp = self.tensor_parallel
        # Only in a local run: elsewhere torch's own store (every address, any family) stays as it was.
        serve = [(local and i == 0 and self.world_size > 1, local and tp > 1 and i % tp == 0)
                 for i in range(self.world_size)]
        threads = [(self.plan_entry.num_cpus, rp.node_processes(self.placement.plan, self.plan_entry.nodes[i]))
                   for i in range(self.world_size)]
        self._setup = (role_cls, envs, init_args, init_kwargs, serve, threads)
        self._pending = [w.setup.remote(self.key, role_cls, envs[i], init_args, init_kwargs, serve[i], threads[i])
                         for i, w in enumerate(self.workers)]

    def end_setup(self) -> None:
        """Wait until every rank has built its role; `threads` records each rank's torch threads."""
        self.threads = self._wait_once(self._pending, "__init__", list(range(self.world_size)), None)
        self._pending = []

    def restart_rank(self, index: int) -> None:
        """A fresh actor for rank `index` on its bundle, built as the first one was."""
        role_cls, envs, init_args, init_kwargs, serve, threads = self._setup
        try:
            ray.kill(self.workers[index], no_restart=True)
        except Exception:  # already gone
            pass
        options = self.placement.slot(self.plan_entry, index).actor_options()
        self.workers[index] = _RemoteHost.options(name=None, max_concurrency=1, **options).remote(
            f"{self.role} rank {index}")
        ray.get(self.workers[index].node_info.remote(cluster_is_local()), timeout=self.timeout_s)
        ray.get(self.workers[index].setup.remote(self.key, role_cls, envs[index], init_args, init_kwargs,
                                                 serve[index], threads[index]), timeout=self.timeout_s)
        self._memory.pop(index, None)
        self._restarted[index] = self._restarted.get(index, 0) + 1

    def _local_rank(self, rank: int) -> int:
        """LOCAL_RANK agrees with what the rank sees: its GPU's index among its visible devices (0, as
        Ray shows each actor its own GPU only), so torch.cuda.set_device(LOCAL_RANK) picks that GPU.
        A CPU rank counts among its role's ranks on the same node, as torchrun would."""
        index = self.infos[rank]["visible_index"]
        if index is not None:
            return index
        node = self.plan_entry.nodes[rank]
        return sum(1 for n in self.plan_entry.nodes[:rank] if n == node)

    def _engine_env(self, rank: int) -> dict[str, str]:
        """Where rank `rank` meets the other ranks of its tensor-parallel engine (none at size 1)."""
        tp = self.tensor_parallel
        if tp == 1:
            return {}
        leader = self.infos[rank - rank % tp]
        return {"ENGINE_TP_SIZE": str(tp), "ENGINE_TP_RANK": str(rank % tp),
                "ENGINE_TP_MASTER_ADDR": leader["ip"], "ENGINE_TP_MASTER_PORT": str(leader["tp_port"])}

    def _submit(self, index: int, method: str, args: tuple, kwargs: dict, before: tuple = (), deps: tuple = (),
                then: tuple = (), ride: bool = True) -> Any:
        if ride and self._rides(args, kwargs, before, then):
            rider = Rider(self, index, (method, args, kwargs, before, deps, then))
            self.hosted_by._riders.setdefault(index, []).append(rider)
            return rider
        start = time.perf_counter()
        # Calls to wait for, and other calls' answers used as arguments, go as top-level arguments,
        # which Ray resolves before the call runs. A rider waited for is sent first, on its own.
        deps = [sent(ref) for ref in deps]
        # Hosted roles' calls ride on the driver's own next call, not on one a watching thread makes.
        riders = [] if CALLS.in_watcher() else self._riders.pop(index, [])
        deps += [sent(ref) for r in riders for ref in r.deps]
        waits = {f"{AFTER_PREFIX}{j}": ref for j, ref in enumerate(deps)}
        sent_kw = dict(kwargs)  # with the deferred methods' ResultOf arguments beside the call's own
        sent_before, sent_then = lift(before, "b", sent_kw), lift(then, "t", sent_kw)
        results = {**{i: (a.key, a.carried) for i, a in enumerate(args) if isinstance(a, ResultOf)},
                   **{k: (v.key, v.carried) for k, v in sent_kw.items() if isinstance(v, ResultOf)}}
        if results:
            waits[RESULTS_KEY] = results
        if riders:
            waits[GUESTS_KEY] = [r.payload() for r in riders]
        ref = self.workers[index].call.remote(
            self.key, method, sent_before, sent_then, *(sent(a.future.handles[0]) if isinstance(a, ResultOf) else a for a in args),
            **{k: sent(v.future.handles[0]) if isinstance(v, ResultOf) else v for k, v in sent_kw.items()}, **waits)
        for slot, r in enumerate(riders):
            r.ref, r.slot, r.host_method = ref, slot, method
        CALLS.remote += 1
        CALLS.spent(time.perf_counter() - start, 0.0)  # serializing the arguments is part of the call
        if self.restarts_left > 0:
            self._calls[ref] = (index, method, args, kwargs, before, deps, then, self._restarted.get(index, 0))
        return ref

    def _rides(self, args: tuple, kwargs: dict, before: tuple, then: tuple) -> bool:
        """Whether the call waits to ride on the host's next call on its rank: a hosted role's kept
        call (`keep`: nothing comes back to wait for) whose arguments Ray need not resolve."""
        if self.hosted_by is None or KEEP_KEY not in kwargs:
            return False
        values = [*args, *kwargs.values(), *(a for _, margs in (*before, *then) for a in margs)]
        return not any(isinstance(v, (ResultOf, ray.ObjectRef)) for v in values)

    def _ready(self, handles: list) -> bool:
        handles = [sent(h) for h in handles]
        return not handles or len(ray.wait(handles, num_returns=len(handles), timeout=0)[0]) == len(handles)

    def _shared(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return tuple(put_large(a) for a in args), {k: put_large(v) for k, v in kwargs.items()}

    def memory(self) -> list:
        missing = [i for i in range(self.world_size) if self._memory.get(i) is None]
        if missing:
            self._wait([self._submit(i, "memory", (), {}) for i in missing], "memory", missing, None)
        return [self._memory[i] for i in range(self.world_size)]

    def _wait(self, handles: list, method: str, indices: list[int], timeout: float | None) -> list:
        start = time.perf_counter()
        # A rider's failure outside its own methods is its host's: named so.
        names = [(self.hosted_by.role, h.host_method) if isinstance(h, Rider) and h.slot is not None
                 else (self.role, method) for h in handles]
        try:
            answers = self._wait_calls([sent(h) for h in handles], method, indices, timeout, names)
        except BaseException:
            CALLS.spent(time.perf_counter() - start, float("inf"))  # failed: its wait, no overhead figure
            raise
        waited = time.perf_counter() - start
        riding = [isinstance(h, Rider) and h.slot is not None for h in handles]
        # What ran on each rank: a host's call ran its guests' methods too.
        ran = max((a[4][h.slot][2] if rides else a[2] + sum(g[2] for g in a[4])
                   for h, a, rides in zip(handles, answers, riding)), default=0.0)
        answers = [a[4][h.slot] if rides else a[:4] for h, a, rides in zip(handles, answers, riding)]
        for index, (_, memory, _, carried) in zip(indices, answers):
            self._memory[index] = memory
            if carried:
                self._carried[index] = carried
        CALLS.spent(waited, ran)
        return [value for value, _, _, _ in answers]

    def _wait_calls(self, handles: list, method: str, indices: list[int], timeout: float | None,
                    names: Optional[list] = None) -> list:
        while True:
            try:
                results = self._wait_once(handles, method, indices, timeout, names)
            except WorkerError as e:
                replaced = self._replace(e, handles) if e.lost and all(h in self._calls for h in handles) else None
                if replaced is None:
                    raise
                handles = replaced
                continue
            for h in handles:
                self._calls.pop(h, None)
            return results

    def _replace(self, error: WorkerError, handles: list) -> Optional[list]:
        """Restart the lost rank of `error` (unless another thread waiting on a call sent to the
        same process did already) and submit its share of the call again; None when no restart
        is left."""
        with self._replacing:
            sent_to = {self._calls[h][7] for h in handles if self._calls[h][0] == error.rank}
            if self._restarted.get(error.rank, 0) in sent_to:
                if self.restarts_left <= 0:
                    return None
                self.restarts_left -= 1
                print(f"{self.role} rank {error.rank} was lost in {error.method}() and is restarted "
                      f"({self.restarts_left} restart(s) left): {str(error).splitlines()[0]}", file=sys.stderr)
                self.restart_rank(error.rank)
                if self.on_restart is not None:
                    self.on_restart(self, error.rank)
            out = []
            for h in handles:
                index, method, args, kwargs, before, deps, then, _ = self._calls[h]
                if index == error.rank:
                    self._calls.pop(h)
                    h = self._submit(index, method, args, kwargs, before, deps, then)
                out.append(h)
            return out

    def _wait_once(self, handles: list, method: str, indices: list[int], timeout: float | None,
                   names: Optional[list] = None) -> list:
        """The answers of `handles` (ranks `indices`); a failure names `names`' (role, method) of its
        handle (default: this group's role and `method`), or a hosted role's that rode on it."""
        timeout = self.timeout_s if timeout is None else timeout
        start = time.monotonic()
        try:  # fast path: everything succeeds in time
            return ray.get(handles, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            timed_out = True
        except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError):
            timed_out = False
        # Name the first failing rank, in rank order among the finished ones.
        ready, _ = ray.wait(handles, num_returns=len(handles), timeout=0)
        ready = set(ready)
        for k, (ref, index) in enumerate(zip(handles, indices)):
            if ref not in ready:
                continue
            role, label = names[k] if names else (self.role, method)
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, GuestFailed):
                    role, label, cause = cause.role, cause.method, cause.cause
                if not isinstance(cause, Exception) or isinstance(cause, ray.exceptions.RayError):
                    cause = e  # its class could not be rebuilt here: caught as WorkerError only
                raise WorkerError.raised(role, index, label, cause, str(e)) from None
            except ray.exceptions.RayActorError as e:
                raise WorkerError(role, index, label, f"the actor process died ({e.__class__.__name__}); "
                                  "check its log for an out-of-memory kill or a crash", str(e), lost=True) from None
        silent = [index for ref, index in zip(handles, indices) if ref not in ready]
        if timed_out and silent:  # none failed: the first rank still silent is reported like a dead one
            raise WorkerError(self.role, silent[0], method, self._silence(silent, time.monotonic() - start),
                              lost=True)
        if timed_out:  # every rank answered just after the bound
            return ray.get(handles)
        raise WorkerError(self.role, indices[0], method, "failed, but no rank reported the error")

    def _silence(self, ranks: list[int], waited: float) -> str:
        infos = getattr(self, "infos", None)  # unknown while node_info itself is awaited
        where = f" (pid {infos[ranks[0]]['pid']})" if infos else ""
        return (f"no answer after {waited:.1f}s: the actor process{where} stopped answering (stopped, hung, "
                f"or waiting in a collective for a rank that is gone); silent ranks {ranks}. "
                "Check its log and stack (py-spy dump), or raise cluster.call_timeout_s (0: no bound)")

    def shutdown(self) -> None:
        self.restarts_left = 0  # a call still watched (sent ahead) sees its rank killed, not lost
        for w in self.workers if self.hosted_by is None else ():  # a hosted role's processes are its host's
            ray.kill(w)
        self.workers = []
