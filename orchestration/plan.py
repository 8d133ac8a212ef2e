"""Print the placement plan of a config without starting anything.

    python -m orchestration.plan +experiment=grpo_colocate
    python -m orchestration.plan +experiment=sampling_device_groups plan.json=true
    python -m orchestration.plan config_file=my_swift_ray.yaml
    python -m orchestration.plan +experiment=grpo_colocate plan.launch=true   # place it for real
"""
from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig

from orchestration.config import (ConfigError, PlanConfig, apply_placement, check_cluster, checked_command_line,
                                  placement_dict, read_config_file, register_schema, split_config_file, validate)
from orchestration.launch import start_roles
from orchestration.placement import PlacementError
from orchestration.plan_types import Plan, PlanError
from orchestration.planner import as_started, make_plan

COLUMNS = ("role", "device", "ranks", "nodes", "group", "colocated_with", "offload", "sleep", "tp", "model", "process")


def _compact(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def format_table(plan: Plan) -> str:
    rows = []
    for r in plan.rows():
        offload = "+".join(n for n, on in (("model", r["offload_model"]), ("optimizer", r["offload_optimizer"])) if on)
        rows.append((r["role"], r["device"], _compact(r["ranks"]), _compact(r["nodes"]), r["group"],
                     ",".join(r["colocated_with"]) or "-", offload or "-", str(r["sleep_level"] or "-"),
                     str(r["tensor_parallel_size"]), r["model"] or "-", f"{r['host']}'s" if r["host"] else "own"))
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(COLUMNS)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    head = f"plan ({plan.form} form): {plan.nnodes} node(s) x {plan.devices_per_node} device(s)"
    return "\n".join([head, line(COLUMNS), line(["-" * w for w in widths]), *map(line, rows)])


class _Idle:
    """Stands in for a role when only the placement is checked."""


def launch_report(cfg: DictConfig, plan: Plan) -> str:
    """Place one idle actor per planned rank and describe where each one runs."""
    started = start_roles(cfg, plan, {r: (_Idle, {}) for r in plan.roles})
    try:
        nodes = {}
        lines = ["placed on the cluster:", "role     rank  node  node_id   visible_devices  pid     ip"]
        for role, group in started.groups.items():
            for rank, info in enumerate(group.infos):
                node = nodes.setdefault(info["node_id"], len(nodes))
                lines.append(f"{role:<8} {rank:<5} {node:<5} {info['node_id'][:8]}  "
                             f"{info['cuda_visible_devices'] or '-':<16} {info['pid']:<7} {info['ip']}")
        return "\n".join(lines)
    finally:
        started.shutdown()


def plan_from_config(cfg: DictConfig) -> tuple[DictConfig, Plan, list[str], list[str]]:
    """The validated config, the plan as its roles start (`as_started`), the config file's
    keys the planner does not read, and notes on roles the engines moved."""
    typed = validate(cfg, PlanConfig, sections=["placement", "cluster", "backend", "config_file", "plan"])
    check_cluster(typed.cluster)
    unused = []
    if typed.config_file:
        placement, items = split_config_file(read_config_file(typed.config_file))
        apply_placement(typed, placement)
        unused = sorted(where for where, _, _ in items)
    plan, notes = as_started(make_plan(placement_dict(typed)), {"teacher": typed.backend.teacher})
    return typed, plan, unused, notes


def report(cfg: DictConfig) -> None:
    """Print the plan of `cfg` (and, with plan.launch=true, where its ranks land)."""
    typed, plan, unused, notes = plan_from_config(cfg)
    if cfg.plan.json:
        print(json.dumps(plan.rows(), indent=2))
    else:
        print(format_table(plan))
    if unused:
        print(f"note: the planner reads only placement keys; not used here: {unused}", file=sys.stderr)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if cfg.plan.launch:
        if typed.backend.workers == "local":
            print("note: backend=local runs every role in this process; nothing to place", file=sys.stderr)
        else:
            print(launch_report(typed, plan))


register_schema(PlanConfig)


@checked_command_line(PlanConfig)
@hydra.main(config_path="pkg://conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        report(cfg)
    except (ConfigError, PlanError, PlacementError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
