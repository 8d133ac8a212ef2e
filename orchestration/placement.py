"""Plan -> Ray placement groups. The only module that calls `placement_group`.

One STRICT_PACK placement group per planned node, holding one bundle per device slot
used on that node ({GPU: 1} per planned GPU rank, {CPU: 1} per CPU process). Each group
is pinned to a distinct Ray node through the node-id label, so a 2-node plan really
spans two nodes. Colocated roles get the same bundle and split it (GPU 1/k each), so
they see the same CUDA_VISIBLE_DEVICES.
"""
from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from orchestration.plan_types import Plan, RolePlan

NODE_LABEL = "ray.io/node-id"


class PlacementError(RuntimeError):
    """The cluster cannot hold the plan: one line `config key 'placement' ... Fix: ...` saying
    what is missing."""


@dataclass
class Slot:
    pg: PlacementGroup
    bundle_index: int
    share: int  # number of roles sharing this bundle
    device: str

    def actor_options(self) -> dict:
        frac = 1.0 / self.share
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.bundle_index)
        if self.device == "GPU":
            return {"num_gpus": frac, "num_cpus": 0, "scheduling_strategy": strategy}
        return {"num_cpus": frac, "scheduling_strategy": strategy}


class Placement:
    def __init__(self, plan: Plan, groups: dict[int, PlacementGroup], slots: dict[tuple, Slot], node_ids: dict[int, str]):
        self.plan, self.groups, self._slots, self.node_ids = plan, groups, slots, node_ids

    def slot(self, role: RolePlan, index: int) -> Slot:
        return self._slots[(role.device, role.nodes[index], role.local_devices[index])]

    def remove(self) -> None:
        for pg in self.groups.values():
            remove_placement_group(pg)
        self.groups = {}


def _slot_keys(plan: Plan) -> dict[tuple, set[str]]:
    """(device, node, local index) -> roles using that slot."""
    keys: dict[tuple, set[str]] = {}
    for r in plan.roles.values():
        for node, local in zip(r.nodes, r.local_devices):
            keys.setdefault((r.device, node, local), set()).add(r.role)
    return keys


def _choose_nodes(need: dict[int, dict[str, float]]) -> dict[int, str]:
    """Map each planned node index to a distinct alive Ray node with the resources it needs."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    # Head node first, then a stable order.
    alive.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeID"]))
    chosen: dict[int, str] = {}
    for k in sorted(need, key=lambda k: -sum(need[k].values())):
        for n in alive:
            if n["NodeID"] in chosen.values():
                continue
            if all(n["Resources"].get(res, 0) >= amount for res, amount in need[k].items()):
                chosen[k] = n["NodeID"]
                break
        else:
            have = [{res: n["Resources"].get(res, 0) for res in ("GPU", "CPU")} for n in alive]
            raise PlacementError(
                f"config key 'placement' plans node {k}, which needs {need[k]}, but no unused alive node has it (the "
                f"cluster has {len(alive)} node(s) with {have}). Fix: give the roles fewer devices in the placement "
                "config, start more nodes or GPUs, or on a CPU machine raise cluster.simulate_gpus")
    return chosen


def create_placement(plan: Plan, timeout_s: float) -> Placement:
    """Placement groups for `plan`, ready within `timeout_s` (cluster.placement_timeout_s)."""
    keys = _slot_keys(plan)
    need: dict[int, dict[str, float]] = {}
    for device, node, _ in keys:
        need.setdefault(node, {"GPU": 0.0, "CPU": 0.0})[device] += 1.0
    need = {k: {res: v for res, v in d.items() if v} for k, d in need.items()}
    node_ids = _choose_nodes(need)
    groups: dict[int, PlacementGroup] = {}
    slots: dict[tuple, Slot] = {}
    for node in sorted(need):
        node_keys = sorted(k for k in keys if k[1] == node)
        bundles = [{k[0]: 1.0} for k in node_keys]
        pg = placement_group(bundles, strategy="STRICT_PACK", name="",
                             bundle_label_selector=[{NODE_LABEL: node_ids[node]}] * len(bundles))
        groups[node] = pg
        for i, k in enumerate(node_keys):
            slots[k] = Slot(pg, i, len(keys[k]), k[0])
    try:
        ray.get([pg.ready() for pg in groups.values()], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for pg in groups.values():
            remove_placement_group(pg)
        raise PlacementError(
            f"config key 'placement' needs {need} per planned node, but its placement groups were not ready after "
            f"{timeout_s:.0f}s (cluster.placement_timeout_s; the cluster has {ray.available_resources()} free). Fix: "
            "free the resources (other jobs or placement groups hold them), give the roles fewer devices, or raise "
            "cluster.placement_timeout_s") from None
    return Placement(plan, groups, slots, node_ids)
