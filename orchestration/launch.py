"""Start the planned roles on the chosen backend: what every driver does first.

    groups = start_roles(cfg, plan, {"train": (Trainer, {...}), "rollout": (Rollout, {...})})
    groups["train"].call("train_step", batch, dispatch="slice", collect="flatten")

With `backend.workers=ray` this starts or joins the cluster, reserves placement groups and
spawns one actor per rank; with `local` every rank is built in this process.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from orchestration.base_group import BaseWorkerGroup
from orchestration.cluster import init_cluster
from orchestration.config import ConfigError
from orchestration.local import LocalWorkerGroup
from orchestration.placement import create_placement
from orchestration.plan_types import Plan, RolePlan
from orchestration.worker_group import WorkerGroup


@dataclass
class Roles:
    """The started worker groups, by role name, and what to release at the end."""
    groups: dict[str, BaseWorkerGroup]
    placement: Any = None
    _closed: bool = field(default=False, repr=False)

    def __getitem__(self, role: str) -> BaseWorkerGroup:
        return self.groups[role]

    def get(self, role: str) -> Optional[BaseWorkerGroup]:
        """The group of `role`, None when it was not started."""
        return self.groups.get(role)

    def shutdown(self) -> None:
        if self._closed:
            return
        for g in self.groups.values():
            g.shutdown()
        if self.placement is not None:
            self.placement.remove()
        self._closed = True


def meets_in_collectives(role_cls: type, entry: Any) -> bool:
    """The role's ranks meet in collectives: several ranks per engine (tensor parallel), or a
    lockstep method (the class's LOCKSTEP_METHODS) across several ranks."""
    return entry.tensor_parallel_size > 1 or bool(entry.world_size > 1 and getattr(role_cls, "LOCKSTEP_METHODS", ()))


def restartable(role_cls: type, entry: Any) -> bool:
    """A rank of this role can be replaced alone: the class says it keeps no state of its own
    (RESTARTABLE), and its ranks meet in no collective."""
    return getattr(role_cls, "RESTARTABLE", False) and not meets_in_collectives(role_cls, entry)


def check_local_backend(plan: Plan, classes: dict[str, type]) -> None:
    """backend.workers=local builds every rank in this one process, so no role whose ranks meet
    in collectives (`meets_in_collectives`) may have several; a ConfigError names the keys."""
    for role, cls in classes.items():
        entry = plan[role]
        if meets_in_collectives(cls, entry):
            size = f"placement.{plan.size_key(role)}"  # placement.train.gpus, placement.device_groups.g.ranks
            tp = entry.tensor_parallel_size
            what, fix = ((f"ranks of one vLLM engine ({tp})", f"{size.rsplit('.', 1)[0]}.vllm_tensor_parallel_size=1")
                         if tp > 1 else (f"{entry.world_size} ranks", f"{size}=1"))
            raise ConfigError(f"config key 'backend.workers'='local' runs every rank in this process, but the {role} "
                              f"role's {what} meet in collectives, which need a process per rank. Fix: set "
                              f"backend=ray, or {fix}")


def driver_group(role_cls: type, init_kwargs: dict, role: str = "driver") -> LocalWorkerGroup:
    """One rank of a role inside the driver process (e.g. an evaluator beside remote trainers)."""
    entry = RolePlan(role=role, device="CPU", ranks=(0,), nodes=(0,), local_devices=(0,), group="driver",
                     offload_model=False, offload_optimizer=False, sleep_level=0, tensor_parallel_size=1)
    return LocalWorkerGroup(role_cls, entry, init_kwargs)


def start_roles(cfg: Any, plan: Plan, roles: dict[str, tuple[type, dict]], restarts: int = 0) -> Roles:
    """Build a worker group per role named in `roles` ({role: (class, init kwargs)}).

    `cfg` is the typed run config (its `backend` and `cluster` sections are read). On Ray,
    `restarts` lost ranks of each restartable role (see `restartable`) are replaced on the fly,
    and a role the plan hosts in another's processes (`RolePlan.host`) is built there.
    """
    missing = sorted(set(roles) - set(plan.roles))
    if missing:
        raise ValueError(f"roles {missing} are not in the placement plan (planned: {sorted(plan.roles)}); "
                         "add them to the placement config")
    if cfg.backend.workers == "local":
        check_local_backend(plan, {r: cls for r, (cls, _) in roles.items()})
        return Roles({r: LocalWorkerGroup(cls, plan[r], kw) for r, (cls, kw) in roles.items()})
    init_cluster(cfg.cluster, plan.demand())
    placement = create_placement(plan, timeout_s=cfg.cluster.placement_timeout_s)
    started = Roles({}, placement)
    try:
        # Every role's actors are created before any is waited for: their processes start at once.
        # Hosts first: a hosted role's setup follows its host's on the same actors.
        for r, (cls, kw) in sorted(roles.items(), key=lambda item: plan[item[0]].host is not None):
            host = plan[r].host
            if host is not None and host not in started.groups:
                raise ValueError(f"role '{r}' is planned in the processes of '{host}', which this run does not start")
            started.groups[r] = WorkerGroup(cls, plan[r], kw, placement=placement,
                                            timeout_s=cfg.cluster.call_timeout_s,
                                            restarts=restarts if restartable(cls, plan[r]) and host is None else 0,
                                            start=False, host=started.groups.get(host) if host else None)
        for group in started.groups.values():
            group.begin_setup()
        for group in started.groups.values():
            group.end_setup()
    except BaseException:
        started.shutdown()
        raise
    return started
