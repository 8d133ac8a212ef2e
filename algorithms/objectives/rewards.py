"""GRPO's reward functions: each of `reward_funcs` (accuracy: data.check; an answer check by
its kind: numeric, exact, last_number, regex, boxed; format; the arithmetic PRM; a dotted path
to a custom function; or '<plugin file>.py:<name>', a reward class a plugin file registers in
algorithms.plugins.orms, which a config_file's external_plugins + reward_funcs name) becomes an
ORM/PRM role config, run in the driver or on the planned `orm`/`prm` roles, and combined as
Σ weight * score. ORM functions also get each completion's dataset columns (`rows`)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from algorithms.data.answers import check_orm_config
from orchestration.launch import driver_group
from orchestration.planner import Plan
from roles.orm import ANSWER_KINDS, ORM
from roles.plugins import is_plugin_spec
from roles.prm import PRM


def reward_specs(algo: Any, data: Any = None) -> list[tuple[str, float, type, dict]]:
    """(label, weight, role class, role config) per reward function of a GRPOAlgorithm;
    `data`: the run's DataConfig (data.check, data.check_pattern; None: its defaults)."""
    weights = list(algo.reward_weights) or [1.0] * len(algo.reward_funcs)
    specs = []
    for name, weight in zip(algo.reward_funcs, weights):
        if name == "accuracy" or name in ANSWER_KINDS:
            specs.append((name, weight, ORM, check_orm_config(data, None if name == "accuracy" else name)))
        elif name == "format":
            pattern = {"format_pattern": algo.format_pattern} if algo.format_pattern else {}
            specs.append((name, weight, ORM, {"kind": "format", **pattern}))
        elif is_plugin_spec(name):
            specs.append((name.rpartition(":")[2], weight, ORM, {"kind": "plugin", "plugin": name}))
        elif name == "prm":
            specs.append((name, weight, PRM, {"kind": "arithmetic", "aggregate": algo.prm_aggregate,
                                              "answer_as_step": True}))
        else:
            specs.append((name.rpartition(".")[2], weight, ORM, {"kind": "custom", "reward_fn": name}))
    return specs


def planned_reward_configs(specs: list, plan: Plan) -> dict[str, dict]:
    """Role configs of the planned orm/prm roles: every ORM function in one combined config."""
    out = {}
    orm = [s for s in specs if s[2] is ORM]
    if "orm" in plan.roles and orm:
        if len(orm) == 1:
            out["orm"] = orm[0][3]
        else:
            merged = {k: v for _, _, _, c in orm for k, v in c.items() if k != "kind"}
            out["orm"] = {**merged, "kind": "combined", "weights": {c["kind"]: w for _, w, _, c in orm}}
    prm = [s for s in specs if s[2] is PRM]
    if "prm" in plan.roles and prm:
        out["prm"] = prm[0][3]
    return out


class Rewards:
    """Scores completions with the reward functions: reward = Σ weight * score. Each function
    runs in its own driver-local group, or the ORM ones together on a planned `orm` group
    (reported as reward/orm, weights applied there) and the PRM on a planned `prm` group."""

    def __init__(self, specs: list, planned: dict[str, Any]):
        role_of = {ORM: "orm", PRM: "prm"}
        self._local = [(label, weight, driver_group(cls, {"config": config}, f"reward_{label}"))
                       for label, weight, cls, config in specs if role_of[cls] not in planned]
        self.parts: list[tuple[str, float, Any]] = list(self._local)  # (label, weight, group)
        # The groups whose score takes the rows' columns (ORMs; a PRM reads none).
        self._with_rows = {id(group) for (_, _, group), (_, _, cls, _) in
                           zip(self._local, [s for s in specs if role_of[s[2]] not in planned]) if cls is ORM}
        orm = [s for s in specs if s[2] is ORM]
        if "orm" in planned:
            self.parts.append((orm[0][0], orm[0][1], planned["orm"]) if len(orm) == 1 else ("orm", 1.0, planned["orm"]))
            self._with_rows.add(id(planned["orm"]))
        if "prm" in planned:
            label, weight, _, _ = next(s for s in specs if s[2] is PRM)
            self.parts.append((label, weight, planned["prm"]))

    def score(self, prompts: list[str], texts: list[str], references: list[str],
              rows: Optional[list[dict]] = None) -> tuple[torch.Tensor, dict]:
        """(rewards [N], {label: mean score}) for N completions; `rows`: each completion's
        dataset columns (Example.columns), which ORM functions get (None: none)."""
        total, means = torch.zeros(len(texts)), {}
        for label, weight, group in self.parts:
            extra = (list(rows),) if rows is not None and id(group) in self._with_rows else ()
            scores = torch.tensor(group.call("score", prompts, texts, references, *extra, dispatch="slice",
                                             collect="flatten"), dtype=torch.float32)
            total += weight * scores
            means[label] = float(scores.mean()) if len(scores) else 0.0
        return total, means

    def shutdown(self) -> None:
        for _, _, group in self._local:  # planned groups belong to the run's roles
            group.shutdown()
