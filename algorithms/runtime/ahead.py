"""Generation ahead of training, bounded by `max_staleness` (GRPO and GKD drivers).

With separate placement the rollout can generate the batch of step k+1 while the trainer
trains on the batch of step k. `Prefetch` draws each step's prompts in order and starts
the generations of steps up to `step + max_staleness` (async_call) when step `step` is
taken; after training, the driver waits for the generations still running (`drain`) and
only then sends the new weights, so the rollout never changes weights mid-batch. A batch
taken at step k was generated with weight version >= k - 1 - max_staleness, while the
trainer holds version k - 1: its staleness is at most max_staleness, and 0 means strictly
on-policy (each generation starts after the previous step's weight sync).

Each generation runs on a thread-watched future so its real end time lands on the
timeline (the driver itself may be busy waiting on the trainer at that moment).
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any, Callable, Optional

from orchestration.base_group import CALLS
from roles.batch import Completions


class Pending:
    """An async group call whose end time is watched by a thread. The call starts when its
    group is free: after `after` (the previous call queued on the same group), if any; the
    thread waits for that one first, so this one's timeout and interval start when it runs."""

    def __init__(self, group: Any, method: str, *args: Any, after: Optional["Pending"] = None, **kwargs: Any):
        self.submitted = time.monotonic()
        self.start = self.end = self.submitted
        self._after, self._value, self._error = after, None, None
        future = group.async_call(method, *args, **kwargs)
        self._thread = threading.Thread(target=self._watch, args=(future,), daemon=True)
        self._thread.start()

    def _watch(self, future: Any) -> None:
        CALLS.watching()
        if self._after is not None:
            self._after._thread.join()
            self.start = max(self.submitted, self._after.end)
        try:
            self._value = future.get()
        except BaseException as e:  # re-raised by result() in the driver's thread
            self._error = e
        self.end = time.monotonic()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: Optional[float] = None) -> Any:
        start = time.perf_counter()
        self._thread.join(timeout)
        CALLS.joined(time.perf_counter() - start)
        if self._thread.is_alive():
            raise TimeoutError(f"no answer after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def logged(self, log: Any, role: str, phase: str, step: Optional[int] = None,
               timeout: Optional[float] = None) -> Any:
        """`result()`, with the call's run on the timeline as `role`'s `phase` (of `step`, default
        the step being recorded)."""
        value = self.result(timeout)
        log.busy(role, phase, self.start, self.end, step=step)
        return value


class Prefetch:
    """Each step's examples, drawn from `stream` in step order, and their completions for the
    steps where `generates(step)` (all by default), generated up to `max_staleness` steps
    ahead. Steps run 1..`last_step`; nothing is generated beyond it. Sampling is seeded by
    (`seed`, step, round), so a step's samples do not depend on what ran before it: a resumed
    run draws what the uninterrupted one drew."""

    def __init__(self, rollout: Any, log: Any, stream: Any, sampling: Any, max_staleness: int,
                 last_step: int, seed: int, generates: Callable[[int], bool] = lambda step: True,
                 first_step: int = 1):
        self.rollout, self.log, self.stream, self.sampling = rollout, log, stream, sampling
        self.max_staleness, self.last_step, self.generates = max_staleness, last_step, generates
        self.seed = seed
        self._ahead: dict[int, tuple[list, Optional[Pending]]] = {}
        self._drawn_at: dict[int, int] = {}  # step -> the stream's batch count before its draw
        self._next = max(first_step, 1)  # step 0 only evaluates
        self._rounds: dict[int, int] = {}
        self._last: Optional[Pending] = None

    def take(self, step: int) -> tuple[list, Optional[Completions]]:
        """(examples, completions or None) of `step`; starts the generations of the following
        steps up to the staleness bound first."""
        while self._next <= min(step + self.max_staleness, self.last_step):
            self._drawn_at[self._next] = self.stream.drawn
            examples = next(self.stream)
            pending = None
            if self.generates(self._next):
                pending = self._generate(examples, self._next)
            self._ahead[self._next] = (examples, pending)
            self._next += 1
        self._drawn_at.pop(step, None)
        examples, pending = self._ahead.pop(step)
        return examples, None if pending is None else self._finish(pending, step)

    def extra(self, step: int) -> tuple[list, Completions]:
        """Another round of fresh prompts for `step` (dynamic sampling), generated now, after
        whatever is already queued on the rollout."""
        examples = next(self.stream)
        return examples, self._finish(self._generate(examples, step), step)

    def position(self) -> int:
        """Batches of the stream used by the steps taken so far: a stream skipping this many
        gives the next step its prompts (batches drawn ahead for later steps are drawn again)."""
        return min(self._drawn_at.values(), default=self.stream.drawn)

    def _generate(self, examples: list, step: int) -> Pending:
        rnd = self._rounds[step] = self._rounds.get(step, -1) + 1
        sampling = replace(self.sampling, seed=step_seed(self.seed, step, rnd))
        self._last = Pending(self.rollout, "generate", [ex.prompt_messages() for ex in examples], sampling,
                             dispatch="slice", collect="flatten", after=self._last)
        return self._last

    def _finish(self, pending: Pending, step: int) -> Completions:
        comps = pending.logged(self.log, "rollout", "generate", step)
        self.log.add("rollout/generate_s", pending.end - pending.start)
        return comps

    def drain(self) -> None:
        """Wait until no generation is running (before the rollout's weights change)."""
        for _, pending in self._ahead.values():
            if pending is not None:
                pending.result()

    def running(self) -> int:
        """Generations started and not finished."""
        return sum(p is not None and not p.done() for _, p in self._ahead.values())


def step_seed(seed: int, step: int, round_: int) -> int:
    """The sampling seed of generation round `round_` of `step` in a run seeded `seed`."""
    return ((seed * 1_000_003 + step) * 1_009 + round_) % 2**62


def staleness(comps: Completions, step: int, bound: int) -> dict[str, float]:
    """Per-sample staleness at `step` (the trainer holds weight version step - 1; a sample made
    with version v is step - 1 - v versions old), checked against `bound`."""
    ages = [step - 1 - int(v) for v in comps.weight_version]
    if not ages:
        return {}
    if max(ages) > bound or min(ages) < 0:
        raise RuntimeError(f"step {step}: samples generated with weight versions {sorted(set(comps.weight_version))} "
                           f"are {max(ages)} versions old; algorithm.max_staleness={bound} allows at most {bound}")
    return {"staleness/max": float(max(ages)), "staleness/mean": sum(ages) / len(ages)}
