"""Turn-taking of roles that share devices, riding on the roles' own calls.

A driver's loop names only its algorithm's phases; `Turns` decides from the plan what happens
around each: a colocated trainer, reference or teacher is onloaded for its turn and offloaded
after it; a sleeping rollout is woken for its work and put back to sleep. Turn-taking costs the
driver no round trip of its own: an onload or wake-up rides on the role's first call of its
turn, and an offload or sleep is sent at the end of the turn and waited for by the next turn's
first call where that runs, not by the driver (orchestration/base_group.py: `defer`, `after`);
a turn promised to be one call (`one_call`, `Turns.call`) carries its offload too, after its
method (`then`), and is checked to have made exactly that one call. The trainer's turn and the
rollout's turn also move the weights between them (algorithms/runtime/weights.py).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from algorithms.records.runlog import RunLog
from algorithms.runtime.ahead import Pending
from algorithms.runtime.weights import RolloutWeights
from orchestration.base_group import GroupFuture, Kept
from orchestration.planner import Plan


def first(results: list) -> Any:
    """collect= for calls whose ranks all return the same (already all-reduced) value."""
    return results[0]


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
    """`roles`: {"train": trainer, "rollout": rollout, ...} worker groups (or fakes), None
    entries left out; `weights`: the rollout's weights against the trainer's."""

    def __init__(self, plan: Plan, roles: dict[str, Any], log: RunLog, weights: RolloutWeights):
        self.roles = {name: group for name, group in roles.items() if group is not None}
        self.trainer, self.rollout = self.roles["train"], self.roles.get("rollout")
        self.log, self.weights = log, weights
        self.offload = {name: offload_args(plan, name) for name in self.roles}
        self.sleep_level = plan["rollout"].sleep_level if "rollout" in plan.roles else 0
        self._pending: list = []  # (role, method, future) of offloads and sleeps not yet waited for
        self._kept: list = []  # (role, group, future) of calls whose answers the ranks kept, not yet waited for

    @contextlib.contextmanager
    def turn(self, role: str, phase: Optional[str] = None, one_call: bool = False, waited: bool = True) -> Iterator[Any]:
        """`role` on its devices for the block (onload/offload when it offloads between turns),
        timed as `phase` when given. The trainer's turn leaves the rollout behind its weights
        until a sync. The onload rides on the role's first call of the block; the offload is
        sent at its end, and the next turn's first call waits for it where it runs. With
        `one_call` (the block makes exactly one call of the role, waited for inside it; checked)
        the offload rides on that call too, after its method: the turn is one round trip.
        `waited` False: that call is waited for later (`call`'s `keep`), and what it moved is
        recorded then."""
        group, offload = self.roles[role], self.offload[role]
        if role == "train":
            self.weights.trainer_moves()
        self._follow(group)
        if offload is not None:
            group.defer("onload")
            if one_call:
                group.then("offload", *offload)
        calls = getattr(group, "calls_sent", None)
        with self._surfacing(), self.log.phase(phase, role) if phase else contextlib.nullcontext():
            yield group
        if one_call and calls is not None and group.calls_sent - calls > 1:
            group.drop_deferred()
            raise RuntimeError(f"the {role} turn was promised one call (one_call=True) but made "
                               f"{group.calls_sent - calls}: its offload rode on the first. Make one call, or "
                               "turn one_call off")
        if offload is not None and not one_call:
            self._put_back(role, group, "onload", "offload", *offload)
            return
        if offload is not None and not group.drop_deferred() and waited:  # the call carried both
            self._moved_with_call(role, group)
        if role == "train" and self.weights.outgoing:
            self._pending.append(("train", "send_weights", self.weights.send_outgoing()))

    def call(self, role: str, method: str, *args: Any, phase: Optional[str] = None, keep: Optional[str] = None,
             ahead: bool = False, **kwargs: Any) -> Any:
        """A turn of `role` that is one call of `method` (waited for; its value returned), timed as
        `phase` when given: onload, method and offload in one round trip (`turn`'s `one_call`).
        With `keep` (a role built in the trainer's processes) each rank keeps its answer for the
        trainer's next call, which names it (`Kept(keep)`, returned at once): the two calls go out
        back to back and run in order there, so they share one round trip; this one is waited for
        with the step's offloads (`settle`), and its work shows in the phase that waits (train).
        `ahead` (not with `keep`): made during a train call, for the next step, on devices of the
        role's own; it returns a future at once (`.get()`). The send is not timed; reading the
        answer records the role's own interval on the timeline and what its onload and offload
        moved, under the step that reads it."""
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
        """The trainer's turn for training step `version`, then its weights to the rollout
        (`RolloutWeights.sync`, its figures into `metrics`). With `one_call` (the block makes
        exactly one trainer call) the turn is one round trip unless a sync that cannot ride
        follows: the onload, the weights' send and the offload all ride on that call."""
        syncs = self.weights.syncs_after(version, prefetch, max_staleness)
        rides = syncs and self.weights.rides(max_staleness)
        one_call = one_call and (rides or not syncs)
        # Queued before the turn queues its offload: the send goes first.
        send = self.weights.queue_send(version) if one_call and rides else None
        with self.turn("train", one_call=one_call) as trainer:
            yield trainer
            self.weights.trained = version
            if send is None:
                metrics.update(self.weights.sync(version, prefetch, max_staleness, metrics))
        if send is not None and not self.trainer.drop_deferred():  # (a call left it queued: dropped)
            self.weights.sent_with_call(version, send)

    @contextlib.contextmanager
    def rollout_turn(self, version: int, metrics: dict, one_call: bool = False) -> Iterator[Any]:
        """The rollout awake for the block (woken and put back to sleep at sleep_level > 0),
        first given the trainer's weights (as `version`) when it is behind them; sync
        figures go into `metrics`. The wake-up rides on the first call after the weights,
        the sleep is waited for as an offload is; with `one_call` (the block makes exactly one
        rollout call; checked) the sleep rides on that call too, after its method."""
        self._follow(self.rollout)
        receiving = self.weights.receive_in(version, metrics)
        if self.sleep_level:
            self.rollout.defer("wake_up")
            if one_call:
                self.rollout.then("sleep", self.sleep_level)
        calls = getattr(self.rollout, "calls_sent", None)
        with self._surfacing():
            yield self.rollout
        if one_call and calls is not None and self.rollout.calls_sent - calls > 1:
            self.rollout.drop_deferred()
            raise RuntimeError(f"the rollout turn was promised one call (one_call=True) but made "
                               f"{self.rollout.calls_sent - calls}: its sleep rode on the first. Make one call, "
                               "or turn one_call off")
        if receiving:
            if self.rollout.drop_deferred():  # the block made no call: the rollout stays asleep and behind
                return
            self.weights.received(metrics)
        if not self.sleep_level:
            return
        if not one_call:
            self._put_back("rollout", self.rollout, "wake_up", "sleep", self.sleep_level)
        elif not self.rollout.drop_deferred():  # the call carried both
            for op in ("wake_up", "sleep"):
                self.log.moved("rollout", op, [r.get(op) for r in self.rollout.deferred_results()])
        else:  # no call: the rollout slept through the block
            return
        self.weights.behind = self.weights.behind or self.sleep_level == 2

    def settle(self) -> None:
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

    def forget(self) -> None:
        """Drop what was sent and not waited for (after an error, which is what the caller hears)."""
        self._pending = []

    def _put_back(self, role: str, group: Any, came: str, method: str, *args: Any) -> None:
        """End of a turn: the role's devices freed (`method`: offload or sleep) by a call sent now;
        the next turn's first call waits for it where it runs (`_follow`), the driver does not.
        A block that made no call leaves the role where it was. A trainer's send left for the
        turn's end rides on its offload."""
        if group.drop_deferred():
            return
        self.log.moved(role, came, [r.get(came) for r in group.deferred_results()])
        if role == "train" and self.weights.outgoing:
            self._pending.append(("train", method, self.weights.send_outgoing(method, *args)))
        else:
            self._pending.append((role, method, group.async_call(method, *args)))

    def _follow(self, group: Any) -> None:
        """`group`'s next call starts once the offloads and sleeps sent before it have finished."""
        group.after([future for _, _, future in self._pending])

    def _moved_with_call(self, role: str, group: Any) -> None:
        for op in ("onload", "offload"):
            self.log.moved(role, op, [r.get(op) for r in group.deferred_results()])

    @contextlib.contextmanager
    def _surfacing(self) -> Iterator[None]:
        """A failed call in a turn may be one that waited for a failed offload: that offload's own
        error (naming its role) is raised first."""
        try:
            yield
        except Exception:
            self.settle()
            raise
