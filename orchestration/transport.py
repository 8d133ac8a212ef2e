"""How a call's arguments and answers travel between the driver and Ray ranks.

- CPU tensors cross as numpy arrays (`send_tensors_as_arrays`): Ray moves those as raw
  buffers, where torch's own pickling costs 20x more for a batch of teacher logprobs.
- An argument several ranks share goes into the object store once (`put_large`), as an
  ObjectRef, from SHARE_MIN_BYTES up.
- Keyword arguments of a rank's call carry what Ray must resolve before the call starts: the
  calls it waits for (AFTER_PREFIX), other calls' answers (RESULTS_KEY), and the ResultOf
  arguments of deferred methods lifted to the top level (`lift`, then `fill` on the rank).
- A role hosted in another role's processes (placement.teacher_in_trainer_process) can keep a
  call's answer on its ranks (KEEP_KEY): each rank holds its own share, and a later call of
  the host role names it with `Kept`, as an argument or a field of a batch argument, so the
  answer never travels through the driver (`resolve_kept` on the rank). Such a kept call is
  not sent on its own: it rides on the host's next call to the rank (`Rider`, GUESTS_KEY),
  which runs it first, so the two are one Ray call.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
import ray

from orchestration.base_group import Kept, ResultOf


def _array_of(t: Any) -> tuple:
    """A CPU tensor as (numpy array, dtype numpy lacks or None, requires_grad); other tensors
    (another device, a sparse or quantized layout) as torch pickles them."""
    import torch

    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        import pickle
        return ("pickled", pickle.dumps(t), None)
    plain = t.detach().contiguous()
    try:
        return (plain.numpy(), None, t.requires_grad)
    except TypeError:  # bfloat16 and the like: the bytes as integers of the same width
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[plain.element_size()]
        return (plain.view(width).numpy(), str(plain.dtype).removeprefix("torch."), t.requires_grad)


def _tensor_of(parts: tuple) -> Any:
    import torch

    data, dtype, grad = parts
    if isinstance(data, str):
        import pickle
        return pickle.loads(dtype)
    # An array read from the object store is read-only shared memory: the tensor gets its own copy.
    t = torch.from_numpy(data if data.flags.writeable else data.copy())
    if dtype is not None:
        t = t.view(getattr(torch, dtype))
    return t.requires_grad_(True) if grad else t


def send_tensors_as_arrays() -> None:
    """Serialize torch.Tensor (exactly that class) as numpy arrays in this process's Ray calls."""
    import torch

    ray.util.register_serializer(torch.Tensor, serializer=_array_of, deserializer=_tensor_of)


# Keyword arguments of a rank's call that carry the calls it waits for (BaseWorkerGroup.after).
AFTER_PREFIX = "_after_call_"
# Keyword argument naming the arguments that are other calls' answers ({position or name: (key,
# carried)}, as ResultOf has them).
RESULTS_KEY = "_results_of_calls"
# Keyword argument of a host role's call that carries the kept calls of the roles it hosts, run
# first (`Rider` below): [(role, method, before, then, args, kwargs)].
GUESTS_KEY = "_guest_calls"
# Keyword arguments that carry the ResultOf arguments of deferred methods (`defer`, `then`) to the
# top level, where Ray resolves them: f"{LIFTED_PREFIX}{entry}_{position}".
LIFTED_PREFIX = "_deferred_arg_"


@dataclasses.dataclass(frozen=True)
class Lifted:
    """Stands in a deferred method's arguments for the ResultOf sent as keyword argument `name`."""
    name: str


def lift(queued: tuple, tag: str, kwargs: dict) -> tuple:
    """`queued` ((method, args) pairs) with each ResultOf argument moved into `kwargs` under a
    name of its own and a Lifted in its place."""
    out = []
    for j, (method, margs) in enumerate(queued):
        if any(isinstance(a, ResultOf) for a in margs):
            margs = list(margs)
            for k, a in enumerate(margs):
                if isinstance(a, ResultOf):
                    kwargs[f"{LIFTED_PREFIX}{tag}{j}_{k}"] = a
                    margs[k] = Lifted(f"{LIFTED_PREFIX}{tag}{j}_{k}")
            margs = tuple(margs)
        out.append((method, margs))
    return tuple(out)


def fill(queued: tuple, values: dict) -> tuple:
    """`queued` with each Lifted argument replaced by its resolved value."""
    return tuple((m, tuple(values[a.name] if isinstance(a, Lifted) else a for a in margs)) for m, margs in queued)


def resolve_kept(args: tuple, kwargs: dict, kept: dict) -> tuple[tuple, dict, set]:
    """`args` and `kwargs` with each Kept (top level, or a field of a dataclass argument)
    replaced by the answer this rank keeps; returns them and the keys used."""
    used: set = set()

    def value(k: Kept) -> Any:
        if k.key not in kept:
            raise KeyError(f"no answer kept under {k.key!r} on this rank: the call that was to keep it did not "
                           "run here before this one")
        used.add(k.key)
        answer = kept[k.key]
        return answer if k.item is None else answer[k.item]

    def one(x: Any) -> Any:
        if isinstance(x, Kept):
            return value(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            marked = {f.name: value(getattr(x, f.name)) for f in dataclasses.fields(x)
                      if isinstance(getattr(x, f.name), Kept)}
            return dataclasses.replace(x, **marked) if marked else x
        return x
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}, used


# An argument shared by several ranks goes into the object store once from this size up; smaller
# ones travel inside each call (Ray inlines arguments under 100 KiB anyway).
SHARE_MIN_BYTES = 64 * 1024


def _nbytes(x: Any, limit: int = SHARE_MIN_BYTES) -> int:
    """Rough serialized size of `x`, counted until it reaches `limit`."""
    if isinstance(x, np.ndarray):
        return x.nbytes
    if hasattr(x, "element_size") and hasattr(x, "numel"):  # a torch tensor
        return x.numel() * x.element_size()
    if isinstance(x, (str, bytes, bytearray)):
        return len(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = [getattr(x, f.name) for f in dataclasses.fields(x)]
    elif isinstance(x, dict):
        x = [*x.keys(), *x.values()]
    if isinstance(x, (list, tuple)):
        total = 8 * len(x)
        for item in x:
            if total >= limit:
                break
            total += _nbytes(item, limit - total)
        return total
    return 8


def put_large(x: Any) -> Any:
    return ray.put(x) if not isinstance(x, ray.ObjectRef) and _nbytes(x) >= SHARE_MIN_BYTES else x


class GuestFailed(Exception):
    """A hosted role's call that rode on its host's call failed on the rank (`_RoleHost._guest`):
    the driver names `role` and `method` (its label), not the host's."""

    def __init__(self, role: str, method: str, cause: BaseException):
        super().__init__(role, method, cause)
        self.role, self.method, self.cause = role, method, cause

    def __str__(self) -> str:
        return f"{self.role}.{self.method}: {type(self.cause).__name__}: {self.cause}"


class Rider:
    """A hosted role's kept call (`keep`) on one rank: no call of its own, it rides on the host's
    next call there (run first in that process; the answer stays there anyway), so the two make
    one round trip. Waited for (or needed as a handle) before a host call carried it, it is sent
    as a call of its own."""

    def __init__(self, group: Any, index: int, call: tuple):
        self.group, self.index, self.call = group, index, call  # call: (method, args, kwargs, before, deps, then)
        # The host's call that carried it, its place among that call's guests and the host's method.
        self.ref: Any = None
        self.slot: Optional[int] = None
        self.host_method = ""

    def sent(self) -> Any:
        """The call that carries it (sent alone now if no host call did)."""
        if self.ref is None:
            waiting = self.group.hosted_by._riders.get(self.index, [])
            if self in waiting:
                waiting.remove(self)
            self.ref = self.group._submit(self.index, *self.call, ride=False)
        return self.ref

    @property
    def deps(self) -> tuple:
        """The calls it waits for (`after`): the host's call carrying it waits for them."""
        return self.call[4]

    def payload(self) -> tuple:
        method, args, kwargs, before, _, then = self.call
        return self.group.key, method, before, then, args, kwargs


def sent(handle: Any) -> Any:
    """A call handle as Ray knows it (a Rider: the call that carries it)."""
    return handle.sent() if isinstance(handle, Rider) else handle
