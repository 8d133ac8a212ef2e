"""A method that rides after a call's own (`then`), on Ray and in-process: the turn of a colocated
role that is one call carries its onload before and its offload after, in one round trip. A
weight sync rides on the trainer's offload and the rollout's next call."""
import pytest
import torch

from orchestration.base_group import CALLS, ResultOf, WorkerError
from orchestration.local import LocalWorkerGroup
from orchestration.planner import make_plan


class Tally:
    """Records the order its methods ran in."""

    def __init__(self):
        self.ran = []

    def onload(self):
        self.ran.append("onload")
        return {"model_bytes": 3}

    def offload(self, model: bool = True, optimizer: bool = False):
        self.ran.append("offload")
        return {"model_bytes": 5 if model else 0, "optimizer_bytes": 7 if optimizer else 0, "seconds": 0.0}

    def work(self, items):
        self.ran.append("work")
        return len(items)

    def fail(self):
        raise ValueError("cannot")

    def offer(self):
        self.ran.append("offer")
        return {"x": 5}

    def take(self, value):
        self.ran.append(f"take {value}")

    def history(self):
        return list(self.ran)


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_then_runs_after_the_calls_method_in_the_same_round_trip(ray_cluster, backend):
    """then() runs a method on every rank right after the next call's method, inside that call; the
    call answers with its method's value; a rank the call does not reach gets the queued methods
    (defer's, then then's) as a call of its own; their results come back per rank; a failing one
    is named after the call's method; drop_deferred() forgets it."""
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1, "c": {"device": "CPU", "ranks": 2, "workers": ["orm"]}}})
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Tally, plan["orm"], placement=placement) if backend == "ray" else \
            LocalWorkerGroup(Tally, plan["orm"])
        g.defer("onload")
        g.then("offload", True)
        before = CALLS.remote
        assert g.call("work", [7], dispatch="slice") == [1]  # only rank 0 has an item
        assert CALLS.remote - before == (2 if backend == "ray" else 0)  # rank 1: a call of its own
        assert g.call("history") == [["onload", "work", "offload"], ["onload", "offload"]]
        moved = {"model_bytes": 5, "optimizer_bytes": 0, "seconds": 0.0}
        assert g.deferred_results() == [{"onload": {"model_bytes": 3}, "offload": moved}] * 2
        g.then("offload")
        assert g.drop_deferred() and not g.drop_deferred()
        g.call("work", [1, 2])
        assert g.call("history")[0] == ["onload", "work", "offload", "work"]  # the dropped offload never ran
        g.then("fail")
        with pytest.raises(WorkerError, match=r"work\+fail\(\)"):
            g.call("work", [1, 2])
        assert g.call("history")[0][-1] == "work"  # the method ran before the failing one
        if backend == "ray":
            g.shutdown()
    finally:
        placement.remove()


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_a_deferred_method_takes_what_another_calls_deferred_method_returned(ray_cluster, backend):
    """defer(..., execute='first') queues a method on the first rank only; a deferred method's
    argument may be ResultOf(call, key, carried=method): the value that method returned on the
    call's first rank, rank to rank."""
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1, "a": {"device": "CPU", "ranks": 2, "workers": ["orm"]},
                                        "b": {"device": "CPU", "ranks": 1, "workers": ["prm"]}}})
    placement = create_placement(plan, timeout_s=30)
    try:
        make = (lambda role: WorkerGroup(Tally, plan[role], placement=placement)) if backend == "ray" else \
            (lambda role: LocalWorkerGroup(Tally, plan[role]))
        a, b = make("orm"), make("prm")
        a.defer("offer", execute="first")
        offered = a.async_call("work", [1, 2])
        b.defer("take", ResultOf(offered, "x", carried="offer"))
        b.then("take", ResultOf(offered, None, carried="offer"))
        assert b.call("work", [3]) == [1]
        assert offered.get() == [2, 2]
        assert a.call("history") == [["offer", "work"], ["work"]]
        assert b.call("history") == [["take 5", "work", "take {'x': 5}"]]
        with pytest.raises(ValueError, match="execute"):
            a.defer("offer", execute="some")
        if backend == "ray":
            a.shutdown(), b.shutdown()
    finally:
        placement.remove()


class Net:
    """A trainer or rollout with real weights (a linear layer) and the real weight send and
    receive; records the order its methods ran in. A train step adds 1 to every weight."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.model, self.ran = torch.nn.Linear(4, 3), []

    def state_dict_buckets(self, bucket_mb, dtype=None, to_cpu=True):
        self.ran.append("send")
        return [[(n, t.detach().clone()) for n, t in self.model.state_dict().items()]]

    def update_weights(self, pairs, version):
        self.ran.append(f"update {version}")
        self.model.load_state_dict(dict(pairs))

    def train_step(self):
        self.ran.append("train_step")
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)
        return {"loss": 0.0}

    def generate(self):
        self.ran.append("generate")
        return float(sum(p.sum() for p in self.model.parameters()))

    def onload(self):
        self.ran.append("onload")

    def offload(self, model=True, optimizer=True):
        self.ran.append("offload")

    def wake_up(self):
        self.ran.append("wake_up")

    def sleep(self, level):
        self.ran.append("sleep")

    def history(self):
        return list(self.ran)


@pytest.mark.parametrize("one_call", [False, True])
def test_a_weight_sync_rides_on_the_trainers_offload_and_the_rollouts_next_call(ray_cluster, tmp_path, one_call):
    """Colocated and strictly on-policy, on a shared-memory path: the send rides on the train
    turn's offload (trainer rank 0 only), the receive on the rollout's next call before its
    wake-up; a step is then 2 calls per trainer rank and 2 for the rollout (was 2 more: send and
    receive, which the driver waited for). One-call turns (`train_turn` and `rollout_turn` with
    one_call) make it 1 and 1: onload, train step, send and offload in the trainer's call; receive,
    wake-up, generate and sleep in the rollout's. Either way the rollout generates with the new
    weights, and the sync's figures come with the rollout's turn."""
    from algorithms.grpo import GRPOConfig
    from algorithms.runtime.steps import Steps
    from orchestration.config import WeightSyncConfig
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup
    from roles.weight_transfer import WeightReceiver, WeightSender
    from tests.driver_helpers import TINY, MarkedLog, prepared

    Trainer = type("Trainer", (Net, WeightSender), {})
    Rollout = type("Rollout", (Net, WeightReceiver), {})
    _, typed, plan = prepared(GRPOConfig, TINY + ["placement=colocate"])
    places = make_plan({"device_groups": {"nproc_per_node": 1, "t": {"device": "CPU", "ranks": 2, "workers": ["orm"]},
                                          "r": {"device": "CPU", "ranks": 1, "workers": ["prm"]}}})
    placement = create_placement(places, timeout_s=30)
    try:
        trainer = WorkerGroup(Trainer, places["orm"], init_args=(0,), placement=placement)
        rollout = WorkerGroup(Rollout, places["prm"], init_args=(1,), placement=placement)
        with Steps(plan, {"train": trainer, "rollout": rollout}, typed.run, WeightSyncConfig(path="shm"),
                   MarkedLog(tmp_path, 3, []), []) as steps:
            turns = steps.turns
            def train(step, metrics):
                if one_call:
                    with turns.train_turn(step, None, 0, metrics, one_call=True):
                        trainer.call("train_step")
                else:
                    with turns.turn("train"):
                        trainer.call("train_step")
                        assert turns.weights.sync(step, None, 0) == {}  # the figures come with the receive
                turns.settle()

            generated, calls = [], []
            for step in (1, 2, 3):
                before, metrics = CALLS.remote, {}
                with turns.rollout_turn(step - 1, metrics, one_call=one_call):
                    generated.append(rollout.call("generate")[0])
                train(step, metrics)
                calls.append(CALLS.remote - before)
                if step > 1:
                    assert metrics["sync/prm/path"] == "shm" and metrics["sync/prm/mb"] > 0  # role: the placement's
            trained = trainer.call("generate", execute="first")
            # The third generation used the weights of two train steps: 2 x 15 weights above the start.
            assert generated[2] == pytest.approx(trained - 15) and generated[1] == pytest.approx(trained - 15 - 15)
            # Two trainer ranks: train_step and offload calls, or one; the rollout's generate and sleep, or one.
            assert calls[2] == (2 + 1 if one_call else 2 + 2 + 2)
            assert rollout.call("history")[0][-8:] == ["update 1", "wake_up", "generate", "sleep",
                                                       "update 2", "wake_up", "generate", "sleep"]
            assert trainer.call("history") == [["onload", "train_step", "send", "offload"] * 3 + ["generate"],
                                               ["onload", "train_step", "offload"] * 3]
            # A step whose generation and eval both receive (as GRPO's last step): its record holds both.
            single, metrics = metrics["sync/prm/mb"], {}
            with turns.rollout_turn(3, metrics, one_call=one_call):
                rollout.call("generate")
            train(4, metrics)
            with turns.rollout_turn(4, metrics, one_call=one_call):
                rollout.call("generate")
            assert metrics["sync/prm/mb"] == pytest.approx(2 * single)
            assert rollout.call("history")[0][-8:] == ["update 3", "wake_up", "generate", "sleep",
                                                       "update 4", "wake_up", "generate", "sleep"]
        trainer.shutdown(), rollout.shutdown()
    finally:
        placement.remove()


def test_a_one_call_turn_is_one_round_trip_with_its_onload_and_offload(ray_cluster, tmp_path):
    """Turns.call (and turn(one_call=True)) of a colocated role send one remote call per rank:
    onload, the method, offload, in that order on the rank, with the moved bytes logged; a turn
    of several calls sends its offload as a call of its own."""
    from algorithms.gkd import GKDConfig
    from algorithms.runtime.steps import Steps
    from orchestration.config import WeightSyncConfig
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup
    from tests.driver_helpers import TINY_GKD, MarkedLog, prepared

    _, typed, plan = prepared(GKDConfig, TINY_GKD + ["placement.offload_teacher_model=true",
                                                       "placement.offload_model=true"])
    assert plan["teacher"].offload_model and plan["train"].offload_model
    places = make_plan({"device_groups": {"nproc_per_node": 1, "t": {"device": "CPU", "ranks": 1, "workers": ["orm"]},
                                          "u": {"device": "CPU", "ranks": 1, "workers": ["prm"]}}})
    placement = create_placement(places, timeout_s=30)
    try:
        teacher = WorkerGroup(Tally, places["orm"], placement=placement)
        trainer = WorkerGroup(Tally, places["prm"], placement=placement)
        log = MarkedLog(tmp_path, 3, [])
        turns = Steps(plan, {"train": trainer, "teacher": teacher}, typed.run, WeightSyncConfig(), log, []).turns
        turns.settle()  # the teacher's first offload, sent as the run starts
        before = CALLS.remote
        assert turns.call("teacher", "work", [1, 2], phase="teacher") == [2]
        assert CALLS.remote - before == 1
        with turns.turn("train", one_call=True):
            trainer.call("work", [1])
        assert CALLS.remote - before == 2
        with turns.turn("train"):  # two calls: the offload goes on its own
            trainer.call("work", [1])
            trainer.call("work", [2])
        assert CALLS.remote - before == 5
        turns.settle()
        assert teacher.call("history") == [["offload", "onload", "work", "offload"]]
        assert trainer.call("history") == [["onload", "work", "offload", "onload", "work", "work", "offload"]]
        sums = log._sums
        assert sums["move/teacher_onload_bytes"] == 3
        assert sums["move/teacher_offload_bytes"] == 10  # the first (as the run starts) and the turn's
        # The riding offload and the separate one.
        assert sums["move/train_offload_bytes"] == 2 * (5 + 7 * plan["train"].offload_optimizer)
        teacher.shutdown(), trainer.shutdown()
    finally:
        placement.remove()


@pytest.mark.parametrize("calls", [2, 3])
def test_a_turn_promised_one_call_that_makes_more_is_refused(tmp_path, calls):
    """turn(one_call=True) puts the role's offload after its first call; a second call would run
    offloaded, so the promise is checked: more calls raise, naming the role; one call, or a turn
    without the promise, goes through."""
    from algorithms.gkd import GKDConfig
    from algorithms.runtime.steps import Steps
    from orchestration.config import WeightSyncConfig
    from tests.driver_helpers import TINY_GKD, MarkedLog, prepared

    _, typed, plan = prepared(GKDConfig, TINY_GKD + ["placement.offload_model=true"])
    places = make_plan({"train": {"gpus": 1}})
    trainer = LocalWorkerGroup(Tally, places["train"])
    turns = Steps(plan, {"train": trainer}, typed.run, WeightSyncConfig(), MarkedLog(tmp_path, 3, []), []).turns
    with pytest.raises(RuntimeError, match="the train turn was promised one call .* made %d" % calls):
        with turns.turn("train", one_call=True):
            for i in range(calls):
                trainer.call("work", [i])
    with turns.turn("train", one_call=True):
        trainer.call("work", [1])
    with turns.turn("train"):
        trainer.call("work", [1])
        trainer.call("work", [2])
    turns.settle()
    assert trainer.call("history")[0][-7:] == ["onload", "work", "offload", "onload", "work", "work", "offload"]
