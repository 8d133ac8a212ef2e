"""ms-swift's RayHelper front end (`@worker` / `@function`) on top of the worker groups.

    from orchestration.decorators import RayHelper

    @RayHelper.worker(group=['model1', 'model2'])
    class MyTrainer: ...          # __init__ calls the _prepare_* methods below

        @RayHelper.function(group='model1', dispatch='slice', collect='flatten')
        def rollout(self, inputs): ...

    RayHelper.initialize({'nproc_per_node': 4, 'g': {'device': 'CPU', 'ranks': 2, 'workers': ['model1']}, ...})
    MyTrainer(args).train()      # or: python train.py --use_ray true --device_groups '<json>'

The decorators are active once `RayHelper.initialize(device_groups)` (ms-swift's call; a
second call with the same groups changes nothing) or `configure(...)` (the same, with a
backend and cluster of choice) ran, or, as ms-swift's command line does, when a @worker
class is constructed in a process started with `--use_ray true --device_groups '<json>'`.
Until then they change nothing: the class and its methods run as if undecorated.

Active, constructing a @worker class in the driver creates, for each device group holding
groups it names, a worker group (Ray actors, or in-process copies with backend='local') of
copies of the class, each built with the same arguments. Groups listed in one device group
share that copy, one per rank, as in ms-swift: what a model1 method stores there a model2
method of the same copy sees. In a copy, the @function methods of the groups it serves run;
those of other groups are skipped while __init__ runs (their copies set themselves up). In
the driver, __init__ skips every @function method and later calls go to the group through
`BaseWorkerGroup.call` with the decorator's dispatch/execute/collect; undecorated methods
(train()) run in the driver. Each copy sees ms-swift's environment besides the worker
groups' own (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): RAY_SWIFT_GROUP,
CLUSTER_NAME, WORKER_NAME and RAY_SWIFT_ARGS (the driver's command-line arguments, JSON).
The class may be imported or defined in the script that runs (Ray sends a `__main__` class
by value, with the globals its methods read: the wrappers read none of this module's state).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from orchestration import dispatch as dsp
from orchestration.base_group import BaseWorkerGroup
from orchestration.cluster import init_cluster
from orchestration.config import ClusterConfig
from orchestration.local import LocalWorkerGroup
from orchestration.placement import create_placement
from orchestration.plan_types import Plan
from orchestration.planner import make_plan
from orchestration.worker_group import WorkerGroup

_STATE = "_rayhelper_state"  # instance attribute holding an _Instance once configured


@dataclass
class _Instance:
    """What the decorators know about one instance of a @worker class."""
    groups: dict[str, BaseWorkerGroup] | None = None  # driver instance: group name -> its workers
    serves: tuple[str, ...] = ()  # worker copy: the groups it serves (those of one device group)
    init_depth: int = 0  # > 0 while its __init__ runs


@dataclass
class _Config:
    plan: Plan
    backend: str
    placement: Any = None
    owns_placement: bool = False
    groups: dict[str, BaseWorkerGroup] = field(default_factory=dict)
    owners: list[BaseWorkerGroup] = field(default_factory=list)  # the groups holding workers (no aliases)
    call_timeout_s: float | None = None  # the cluster config's bound on each wait for workers

    def spawn(self, cls: type, names: list[str], args: tuple, kwargs: dict) -> dict[str, BaseWorkerGroup]:
        for name in names:
            if name in self.groups:
                raise RuntimeError(f"group '{name}' already has workers from an earlier @worker instance; "
                                   "call configure() or teardown() before constructing another")
            if name not in self.plan.roles:
                raise KeyError(f"@worker group '{name}' of {cls.__name__} is not in the configured plan "
                               f"(planned: {', '.join(self.plan.roles)}); add it to a device group's workers")
        # Names of one device group share one copy per rank (ms-swift's RAY_SWIFT_GROUP).
        by_device_group: dict[str, list[str]] = {}
        for name in names:
            by_device_group.setdefault(self.plan[name].group, []).append(name)
        made = {}
        for served in by_device_group.values():
            entry = self.plan[served[0]]
            factory = functools.partial(_make_replica, cls, tuple(served))
            env = _swift_env(served, entry.world_size)
            if self.backend == "local":
                group = LocalWorkerGroup(factory, entry, kwargs, init_args=args, env=env)
            else:
                group = WorkerGroup(factory, entry, kwargs, placement=self.placement, init_args=args, env=env,
                                    timeout_s=self.call_timeout_s)
            self.owners.append(group)
            for name in served:  # errors name the group a method belongs to
                self.groups[name] = made[name] = group if name == served[0] else group.alias(name)
        return made


def _swift_env(served: list[str], world_size: int) -> list[dict[str, str]]:
    """ms-swift's variables for each rank of the copies serving `served`."""
    exp = os.environ.get("RAY_SWIFT_EXP_NAME", "").strip()
    cluster = (f"{exp}-" if exp else "") + "-".join(served)
    args = json.dumps(sys.argv[1:])
    return [{"RAY_SWIFT_GROUP": ",".join(served), "CLUSTER_NAME": cluster, "WORKER_NAME": f"{cluster}-{rank}",
             "RAY_SWIFT_ARGS": args} for rank in range(world_size)]


_config: _Config | None = None


def configure(plan: Plan | Mapping, backend: str = "ray", placement: Any = None, cluster: Any = None) -> None:
    """Activate the decorators for @worker instances constructed from now on.

    `plan` is a Plan or a `device_groups` mapping whose workers name the groups. With
    backend='ray' and no `placement`, Ray is started if needed (`cluster`: a ClusterConfig,
    e.g. with simulate_gpus) and the plan is placed; `teardown` removes that placement. Waits for
    the workers are bounded by `cluster.call_timeout_s` (ClusterConfig's default without one).
    """
    global _config
    teardown()
    if backend not in ("ray", "local"):
        raise ValueError(f"backend must be 'ray' or 'local', got {backend!r}")
    plan = plan if isinstance(plan, Plan) else plan_device_groups(plan)
    owns = False
    cluster = cluster or ClusterConfig()
    if backend == "ray" and placement is None:
        init_cluster(cluster, plan.demand())
        placement, owns = create_placement(plan, cluster.placement_timeout_s), True
    _config = _Config(plan, backend, placement, owns, call_timeout_s=cluster.call_timeout_s)


def teardown() -> None:
    """Shut down the workers made since `configure` and make the decorators transparent again."""
    global _config
    config, _config = _config, None
    if config is None:
        return
    for group in config.owners:
        group.shutdown()
    if config.owns_placement:
        config.placement.remove()


def is_configured() -> bool:
    return _config is not None


def initialize(device_groups: Mapping | str | Plan, backend: str = "ray", placement: Any = None,
               cluster: Any = None) -> None:
    """ms-swift's `RayHelper.initialize(device_groups)`: activate the decorators on Ray (started, or
    joined through RAY_ADDRESS, as `configure` does). `device_groups` is the mapping or its JSON.
    Already active with the same groups, it changes nothing, as in ms-swift; active with other
    groups it refuses (call `RayHelper.teardown()` first) rather than keep the old ones unnoticed."""
    if isinstance(device_groups, str):
        device_groups = _json(device_groups, "device_groups")
    plan = device_groups if isinstance(device_groups, Plan) else plan_device_groups(device_groups)
    if _config is not None:
        if _config.plan == plan:
            return
        raise RuntimeError(f"RayHelper is already initialized with device groups for {list(_config.plan.roles)}; "
                           "call RayHelper.teardown() before initializing it with other device_groups")
    configure(plan, backend=backend, placement=placement, cluster=cluster)


def _json(text: str, flag: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON ({e}): {text!r}. Write it as JSON, e.g. "
                         '\'{"nproc_per_node": 2, "g": {"device": "GPU", "ranks": [0, 1], "workers": ["default"]}}\''
                         ) from None


_TRUE, _FALSE = {"1", "true", "t", "yes", "y", "on"}, {"0", "false", "f", "no", "n", "off"}


def try_init_ray(argv: list[str] | None = None) -> bool:
    """ms-swift's command line: with `--use_ray true` (or `--use_ray=true`) in `argv` (sys.argv),
    initialize from `--device_groups '<json>'`. Returns whether the decorators are active.
    Also run when a @worker class is constructed while they are not."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--use_ray", nargs="?", const="true", default=None)
    parser.add_argument("--device_groups", default=None)
    known, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.use_ray is None or known.use_ray.strip().lower() in _FALSE:
        if known.device_groups is not None and _config is None:
            warnings.warn("--device_groups is given without --use_ray true; the @worker classes run in this "
                          "process. Add --use_ray true to run them on Ray", stacklevel=2)
        return _config is not None
    if known.use_ray.strip().lower() not in _TRUE:
        raise ValueError(f"--use_ray expects true or false, got {known.use_ray!r}")
    if known.device_groups is None:
        raise ValueError("--use_ray true needs --device_groups '<json>' naming the device groups, e.g. "
                         '--device_groups \'{"nproc_per_node": 2, "g": {"device": "GPU", "ranks": [0, 1], '
                         '"workers": ["default"]}}\'')
    initialize(_json(known.device_groups, "--device_groups"))
    return True


def plan_device_groups(device_groups: Mapping) -> Plan:
    """Plan a `device_groups` mapping whose workers are any names (model1, model2, ...); errors
    name its keys as given (`device_groups.<group>.ranks`)."""
    return make_plan({"device_groups": device_groups}, any_role_names=True, section="")


def _make_replica(cls: type, serves: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
    """Build the copy of a @worker class that serves the groups `serves` (runs inside the worker)."""
    obj = cls.__new__(cls)
    obj.__dict__[_STATE] = _Instance(serves=serves)
    obj.__init__(*args, **kwargs)
    return obj


def worker(group: list[str] | str) -> Callable[[type], type]:
    """Class decorator: instances built while configured get a worker group per named group."""
    names = tuple([group] if isinstance(group, str) else group)

    def decorate(cls: type) -> type:
        init = cls.__init__

        # The wrappers only forward to module functions, which Ray pickles by reference: a class
        # defined in a script's __main__ is pickled by value, with the globals its methods read,
        # and reading _config here would ship the live workers (and their locks) with it.
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            _construct(cls, names, init, self, args, kwargs)

        cls.__init__ = __init__
        return cls

    return decorate


def _construct(cls: type, names: tuple[str, ...], init: Callable, obj: Any, args: tuple, kwargs: dict) -> None:
    """A @worker class's constructor: spawn its workers once active, then run its own __init__."""
    state = obj.__dict__.get(_STATE)
    if state is None:
        if _config is None and not try_init_ray():  # not active: a plain constructor
            init(obj, *args, **kwargs)
            return
        state = _Instance(groups=_config.spawn(cls, list(names), args, kwargs))
        obj.__dict__[_STATE] = state
    state.init_depth += 1
    try:
        init(obj, *args, **kwargs)
    finally:
        state.init_depth -= 1


def function(group: str, dispatch: dsp.Dispatch = "all", execute: dsp.Execute = "all",
             collect: dsp.Collect = "none") -> Callable[[Callable], Callable]:
    """Method decorator: the method belongs to `group`; see `orchestration.dispatch` for the modes."""
    dsp.check_execute(execute)
    modes = {"dispatch": dispatch, "execute": execute, "collect": collect}

    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)  # forwards only, as worker's __init__ does
        def wrapper(self, *args, **kwargs):
            return _call(func, group, modes, self, args, kwargs)

        return wrapper

    return decorate


def _call(func: Callable, group: str, modes: dict, obj: Any, args: tuple, kwargs: dict) -> Any:
    """A @function method's call: run here, skip it, or send it to its group's workers."""
    state = getattr(obj, "__dict__", {}).get(_STATE)
    if state is None:  # not configured (or not a @worker instance): a plain call
        return func(obj, *args, **kwargs)
    if state.serves:  # inside a worker copy
        if group in state.serves:
            return func(obj, *args, **kwargs)
        if state.init_depth:
            return None  # another group's setup: that group's copies run it
        raise RuntimeError(f"{func.__qualname__} belongs to group '{group}' but was called inside a "
                           f"{'/'.join(state.serves)} worker (rank {os.environ.get('RANK')}); "
                           "call it from the driver instead")
    if state.init_depth:
        return None  # driver __init__: each group's copies ran their own setup
    if group not in state.groups:
        raise RuntimeError(f"{func.__qualname__} belongs to group '{group}', which "
                           f"@worker(group={list(state.groups)}) of {type(obj).__name__} does not name")
    return state.groups[group].call(func.__name__, *args, **modes, **kwargs)


class RayHelper:
    """ms-swift's spelling, so its examples run with only the import changed."""
    worker = staticmethod(worker)
    function = staticmethod(function)
    initialize = staticmethod(initialize)
    configure = staticmethod(configure)
    try_init_ray = staticmethod(try_init_ray)
    teardown = staticmethod(teardown)
