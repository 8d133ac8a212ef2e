"""The Swift-Ray placement form: ``device_groups: {nproc_per_node: N, <group>: {device, ranks,
workers}}`` -> a `Plan` (`orchestration/planner.py:make_plan` calls `plan_device_groups` for a
config that has ``device_groups``). Pure: no Ray, no I/O; errors are `PlanError`s naming the key.
"""
from __future__ import annotations

import ast
import re
from typing import Any, Mapping

from orchestration.planner import (GROUP_ENTRY_KEYS, ROLES, VLLM_ROLES, Plan, PlanError, RolePlan, _check_capacity,
                                   _common, _defaults, _num_cpus, _positive_int, _reject_unknown)

_RANGE = re.compile(r"^\s*list\(\s*range\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?\)\s*\)\s*$")


def parse_ranks(value: Any, key: str) -> int | list[int]:
    """`ranks` as given by users: an int, a list of ints, or the strings
    'list(range(a, b))', 'list(range(n))', '[0, 1]' or '0,1'. Never eval'd."""
    if isinstance(value, bool):
        raise PlanError(key, f"expected an int or a list of ints, got {value!r}", "write ranks: 2 or ranks: [0, 1]")
    if isinstance(value, int):
        return _positive_int(value, key)
    if isinstance(value, str):
        m = _RANGE.match(value)
        if m:
            a, b = (0, int(m.group(1))) if m.group(2) is None else (int(m.group(1)), int(m.group(2)))
            value = list(range(a, b))
        else:
            text = value.strip()
            try:
                value = ast.literal_eval(text if text.startswith("[") else f"[{text}]")
            except (ValueError, SyntaxError):
                raise PlanError(key, f"cannot read ranks {value!r}",
                                "write an int, a list like [0, 1], or 'list(range(0, 2))'") from None
    if isinstance(value, (list, tuple)):
        if not value or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in value):
            raise PlanError(key, f"expected a non-empty list of ranks >= 0, got {value!r}",
                            "write ranks like [0, 1] or 'list(range(0, 2))'")
        if len(set(value)) != len(value):
            raise PlanError(key, f"rank listed twice in {list(value)}", "list each rank once")
        return list(value)
    raise PlanError(key, f"expected an int or a list of ints, got {value!r}", "write ranks: 2 or ranks: [0, 1]")


_NAME = re.compile(r"^[A-Za-z_][\w-]*$")


def plan_device_groups(cfg: dict, any_role_names: bool = False) -> Plan:
    common = _common(cfg)
    default_tp = _defaults()[1].vllm_tensor_parallel_size
    dg = cfg["device_groups"]
    if not isinstance(dg, Mapping):
        raise PlanError("device_groups", f"expected a mapping, got {dg!r}",
                        "write device_groups: {nproc_per_node: N, my_group: {device, ranks, workers}}")
    dg = dict(dg)
    if "nproc_per_node" not in dg:
        raise PlanError("device_groups.nproc_per_node", "missing",
                        "set device_groups.nproc_per_node to the devices per node")
    per_node = _positive_int(dg.pop("nproc_per_node"), "device_groups.nproc_per_node")

    parsed = []  # (name, device, ranks|count, workers, vLLM tensor parallel size)
    cpus: dict[str, float | None] = {}  # group -> num_cpus of its ranks
    owner: dict[str, str] = {}
    for name, group in dg.items():
        key = f"device_groups.{name}"
        if not isinstance(group, Mapping):
            raise PlanError(key, f"expected a mapping with device/ranks/workers, got {group!r}",
                            f"write {name}: {{device: GPU, ranks: 2, workers: [sampler]}}")
        group = dict(group)
        _reject_unknown(group, GROUP_ENTRY_KEYS, key)
        device = str(group.get("device", "GPU")).upper()
        if device not in ("GPU", "CPU"):
            raise PlanError(f"{key}.device", f"unknown device {group.get('device')!r}", "use GPU or CPU")
        if "ranks" not in group:
            raise PlanError(f"{key}.ranks", "missing", "give ranks as a count (2) or a list ([0, 1])")
        ranks = parse_ranks(group["ranks"], f"{key}.ranks")
        if device == "CPU" and isinstance(ranks, list):
            raise PlanError(f"{key}.ranks", "CPU groups take a process count, not a list of ranks",
                            f"write ranks: {len(ranks)}")
        workers = group.get("workers")
        workers = [workers] if isinstance(workers, str) else workers
        if not workers or not isinstance(workers, (list, tuple)):
            raise PlanError(f"{key}.workers", f"expected a non-empty list of roles, got {workers!r}",
                            f"write workers: [sampler] with roles from {list(ROLES)}")
        for role in workers:
            known = role in ROLES or (any_role_names and isinstance(role, str) and bool(_NAME.match(role)))
            if not known:
                raise PlanError(f"{key}.workers", f"unknown role '{role}'", f"use roles from {list(ROLES)}")
            if role in owner:
                raise PlanError(f"{key}.workers", f"role '{role}' is already in group '{owner[role]}'",
                                "list each role in exactly one group")
            owner[role] = name
        # Beyond ms-swift's form: ranks per vLLM engine of the group's rollout/sampler/teacher.
        tp = _positive_int(group.get("vllm_tensor_parallel_size", default_tp), f"{key}.vllm_tensor_parallel_size")
        count = len(ranks) if isinstance(ranks, list) else ranks
        if tp > 1 and (device == "CPU" or count % tp or not set(workers) & set(VLLM_ROLES)):
            problem = ("CPU groups run no vLLM engine" if device == "CPU" else
                       f"tensor parallel size {tp} does not divide the group's {count} ranks" if count % tp else
                       f"no role of {list(workers)} runs a vLLM engine")
            raise PlanError(f"{key}.vllm_tensor_parallel_size", problem,
                            f"set it on a GPU group holding one of {list(VLLM_ROLES)}, dividing its ranks")
        parsed.append((name, device, ranks, list(workers), tp))
        cpus[name] = _num_cpus(group, key)

    # Explicit GPU ranks first; counts then take the lowest free ranks, in group order.
    taken: dict[int, str] = {}
    for name, device, ranks, _, _ in parsed:
        if device == "GPU" and isinstance(ranks, list):
            for r in ranks:
                if r in taken:
                    raise PlanError(f"device_groups.{name}.ranks",
                                    f"rank {r} is also used by group '{taken[r]}'",
                                    "give each group its own ranks, or list both roles in one group's workers to colocate them")
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
        nnodes = _positive_int(cfg["nnodes"], "nnodes")
        _check_capacity(gpu_ranks, nnodes, per_node, "nnodes")
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
    return Plan(roles=roles, nnodes=nnodes, devices_per_node=per_node, form="device_groups",
                gkd_logits_topk=common["gkd_logits_topk"])
