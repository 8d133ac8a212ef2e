"""A method that rides after a call's own (`then`), on Ray and in-process: the turn of a colocated
role that is one call carries its onload before and its offload after, in one round trip."""
import pytest

from orchestration.base_group import CALLS, WorkerError
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


def test_a_one_call_turn_is_one_round_trip_with_its_onload_and_offload(ray_cluster, tmp_path):
    """Turns.call (and turn(one_call=True)) of a colocated role send one remote call per rank:
    onload, the method, offload, in that order on the rank, with the moved bytes logged; a turn
    of several calls sends its offload as a call of its own."""
    from algorithms.gkd import GKDRunConfig
    from algorithms.turns import Turns
    from orchestration.config import WeightSyncConfig
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup
    from tests.driver_helpers import TINY_GKD, MarkedLog, prepared

    _, typed, plan = prepared(GKDRunConfig, TINY_GKD + ["placement.offload_teacher_model=true",
                                                       "placement.offload_model=true"])
    assert plan["teacher"].offload_model and plan["train"].offload_model
    places = make_plan({"device_groups": {"nproc_per_node": 1, "t": {"device": "CPU", "ranks": 1, "workers": ["orm"]},
                                          "u": {"device": "CPU", "ranks": 1, "workers": ["prm"]}}})
    placement = create_placement(places, timeout_s=30)
    try:
        teacher = WorkerGroup(Tally, places["orm"], placement=placement)
        trainer = WorkerGroup(Tally, places["prm"], placement=placement)
        log = MarkedLog(tmp_path, 3, [])
        turns = Turns(plan, {"train": trainer, "teacher": teacher}, typed.run, WeightSyncConfig(), log, [])
        turns._settle()  # the teacher's first offload, sent as the run starts
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
        turns._settle()
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
