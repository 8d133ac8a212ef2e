"""Which weights the rollout holds, and when and how the trainer's go there.

The rollout is `behind` when the trainer's weights moved on since it took them (a train turn),
when sleep level 2 dropped them, or when it starts without them (a separate evaluator). A
strictly on-policy run (max_staleness 0) sends after a training step only when the rollout
works before the next one (its next step generates, or eval is due): GKD's off-policy steps
skip it, and a later sync sends the newer weights. With max_staleness > 0, generations started
ahead first finish on the old weights (`drain`). On Ray, strictly on-policy, over a path that
lets the receive come later (`WeightSync.defers`), the sync is no call of its own: the send
rides on the train turn's last call and the receive on the rollout's next one; the figures
come with the rollout's turn. The weight-sync channel (shared-memory files, process groups)
lives from the first sync to `close`.
"""
from __future__ import annotations

from typing import Any, Optional

from algorithms.records.runlog import RunLog
from orchestration.base_group import ResultOf
from orchestration.config import WeightSyncConfig
from orchestration.weight_sync import WeightSync, sync_metrics


def due(step: int, every: int) -> bool:
    """Periodic work (eval, save) at training step `step`: every `every` steps, 0 never."""
    return step > 0 and every > 0 and step % every == 0


class RolloutWeights:
    """The rollout's weights against the trainer's. `run`: the run's LoopConfig (its length and
    eval cadence say when the rollout works); `version`: the training step whose weights the
    rollout should hold at the start (a resumed run's checkpoint step)."""

    def __init__(self, trainer: Any, rollout: Any, settings: WeightSyncConfig, log: RunLog, run: Any,
                 version: int, behind: bool, adapter: bool = False, drops_weights: bool = False):
        self.trainer, self.rollout, self.settings, self.log, self.run = trainer, rollout, settings, log, run
        self.adapter = adapter  # the trainer trains a LoRA adapter (what a sync carries: weight_sync.lora)
        self.drops_weights = drops_weights  # the rollout sleeps at level 2: every merged sync is whole
        self.behind = behind  # the rollout lacks the trainer's current weights
        self.version = version  # of the weights the rollout should hold
        self.trained = version  # the last training step the driver saw end
        self._sync: Optional[WeightSync] = None
        # A sync whose send rides on the train turn's last call (its version), set by `sync`; then
        # the send made, whose receive rides on the rollout's next call: (version, channel, the
        # send's answer or a ResultOf standing for it).
        self._outgoing: Optional[int] = None
        self.sent: Optional[tuple] = None
        self._receiving: Optional[int] = None  # the version a rollout turn's first call receives

    # ------------------------------------------------------------------ when

    def works_after(self, step: int, prefetch: Any) -> bool:
        """Whether the rollout generates or evaluates between training step `step` and the next."""
        evals = step == self.run.steps or due(step, self.run.eval_every)
        nxt = step + 1
        return evals or (nxt <= self.run.steps and getattr(prefetch, "generates", lambda s: True)(nxt))

    def syncs_after(self, version: int, prefetch: Any, max_staleness: int) -> bool:
        """Whether `sync` after training step `version` sends the weights (else the train turn can
        be one call)."""
        return bool(max_staleness) or self.works_after(version, prefetch)

    def rides(self, max_staleness: int) -> bool:
        """Whether a sync's send can ride on the trainer's call and its receive on the rollout's."""
        return not max_staleness and self.channel().defers(self.rollout)

    # ------------------------------------------------------------------ moving them

    def trainer_moves(self) -> None:
        """A train turn starts: weights sent before are not the ones the rollout should take."""
        self.behind, self.sent = True, None

    def sync(self, version: int, prefetch: Any, max_staleness: int, before: Optional[dict] = None) -> dict[str, Any]:
        """The trainer's weights into the rollout after training step `version` (called in the
        train turn). Nothing is sent while the rollout has no work before the next step; on a
        path that rides (`rides`), the send is left for the train turn's end (`outgoing`)."""
        if not self.syncs_after(version, prefetch, max_staleness):
            with self.log.phase("sync_weights"):  # every record has the phase, 0 s here
                self.log.add("sync/skipped", 1)
            return {}
        if max_staleness:
            with self.log.phase("wait_rollout"):
                prefetch.drain()
        elif self.rides(max_staleness):
            # The send rides on the train turn's end, the receive on the rollout's next call (no
            # generation runs ahead to overtake it), so the driver waits for neither: 0 s here.
            with self.log.phase("sync_weights"):
                self._outgoing = version
            return {}
        return self.send_now(version, before)

    def send_now(self, version: int, before: Optional[dict] = None) -> dict[str, Any]:
        """The weights sent and received now; their figures (added to `before`'s, the step's so far)."""
        with self.log.phase("sync_weights", "train", "rollout"):
            metrics = sync_metrics(self.channel().sync([self.rollout], version), before)
        self.behind, self.version = False, version
        return metrics

    @property
    def outgoing(self) -> bool:
        """A send `sync` left for the end of the train turn."""
        return self._outgoing is not None

    def queue_send(self, version: int) -> tuple:
        """Trainer rank 0's send of `version` queued to run after the trainer's next call's
        method (the train turn's one call); returns its arguments for `sent_with_call`."""
        send = self.channel().send_args(self.rollout, version)
        self.trainer.then("send_weights", *send, execute="first")
        return send

    def sent_with_call(self, version: int, send: tuple) -> None:
        """The train turn's call carried the send `queue_send` queued: its receive rides on the
        rollout's next call. (Timed as `sync`'s phase: 0 s here, the figures come with the receive.)"""
        with self.log.phase("sync_weights"):
            sent = self.trainer.deferred_results()[0].get("send_weights")
            if sent is not None and sent["manifest"].seq == send[1]:  # this turn's call carried it
                self.sent = (version, send[0], sent)

    def send_outgoing(self, carrier: Optional[str] = None, *args: Any) -> Any:
        """The send `sync` left for the end of the train turn: trainer rank 0's send_weights rides
        on the `carrier` call (the turn's offload), else is a call of its own; returns that call's
        future. The rollout's next turn takes the weights (`receive_in`)."""
        version, self._outgoing = self._outgoing, None
        send = self.channel().send_args(self.rollout, version)
        if carrier is None:
            future = self.trainer.async_call("send_weights", *send, execute="first")
        else:
            self.trainer.defer("send_weights", *send, execute="first")
            future = self.trainer.async_call(carrier, *args)
        self.sent = (version, send[0], ResultOf(future, None, carrier and "send_weights"))
        return future

    def receive_in(self, version: int, metrics: dict) -> bool:
        """The rollout's turn starts: a send made already is received by its first call (returns
        True: `received` follows the block); else, behind, it gets `version` now."""
        if self.behind and self.sent is not None:
            self._receiving, (_, channel, sent) = self.sent[0], self.sent
            self._sync.receive_later(self.rollout, channel, sent)
            return True
        if self.behind:
            metrics.update(self.send_now(version, metrics))
        return False

    def received(self, metrics: dict) -> None:
        """The rollout's first call of the turn carried the receive: its figures into `metrics`."""
        version = self._receiving  # (the version sent when the turn began)
        answers = [r.get("receive_sent") for r in self.rollout.deferred_results()]
        metrics.update(sync_metrics([self._sync.received(self.rollout, version, answers)], metrics))
        self.behind, self.version, self.sent = False, version, None

    def restore_rank(self, rank: int) -> None:
        """A replaced rollout rank gets the trainer's weights (it starts with its model's). The
        trainer runs one call at a time in the order sent, so they are its weights once every
        call sent to it ran: what the rank's peers hold, or newer ones while they are behind (the
        next sync brings every rank level). They are labelled as the last training step seen to
        end (`trained`): they are that or newer."""
        if self._sync is not None and self._sync.path_for(self.rollout) == "collective":  # its process group
            self._sync.close()                                                            # had the lost rank
            self._sync = None
        # A fresh rank holds its model's weights: a LoRA run's base, onto which an adapter-only sync
        # goes as it does to its peers; a merged sync sends it every weight.
        adapter = {"part": "adapter"} if self.channel().part_for(self.rollout) == "adapter" else {}
        self.channel().forget(self.rollout)
        buckets = self.trainer.call("state_dict_buckets", self.settings.bucket_mb, execute="first", **adapter)
        self.rollout.call_rank(rank, "update_weights", buckets, self.trained, **adapter)

    def channel(self) -> WeightSync:
        """The run's weight-sync channel, made on first use."""
        if self._sync is None:
            self._sync = WeightSync(self.trainer, self.settings, self.adapter, self.drops_weights)
        return self._sync

    def close(self, failed: bool) -> None:
        """Close the channel; after an error, also delete the shared-memory files a killed trainer
        rank could not (from this process, calling no actor)."""
        if self._sync is not None:
            if failed:
                self._sync.remove_scratch()
            self._sync.close()
            self._sync = None
