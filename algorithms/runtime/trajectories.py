"""Multi-turn rollouts in the drivers (algorithm.multi_turn): each step's trajectories come
from the rollout's `generate_trajectories` (the turn loop runs inside the Rollout role,
roles/multi_turn.py), generated ahead as single-turn completions are (`TrajectoryPrefetch`);
then the environment's rewards (`env_rewards`), the trajectories that failed (`failed_rows`)
and what the rollouts looked like (`multi_turn_metrics`)."""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

import torch

from algorithms.runtime.ahead import Pending, Prefetch, step_seed
from roles.batch import Completions


def row_columns(ex: Any) -> dict:
    """What a scheduler or environment reads of an example (ms-swift's data_dict): its dataset
    columns, and `solution` (its reference answer) and `messages` (its prompt) when the
    columns have none."""
    return {"solution": ex.answer or ex.solution, "messages": ex.prompt_messages(), **ex.columns}


class TrajectoryPrefetch(Prefetch):
    """Prefetch whose generations are multi-turn trajectories (`multi_turn`: a MultiTurnConfig)."""

    def __init__(self, *args: Any, multi_turn: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.multi_turn = asdict(multi_turn)

    def _generate(self, examples: list, step: int) -> Pending:
        rnd = self._rounds[step] = self._rounds.get(step, -1) + 1
        sampling = replace(self.sampling, seed=step_seed(self.seed, step, rnd))
        self._last = Pending(self.rollout, "generate_trajectories", [ex.prompt_messages() for ex in examples],
                             sampling, self.multi_turn, [row_columns(ex) for ex in examples],
                             dispatch="slice", collect="flatten", after=self._last)
        return self._last


def env_rewards(comps: Completions, mode: str) -> torch.Tensor:
    """Each trajectory's environment reward: the sum of its turns' rewards, the final turn's,
    or 0 with mode "none" (and for trajectories whose environment gave none)."""
    out = torch.zeros(len(comps))
    if mode == "none":
        return out
    for i, info in enumerate(comps.rollout_infos):
        steps = info.get("step_rewards") or []
        out[i] = float(sum(steps)) if mode == "sum" else float(steps[-1]) if steps else 0.0
    return out


def failed_rows(comps: Completions, scores: torch.Tensor, group: int) -> torch.Tensor:
    """Trajectories that failed (finish_reason "error": their loss mask is already 0) count in no
    group statistic: their reward becomes the mean of their group's others. Raises when every
    trajectory of the step failed, with the first reason."""
    failed = torch.tensor([r == "error" for r in comps.finish_reasons], dtype=torch.bool)
    if len(failed) and bool(failed.all()):
        raise RuntimeError(f"every trajectory of the step failed ({len(failed)}); the first: "
                           f"{comps.rollout_infos[0].get('error')}")
    scores = scores.clone()
    for g in range(len(scores) // group):
        rows = slice(g * group, (g + 1) * group)
        ok = ~failed[rows]
        mean = scores[rows][ok].mean() if ok.any() else torch.tensor(0.0)
        scores[rows] = torch.where(failed[rows], mean, scores[rows])
    return scores


def multi_turn_metrics(comps: Completions) -> dict:
    """Turns, model/environment tokens, tool calls and errors, failed trajectories per step."""
    n = max(len(comps), 1)
    infos = comps.rollout_infos
    model = sum(sum(m) for m in comps.completion_mask)
    total = sum(len(c) for c in comps.completion_ids)
    return {"multi_turn/turns": sum(i.get("num_turns", 0) for i in infos) / n,
            "multi_turn/model_tokens": model / n, "multi_turn/env_tokens": (total - model) / n,
            "multi_turn/tool_calls": float(sum(i.get("tool_calls", 0) for i in infos)),
            "multi_turn/tool_errors": float(sum(i.get("tool_errors", 0) for i in infos)),
            "multi_turn/failed": float(sum(r == "error" for r in comps.finish_reasons)),
            "multi_turn/env_reward": sum(sum(i.get("step_rewards") or [0.0]) for i in infos) / n}
