"""Calls through Ray compiled graphs (cluster.compiled_calls): the same answers, order, errors,
`after` and answers-as-arguments as normal calls; a dead or silent rank reported, never a hang;
the GKD driver on Ray with them computes what it computes in one process."""
import os
import time

import pytest
import ray
import torch

from orchestration.base_group import CALLS, WorkerError
from orchestration.compiled_calls import FastCall
from orchestration.planner import make_plan


class Log:
    """Appends tags in the order its calls run."""

    RESTARTABLE = True

    def __init__(self):
        self.tags = []

    def clear(self):
        self.tags = []

    def add(self, tag, nap=0.0):
        time.sleep(nap)
        self.tags.append(tag)
        return list(self.tags)

    def boom(self):
        raise ValueError("no such tag")

    def die_once(self, marker):
        """Kills its process the first time (`marker` does not exist yet), then answers."""
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)
        return "survived"

    def threads(self):
        return torch.get_num_threads()

    def now(self, nap=0.0):
        time.sleep(nap)
        return time.time()

    def plus(self, x):
        return x + 1

    def memory(self):
        return {"rss_bytes": len(self.tags)}


@pytest.fixture(scope="module")
def place(ray_cluster):
    """One-rank groups with compiled calls on: make(role, **options); `shared`: prm and orm groups
    the tests that kill or stall no rank use in turn (each clears its log first)."""
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1,
                                        "a": {"device": "CPU", "ranks": 1, "workers": ["prm"]},
                                        "b": {"device": "CPU", "ranks": 1, "workers": ["orm"]},
                                        "c": {"device": "CPU", "ranks": 1, "workers": ["teacher"]},
                                        "d": {"device": "CPU", "ranks": 2, "workers": ["sampler"]}}})
    placement = create_placement(plan, timeout_s=30)
    made = []

    def make(role, **options):
        made.append(WorkerGroup(Log, plan[role], placement=placement, compiled_calls=True, **options))
        return made[-1]
    shared = (make("prm"), make("orm"))
    yield make, shared
    for g in made:
        g.shutdown()
    placement.remove()


@pytest.fixture()
def shared(place):
    for g in place[1]:
        g.call("clear")
    return place[1]


@pytest.fixture()
def fresh(place):
    """A new one-rank group (role teacher) for a test that kills or stalls its rank."""
    made = []

    def make(**options):
        made.append(place[0]("teacher", **options))
        return made[-1]
    yield make
    for g in made:
        g.shutdown()


def test_calls_go_through_the_graph_and_answer_as_normal_calls(shared):
    g = shared[0]
    before = CALLS.remote
    future = g.async_call("add", "a")
    assert isinstance(future.handles[0], FastCall)
    assert future.get() == [["a"]]
    assert CALLS.remote == before + 1
    assert g.call("threads") == g.threads  # the graph's thread computes with the rank's torch threads
    g.call("add", "b")
    before = CALLS.remote
    assert g.memory() == [{"rss_bytes": 2}] and CALLS.remote == before  # figures ride back on graph calls


def test_a_normal_call_and_graph_calls_run_in_the_order_sent(shared):
    """An ObjectRef argument takes the normal path; the driver keeps the rank's order between the
    two kinds (Ray runs graph calls on a thread of their own)."""
    g = shared[0]
    first = g.async_call("add", "graph 1", 0.3)  # in flight on the graph's thread
    second = g.async_call("add", ray.put("normal"), 0.3)  # waits for the first, then runs
    assert not isinstance(second.handles[0], FastCall)
    third = g.async_call("add", "graph 2")  # the normal call is still running: normal path too
    assert not isinstance(third.handles[0], FastCall)
    assert third.get() == [["graph 1", "normal", "graph 2"]]
    assert first.get() == [["graph 1"]] and second.get() == [["graph 1", "normal"]]
    assert isinstance(g.async_call("add", "graph 3").handles[0], FastCall)


def test_an_error_names_role_rank_and_method_and_the_graph_goes_on(shared):
    g = shared[0]
    with pytest.raises(ValueError, match="no such tag") as info:
        g.call("boom")
    assert isinstance(info.value, WorkerError) and (info.value.role, info.value.rank, info.value.method) == ("prm", 0, "boom")
    assert g._graphs is not None and g.call("add", "after") == [["after"]]


def test_after_and_answers_as_arguments_across_graph_calls(shared):
    a, b = shared
    napping = a.async_call("now", 0.4)
    b.after([napping])
    started = b.async_call("now")
    assert started.get()[0] >= napping.get()[0]
    from orchestration.base_group import ResultOf
    assert b.call("plus", ResultOf(a.async_call("plus", 1))) == [3]


def test_a_dead_rank_is_restarted_its_call_run_again_and_the_graph_compiled_again(fresh, tmp_path):
    g = fresh(restarts=1)
    assert g.call("die_once", str(tmp_path / "died")) == ["survived"]
    assert g.restarts_left == 0 and g._graphs is not None
    assert isinstance(g.async_call("add", "fresh").handles[0], FastCall)


def test_a_dead_rank_without_restarts_is_reported_not_waited_for(fresh, tmp_path):
    g = fresh()
    with pytest.raises(WorkerError, match="died") as info:
        g.call("die_once", str(tmp_path / "died"))
    assert info.value.lost and (info.value.rank, info.value.method) == (0, "die_once")
    assert g._graphs is None


def test_a_silent_rank_is_reported_and_the_group_goes_on_with_normal_calls(fresh):
    g = fresh()
    g.timeout_s = 1.0  # after its start, which takes longer
    with pytest.raises(WorkerError, match="no answer after") as info:
        g.call("now", 3.0)
    assert info.value.lost and g._graphs is None
    assert not isinstance(g.async_call("add", "x").handles[0], FastCall)
    assert g.async_call("add", "y").get(10) == [["x", "y"]]


def test_groups_of_several_ranks_keep_normal_calls(place):
    g = place[0]("sampler")
    assert g._graphs is None and not isinstance(g.async_call("add", "x").handles[0], FastCall)


def test_gkd_on_ray_with_compiled_calls_computes_what_it_computes_in_process(ray_cluster, tmp_path):
    """The GKD quickstart, shrunk, with on-policy steps (generation, weight sync, teacher and
    trainer turns): every call that can takes the graph, and the losses equal the in-process run's."""
    from algorithms import gkd
    from algorithms.config import GKDRunConfig
    from algorithms.runlog import read_metrics
    from tests.driver_helpers import TINY, prepared

    base = ["+experiment=gkd_quickstart", *TINY, "model=nano_qwen2", "placement.teacher_model=nano_qwen2",
            "teacher.warmup_steps=0", "algorithm.max_new_tokens=4", "algorithm.lmbda=0.5", "run.eval_every=0",
            "run.eval_max_new_tokens=4", f"teacher.cache_dir={tmp_path / 'teachers'}"]
    losses = {}
    for workers in ("local", "ray"):
        _, typed, plan = prepared(GKDRunConfig, [*base, f"backend.workers={workers}", "cluster.compiled_calls=true"])
        gkd.validate(typed, plan)
        gkd.run(typed, plan, tmp_path / workers)
        records = read_metrics(tmp_path / workers / "metrics.jsonl")
        losses[workers] = [r["train/loss"] for r in records if "train/loss" in r]
        if workers == "ray":
            # Calls that wait for another call (`after`) or take a normal call's answer go the normal way.
            assert all(1 <= r["calls/compiled"] <= r["calls/remote"] for r in records[1:])
    assert len(losses["ray"]) == 3
    assert losses["ray"] == pytest.approx(losses["local"], rel=1e-4)
