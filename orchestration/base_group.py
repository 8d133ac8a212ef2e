"""What the Ray and the local worker groups share: the call API, futures and errors.

A subclass supplies `_submit(index, method, args, kwargs, before, deps) -> handle` and
`_wait(handles, method, indices) -> results`; everything about dispatch, execute and
collect lives here once, so both backends give identical results. Arguments that several
ranks get unchanged (dispatch='all', a tensor-parallel engine's ranks, lockstep empty
slices) pass through `_shared` once per call, where the Ray group puts them into the object
store once. `CALLS` counts, over every group of this process, the remote calls made, the
seconds the driver's own thread spent sending, waiting for (or, in-process, running) role
methods, and what the calls cost beyond their methods' run on the ranks, so a driver can
report its own time per step apart from its roles', and the calls' overhead.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any, Callable

from orchestration import dispatch as dsp


class WorkerError(RuntimeError):
    """A worker failed or died. Names the role, rank and method; carries the remote traceback.
    `lost`: the rank's process died or stopped answering (a restart may help), rather than its
    code raising (a restart would raise again).

    An error the worker's code raised comes as `WorkerError.raised(...)`, an instance of a class
    deriving from both WorkerError and the original exception's class (as Ray's RayTaskError
    does), so `except ValueError` catches a ValueError raised in a worker; `cause` is that
    exception and its attributes read through."""

    _cause_cls: type | None = None  # on the classes made by `raised`: the original exception's class

    def __init__(self, role: str, rank: int, method: str, problem: str, traceback: str = "", lost: bool = False,
                 cause: BaseException | None = None):
        self.role, self.rank, self.method, self.lost = role, rank, method, lost
        self.problem, self.remote_traceback, self.cause = problem, traceback, cause
        msg = f"{role} rank {rank} failed in {method}(): {problem}"
        if traceback:
            msg += f"\n--- remote traceback ({role} rank {rank}) ---\n{traceback.rstrip()}"
        RuntimeError.__init__(self, msg)  # not the original class's __init__: its arguments are unknown

    @classmethod
    def raised(cls, role: str, rank: int, method: str, cause: BaseException, traceback: str = "") -> "WorkerError":
        """The error for `cause`, raised by `method` on `rank`: catchable as WorkerError and as
        `type(cause)` (a plain WorkerError where that class cannot be a second base)."""
        problem = f"{type(cause).__name__}: {cause}"
        return _catchable_as(_original_class(cause))(role, rank, method, problem, traceback, cause=cause)

    def __str__(self) -> str:
        return self.args[0] if self.args else ""  # never the original class's __str__

    def __getattr__(self, name: str):
        # Only reached for attributes WorkerError lacks: those of the original exception.
        cause = self.__dict__.get("cause")
        if cause is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(cause, name)

    def __reduce__(self):
        return _rebuild, (self.role, self.rank, self.method, self.problem, self.remote_traceback, self.lost,
                          self.cause)


def _original_class(cause: BaseException) -> type:
    cls = type(cause)
    return (cls._cause_cls or WorkerError) if issubclass(cls, WorkerError) else cls


_catchable: dict[type, type] = {}


def _catchable_as(cls: type) -> type:
    """WorkerError's subclass that also derives from `cls` (made once per class)."""
    if cls is WorkerError or not issubclass(cls, Exception):
        return WorkerError
    if cls not in _catchable:
        try:
            made = type(f"WorkerError({cls.__name__})", (WorkerError, cls), {"_cause_cls": cls})
            made.__module__, made.__qualname__ = __name__, made.__name__
        except TypeError:  # e.g. a final class or an incompatible layout
            made = WorkerError
        _catchable[cls] = made
    return _catchable[cls]


def _rebuild(role, rank, method, problem, traceback, lost, cause) -> WorkerError:
    cls = WorkerError if cause is None else _catchable_as(_original_class(cause))
    return cls(role, rank, method, problem, traceback, lost, cause)


@dataclass
class CallStats:
    """Running totals of this process's worker-group calls (read differences per step)."""
    # Remote calls submitted (one per rank called; in-process calls are not remote).
    remote: int = 0
    # Seconds the driver's own thread spent inside role calls: sending them, waiting for remote
    # ranks, running in-process ranks, or waiting for a thread that watches a call (`joined`).
    role_s: float = 0.0
    # Seconds the calls took beyond their methods' run on the ranks (per call, its send, and its
    # wait less its slowest rank's method as that rank reported back, 0 at least: a call waited
    # for after it ended, or queued behind another, counts no more than its wait): transfer,
    # scheduling. Counted in every thread.
    overhead_s: float = 0.0

    def __post_init__(self):
        self._lock = threading.Lock()
        self._thread = threading.local()  # .watcher: this thread watches calls beside the driver

    def spent(self, waited: float, ran: float) -> None:
        """A call's seconds: `waited` for it (or sending it, or running it in process), of which
        its ranks' methods ran `ran`. In a watching thread (`watching`) the wait is beside the
        driver's own, so not the driver's (the driver's wait for that thread is: `joined`)."""
        with self._lock:
            self.overhead_s += max(waited - ran, 0.0)
            if not self.in_watcher():
                self.role_s += waited

    def joined(self, waited: float) -> None:
        """The driver waited `waited` seconds for a thread that watches a call."""
        self.spent(waited, waited)

    def watching(self) -> None:
        """Mark the current thread as one that watches calls beside the driver."""
        self._thread.watcher = True

    def in_watcher(self) -> bool:
        """Whether the current thread watches calls beside the driver (`watching`)."""
        return getattr(self._thread, "watcher", False)


CALLS = CallStats()


@dataclass(frozen=True)
class ResultOf:
    """A call argument that is the value another group's call returned on its first rank (or
    `key` of that value, a dict; with `carried`, the value of that deferred method the call
    carried, see `defer` and `then`): the call starts on its ranks once that value exists, and
    the value goes from rank to rank, not through the driver, which does not wait for it (a
    weight sync's receive takes the send's manifest so). An argument of the call, or of a
    method queued with `defer` or `then`; not nested inside another argument."""
    future: "GroupFuture"
    key: str | None = None
    carried: str | None = None

    def pick(self, value: Any, carried: dict | None = None) -> Any:
        return pick(value, carried, self.key, self.carried)


def pick(value: Any, carried: dict | None, key: str | None, method: str | None) -> Any:
    """What a ResultOf argument stands for in a call's answer: the method's `value`, or the value
    of the deferred `method` among those the call `carried`; then its `key` (a dict's) if given."""
    chosen = value if method is None else (carried or {}).get(method)
    return chosen if key is None else chosen.get(key)


# Keyword argument of a rank's call whose answer the rank keeps under that name (returning None).
KEEP_KEY = "_keep_answer_as"


@dataclass(frozen=True)
class Kept:
    """Stands for the answer each rank kept under `key` (`async_call(..., keep=key)`), or its
    element `item` when the answer is a tuple: an argument of a later call to the same processes,
    or a field of a batch dataclass passed as one, that each rank replaces with its own answer.
    Not sliced by dispatch (it has no length)."""
    key: str
    item: int | None = None


class GroupFuture:
    """Result of `async_call`: `get()` waits, collects and returns like `call` would. `handles`:
    the ranks' calls as the backend knows them (ObjectRefs on Ray), for another group's `after`
    and for `ready`."""

    def __init__(self, finish: Callable[[float | None], Any], handles: tuple = (), ready: Callable[[], bool] | None = None):
        self._finish = finish
        self._done = False
        self._value: Any = None
        self.handles = handles
        self._ready = ready

    def ready(self) -> bool:
        """Whether `get()` would return without waiting."""
        return self._done or self._ready is None or self._ready()

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
    # (method, args, first) to run first thing in the next call (`defer`); first: on the first
    # engine's ranks only, else on every rank.
    _deferred: tuple = ()
    # (method, args, first) to run right after the next call's method (`then`).
    _then: tuple = ()
    # rank -> {method: result} of the deferred methods its latest call carried.
    _carried: dict = {}
    # Handles of other groups' calls the next call waits for (`after`).
    _waits_for: tuple = ()
    # The group whose processes hold this role's instance beside its own (a Ray WorkerGroup's
    # `host`, placement.teacher_in_trainer_process); None: processes of its own.
    hosted_by: "BaseWorkerGroup | None" = None
    # Whether its ranks can keep a call's answer (`keep`): each rank is a process of its own.
    keeps_answers: bool = False
    # Calls the driver has sent (a restart's calls from a watching thread not counted): a turn
    # promised to be one call checks it made exactly one.
    calls_sent: int = 0

    def call(self, method: str, *args: Any, dispatch: dsp.Dispatch = "all", execute: dsp.Execute = "all",
             collect: dsp.Collect = "none", **kwargs: Any) -> Any:
        """Run `method` on the workers and wait. See `orchestration.dispatch` for the modes."""
        return self.async_call(method, *args, dispatch=dispatch, execute=execute, collect=collect, **kwargs).get()

    def async_call(self, method: str, *args: Any, dispatch: dsp.Dispatch = "all", execute: dsp.Execute = "all",
                   collect: dsp.Collect = "none", keep: str | None = None, **kwargs: Any) -> GroupFuture:
        """With `keep`, each rank keeps its answer under that name and the future's value is
        `Kept(keep)`: a later call to the same processes names it (a hosted teacher's logits for
        the trainer); every rank is called, an empty slice included, so every rank has one."""
        dsp.check_execute(execute)
        if keep is not None and (execute == "first" or not self.keeps_answers or self.tensor_parallel != 1):
            raise ValueError(f"{self.role}: keep={keep!r} needs ranks that are processes of their own (a Ray group), "
                             "execute='all' and tensor parallel size 1")
        tp = self.tensor_parallel
        if CALLS.in_watcher():  # (a restart's calls) what the driver queued rides on the driver's next call
            before = then = deps = ()
        else:
            self.calls_sent += 1
            before, self._deferred = self._deferred, ()
            then, self._then = self._then, ()
            deps, self._waits_for = self._waits_for, ()
        label = "+".join([m for m, *_ in before] + [method] + [m for m, *_ in then])  # how an error names the call
        if execute == "first":  # the first engine: rank 0 and its tensor-parallel peers
            shared = self._shared(args, kwargs) if tp > 1 else (args, kwargs)
            handles = [self._submit(i, method, *shared, self._for_rank(before, i), deps, self._for_rank(then, i))
                       for i in range(tp)]
            rest = self._submit_deferred((*before, *then), set(range(tp)), deps)
            return GroupFuture(lambda timeout: self._finish(handles, label, list(range(tp)), timeout, rest)[0],
                               (*handles, *rest[0]), lambda: self._ready([*handles, *rest[0]]))
        if callable(dispatch):  # a custom dispatch is asked for every rank
            per_worker = dsp.split(dispatch, self.world_size, args, kwargs)
        else:  # one share per engine, the same for each of its ranks
            shares = dsp.split(dispatch, self.world_size // tp, args, kwargs,
                               keep_empty=method in self.lockstep or keep is not None)
            per_worker = [shares[i // tp] for i in range(self.world_size)]
        if keep is not None:  # the same share object for the ranks that shared one
            marked = {id(s): (s[0], {**s[1], KEEP_KEY: keep}) for s in per_worker if s is not None}
            per_worker = [None if s is None else marked[id(s)] for s in per_worker]
        indices = [i for i, a in enumerate(per_worker) if a is not None]
        users: dict[int, int] = {}  # id of a share -> ranks receiving that very share
        for i in indices:
            users[id(per_worker[i])] = users.get(id(per_worker[i]), 0) + 1
        shared: dict[int, tuple] = {}  # one _shared per share that several ranks receive
        for i in indices:
            key = id(per_worker[i])
            if users[key] > 1 and key not in shared:
                shared[key] = self._shared(*per_worker[i])
        handles = [self._submit(i, method, *shared.get(id(per_worker[i]), per_worker[i]), self._for_rank(before, i),
                                deps, self._for_rank(then, i)) for i in indices]
        rest = self._submit_deferred((*before, *then), set(indices), deps)

        def finish(timeout: float | None) -> Any:
            results = self._finish(handles, label, indices, timeout, rest)
            return Kept(keep) if keep is not None else dsp.collect(collect, [r for i, r in zip(indices, results)
                                                                            if i % tp == 0])
        return GroupFuture(finish, (*handles, *rest[0]), lambda: self._ready([*handles, *rest[0]]))

    def defer(self, method: str, *args: Any, execute: dsp.Execute = "all") -> None:
        """Run `method(*args)` on every rank (execute='first': on the first engine's ranks only)
        first thing in the group's next call, inside that call's own round trip (a colocated
        role's onload rides on its first work of the turn). A rank the next call does not reach
        gets it as a call of its own, sent alongside. `defer`, `then` and `after` queue for the
        driver's own next call: a call made in a thread watching calls (a restart's) carries none."""
        dsp.check_execute(execute)
        self._deferred = (*self._deferred, (method, args, execute == "first"))

    def then(self, method: str, *args: Any, execute: dsp.Execute = "all") -> None:
        """Run `method(*args)` on every rank (execute='first': on the first engine's ranks only)
        right after the group's next call's method, inside that call's own round trip (a
        colocated role's offload rides on the one call of its turn): the call's answer is its
        method's, and the call finishes once this ran too. Its results come back as the deferred
        ones do (`deferred_results`). A rank the next call does not reach gets it as a call of its
        own, sent alongside."""
        dsp.check_execute(execute)
        self._then = (*self._then, (method, args, execute == "first"))

    def _for_rank(self, queued: tuple, rank: int) -> tuple:
        """The (method, args) of `queued` that rank `rank` runs."""
        return tuple((m, a) for m, a, first in queued if not first or rank < self.tensor_parallel)

    def after(self, futures: list[GroupFuture]) -> None:
        """The group's next call starts on its ranks only once `futures` (calls of other groups,
        e.g. an offload freeing the devices this group is about to use) have finished. Their
        handles go along with the call, and the cluster holds it until they are done: the driver
        does not wait. In-process calls have finished already. The caller still `get()`s those
        futures for their results and errors."""
        self._waits_for = (*self._waits_for, *(h for f in futures for h in f.handles))

    def drop_deferred(self) -> bool:
        """Forget what `defer` and `then` queued; True if something was queued (no call has carried it)."""
        queued, self._deferred, self._then = bool(self._deferred or self._then), (), ()
        return queued

    def deferred_results(self) -> list:
        """Each rank's results of the deferred methods its latest call carried, as
        [{method: result}] in rank order (ranks never called: {})."""
        return [self._carried.get(i, {}) for i in range(self.world_size)]

    def _submit_deferred(self, queued: tuple, reached: set[int], deps: tuple) -> tuple[list, list[int], str, list]:
        """The `defer` and `then` methods (`queued`, in their order) for the ranks a call does not
        reach, as calls of their own; returns (handles, ranks, the methods' label, the method each
        of those calls ran last)."""
        handles, ranks, lasts = [], [], []
        for i in range(self.world_size):
            mine = self._for_rank(queued, i)
            if i in reached or not mine:
                continue
            (method, args), before = mine[-1], mine[:-1]
            handles.append(self._submit(i, method, args, {}, before, deps))
            ranks.append(i)
            lasts.append(method)
        return handles, ranks, "+".join(m for m, *_ in queued), lasts

    def _finish(self, handles: list, label: str, indices: list[int], timeout: float | None,
                rest: tuple[list, list[int], str, list]) -> list:
        results = self._wait(handles, label, indices, timeout)
        if rest[0]:
            for index, last, value in zip(rest[1], rest[3], self._wait(rest[0], rest[2], rest[1], timeout)):
                self._carried[index] = {**self._carried.get(index, {}), last: value}
        return results

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` on rank `rank` alone and wait (e.g. weights for a rank just restarted)."""
        return self._wait([self._submit(rank, method, args, kwargs, (), ())], method, [rank], None)[0]

    def alias(self, role: str) -> "BaseWorkerGroup":
        """These workers under another role name: calls reach the same instances, errors name
        `role`. For roles that share one process per rank (RayHelper's workers listed in one device
        group); shutting down either one ends the workers of both."""
        twin = copy.copy(self)
        twin.role = role
        return twin

    def memory(self) -> list:
        """Each rank's memory() figures (host RSS now and at peak, device peak). The Ray group
        answers with those that came back with each rank's latest call, asking only ranks never
        called; in-process ranks are asked directly."""
        return self.call("memory")

    def _shared(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments of one share sent to several ranks, as each rank receives them."""
        return args, kwargs

    def _submit(self, index: int, method: str, args: tuple, kwargs: dict, before: tuple, deps: tuple,
                then: tuple = ()) -> Any:
        """Start `method` on rank `index`, after the `before` methods ((method, args) pairs) there and
        followed by the `then` ones, once the calls `deps` (handles, see `after`) finished."""
        raise NotImplementedError

    def _ready(self, handles: list) -> bool:
        """Whether these calls have finished (in-process ones always have)."""
        return True

    def _wait(self, handles: list, method: str, indices: list[int], timeout: float | None) -> list:
        raise NotImplementedError
