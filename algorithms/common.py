"""Pieces every driver uses: encoding examples into batches, weight sync, eval accuracy,
checkpoints, and the Hydra entry-point wrapper that turns config errors into one line."""
from __future__ import annotations

import atexit
import contextlib
import functools
import random
import sys
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from algorithms.runlog import timed_call
from algorithms.tasks import Example
from orchestration.config import WeightSyncConfig
from orchestration.weight_sync import WeightSync, sync_metrics
from roles.batch import Batch, Completions, batch_from_completions
from roles.batch import SamplingParams
from roles.orm import ORM


def encode_examples(tokenizer: Any, examples: list[Example], pretrain: bool = False) -> Completions:
    """Dataset responses as completions: chat-rendered prompt ids + response ids + eos."""
    prompt_ids, completion_ids = [], []
    for ex in examples:
        prompt = tokenizer.apply_chat_template(ex.prompt_messages(), add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(ex.messages(), tokenize=False)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        f = tokenizer(full, add_special_tokens=False)["input_ids"]
        if f[:len(p)] != p:  # the template must extend the prompt; else train on the whole text
            p = []
        if pretrain:
            p, f = f[:1], f
        prompt_ids.append(p)
        completion_ids.append(f[len(p):])
    n = len(examples)
    return Completions(list(range(n)), prompt_ids, completion_ids, [""] * n, [], ["stop"] * n, [0] * n)


def batch_of(tokenizer: Any, completions: Completions) -> Batch:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return batch_from_completions(completions, pad)


def prompt_stream(examples: list[Example], per_step: int, seed: int) -> Iterator[list[Example]]:
    """Endless shuffled epochs of `per_step` examples."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < per_step:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        yield [examples[i] for i in order[:per_step]]
        del order[:per_step]


# One WeightSync per trainer group: it keeps its shared-memory files and process groups between syncs.
_SYNCS: "weakref.WeakKeyDictionary[Any, WeightSync]" = weakref.WeakKeyDictionary()
# Killed actors cannot delete their /dev/shm files; the driver does it when it exits.
atexit.register(lambda: [sync.remove_scratch() for sync in list(_SYNCS.values())])


@contextlib.contextmanager
def turn(log: Any, role: str, group: Any, offload: Optional[tuple]) -> Iterator[None]:
    """A colocated role's turn on its devices: onloaded for the block and offloaded after it
    with `offload` as offload()'s arguments; None: the role stays loaded, nothing is called.
    Both calls are timed as phases of the role (runlog.timed_call)."""
    if offload is not None:
        timed_call(log, role, group, "onload")
    yield
    if offload is not None:
        timed_call(log, role, group, "offload", *offload)


class RolloutTurns:
    """Turn-taking and weight sync of a rollout: `sleep()` after its work, `wake()` before it
    (no-ops at sleep_level 0), `sync()` after each training step. Sleep level 2 drops the
    weights, so `wake()` first sends the trainer's current ones unless a sync came since."""

    def __init__(self, rollout: Any, trainer: Any, level: int, settings: WeightSyncConfig, log: Any):
        self.rollout, self.trainer, self.level, self.settings, self.log = rollout, trainer, level, settings, log
        self.dropped = False

    def wake(self, version: int) -> dict[str, Any]:
        metrics = self._send(version) if self.dropped else {}
        if self.level:
            timed_call(self.log, "rollout", self.rollout, "wake_up")
        return metrics

    def sleep(self) -> None:
        if self.level:
            timed_call(self.log, "rollout", self.rollout, "sleep", self.level)
            self.dropped = self.level == 2

    def sync(self, version: int, prefetch: Any, max_staleness: int) -> dict[str, Any]:
        """The trainer's weights into the rollout after a training step; generations started
        ahead (max_staleness > 0) first finish on the old weights."""
        if max_staleness:
            with self.log.phase("wait_rollout"):
                prefetch.drain()
        return self._send(version)

    def _send(self, version: int) -> dict[str, Any]:
        with self.log.phase("sync_weights", "train", "rollout"):
            metrics = sync_weights(self.trainer, [self.rollout], self.settings, version)
        self.dropped = False
        return metrics


def sync_weights(trainer: Any, targets: list[Any], settings: WeightSyncConfig, version: int) -> dict[str, Any]:
    """Trainer rank 0's weights, in buckets, into every rank of each target group by the path
    `orchestration.weight_sync` picks (shared memory, broadcast, object store or file);
    returns sync/<role>/{path,mb,seconds,mb_per_s} metrics."""
    sync = _SYNCS.get(trainer)
    if sync is None or sync.settings != settings:
        if sync is not None:
            sync.close()
        sync = _SYNCS[trainer] = WeightSync(trainer, settings)
    return sync_metrics(sync.sync(targets, version))


# The task's "#### N" answer check, for the accuracies every driver logs.
NUMERIC = ORM(kind="numeric")


def accuracy(rollout: Any, examples: list[Example], max_new_tokens: int) -> float:
    """Greedy accuracy on `examples`: the completion's '#### N' equals the reference answer."""
    prompts = [ex.prompt_messages() for ex in examples]
    comps = rollout.call("generate", prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
                         dispatch="slice", collect="flatten")
    scores = NUMERIC.score([ex.prompt for ex in examples], comps.texts, [ex.answer for ex in examples])
    return sum(scores) / max(len(scores), 1)


def first(results: list) -> Any:
    """collect= for calls whose ranks all return the same (already all-reduced) value."""
    return results[0]


def warmup_steps(steps: int) -> int:
    """Learning-rate warm-up of an SFT phase inside another run (GRPO's warm start, GKD's
    teacher, distill's SFT): a tenth of its steps, at most 20."""
    return min(20, steps // 10)


def due(step: int, every: int) -> bool:
    """Periodic work (eval, save) at training step `step`: every `every` steps, 0 never."""
    return step > 0 and every > 0 and step % every == 0


def periodic_save_due(step: int, run: Any) -> bool:
    """A save_every checkpoint at `step`, unless the final save writes the same step."""
    return due(step, run.save_every) and not (step == run.steps and run.save_final)


def offload_args(entry: Any) -> Optional[tuple]:
    """offload(model, optimizer) arguments of a colocated trainer's plan entry; None when it
    offloads nothing (it stays on its devices between turns)."""
    if entry.offload_model or entry.offload_optimizer:
        return entry.offload_model, entry.offload_optimizer
    return None


def checkpoint(trainer: Any, out_dir: Path, step: int, offload: Optional[tuple] = None) -> Path:
    """Checkpoint the trainer at `step` into out_dir/checkpoints/step_<step>; an offloaded
    trainer (`offload`: its offload(model, optimizer) arguments) comes back for it and goes again."""
    path = out_dir / "checkpoints" / f"step_{step}"
    if offload is not None:
        trainer.call("onload")
    trainer.call("save", str(path))
    if offload is not None:
        trainer.call("offload", *offload)
    return path


def friendly_errors(main: Callable) -> Callable:
    """Config/plan/placement errors exit with one line naming the key and the fix."""
    from orchestration.config import ConfigError
    from orchestration.planner import PlanError

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except (ConfigError, PlanError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper
