"""The words of a placement and what planning one yields; pure (standard library only).

* Names: the roles a placement may name and the keys of both ms-swift forms (Megatron-Ray:
  ``train/rollout/teacher: {gpus}``, ``colocate_groups``, ...; Swift-Ray: ``device_groups``).
* Types: `RolePlan` (where one role runs), `Plan` (every role), `PlanError` (an impossible
  layout, naming the config key and the fix).
* Checks both forms share (`positive_int`, `num_cpus`, `reject_unknown`, `check_capacity`).

orchestration/config.py (the typed sections), planner.py (the Megatron-Ray form and
`make_plan`) and device_groups.py (the Swift-Ray form) build on this module; it imports none
of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

ROLES = ("train", "rollout", "teacher", "sampler", "prm", "orm", "default")
MEGATRON_ROLES = ("train", "rollout", "teacher")
# Roles that can run a vLLM engine, so may set vllm_tensor_parallel_size.
VLLM_ROLES = ("rollout", "sampler", "teacher")
# Keys shared by both forms, then the keys of each form.
COMMON_KEYS = {"offload_model", "offload_optimizer", "sleep_level", "nnodes"}
MEGATRON_KEYS = COMMON_KEYS | {"colocate_groups", "teacher_model", "offload_teacher_model",
                               "teacher_in_trainer_process", "nproc_per_node", *MEGATRON_ROLES}
SWIFT_KEYS = COMMON_KEYS | {"device_groups"}
# Every key a placement (or the placement part of an ms-swift YAML file) may hold.
PLACEMENT_KEYS = MEGATRON_KEYS | SWIFT_KEYS
# Keys of a Megatron-form role entry (train: {...}) and of a Swift-form device group.
ROLE_ENTRY_KEYS = {"gpus", "model", "vllm_tensor_parallel_size", "num_cpus"}
GROUP_ENTRY_KEYS = {"device", "ranks", "workers", "vllm_tensor_parallel_size", "num_cpus"}
DEVICES = ("GPU", "CPU")

class _Unset:
    """A PlanError's value when there is none to show (a missing key); a class, so it pickles as itself."""


class PlanError(ValueError):
    """An impossible or ambiguous placement: one line `config key '<section>.<key>'=<value>
    <problem>. Fix: <fix>`. `key` is relative to the placement mapping (`train.gpus`); `section`
    is where that mapping sits in the config ('placement'; '' for a bare mapping)."""

    def __init__(self, key: str, problem: str, fix: str, value: Any = _Unset, section: str = "placement"):
        super().__init__(key, problem, fix, value, section)
        self.key, self.problem, self.fix, self.value, self.section = key, problem, fix, value, section

    def __str__(self) -> str:
        full = f"{self.section}.{self.key}" if self.section else self.key
        value = self.value
        if isinstance(value, Mapping):  # a section as the typed config holds it: its set keys
            value = {k: v for k, v in value.items() if v is not None}
        shown = "" if value is _Unset else f"={value!r}"
        return f"config key '{full}'{shown} {self.problem}. Fix: {self.fix}"

    def under(self, section: str) -> PlanError:
        """This error with its key under `section` (where the planned mapping sits in the config)."""
        self.section, self.args = section, (*self.args[:4], section)
        return self


@dataclass(frozen=True)
class RolePlan:
    role: str
    device: str  # "GPU" or "CPU"
    # Global ranks: device index over the cluster (node * devices_per_node + local) for
    # GPU roles; process index among all CPU processes for CPU roles.
    ranks: tuple[int, ...]
    nodes: tuple[int, ...]  # node index of each rank
    local_devices: tuple[int, ...]  # device index inside its node, per rank
    group: str  # device group; colocated roles share it and its bundles
    # What the planner decided from the placement config (offload_*, sleep_level,
    # vllm_tensor_parallel_size), per role.
    offload_model: bool
    offload_optimizer: bool
    sleep_level: int
    tensor_parallel_size: int
    colocated_with: tuple[str, ...] = ()
    model: str | None = None
    # CPU cores each rank computes with (its torch/OpenMP threads); None: its share of its
    # node's cores (orchestration.worker_group). Not used by backend=local.
    num_cpus: float | None = None
    # Role whose processes this role is built in on Ray (a teacher with
    # teacher_in_trainer_process: "train"); None: processes of its own.
    host: str | None = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Plan:
    roles: dict[str, RolePlan]
    nnodes: int
    devices_per_node: int
    form: str  # "megatron" or "device_groups"
    notes: tuple[str, ...] = field(default=())

    def __getitem__(self, role: str) -> RolePlan:
        if role not in self.roles:
            raise KeyError(f"role '{role}' is not in the plan (planned: {', '.join(self.roles)})")
        return self.roles[role]

    def rows(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per role, for the CLI table and `plan.json=true`."""
        return [{"role": r.role, "device": r.device, "ranks": list(r.ranks),
                 "nodes": sorted(set(r.nodes)), "group": r.group,
                 "colocated_with": list(r.colocated_with), "offload_model": r.offload_model,
                 "offload_optimizer": r.offload_optimizer, "sleep_level": r.sleep_level,
                 "tensor_parallel_size": r.tensor_parallel_size, "model": r.model, "num_cpus": r.num_cpus,
                 "host": r.host}
                for r in self.roles.values()]

    def demand(self) -> dict[str, float]:
        """Devices the plan reserves: {'GPU': n, 'CPU': m} (colocated roles count once)."""
        seen: dict[str, set] = {"GPU": set(), "CPU": set()}
        for r in self.roles.values():
            seen[r.device].update(r.ranks)
        return {k: float(len(v)) for k, v in seen.items()}

    def size_key(self, role: str) -> str:
        """The placement key that sets `role`'s rank count (for messages): `train.gpus`, or
        `device_groups.<group>.ranks`."""
        return f"device_groups.{self[role].group}.ranks" if self.form == "device_groups" else f"{role}.gpus"


# ----------------------------------------------------------------------------- shared checks

def positive_int(value: Any, key: str, minimum: int = 1) -> int:
    """`value` if it is an int >= `minimum`, else a PlanError on `key`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(key, f"is not an integer >= {minimum}", f"set it to an integer >= {minimum}", value)
    return value


def num_cpus(entry: Mapping, key: str) -> float | None:
    """A role's or group's num_cpus (`key`: the entry's key): None (unset) or a number > 0."""
    value = entry.get("num_cpus")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError(f"{key}.num_cpus", "is not a number of cores > 0",
                        "set it to the cores each rank computes with (e.g. 2), or leave it unset for a share of "
                        "the node's cores", value)
    return float(value)


def reject_unknown(d: Mapping, allowed: set, where: str) -> None:
    """A PlanError on the first key of `d` outside `allowed` (`where`: the key of `d`, '' at the top)."""
    unknown = sorted(set(d) - allowed)
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        others = f" (so are {unknown[1:]})" if len(unknown) > 1 else ""
        raise PlanError(key, f"is an unknown key here{others}",
                        f"remove it; the keys accepted here are {sorted(allowed)}", d[unknown[0]])


def check_capacity(ranks_used: list[int], nnodes: int, per_node: int, key: str, value: Any) -> None:
    """The device ranks used fit in nnodes x per_node devices; else a PlanError on `key` (=`value`)."""
    if ranks_used and max(ranks_used) >= nnodes * per_node:
        raise PlanError(key, f"leaves {nnodes} node(s) x {per_node} device(s), ranks 0..{nnodes * per_node - 1}, "
                        f"but the layout needs device rank {max(ranks_used)}",
                        "raise nnodes or nproc_per_node, or give the roles fewer devices", value)
