"""Surviving lost workers (run.max_restarts): a restartable group replaces a killed rank and
runs its share again; a GRPO run on Ray whose rollout process is killed loses no step, and one
whose trainer process is killed continues from its newest checkpoint."""
import json
import os
import signal
import threading
import time

import pytest

from algorithms import grpo
from algorithms.records.trackers import read_metrics
from algorithms.runtime.steps import Steps
from algorithms.runtime.entry import run_with_restarts
from orchestration.base_group import CALLS, WorkerError
from orchestration.planner import make_plan
from tests.driver_helpers import TINY, prepared
from tests.roles_for_tests import Probe

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


class Stateless(Probe):
    RESTARTABLE = True
    LOCKSTEP_METHODS = ()

    def fail(self):
        raise ValueError("a bug in the role's code")

    def nap(self, seconds):
        time.sleep(sum(seconds))
        return [os.getpid()]


def wait_dead(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.05)


def test_a_killed_rank_of_a_restartable_group_is_replaced_and_its_share_run_again(ray_cluster):
    from orchestration.launch import restartable
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"rollout": {"gpus": 2}})
    assert restartable(Stateless, plan["rollout"]) and not restartable(Probe, plan["rollout"])
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Stateless, plan["rollout"], placement=placement, restarts=2)
        seen = []
        g.on_restart = lambda group, rank: seen.append((group.role, rank, group.call_rank(rank, "whoami")["pid"]))
        before = [r["pid"] for r in g.call("whoami")]
        os.kill(before[1], signal.SIGKILL)
        wait_dead(before[1])
        assert g.call("rank_and_len", list(range(5)), dispatch="slice", collect="flatten") == [(0, 3), (1, 2)]
        after = [r["pid"] for r in g.call("whoami")]
        assert after[0] == before[0] and after[1] != before[1] and seen == [("rollout", 1, after[1])]
        assert g.restarts_left == 1
        # Two calls in flight to a process that dies, one waited for by a thread watching it (a
        # call sent ahead): the rank is replaced once, and both calls run again on the new process.
        first = g.async_call("nap", [0.0, 1.5], dispatch="slice", collect="flatten")
        second = g.async_call("nap", [0.0, 0.0], dispatch="slice", collect="flatten")
        os.kill(after[1], signal.SIGKILL)
        wait_dead(after[1])
        answers = []
        watcher = threading.Thread(target=lambda: (CALLS.watching(), answers.append(second.get())))
        watcher.start()
        answers.append(first.get())
        watcher.join()
        now = [r["pid"] for r in g.call("whoami")]
        assert now[1] not in (after[1], before[1]) and answers == [[now[0], now[1]]] * 2
        assert g.restarts_left == 0 and len(seen) == 2
        # A bug in the role's code is no lost process: raised at once, nothing restarted.
        with pytest.raises(WorkerError, match="ValueError: a bug") as bug:
            g.call("fail")
        assert not bug.value.lost
        # Restarts used up: the next loss is the caller's.
        os.kill(after[0], signal.SIGKILL)
        wait_dead(after[0])
        with pytest.raises(WorkerError, match="rollout rank 0 failed in echo\\(\\): the actor process died") as lost:
            g.call("echo", 1)
        assert lost.value.lost
        g.shutdown()
    finally:
        placement.remove()


def kill_after(monkeypatch, *kills: tuple[int, str]):
    """SIGKILL rank 0 of each (step, role) right after that step's record is first written."""
    end_step, done = Steps.end_step, []

    def killing(self, s, metrics, state=None):
        record = end_step(self, s, metrics, state)
        for step, role in kills:
            if s == step and (step, role) not in done:
                done.append((step, role))
                pid = self.turns.roles[role].infos[0]["pid"]
                os.kill(pid, signal.SIGKILL)
                wait_dead(pid)
        return record

    monkeypatch.setattr(Steps, "end_step", killing)


GRPO = ["+experiment=grpo_quickstart", *TINY, "algorithm.num_generations=2", "algorithm.max_new_tokens=8",
        "algorithm.warmup_sft_steps=0", "data.train_size=6", "run.steps=4", "run.save_every=2", "run.eval_every=0",
        "run.max_restarts=1", "placement.colocate_groups=null", "placement.offload_model=false",
        "placement.offload_optimizer=false", "placement.sleep_level=0"]


def events(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_grpo_survives_a_killed_rollout_and_continues_from_its_checkpoint_after_a_killed_trainer(
        ray_cluster, tmp_path, monkeypatch):
    """One run loses both: the rollout process after step 1 (its group replaces the rank; no
    step lost) and the trainer process after step 3 (every role restarts from step 2's
    checkpoint; step 3 is redone)."""
    _, typed, plan = prepared(grpo.GRPOConfig, GRPO)
    grpo.validate(typed, plan)
    kill_after(monkeypatch, (1, "rollout"), (3, "train"))
    record = run_with_restarts(grpo.run, typed, plan, tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]  # nothing lost, step 3 written once
    assert records[2]["events/restarts"] == 1 and records[2]["staleness/max"] == 0
    assert [(e["scope"], e["role"], e["rank"]) for e in events(tmp_path)] == [("rank", "rollout", 0),
                                                                               ("run", "train", 0)]
    assert record["checkpoint"].endswith("step_4")
    # Without restarts the loss is the caller's, naming the rank.
    _, typed, plan = prepared(grpo.GRPOConfig, GRPO + ["run.max_restarts=0"])
    kill_after(monkeypatch, (1, "train"))
    with pytest.raises(WorkerError, match="train rank 0 failed") as lost:
        run_with_restarts(grpo.run, typed, plan, tmp_path / "again")
    assert lost.value.lost


def test_a_rollout_rank_replaced_during_a_train_call_gets_the_trainers_weights_and_leaves_the_drivers_riders(
        tmp_path):
    """A rollout rank lost under a generation sent ahead is replaced in the thread watching that
    generation while step 3 trains (the rollout behind the trainer): the new rank gets the
    trainer's weights as they are once the calls sent to it ran, labelled as the last step seen
    to end (2), not none (its model's own); the restart's calls carry nothing the driver queued
    for its own next call."""
    from orchestration.config import WeightSyncConfig
    from tests.driver_helpers import FakeGroup, FakeRollout, FakeTrainer, MarkedLog

    class Drained:  # the prefetch of a run with max_staleness 1, nothing left in flight
        generates = staticmethod(lambda step: True)

        def drain(self):
            pass

    calls = []
    trainer = FakeGroup("train", [FakeTrainer()], calls)
    rollout = FakeGroup("rollout", [FakeRollout(), FakeRollout()], calls)
    _, typed, plan = prepared(grpo.GRPOConfig, GRPO)
    steps = Steps(plan, {"train": trainer, "rollout": rollout}, typed.run, WeightSyncConfig(),
                  MarkedLog(tmp_path, 4, []), [])
    turns = steps.turns
    with turns.train_turn(2, Drained(), 1, {}):
        pass
    assert [r.version for r in rollout.ranks] == [2, 2]
    with turns.train_turn(3, Drained(), 1, {}):
        trainer.ranks[0].steps = 3  # the step's train call ran
        trainer.defer("memory")  # the driver's, for its next trainer call
        fresh = rollout.ranks[1] = FakeRollout()
        fresh.has_weights = False
        watcher = threading.Thread(target=lambda: (CALLS.watching(), steps._restored(rollout, 1)))
        watcher.start()
        watcher.join()
        assert fresh.has_weights and fresh.version == 2 == rollout.ranks[0].version
        assert trainer.drop_deferred()  # still queued: the restart's call did not carry it
    assert [(e["role"], e["rank"]) for e in events(tmp_path)] == [("rollout", 1)]
