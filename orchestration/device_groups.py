"""The Swift-Ray placement form: ``device_groups: {nproc_per_node: N, <group>: {device, ranks,
workers}}`` -> a `Plan` (`orchestration/planner.py:make_plan` calls `plan_device_groups` for a
config that has ``device_groups``). Pure: no Ray, no I/O; errors are `PlanError`s naming the key.
"""
from __future__ import annotations

import ast
import re
from typing import Any, Mapping

from orchestration.config import RoleDevices
from orchestration.plan_types import (DEVICES, GROUP_ENTRY_KEYS, ROLES, VLLM_ROLES, Plan, PlanError, RolePlan,
                                      check_capacity, num_cpus, positive_int, reject_unknown)

_RANGE = re.compile(r"^\s*list\(\s*range\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)\s*\)\s*$")
_RANKS_FIX = "write an int (2), a list like [0, 1], or 'list(range(0, 2))'"


def parse_ranks(value: Any, key: str) -> int | list[int]:
    """`ranks` as given by users: an int, a list of ints, or the strings
    'list(range(a, b))', 'list(range(n))', '[0, 1]' or '0,1'. Never eval'd."""
    given = value
    if isinstance(value, bool):
        raise PlanError(key, "is not an int or a list of ints", _RANKS_FIX, given)
    if isinstance(value, int):
        return positive_int(value, key)
    if isinstance(value, str):
        m = _RANGE.match(value)
        if m:
            a, b = (0, int(m.group(1))) if m.group(2) is None else (int(m.group(1)), int(m.group(2)))
            value = list(range(a, b))
        else:
            text = value.strip()
            try:
                value = ast.literal_eval(text if text.startswith("[") else f"[{text}]")
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                raise PlanError(key, "cannot be read as ranks", _RANKS_FIX, given) from None
    if isinstance(value, (list, tuple)):
        if not value or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in value):
            raise PlanError(key, "is not a non-empty list of ranks >= 0", _RANKS_FIX, given)
        if len(set(value)) != len(value):
            raise PlanError(key, "lists a rank twice", "list each rank once", given)
        return list(value)
    raise PlanError(key, "is not an int or a list of ints", _RANKS_FIX, given)


_NAME = re.compile(r"^[A-Za-z_][\w-]*$")


def plan_device_groups(cfg: dict, common: dict[str, Any], any_role_names: bool = False) -> Plan:
    """The plan of a placement with `device_groups`; `common`: its shared keys, checked
    (planner.common_settings); `any_role_names`: workers may be any identifier."""
    default_tp = RoleDevices.vllm_tensor_parallel_size
    dg = cfg["device_groups"]
    if not isinstance(dg, Mapping):
        raise PlanError("device_groups", "is not a mapping of device groups",
                        "write device_groups: {nproc_per_node: N, my_group: {device: GPU, ranks: N, workers: [role]}}",
                        dg)
    dg = dict(dg)
    if "nproc_per_node" not in dg:
        raise PlanError("device_groups.nproc_per_node", "is missing",
                        "set device_groups.nproc_per_node to the devices per node")
    per_node = positive_int(dg.pop("nproc_per_node"), "device_groups.nproc_per_node")
    if not dg:
        raise PlanError("device_groups", "holds no device group",
                        "add one: device_groups.<group>: {device: GPU, ranks: N, workers: [role]}",
                        cfg["device_groups"])

    parsed = []  # (name, device, ranks|count, workers, vLLM tensor parallel size)
    cpus: dict[str, float | None] = {}  # group -> num_cpus of its ranks
    owner: dict[str, str] = {}
    for name, group in dg.items():
        key = f"device_groups.{name}"
        if not isinstance(group, Mapping):
            raise PlanError(key, "is not a device group (a mapping with device, ranks and workers)",
                            f"write {name}: {{device: GPU, ranks: 2, workers: [sampler]}}", group)
        group = dict(group)
        reject_unknown(group, GROUP_ENTRY_KEYS, key)
        device = str(group.get("device", "GPU")).upper()
        if device not in DEVICES:
            raise PlanError(f"{key}.device", "is an unknown device", "use GPU or CPU", group.get("device"))
        if group.get("ranks") is None:
            raise PlanError(f"{key}.ranks", "is missing", "give the group's ranks as a count (2) or a list ([0, 1])")
        ranks = parse_ranks(group["ranks"], f"{key}.ranks")
        if device == "CPU" and isinstance(ranks, list):
            raise PlanError(f"{key}.ranks", "lists ranks, but a CPU group takes a process count",
                            f"write ranks: {len(ranks)}", group["ranks"])
        workers = group.get("workers")
        workers = [workers] if isinstance(workers, str) else workers
        if workers is None:
            raise PlanError(f"{key}.workers", "is missing", f"list the group's roles, e.g. workers: [sampler], with "
                            f"roles from {list(ROLES)}")
        if not workers or not isinstance(workers, (list, tuple)):
            raise PlanError(f"{key}.workers", "is not a non-empty list of roles",
                            f"write workers: [sampler] with roles from {list(ROLES)}", workers)
        for role in workers:
            known = role in ROLES or (any_role_names and isinstance(role, str) and bool(_NAME.match(role)))
            if not known:
                raise PlanError(f"{key}.workers", f"names an unknown role '{role}'", f"use roles from {list(ROLES)}",
                                list(workers))
            if role in owner:
                raise PlanError(f"{key}.workers", f"names role '{role}', which is already in group '{owner[role]}'",
                                "list each role in exactly one group", list(workers))
            owner[role] = name
        # Beyond ms-swift's form: ranks per vLLM engine of the group's rollout/sampler/teacher.
        tp = positive_int(group.get("vllm_tensor_parallel_size", default_tp), f"{key}.vllm_tensor_parallel_size")
        count = len(ranks) if isinstance(ranks, list) else ranks
        if tp > 1 and (device == "CPU" or count % tp or not set(workers) & set(VLLM_ROLES)):
            problem = ("is set on a CPU group, and CPU groups run no vLLM engine" if device == "CPU" else
                       f"does not divide the group's {count} ranks" if count % tp else
                       f"is set, but no role of {list(workers)} runs a vLLM engine")
            raise PlanError(f"{key}.vllm_tensor_parallel_size", problem,
                            f"set it on a GPU group holding one of {list(VLLM_ROLES)}, dividing its ranks", tp)
        parsed.append((name, device, ranks, list(workers), tp))
        cpus[name] = num_cpus(group, key)

    # Explicit GPU ranks first; counts then take the lowest free ranks, in group order.
    taken: dict[int, str] = {}
    for name, device, ranks, _, _ in parsed:
        if device == "GPU" and isinstance(ranks, list):
            for r in ranks:
                if r in taken:
                    raise PlanError(f"device_groups.{name}.ranks", f"holds rank {r}, but rank {r} is also used by "
                                    f"group '{taken[r]}'", "give each group its own ranks, or list both roles in "
                                    "one group's workers to colocate them", dg[name]["ranks"])
                taken[r] = name
    resolved: dict[str, list[int]] = {}
    next_cpu = 0
    for name, device, ranks, _, _ in parsed:
        if device == "CPU":
            resolved[name] = list(range(next_cpu, next_cpu + ranks))
            next_cpu += ranks
        elif isinstance(ranks, list):
            resolved[name] = ranks
        else:
            free, r = [], 0
            while len(free) < ranks:
                if r not in taken:
                    free.append(r)
                    taken[r] = name
                r += 1
            resolved[name] = free

    gpu_ranks = [r for name, device, _, _, _ in parsed if device == "GPU" for r in resolved[name]]
    if "nnodes" in cfg:
        nnodes = positive_int(cfg["nnodes"], "nnodes")
        check_capacity(gpu_ranks, nnodes, per_node, "nnodes", nnodes)
    else:
        nnodes = (max(gpu_ranks) // per_node + 1) if gpu_ranks else 1

    roles = {}
    for name, device, _, workers, tp in parsed:
        ranks = tuple(resolved[name])
        gpu = device == "GPU"
        for role in workers:
            mates = tuple(w for w in workers if w != role)
            roles[role] = RolePlan(
                role=role, device=device, ranks=ranks,
                nodes=tuple(r // per_node if gpu else 0 for r in ranks),
                local_devices=tuple(r % per_node if gpu else r for r in ranks),
                group=name, colocated_with=mates,
                offload_model=bool(mates) and role not in ("rollout", "sampler") and common["offload_model"],
                offload_optimizer=bool(mates) and role in ("train", "default") and common["offload_optimizer"],
                sleep_level=common["sleep_level"] if (mates and role in ("rollout", "sampler")) else 0,
                tensor_parallel_size=tp if role in VLLM_ROLES else 1, num_cpus=cpus[name])
    return Plan(roles=roles, nnodes=nnodes, devices_per_node=per_node, form="device_groups")
