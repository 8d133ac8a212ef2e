"""Placement planner: a placement config (either ms-swift form) -> a `Plan`.

Pure: no Ray, no I/O. Two input forms are accepted (docs/placement.md, "Both ms-swift forms"):

* Megatron-Ray form: ``train/rollout/teacher: {gpus: N}``, ``colocate_groups``,
  ``teacher_model`` (a teacher colocated with the trainer), ``offload_*``, ``sleep_level``;
  planned here.
* Swift-Ray form: ``device_groups: {nproc_per_node: N, <group>: {device, ranks, workers}}``;
  planned by orchestration/device_groups.py.

Every impossible layout raises `PlanError` (orchestration/plan_types.py), one line naming the
config key, its value and the fix. Defaults of keys a mapping leaves out come from the typed
sections (orchestration/config.py: PlacementConfig, RoleDevices).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from orchestration.config import PlacementConfig, RoleDevices
from orchestration.device_groups import plan_device_groups
from orchestration.plan_types import (COMMON_KEYS, MEGATRON_KEYS, MEGATRON_ROLES, ROLE_ENTRY_KEYS, SWIFT_KEYS, Plan,
                                      PlanError, RolePlan, check_capacity, num_cpus, positive_int, reject_unknown)


def make_plan(cfg: Mapping[str, Any], *, any_role_names: bool = False, section: str = "placement") -> Plan:
    """Build a Plan from a placement mapping in either ms-swift form (None/False/{} = unset).

    `any_role_names` lets `device_groups` workers be any identifier (model1, model2, ...),
    as the @worker/@function front end names its groups; drivers keep the role names.
    `section`: where the mapping sits in the config, the prefix of the keys errors name
    ('' for a mapping given on its own, as RayHelper.initialize's device_groups).
    """
    try:
        cfg = {k: v for k, v in dict(cfg).items() if v is not None and v is not False and v != {}}
        if "device_groups" in cfg:
            mixed = [k for k in (*MEGATRON_ROLES, *sorted(MEGATRON_KEYS - COMMON_KEYS)) if k in cfg]
            if mixed:
                raise PlanError(mixed[0], "is a Megatron-Ray form key (train/rollout/teacher, colocate_groups), mixed "
                                "here with the Swift-Ray form (device_groups)",
                                "use one form: drop device_groups, or drop the Megatron-Ray keys (on the command "
                                "line, start from placement=empty)", cfg[mixed[0]])
            reject_unknown(cfg, SWIFT_KEYS, "")
            return plan_device_groups(cfg, common_settings(cfg), any_role_names)
        reject_unknown(cfg, MEGATRON_KEYS, "")
        return _plan_megatron(cfg)
    except PlanError as e:
        raise e.under(section)


def with_colocated_role(plan: Plan, role: str, beside: str, offload_model: bool) -> Plan:
    """`plan` plus `role` on exactly the devices of role `beside`, sharing its bundles (and
    those of every role colocated with it), e.g. GRPO's reference policy beside the trainer.
    With `offload_model` the new role keeps its weights in host memory between uses."""
    base = plan[beside]
    if role in plan.roles:
        raise PlanError(role, f"names role '{role}', which is already planned",
                        f"remove '{role}' from the placement config")
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


def common_settings(cfg: Mapping) -> dict[str, Any]:
    """The keys both forms share (offload_*, sleep_level), checked, with
    PlacementConfig's defaults where `cfg` leaves them out."""
    sleep = cfg.get("sleep_level", PlacementConfig.sleep_level)
    if isinstance(sleep, bool) or sleep not in (0, 1, 2):
        raise PlanError("sleep_level", "must be 0, 1 or 2",
                        "use 1 (weights to host memory) or 2 (weights discarded), 0 to never sleep", sleep)
    return {"offload_model": bool(cfg.get("offload_model", PlacementConfig.offload_model)),
            "offload_optimizer": bool(cfg.get("offload_optimizer", PlacementConfig.offload_optimizer)),
            "sleep_level": sleep}


# ------------------------------------------------------------------ Megatron-Ray form

def _role_entries(cfg: dict) -> dict[str, dict]:
    """The role sections (train/rollout/teacher: {gpus, ...}) of `cfg`, checked."""
    default_tp = RoleDevices.vllm_tensor_parallel_size
    entries: dict[str, dict] = {}
    for role in MEGATRON_ROLES:
        if role not in cfg:
            continue
        entry = cfg[role]
        if not isinstance(entry, Mapping):
            raise PlanError(role, "is not a mapping of the role's devices",
                            f"set placement.{role}.gpus=N (in a config_file: {role}: {{gpus: N}})", entry)
        entry = {k: v for k, v in dict(entry).items() if v is not None}
        reject_unknown(entry, ROLE_ENTRY_KEYS, role)
        if "gpus" not in entry:
            raise PlanError(f"{role}.gpus", "is missing",
                            f"set placement.{role}.gpus to the number of devices for {role}")
        positive_int(entry["gpus"], f"{role}.gpus")
        num_cpus(entry, role)
        tp = positive_int(entry.get("vllm_tensor_parallel_size", default_tp), f"{role}.vllm_tensor_parallel_size")
        if tp > 1 and role == "train":
            raise PlanError("train.vllm_tensor_parallel_size", "is set, but the trainer has no vLLM engine",
                            "set it on rollout or teacher", tp)
        if entry["gpus"] % tp:
            raise PlanError(f"{role}.vllm_tensor_parallel_size", f"does not divide {role}.gpus={entry['gpus']}",
                            f"choose a tensor parallel size that divides {entry['gpus']}", tp)
        entries[role] = entry
    if "train" not in entries and "rollout" not in entries:
        raise PlanError("train.gpus", "is unset or 0, and so is rollout.gpus: no train or rollout role has devices",
                        "set placement.train.gpus to the trainer's device count (and placement.rollout.gpus for a "
                        "rollout of its own)")
    return entries


def _colocate_groups(cfg: dict, entries: dict[str, dict]) -> tuple[list[list[str]], dict[str, int]]:
    """colocate_groups, checked: (the groups, role -> index of its group)."""
    raw = cfg.get("colocate_groups")
    raw = [] if raw is None else raw  # None: every role on its own devices
    if not isinstance(raw, (list, tuple)) or any(not isinstance(g, (list, tuple)) for g in raw):
        raise PlanError("colocate_groups", "is not a list of lists of roles",
                        "write colocate_groups: [[train, rollout]] (on the command line: "
                        "placement.colocate_groups=[[train,rollout]])", raw)
    groups: list[list[str]] = []
    owner: dict[str, int] = {}
    for gi, group in enumerate(raw):
        for role in group:
            if role not in MEGATRON_ROLES:
                raise PlanError("colocate_groups", f"names an unknown role '{role}'",
                                f"use role names from {list(MEGATRON_ROLES)}", raw)
            if role not in entries:
                raise PlanError("colocate_groups", f"colocates role '{role}', which has no devices",
                                f"set placement.{role}.gpus=N, or remove {role} from colocate_groups", raw)
            if owner.get(role) == gi:
                raise PlanError("colocate_groups", f"lists role '{role}' twice in one group", "list it once", raw)
            if role in owner:
                raise PlanError("colocate_groups", f"puts role '{role}' in two colocate groups",
                                "put each role in at most one group (merge the groups)", raw)
            owner[role] = gi
        counts = {r: entries[r]["gpus"] for r in group}
        if len(set(counts.values())) > 1:
            raise PlanError("colocate_groups", f"colocates roles with the device counts {counts}, but colocated roles "
                            "need equal device counts",
                            "give every role of the group the same gpus, or place them separately", raw)
        groups.append(list(group))
    return groups, owner


def _plan_megatron(cfg: dict) -> Plan:
    common = common_settings(cfg)
    entries = _role_entries(cfg)
    teacher_model = cfg.get("teacher_model")
    colocated_teacher = teacher_model is not None and "teacher" not in entries
    if cfg.get("offload_teacher_model") and not colocated_teacher:
        raise PlanError("offload_teacher_model", "applies only to a teacher colocated with the trainer",
                        "set teacher_model (and no teacher group), or drop offload_teacher_model", True)
    if cfg.get("teacher_in_trainer_process") and not colocated_teacher:
        raise PlanError("teacher_in_trainer_process", "applies only to a teacher colocated with the trainer, which "
                        "runs in its processes", "set teacher_model (and no teacher group), or drop "
                        "teacher_in_trainer_process", True)
    if colocated_teacher:
        if "train" not in entries:
            raise PlanError("teacher_model", "is a teacher colocated with the trainer, but there is no train group",
                            "set placement.train.gpus=N", teacher_model)
        entries["teacher"] = {"gpus": entries["train"]["gpus"], "model": teacher_model}
    elif "teacher" in entries and teacher_model is not None:
        entries["teacher"].setdefault("model", teacher_model)

    # Colocate groups: validated, then implicit colocation of the teacher with train.
    groups, owner = _colocate_groups(cfg, entries)
    if colocated_teacher:
        if "train" in owner:
            groups[owner["train"]].append("teacher")
        else:
            owner["train"] = len(groups)
            groups.append(["train", "teacher"])
        owner["teacher"] = owner["train"]

    # Devices: each colocate group (once) and each separate role take the next ranks.
    order = [r for r in MEGATRON_ROLES if r in entries]
    first: dict[Any, list[int]] = {}
    next_rank = 0
    for role in order:
        key = owner.get(role, role)
        if key not in first:
            n = entries[role]["gpus"]
            first[key] = list(range(next_rank, next_rank + n))
            next_rank += n
    nnodes = cfg.get("nnodes")
    nnodes = 1 if nnodes is None else positive_int(nnodes, "nnodes")  # None: one node (Megatron form)
    per_node = cfg.get("nproc_per_node")
    per_node = -(-next_rank // nnodes) if per_node is None else positive_int(per_node, "nproc_per_node")
    size_key = "nproc_per_node" if "nproc_per_node" in cfg else "nnodes"
    check_capacity(list(range(next_rank)), nnodes, per_node, size_key, cfg.get(size_key))

    default_tp = RoleDevices.vllm_tensor_parallel_size
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
            model=entries[role].get("model"), num_cpus=num_cpus(entries[role], role),
            host="train" if is_teacher and cfg.get("teacher_in_trainer_process") else None)
    return Plan(roles=roles, nnodes=nnodes, devices_per_node=per_node, form="megatron")
