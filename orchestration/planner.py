"""Placement planner: a placement config (either ms-swift form) -> a `Plan`.

Pure: no Ray, no I/O. Two input forms are accepted (DESIGN §5):

* Megatron-Ray form: ``train/rollout/teacher: {gpus: N}``, ``colocate_groups``,
  ``teacher_model`` (a teacher colocated with the trainer), ``offload_*``, ``sleep_level``.
* Swift-Ray form: ``device_groups: {nproc_per_node: N, <group>: {device, ranks, workers}}``
  (orchestration/device_groups.py).

Every impossible layout raises `PlanError`, whose message names the key and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

ROLES = ("train", "rollout", "teacher", "sampler", "prm", "orm", "default")
MEGATRON_ROLES = ("train", "rollout", "teacher")
# Roles that can run a vLLM engine, so may set vllm_tensor_parallel_size.
VLLM_ROLES = ("rollout", "sampler", "teacher")
# Keys shared by both forms, then the keys of each form.
COMMON_KEYS = {"offload_model", "offload_optimizer", "sleep_level", "nnodes", "gkd_logits_topk"}
MEGATRON_KEYS = COMMON_KEYS | {"colocate_groups", "teacher_model", "offload_teacher_model", "teacher_in_trainer_process",
                               "nproc_per_node", *MEGATRON_ROLES}
SWIFT_KEYS = COMMON_KEYS | {"device_groups"}
ROLE_ENTRY_KEYS = {"gpus", "model", "vllm_tensor_parallel_size", "num_cpus"}
GROUP_ENTRY_KEYS = {"device", "ranks", "workers", "vllm_tensor_parallel_size", "num_cpus"}


class PlanError(ValueError):
    """An impossible or ambiguous placement. `key` is the offending config key."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key = key
        super().__init__(f"placement key '{key}': {problem}. Fix: {fix}")


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
    gkd_logits_topk: int | None = None
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


def with_colocated_role(plan: Plan, role: str, beside: str, offload_model: bool) -> Plan:
    """`plan` plus `role` on exactly the devices of role `beside`, sharing its bundles (and
    those of every role colocated with it), e.g. GRPO's reference policy beside the trainer.
    With `offload_model` the new role keeps its weights in host memory between uses."""
    base = plan[beside]
    if role in plan.roles:
        raise PlanError(role, f"role '{role}' is already planned", f"remove '{role}' from the placement config")
    mates = (beside, *base.colocated_with)
    roles = {name: replace(r, colocated_with=(*r.colocated_with, role)) if name in mates else r
             for name, r in plan.roles.items()}
    roles[role] = replace(base, role=role, colocated_with=mates, offload_model=offload_model,
                          offload_optimizer=False, sleep_level=0, tensor_parallel_size=1, model=None)
    return replace(plan, roles=roles)


# Engines a role can be built with inside another role's processes (RolePlan.host); the others
# (vLLM, Megatron) start distributed groups of their own.
HOSTABLE_ENGINES = ("torch",)


def as_started(plan: Plan, engines: Mapping[str, str]) -> tuple[Plan, list[str]]:
    """The plan as its roles start: a role planned in another role's processes whose engine
    (`engines[role]`, torch's where absent) cannot be hosted there gets processes of its own.
    Returns the plan and a note per role moved."""
    roles, notes = dict(plan.roles), []
    for name, r in plan.roles.items():
        engine = engines.get(name, "torch")
        if r.host is not None and engine not in HOSTABLE_ENGINES:
            roles[name] = replace(r, host=None)
            notes.append(f"the {engine} {name} engine runs in processes of its own, not in the {r.host} role's "
                         f"(only {', '.join(HOSTABLE_ENGINES)} engines share another role's processes)")
    return (replace(plan, roles=roles) if notes else plan), notes


def make_plan(cfg: Mapping[str, Any], *, any_role_names: bool = False) -> Plan:
    """Build a Plan from a placement mapping in either ms-swift form (None/False = unset).

    `any_role_names` lets `device_groups` workers be any identifier (model1, model2, ...),
    as the @worker/@function front end names its groups; drivers keep the role names.
    """
    cfg = {k: v for k, v in dict(cfg).items() if v is not None and v is not False}
    if "device_groups" in cfg:
        mixed = sorted(set(cfg) & (MEGATRON_KEYS - COMMON_KEYS))
        if mixed:
            raise PlanError(mixed[0], "the Megatron-Ray form (train/rollout/teacher, colocate_groups) "
                            "is mixed with the Swift-Ray form (device_groups)",
                            "use one form: either device_groups, or train/rollout/teacher with colocate_groups")
        _reject_unknown(cfg, SWIFT_KEYS, "placement")
        from orchestration.device_groups import plan_device_groups  # it builds on this module's types

        return plan_device_groups(cfg, any_role_names)
    _reject_unknown(cfg, MEGATRON_KEYS, "placement")
    return _plan_megatron(cfg)


# ----------------------------------------------------------------------------- helpers

def _reject_unknown(d: Mapping, allowed: set, where: str) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise PlanError(f"{where}.{unknown[0]}", f"unknown key(s) {unknown}",
                        f"remove them; accepted keys here are {sorted(allowed)}")


def _positive_int(value: Any, key: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(key, f"expected an integer >= {minimum}, got {value!r}",
                        f"set {key} to an integer >= {minimum}")
    return value


def _defaults() -> tuple[type, type]:
    """The config dataclasses whose fields hold the defaults of keys a mapping leaves out
    (PlacementConfig, RoleDevices); imported here because orchestration.config imports this
    module."""
    from orchestration.config import PlacementConfig, RoleDevices

    return PlacementConfig, RoleDevices


def _common(cfg: Mapping) -> dict[str, Any]:
    placement, _ = _defaults()
    sleep = cfg.get("sleep_level", placement.sleep_level)
    if sleep not in (0, 1, 2):
        raise PlanError("sleep_level", f"must be 0, 1 or 2, got {sleep!r}",
                        "use 1 (weights to host memory) or 2 (weights discarded), 0 to never sleep")
    topk = cfg.get("gkd_logits_topk")
    if topk is not None:
        _positive_int(topk, "gkd_logits_topk")
    return {"offload_model": bool(cfg.get("offload_model", placement.offload_model)),
            "offload_optimizer": bool(cfg.get("offload_optimizer", placement.offload_optimizer)),
            "sleep_level": sleep, "gkd_logits_topk": topk}


def _num_cpus(entry: Mapping, key: str) -> float | None:
    """A role's or group's num_cpus: None (unset) or a number > 0."""
    value = entry.get("num_cpus")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError(f"{key}.num_cpus", f"expected a number of cores > 0, got {value!r}",
                        f"set {key}.num_cpus to the cores each rank computes with (e.g. 2), or leave it "
                        "unset for a share of the node's cores")
    return float(value)


def _check_capacity(ranks_used: list[int], nnodes: int, per_node: int, key: str) -> None:
    if ranks_used and max(ranks_used) >= nnodes * per_node:
        raise PlanError(key, f"the layout needs device rank {max(ranks_used)} but {nnodes} node(s) x "
                        f"{per_node} device(s) only have ranks 0..{nnodes * per_node - 1}",
                        "raise nnodes or nproc_per_node, or give the roles fewer devices")


# ------------------------------------------------------------------ Megatron-Ray form

def _plan_megatron(cfg: dict) -> Plan:
    common = _common(cfg)
    default_tp = _defaults()[1].vllm_tensor_parallel_size
    entries: dict[str, dict] = {}
    for role in MEGATRON_ROLES:
        if role not in cfg:
            continue
        entry = cfg[role]
        if not isinstance(entry, Mapping):
            raise PlanError(role, f"expected a mapping like {{gpus: 2}}, got {entry!r}",
                            f"write {role}: {{gpus: N}}")
        entry = {k: v for k, v in dict(entry).items() if v is not None}
        _reject_unknown(entry, ROLE_ENTRY_KEYS, role)
        if "gpus" not in entry:
            raise PlanError(f"{role}.gpus", "missing", f"set {role}.gpus to the number of devices for {role}")
        _positive_int(entry["gpus"], f"{role}.gpus")
        _num_cpus(entry, role)
        tp = _positive_int(entry.get("vllm_tensor_parallel_size", default_tp), f"{role}.vllm_tensor_parallel_size")
        if tp > 1 and role == "train":
            raise PlanError("train.vllm_tensor_parallel_size", "the trainer has no vLLM engine",
                            "set it on rollout or teacher")
        if entry["gpus"] % tp:
            raise PlanError(f"{role}.vllm_tensor_parallel_size",
                            f"tensor parallel size {tp} does not divide {role}.gpus={entry['gpus']}",
                            f"choose a tensor parallel size that divides {entry['gpus']}")
        entries[role] = entry
    if "train" not in entries and "rollout" not in entries:
        raise PlanError("train", "no role has devices", "add at least train: {gpus: N}")

    teacher_model = cfg.get("teacher_model")
    colocated_teacher = teacher_model is not None and "teacher" not in entries
    if cfg.get("offload_teacher_model") and not colocated_teacher:
        raise PlanError("offload_teacher_model", "only a teacher colocated with the trainer is offloaded",
                        "set teacher_model (and no teacher group), or drop offload_teacher_model")
    if cfg.get("teacher_in_trainer_process") and not colocated_teacher:
        raise PlanError("teacher_in_trainer_process", "only a teacher colocated with the trainer runs in its processes",
                        "set teacher_model (and no teacher group), or drop teacher_in_trainer_process")
    if colocated_teacher:
        if "train" not in entries:
            raise PlanError("teacher_model", "a colocated teacher shares the trainer's devices, "
                            "but there is no train group", "add train: {gpus: N}")
        entries["teacher"] = {"gpus": entries["train"]["gpus"], "model": teacher_model}
    elif "teacher" in entries and teacher_model is not None:
        entries["teacher"].setdefault("model", teacher_model)

    # Colocate groups: validated, then implicit colocation of the teacher with train.
    groups: list[list[str]] = []
    owner: dict[str, int] = {}
    raw_groups = cfg.get("colocate_groups")
    raw_groups = [] if raw_groups is None else raw_groups  # None: every role on its own devices
    if not isinstance(raw_groups, (list, tuple)) or any(not isinstance(g, (list, tuple)) for g in raw_groups):
        raise PlanError("colocate_groups", f"expected a list of lists of roles, got {raw_groups!r}",
                        "write colocate_groups: [[train, rollout]]")
    for gi, group in enumerate(raw_groups):
        for role in group:
            if role not in MEGATRON_ROLES:
                raise PlanError("colocate_groups", f"unknown role '{role}'",
                                f"use role names from {list(MEGATRON_ROLES)}")
            if role not in entries:
                raise PlanError("colocate_groups", f"role '{role}' is colocated but has no devices",
                                f"add {role}: {{gpus: N}} or remove it from colocate_groups")
            if role in owner:
                raise PlanError("colocate_groups", f"role '{role}' is in two colocate groups",
                                "put each role in at most one group (merge the groups)")
            owner[role] = gi
        counts = {r: entries[r]["gpus"] for r in group}
        if len(set(counts.values())) > 1:
            raise PlanError("colocate_groups", f"colocated roles need equal device counts, got {counts}",
                            "give every role of the group the same gpus, or place them separately")
        groups.append(list(group))
    if colocated_teacher:
        if "train" in owner:
            groups[owner["train"]].append("teacher")
        else:
            owner["train"] = len(groups)
            groups.append(["train", "teacher"])
        owner["teacher"] = owner["train"]

    # Devices: each colocate group (once) and each separate role take the next ranks.
    order = [r for r in MEGATRON_ROLES if r in entries]
    first: dict[str, list[int]] = {}
    next_rank = 0
    for role in order:
        key = owner.get(role, role)
        if key not in first:
            n = entries[role]["gpus"]
            first[key] = list(range(next_rank, next_rank + n))
            next_rank += n
    nnodes = cfg.get("nnodes")
    nnodes = 1 if nnodes is None else _positive_int(nnodes, "nnodes")  # None: one node (Megatron form)
    per_node = cfg.get("nproc_per_node")
    per_node = -(-next_rank // nnodes) if per_node is None else _positive_int(per_node, "nproc_per_node")
    _check_capacity(list(range(next_rank)), nnodes, per_node,
                    "nproc_per_node" if "nproc_per_node" in cfg else "nnodes")

    roles = {}
    for role in order:
        key = owner.get(role, role)
        mates = tuple(r for r in groups[key] if r != role) if isinstance(key, int) else ()
        ranks = tuple(first[key])
        is_teacher = role == "teacher"
        roles[role] = RolePlan(
            role=role, device="GPU", ranks=ranks,
            nodes=tuple(r // per_node for r in ranks), local_devices=tuple(r % per_node for r in ranks),
            group="+".join(groups[key]) if isinstance(key, int) else role, colocated_with=mates,
            # The rollout frees memory by sleeping; trainer and teacher by offloading.
            offload_model=bool(mates) and (bool(cfg.get("offload_teacher_model")) if is_teacher
                                           else role == "train" and common["offload_model"]),
            offload_optimizer=bool(mates) and role == "train" and common["offload_optimizer"],
            sleep_level=common["sleep_level"] if (mates and role == "rollout") else 0,
            tensor_parallel_size=entries[role].get("vllm_tensor_parallel_size", default_tp),
            model=entries[role].get("model"), num_cpus=_num_cpus(entries[role], role),
            host="train" if is_teacher and cfg.get("teacher_in_trainer_process") else None)
    return Plan(roles=roles, nnodes=nnodes, devices_per_node=per_node, form="megatron",
                gkd_logits_topk=common["gkd_logits_topk"])
