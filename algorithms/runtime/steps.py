"""The frame of a driver's loop: where it starts, how each step ends, how the run ends.

    with Steps(plan, roles, cfg.run, cfg.weight_sync, log, eval_set, data=cfg.data) as steps:
        turns = steps.turns                      # turn-taking (algorithms/runtime/turns.py)
        for step in range(steps.first_step, cfg.run.steps + 1):
            ...                                  # the algorithm's phases
            steps.end_step(step, metrics, {"stream": ...})
        return steps.finish({"stream": ...})

Checkpoints are written whole or not at all (algorithms/records/checkpoints.py). With
`run.resume`, `Steps` loads the checkpoint into the trainer before the first step, rewinds
metrics.jsonl and timeline.jsonl to it, and hands the driver its saved state (`resumed`: the
prompt stream's position); the loop then runs from `first_step`. Each step ends with eval
when due (step 0, every run.eval_every steps, the last), the periodic save, the step's
offloads and sleeps collected, each role's memory, and the metrics record, with
`calls/remote` (the remote calls the step made), `time/driver` (the step's wall time outside
role calls) and `time/call_overhead` (the time role calls took beyond their methods' run on
the ranks). A replaced rank of a restartable role is counted and recorded; a rollout rank
gets the trainer's weights.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

from algorithms.data.answers import accuracy
from algorithms.records.checkpoints import SAVED_RECORD, driver_state, find_resume, save_checkpoint
from algorithms.records.runlog import RunLog, record_event, timed_call
from algorithms.runtime.turns import Turns
from algorithms.runtime.weights import RolloutWeights, due
from orchestration.base_group import CALLS, BaseWorkerGroup
from orchestration.config import WeightSyncConfig
from orchestration.planner import Plan

logger = logging.getLogger(__name__)


class Steps:
    """`roles`: {"train": trainer, "rollout": rollout, ...} worker groups (or fakes); None
    entries are skipped. `run` is the run's LoopConfig (steps, eval and save cadence, resume).
    `rollout_behind`: the rollout starts without the trainer's weights (a separate evaluator).
    `data`: the run's DataConfig (data.check judges eval/accuracy); `adapter`: the trainer trains
    a LoRA adapter (weight_sync.lora says what its syncs carry)."""

    def __init__(self, plan: Plan, roles: dict[str, Any], run: Any, weight_sync: WeightSyncConfig, log: RunLog,
                 eval_set: list, rollout_behind: bool = False, data: Any = None, adapter: bool = False):
        self.run, self.log, self.eval_set, self.data = run, log, eval_set, data
        # Resume: the trainer continues from the checkpoint; the driver reads `resumed`.
        self.resumed_from = find_resume(log.dir, run.resume)
        self.resumed: dict = driver_state(self.resumed_from) if self.resumed_from else {}
        self.first_step = self.resumed.get("step", -1) + 1
        present = {name: group for name, group in roles.items() if group is not None}
        self.weights = RolloutWeights(present["train"], present.get("rollout"), weight_sync, log, run,
                                      version=max(self.first_step - 1, 0), behind=rollout_behind, adapter=adapter,
                                      drops_weights="rollout" in plan.roles and plan["rollout"].sleep_level == 2)
        self.turns = Turns(plan, present, log, self.weights)
        self._mark = (time.perf_counter(), CALLS.remote, CALLS.role_s, CALLS.overhead_s)  # start of the step's accounting
        self._last: dict = {}
        if self.resumed_from is not None:
            self._last = log.rewind(self.resumed["step"], self.resumed.get(SAVED_RECORD))
            with self.turns.turn("train"):
                self.turns.trainer.call("load", str(self.resumed_from))
            logger.info(f"resumed from {self.resumed_from}: continuing at step {self.first_step}")
        for group in present.values():  # a replaced rank of a restartable role (Ray groups)
            if hasattr(group, "on_restart"):
                group.on_restart = self._restored
        for name in ("reference", "teacher"):  # they wait offloaded for their first turn
            if name in present and self.turns.offload[name] is not None:
                timed_call(log, name, present[name], "offload", *self.turns.offload[name])

    def quiet_after(self, step: int, prefetch: Any) -> bool:
        """Whether nothing but the trainer's next step follows training step `step`: no eval, no
        save, no generation (so no weight sync), and a next step. Its inputs may then be made, and
        scored by a role that runs behind the trainer or beside it, while step `step` trains."""
        return (step < self.run.steps and not due(step, self.run.save_every)
                and not self.weights.works_after(step, prefetch))

    def end_step(self, step: int, metrics: dict, state: Optional[dict] = None) -> dict:
        """Eval (step 0, every run.eval_every steps, the last step), the periodic save (with the
        driver's `state`, what a resumed run needs besides the trainer's), each role's memory
        (all idle here), then the step's metrics record, which is returned."""
        if self.eval_set and (step == 0 or step == self.run.steps or due(step, self.run.eval_every)):
            # Eval: greedy accuracy of the current weights on held-out prompts (none held out: no eval).
            with self.turns.rollout_turn(step, metrics), self.log.phase("eval", "rollout"):
                metrics["eval/accuracy"] = accuracy(self.turns.rollout, self.eval_set, self.run.eval_max_new_tokens,
                                                    self.data)
        if due(step, self.run.save_every) and not (step == self.run.steps and self.run.save_final):
            # The step's record as it stands goes into the checkpoint too: an interruption
            # between the save and the record's line would otherwise lose the line on resume.
            with self.log.phase("save", "train"):
                self.save(step, {**(state or {}), SAVED_RECORD: self.log.draft(step, metrics)})
        self.turns.settle()  # the step's offloads and sleeps, their figures in its record
        for name, group in self.turns.roles.items():  # Ray groups answer from what their calls brought back
            self.log.memory(name, group.memory() if isinstance(group, BaseWorkerGroup) else group.call("memory"))
        now = time.perf_counter()
        start, calls, role_s, overhead_s = self._mark
        metrics["calls/remote"] = CALLS.remote - calls
        metrics["time/driver"] = round(max(now - start - (CALLS.role_s - role_s), 0.0), 4)
        metrics["time/call_overhead"] = round(max(CALLS.overhead_s - overhead_s, 0.0), 4)
        self._last = self.log.step(step, metrics)
        self._mark = (time.perf_counter(), CALLS.remote, CALLS.role_s, CALLS.overhead_s)
        return self._last

    def save(self, step: int, state: dict) -> Path:
        """Checkpoint the trainer (onloaded for it) and the driver's `state` into
        <run dir>/checkpoints/step_<step>, atomically; keeps the run.keep_last newest."""
        behind, sent = self.weights.behind, self.weights.sent
        with self.turns.turn("train"):
            path = save_checkpoint(self.log.dir, step, lambda tmp: self.turns.trainer.call("save", str(tmp)), state,
                                   self.run.keep_last)
        self.weights.behind, self.weights.sent = behind, sent  # saving changes no weight
        return path

    def finish(self, state: Optional[dict] = None) -> dict:
        """The end of the run: the final checkpoint (run.save_final) into the last record, which
        is returned. A resumed run that had already finished only reports its checkpoint."""
        record = dict(self._last)
        self.turns.settle()
        if self.first_step > self.run.steps:
            record["checkpoint"] = str(self.resumed_from)
        elif self.run.save_final:
            record["checkpoint"] = str(self.save(self.run.steps, state or {}))
        return record

    def _restored(self, group: Any, rank: int) -> None:
        """A lost rank of `group` was replaced: a rollout rank gets the trainer's weights; the
        restart is counted and recorded."""
        if group is self.turns.rollout:
            self.weights.restore_rank(rank)
        self.log.add("events/restarts", 1)
        record_event(self.log.dir, {"event": "restart", "scope": "rank", "role": group.role, "rank": rank,
                                    "step": self.log.current_step})

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc: Any) -> None:
        """Close the weight-sync channel; after an error, also delete the shared-memory files a
        killed trainer rank could not."""
        if exc[0] is None:
            self.turns.settle()
        else:
            self.turns.forget()  # the error is what the caller hears; a role's own failure there is not
        self.weights.close(failed=exc[0] is not None)
