"""ms-swift's RayHelper front end (`@worker` / `@function`) on top of the worker groups.

    from orchestration.decorators import RayHelper, configure

    @RayHelper.worker(group=['model1', 'model2'])
    class MyTrainer: ...          # __init__ calls the _prepare_* methods below

        @RayHelper.function(group='model1', dispatch='slice', collect='flatten')
        def rollout(self, inputs): ...

    configure({'nproc_per_node': 4, 'g': {'device': 'CPU', 'ranks': 2, 'workers': ['model1']}, ...})
    MyTrainer(args).train()

Until `configure` is called the decorators change nothing: the class and its methods run
as if undecorated. Once configured, constructing a @worker class in the driver creates,
for each group it names, a worker group (Ray actors, or in-process copies with
backend='local') of copies of the class, each built with the same arguments. In a copy,
the @function methods of its own group run; those of other groups are skipped while
__init__ runs (that group's copies set themselves up). In the driver, __init__ skips
every @function method and later calls go to the group through `BaseWorkerGroup.call`
with the decorator's dispatch/execute/collect; undecorated methods (train()) run in
the driver.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from orchestration import dispatch as dsp
from orchestration.base_group import BaseWorkerGroup
from orchestration.planner import Plan, make_plan

_STATE = "_rayhelper_state"  # instance attribute holding an _Instance once configured


@dataclass
class _Instance:
    """What the decorators know about one instance of a @worker class."""
    groups: dict[str, BaseWorkerGroup] | None = None  # driver instance: group name -> its workers
    replica_of: str | None = None  # worker copy: the group it serves
    init_depth: int = 0  # > 0 while its __init__ runs


@dataclass
class _Config:
    plan: Plan
    backend: str
    placement: Any = None
    owns_placement: bool = False
    groups: dict[str, BaseWorkerGroup] = field(default_factory=dict)
    call_timeout_s: float | None = None  # the cluster config's bound on each wait for workers

    def spawn(self, cls: type, names: list[str], args: tuple, kwargs: dict) -> dict[str, BaseWorkerGroup]:
        for name in names:
            if name in self.groups:
                raise RuntimeError(f"group '{name}' already has workers from an earlier @worker instance; "
                                   "call configure() or teardown() before constructing another")
            if name not in self.plan.roles:
                raise KeyError(f"@worker group '{name}' of {cls.__name__} is not in the configured plan "
                               f"(planned: {', '.join(self.plan.roles)}); add it to a device group's workers")
        made = {}
        for name in names:
            factory = functools.partial(_make_replica, cls, name)
            if self.backend == "local":
                from orchestration.local import LocalWorkerGroup
                group = LocalWorkerGroup(factory, self.plan[name], kwargs, init_args=args)
            else:
                from orchestration.worker_group import WorkerGroup
                group = WorkerGroup(factory, self.plan[name], kwargs, placement=self.placement, init_args=args,
                                    timeout_s=self.call_timeout_s)
            self.groups[name] = made[name] = group
        return made


_config: _Config | None = None


def configure(plan: Plan | Mapping, backend: str = "ray", placement: Any = None, cluster: Any = None) -> None:
    """Activate the decorators for @worker instances constructed from now on.

    `plan` is a Plan or a `device_groups` mapping whose workers name the groups. With
    backend='ray' and no `placement`, Ray is started if needed (`cluster`: a ClusterConfig,
    e.g. with simulate_gpus) and the plan is placed; `teardown` removes that placement. Waits for
    the workers are bounded by `cluster.call_timeout_s` (ClusterConfig's default without one).
    """
    from orchestration.config import ClusterConfig

    global _config
    teardown()
    if backend not in ("ray", "local"):
        raise ValueError(f"backend must be 'ray' or 'local', got {backend!r}")
    plan = plan if isinstance(plan, Plan) else plan_device_groups(plan)
    owns = False
    cluster = cluster or ClusterConfig()
    if backend == "ray" and placement is None:
        from orchestration.cluster import init_cluster
        from orchestration.placement import create_placement
        init_cluster(cluster, plan.demand())
        placement, owns = create_placement(plan, cluster.placement_timeout_s), True
    _config = _Config(plan, backend, placement, owns, call_timeout_s=cluster.call_timeout_s)


def teardown() -> None:
    """Shut down the workers made since `configure` and make the decorators transparent again."""
    global _config
    config, _config = _config, None
    if config is None:
        return
    for group in config.groups.values():
        group.shutdown()
    if config.owns_placement:
        config.placement.remove()


def is_configured() -> bool:
    return _config is not None


def plan_device_groups(device_groups: Mapping) -> Plan:
    """Plan a `device_groups` mapping whose workers are any names (model1, model2, ...)."""
    return make_plan({"device_groups": device_groups}, any_role_names=True)


def _make_replica(cls: type, group: str, *args: Any, **kwargs: Any) -> Any:
    """Build the copy of a @worker class that serves `group` (runs inside the worker)."""
    obj = cls.__new__(cls)
    obj.__dict__[_STATE] = _Instance(replica_of=group)
    obj.__init__(*args, **kwargs)
    return obj


def worker(group: list[str] | str) -> Callable[[type], type]:
    """Class decorator: instances built while configured get a worker group per named group."""
    names = [group] if isinstance(group, str) else list(group)

    def decorate(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            state = self.__dict__.get(_STATE)
            if state is None:
                if _config is None:  # not configured: a plain constructor
                    return init(self, *args, **kwargs)
                state = _Instance(groups=_config.spawn(cls, names, args, kwargs))
                self.__dict__[_STATE] = state
            state.init_depth += 1
            try:
                init(self, *args, **kwargs)
            finally:
                state.init_depth -= 1

        cls.__init__ = __init__
        return cls

    return decorate


def function(group: str, dispatch: dsp.Dispatch = "all", execute: dsp.Execute = "all",
             collect: dsp.Collect = "none") -> Callable[[Callable], Callable]:
    """Method decorator: the method belongs to `group`; see `orchestration.dispatch` for the modes."""
    dsp.check_execute(execute)

    def decorate(func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(self, *args, **kwargs):
            state = getattr(self, "__dict__", {}).get(_STATE)
            if state is None:  # not configured (or not a @worker instance): a plain call
                return func(self, *args, **kwargs)
            if state.replica_of is not None:  # inside a worker copy
                if state.replica_of == group:
                    return func(self, *args, **kwargs)
                if state.init_depth:
                    return None  # another group's setup: that group's copies run it
                raise RuntimeError(f"{func.__qualname__} belongs to group '{group}' but was called inside a "
                                   f"'{state.replica_of}' worker; call it from the driver instead")
            if state.init_depth:
                return None  # driver __init__: each group's copies ran their own setup
            if group not in state.groups:
                raise RuntimeError(f"{func.__qualname__} belongs to group '{group}', which "
                                   f"@worker(group={list(state.groups)}) of {type(self).__name__} does not name")
            return state.groups[group].call(func.__name__, *args, dispatch=dispatch, execute=execute,
                                            collect=collect, **kwargs)

        return wrapper

    return decorate


class RayHelper:
    """ms-swift's spelling, so its examples run with only the import changed."""
    worker = staticmethod(worker)
    function = staticmethod(function)
    initialize = staticmethod(configure)  # ms-swift: RayHelper.initialize(device_groups)
    configure = staticmethod(configure)
    teardown = staticmethod(teardown)
