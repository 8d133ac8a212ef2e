"""One run's turn-taking on shared devices, its weight sync, and the end of every step.

A driver's loop names only its algorithm's phases (generate, score, teacher, train, sync,
eval, save). `Turns` decides from the plan what happens around each phase: a colocated
trainer, reference or teacher is onloaded for its turn and offloaded after it; a sleeping
rollout is woken for its work and put back to sleep; the rollout gets the trainer's weights
before it works whenever it is behind them (sleep level 2 dropped them, or training moved on
without a sync). A strictly on-policy run (max_staleness 0) syncs after a training step only
when the rollout works before the next one (its next step generates, or eval is due): GKD's
off-policy steps skip it. Turn-taking costs the driver no round trip of its own: an onload or
wake-up rides on the role's first call of its turn, and an offload or sleep is sent at the end
of the turn and waited for by the next turn's first call where that runs, not by the driver
(orchestration/base_group.py: `defer`, `after`); a turn that is one call (`one_call`,
`Turns.call`) carries its offload too, after its method (`then`). On Ray, a strictly on-policy
sync over a path that lets the receive come later rides too: the send on the train turn's last
call (`train_turn`), the receive on the rollout's next one (`rollout_turn`). It also closes each
step (eval when due, the periodic save, memory figures as they came back with the roles' calls,
the metrics record, with `calls/remote`: the remote calls the step made, `time/driver`: the
step's wall time outside role calls, and `time/call_overhead`: the time role calls took beyond
their methods' run on the ranks) and the run (the final save), and owns the run's weight-sync
channel, whose shared-memory files and process groups live from the first sync to the end of
the `with Turns(...)` block.

Checkpoints are written whole or not at all (algorithms/checkpoints.py). With `run.resume`,
`Turns` loads the checkpoint into the trainer before the first step, rewinds metrics.jsonl and
timeline.jsonl to it, and hands the driver its saved state (`resumed`: the prompt stream's
position); the loop then runs from `first_step`.
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from algorithms.checkpoints import SAVED_RECORD, driver_state, find_resume, save_checkpoint
from algorithms.common import accuracy, record_event
from algorithms.overlap import Pending
from algorithms.runlog import RunLog, timed_call
from orchestration.base_group import CALLS, BaseWorkerGroup, GroupFuture, Kept, ResultOf
from orchestration.config import WeightSyncConfig
from orchestration.planner import Plan
from orchestration.weight_sync import WeightSync, sync_metrics

logger = logging.getLogger(__name__)


def due(step: int, every: int) -> bool:
    """Periodic work (eval, save) at training step `step`: every `every` steps, 0 never."""
    return step > 0 and every > 0 and step % every == 0


def offload_args(plan: Plan, role: str) -> Optional[tuple]:
    """offload() arguments of a role between its turns; None: it stays on its devices.
    The trainer offloads what the plan says; the reference policy never steps, so its
    optimizer state goes too; the teacher has only weights."""
    entry = plan.roles.get(role)
    if entry is None:
        return None
    if role == "train":
        offloads = entry.offload_model or entry.offload_optimizer
        return (entry.offload_model, entry.offload_optimizer) if offloads else None
    if role in ("reference", "teacher") and entry.offload_model:
        return (True, True) if role == "reference" else ()
    return None


class Turns:
    """`roles`: {"train": trainer, "rollout": rollout, ...} worker groups (or fakes); None
    entries are skipped. `run` is the run's LoopConfig (steps, eval and save cadence, resume).
    `rollout_behind`: the rollout starts without the trainer's weights (a separate evaluator)."""

    def __init__(self, plan: Plan, roles: dict[str, Any], run: Any, weight_sync: WeightSyncConfig, log: RunLog,
                 eval_set: list, rollout_behind: bool = False, data: Any = None):
        self.roles = {name: group for name, group in roles.items() if group is not None}
        self.trainer, self.rollout = self.roles["train"], self.roles.get("rollout")
        self.run, self.settings, self.log, self.eval_set = run, weight_sync, log, eval_set
        self.data = data  # the run's DataConfig: data.check judges eval/accuracy
        self.offload = {name: offload_args(plan, name) for name in self.roles}
        self.sleep_level = plan["rollout"].sleep_level if "rollout" in plan.roles else 0
        self.behind = rollout_behind  # the rollout lacks the trainer's current weights
        self._sync: Optional[WeightSync] = None
        # A sync whose send rides on the train turn's last call (its version), set by `sync`; then
        # the send made, whose receive rides on the rollout's next call: (version, channel, the
        # send's answer or a ResultOf standing for it).
        self._outgoing: Optional[int] = None
        self._sent: Optional[tuple] = None
        self._pending: list = []  # (role, method, future) of offloads and sleeps not yet waited for
        self._kept: list = []  # (role, group, future) of calls whose answers the ranks kept, not yet waited for
        self._mark = (time.perf_counter(), CALLS.remote, CALLS.role_s, CALLS.overhead_s)  # start of the step's accounting
        # Resume: the trainer continues from the checkpoint; the driver reads `resumed`.
        self.resumed_from = find_resume(log.dir, run.resume)
        self.resumed: dict = driver_state(self.resumed_from) if self.resumed_from else {}
        self.first_step = self.resumed.get("step", -1) + 1
        self._last: dict = {}
        if self.resumed_from is not None:
            self._last = log.rewind(self.resumed["step"], self.resumed.get(SAVED_RECORD))
            with self.turn("train"):
                self.trainer.call("load", str(self.resumed_from))
            logger.info(f"resumed from {self.resumed_from}: continuing at step {self.first_step}")
        self.version = max(self.first_step - 1, 0)  # of the weights the rollout should hold
        self.trained = self.version  # the last training step the driver saw end
        for name, group in self.roles.items():  # a replaced rank of a restartable role (Ray groups)
            if hasattr(group, "on_restart"):
                group.on_restart = self._restored
        for name in ("reference", "teacher"):  # they wait offloaded for their first turn
            if name in self.roles and self.offload[name] is not None:
                timed_call(log, name, self.roles[name], "offload", *self.offload[name])

    # ------------------------------------------------------------------ turns

    @contextlib.contextmanager
    def turn(self, role: str, phase: Optional[str] = None, one_call: bool = False, waited: bool = True) -> Iterator[Any]:
        """`role` on its devices for the block (onload/offload when it offloads between turns),
        timed as `phase` when given. The trainer's turn leaves the rollout behind its weights
        until a sync. The onload rides on the role's first call of the block; the offload is
        sent at its end, and the next turn's first call waits for it where it runs, so no
        round trip of either is the driver's to wait for. With `one_call` (the block makes
        exactly one call of the role, waited for inside it) the offload rides on that call too,
        after its method: the turn is one round trip. `waited` False: that call is waited for later
        (`call`'s `keep`), and what it moved is recorded then."""
        group, offload = self.roles[role], self.offload[role]
        if role == "train":  # weights sent before are not the ones the rollout should take any more
            self.behind, self._sent = True, None
        self._follow(group)
        if offload is not None:
            group.defer("onload")
            if one_call:
                group.then("offload", *offload)
        with self._surfacing(), self.log.phase(phase, role) if phase else contextlib.nullcontext():
            yield group
        if offload is not None and not one_call:
            self._put_back(role, group, "onload", "offload", *offload)
            return
        if offload is not None and not group.drop_deferred() and waited:  # the call carried both
            self._moved_with_call(role, group)
        if role == "train" and self._outgoing is not None:
            self._send_weights()

    def call(self, role: str, method: str, *args: Any, phase: Optional[str] = None, keep: Optional[str] = None,
             ahead: bool = False, **kwargs: Any) -> Any:
        """A turn of `role` that is one call of `method` (waited for; its value returned), timed as
        `phase` when given: onload, method and offload in one round trip (`turn`'s `one_call`).
        With `keep` (a role built in the trainer's processes) each rank keeps its answer for the
        trainer's next call, which names it (`Kept(keep)`, returned at once): the two calls go out
        back to back and run in order there, so they share one round trip; this one is waited for
        with the step's offloads (`_settle`), and its work shows in the phase that waits (train).
        `ahead` (not with `keep`): made during a train call, for the next step (`quiet_after`), on
        devices of the role's own; it returns a future at once (`.get()`). The send is not timed;
        reading the answer records the role's own interval on the timeline and what its onload
        and offload moved, under the step that reads it."""
        if ahead:
            if keep is not None:
                raise ValueError(f"{role}.{method}: ahead=True with keep={keep!r}; a kept answer rides on the "
                                 "trainer's next call anyway. Call ahead only a role on devices of its own")
            with self.turn(role, None, one_call=True, waited=False) as group:
                pending = Pending(group, method, *args, **kwargs)

            def answer(timeout: Optional[float] = None) -> Any:
                value = pending.logged(self.log, role, phase or method, timeout=timeout)
                if self.offload[role] is not None:  # what its onload and offload moved
                    self._moved_with_call(role, group)
                return value
            return GroupFuture(answer, ready=pending.done)
        if keep is None:
            with self.turn(role, phase, one_call=True) as group:
                return group.call(method, *args, **kwargs)
        with self.turn(role, phase, one_call=True, waited=False) as group:
            self._kept.append((role, group, group.async_call(method, *args, keep=keep, **kwargs)))
        return Kept(keep)

    @contextlib.contextmanager
    def train_turn(self, version: int, prefetch: Any, max_staleness: int, metrics: dict,
                   one_call: bool = False) -> Iterator[Any]:
        """The trainer's turn for training step `version`, then its weights to the rollout (`sync`,
        its figures into `metrics`). With `one_call` (the block makes exactly one trainer call)
        the turn is one round trip unless a sync that cannot ride follows: the onload, the
        weights' send and the offload all ride on that call."""
        syncs = self.syncs_after(version, prefetch, max_staleness)
        rides = syncs and not max_staleness and self._channel().defers(self.rollout)
        one_call = one_call and (rides or not syncs)
        send = None
        if one_call and rides:  # queued before the turn queues its offload: the send goes first
            send = self._channel().send_args(self.rollout, version)
            self.trainer.then("send_weights", *send, execute="first")
        with self.turn("train", one_call=one_call) as trainer:
            yield trainer
            self.trained = version
            if send is None:
                metrics.update(self.sync(version, prefetch, max_staleness, metrics))
        if send is not None and not self.trainer.drop_deferred():  # (a call left it queued: dropped)
            with self.log.phase("sync_weights"):  # as `sync`'s: 0 s here, the figures come with the receive
                sent = self.trainer.deferred_results()[0].get("send_weights")
                if sent is not None and sent["manifest"].seq == send[1]:  # this turn's call carried it
                    self._sent = (version, send[0], sent)

    @contextlib.contextmanager
    def rollout_turn(self, version: int, metrics: dict, one_call: bool = False) -> Iterator[Any]:
        """The rollout awake for the block (woken and put back to sleep at sleep_level > 0),
        first given the trainer's weights (as `version`) when it is behind them; sync
        figures go into `metrics`. The wake-up rides on the first call after the weights,
        the sleep is waited for as an offload is; with `one_call` (the block makes exactly one
        rollout call) the sleep rides on that call too, after its method."""
        self._follow(self.rollout)
        receiving = self.behind and self._sent is not None
        if receiving:  # sent already: the receive rides on the rollout's first call
            sent_version, channel, sent = self._sent
            self._sync.receive_later(self.rollout, channel, sent)
        elif self.behind:
            metrics.update(self._send(version, metrics))
        if self.sleep_level:
            self.rollout.defer("wake_up")
            if one_call:
                self.rollout.then("sleep", self.sleep_level)
        with self._surfacing():
            yield self.rollout
        if receiving:
            if self.rollout.drop_deferred():  # the block made no call: the rollout stays asleep and behind
                return
            answers = [r.get("receive_sent") for r in self.rollout.deferred_results()]
            metrics.update(sync_metrics([self._sync.received(self.rollout, sent_version, answers)], metrics))
            self.behind, self.version, self._sent = False, sent_version, None
        if not self.sleep_level:
            return
        if not one_call:
            self._put_back("rollout", self.rollout, "wake_up", "sleep", self.sleep_level)
        elif not self.rollout.drop_deferred():  # the call carried both
            for op in ("wake_up", "sleep"):
                self.log.moved("rollout", op, [r.get(op) for r in self.rollout.deferred_results()])
        else:  # no call: the rollout slept through the block
            return
        self.behind = self.behind or self.sleep_level == 2

    def _put_back(self, role: str, group: Any, came: str, method: str, *args: Any) -> None:
        """End of a turn: the role's devices freed (`method`: offload or sleep) by a call sent now;
        the next turn's first call waits for it where it runs (`_follow`), the driver does not.
        A block that made no call leaves the role where it was."""
        if group.drop_deferred():
            return
        self.log.moved(role, came, [r.get(came) for r in group.deferred_results()])
        if role == "train" and self._outgoing is not None:
            self._send_weights(method, *args)
        else:
            self._pending.append((role, method, group.async_call(method, *args)))

    def _send_weights(self, carrier: Optional[str] = None, *args: Any) -> None:
        """The send of the sync `sync` left for the end of the train turn: trainer rank 0's
        send_weights rides on the `carrier` call (the turn's offload), else is a call of its own;
        the rollout's next turn takes the weights (`rollout_turn`). The driver waits for neither."""
        version, self._outgoing = self._outgoing, None
        send = self._channel().send_args(self.rollout, version)
        if carrier is None:
            future = self.trainer.async_call("send_weights", *send, execute="first")
        else:
            self.trainer.defer("send_weights", *send, execute="first")
            future = self.trainer.async_call(carrier, *args)
        self._pending.append(("train", carrier or "send_weights", future))
        self._sent = (version, send[0], ResultOf(future, None, carrier and "send_weights"))

    def _follow(self, group: Any) -> None:
        """`group`'s next call starts once the offloads and sleeps sent before it have finished."""
        group.after([future for _, _, future in self._pending])

    def _moved_with_call(self, role: str, group: Any) -> None:
        for op in ("onload", "offload"):
            self.log.moved(role, op, [r.get(op) for r in group.deferred_results()])

    def _settle(self) -> None:
        """Wait for the calls whose answers were kept (they ran first), then the offloads and sleeps
        sent, and collect them (their moved bytes, errors, memory figures); a wait of the latter is
        timed as the call's phase."""
        kept, self._kept = self._kept, []
        for role, group, future in kept:
            future.get()
            if self.offload[role] is not None:
                self._moved_with_call(role, group)
        pending, self._pending = self._pending, []
        for role, method, future in pending:
            with self.log.phase(method, role):
                results = future.get()
            if method != "send_weights":  # a send's figures come with its receive
                self.log.moved(role, method, results)

    @contextlib.contextmanager
    def _surfacing(self) -> Iterator[None]:
        """A failed call in a turn may be one that waited for a failed offload: that offload's own
        error (naming its role) is raised first."""
        try:
            yield
        except Exception:
            self._settle()
            raise

    def sync(self, version: int, prefetch: Any, max_staleness: int, before: Optional[dict] = None) -> dict[str, Any]:
        """The trainer's weights into the rollout after training step `version` (called in the
        train turn); generations started ahead (max_staleness > 0) first finish on the old
        weights. Strictly on-policy, nothing is sent while the rollout has no work before the
        next training step (the rollout stays behind, and a later step's sync sends the newer
        weights); on a path that lets the receive come later (WeightSync.defers), the send
        rides on the train turn's last call and the receive on the rollout's next one, and the
        figures come with the rollout's turn."""
        if not self.syncs_after(version, prefetch, max_staleness):
            with self.log.phase("sync_weights"):  # every record has the phase, 0 s here
                self.log.add("sync/skipped", 1)
            return {}
        if max_staleness:
            with self.log.phase("wait_rollout"):
                prefetch.drain()
        elif self._channel().defers(self.rollout):
            # The send rides on the train turn's end, the receive on the rollout's next call (no
            # generation runs ahead to overtake it), so the driver waits for neither: 0 s here.
            with self.log.phase("sync_weights"):
                self._outgoing = version
            return {}
        return self._send(version, before)

    def quiet_after(self, step: int, prefetch: Any) -> bool:
        """Whether nothing but the trainer's next step follows training step `step`: no eval, no
        save, no generation (so no weight sync), and a next step. Its inputs may then be made, and
        scored by a role that runs behind the trainer or beside it, while step `step` trains."""
        return (step < self.run.steps and not due(step, self.run.save_every)
                and not self._rollout_works_after(step, prefetch))

    def syncs_after(self, version: int, prefetch: Any, max_staleness: int) -> bool:
        """Whether `sync` after training step `version` sends the weights (else the train turn can
        be one call)."""
        return bool(max_staleness) or self._rollout_works_after(version, prefetch)

    def _rollout_works_after(self, step: int, prefetch: Any) -> bool:
        """Whether the rollout generates or evaluates between training step `step` and the next."""
        evals = step == self.run.steps or due(step, self.run.eval_every)
        nxt = step + 1
        return evals or (nxt <= self.run.steps and getattr(prefetch, "generates", lambda s: True)(nxt))

    def _restored(self, group: Any, rank: int) -> None:
        """A lost rank of `group` was replaced: a rollout rank gets the trainer's weights (it
        starts with its model's); the restart is counted and recorded. The trainer runs one call
        at a time in the order sent, so they are its weights once every call sent to it ran: what
        the rank's peers hold, or newer ones while they are behind (a generation sent ahead, lost
        during a train call, runs again on them; the next sync brings every rank level). They are
        labelled as the last training step seen to end (`trained`): they are that or newer."""
        if group is self.rollout:
            if self._sync is not None and self._sync.path_for(group) == "collective":  # its process group
                self._sync.close()                                                     # had the lost rank
                self._sync = None
            buckets = self.trainer.call("state_dict_buckets", self.settings.bucket_mb, execute="first")
            group.call_rank(rank, "update_weights", buckets, self.trained)
        self.log.add("events/restarts", 1)
        record_event(self.log.dir, {"event": "restart", "scope": "rank", "role": group.role, "rank": rank,
                                    "step": self.log.current_step})

    def _channel(self) -> WeightSync:
        """The run's weight-sync channel, made on first use."""
        if self._sync is None:
            self._sync = WeightSync(self.trainer, self.settings)
        return self._sync

    def _send(self, version: int, before: Optional[dict] = None) -> dict[str, Any]:
        """The weights sent and received now; their figures (added to `before`'s, the step's so far)."""
        with self.log.phase("sync_weights", "train", "rollout"):
            metrics = sync_metrics(self._channel().sync([self.rollout], version), before)
        self.behind, self.version = False, version
        return metrics

    # ------------------------------------------------------------------ end of step / run

    def end_step(self, step: int, metrics: dict, state: Optional[dict] = None) -> dict:
        """Eval (step 0, every run.eval_every steps, the last step), the periodic save (with the
        driver's `state`, what a resumed run needs besides the trainer's), each role's memory
        (all idle here), then the step's metrics record, which is returned."""
        if step == 0 or step == self.run.steps or due(step, self.run.eval_every):
            # Eval: greedy accuracy of the current weights on held-out prompts.
            with self.rollout_turn(step, metrics), self.log.phase("eval", "rollout"):
                metrics["eval/accuracy"] = accuracy(self.rollout, self.eval_set, self.run.eval_max_new_tokens, self.data)
        if due(step, self.run.save_every) and not (step == self.run.steps and self.run.save_final):
            # The step's record as it stands goes into the checkpoint too: an interruption
            # between the save and the record's line would otherwise lose the line on resume.
            with self.log.phase("save", "train"):
                self.save(step, {**(state or {}), SAVED_RECORD: self.log.draft(step, metrics)})
        self._settle()  # the step's offloads and sleeps, their figures in its record
        for name, group in self.roles.items():  # Ray groups answer from what their calls brought back
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
        behind, sent = self.behind, self._sent
        with self.turn("train"):
            path = save_checkpoint(self.log.dir, step, lambda tmp: self.trainer.call("save", str(tmp)), state,
                                   self.run.keep_last)
        self.behind, self._sent = behind, sent  # saving changes no weight
        return path

    def finish(self, state: Optional[dict] = None) -> dict:
        """The end of the run: the final checkpoint (run.save_final) into the last record, which
        is returned. A resumed run that had already finished only reports its checkpoint."""
        record = dict(self._last)
        self._settle()
        if self.first_step > self.run.steps:
            record["checkpoint"] = str(self.resumed_from)
        elif self.run.save_final:
            record["checkpoint"] = str(self.save(self.run.steps, state or {}))
        return record

    def __enter__(self) -> "Turns":
        return self

    def __exit__(self, *exc: Any) -> None:
        """Close the weight-sync channel; after an error, also delete the shared-memory files a
        killed trainer rank could not (from this process, calling no actor)."""
        if exc[0] is None:
            self._settle()
        else:
            self._pending = []  # the error is what the caller hears; a role's own failure there is not
        if self._sync is not None:
            if exc[0] is not None:
                self._sync.remove_scratch()
            self._sync.close()
            self._sync = None
