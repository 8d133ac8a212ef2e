"""What rides on a worker group's calls (real Ray, and the local backend where it has the
same): threads per rank, memory figures and rank seconds coming back with each answer, a
deferred method riding on the next call, a call that waits on another group's call, and one
call's answer as another's argument without the driver."""
import threading

import pytest
import torch

from orchestration.base_group import WorkerError
from orchestration.local import LocalWorkerGroup
from orchestration.planner import make_plan

class Counter:
    """Reports its threads and memory figures (these change with every call, so a stale one shows)."""

    LOCKSTEP_METHODS = ("lengths",)

    def __init__(self):
        self.calls = 0

    def threads(self) -> dict:
        import os
        return {"torch": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}

    def bump(self, x=None):
        self.calls += 1
        return self.calls

    def lengths(self, items):
        return [len(items)]

    def nap(self, seconds: list) -> float:
        """Sleeps; returns when it woke (wall clock)."""
        import time
        time.sleep(sum(seconds))
        return time.time()

    def slept(self, seconds: list) -> float:
        """Sleeps; returns the seconds it slept (more than asked on a busy machine)."""
        import time
        start = time.perf_counter()
        time.sleep(sum(seconds))
        return time.perf_counter() - start

    def now(self) -> float:
        import time
        return time.time()

    def later(self, seconds: float, value) -> dict:
        """After `seconds`, {"value": value, "at": when it returned}."""
        import time
        time.sleep(seconds)
        return {"value": value, "at": time.time()}

    def plus_one(self, x, stamp=None) -> tuple:
        import time
        return x + 1, stamp, time.time()

    def memory(self) -> dict:
        return {"rss_bytes": 1000 + self.calls}


def test_threads_follow_num_cpus_else_the_node_share(ray_cluster):
    """A group's num_cpus sets its ranks' torch and OpenMP threads; the others split the cores by
    the processes planned on the node (here 1 + 2)."""
    from orchestration.placement import create_placement
    from orchestration.rank_process import usable_cores
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1,
                                        "a": {"device": "CPU", "ranks": 1, "workers": ["prm"], "num_cpus": 3},
                                        "b": {"device": "CPU", "ranks": 2, "workers": ["orm"]}}})
    assert plan["prm"].num_cpus == 3.0 and plan["orm"].num_cpus is None
    placement = create_placement(plan, timeout_s=30)
    try:
        prm = WorkerGroup(Counter, plan["prm"], placement=placement, start=False)
        orm = WorkerGroup(Counter, plan["orm"], placement=placement, start=False)
        for g in (prm, orm):
            g.begin_setup()
        for g in (prm, orm):
            g.end_setup()
        assert prm.call("threads") == [{"torch": 3, "omp": "3"}] and prm.threads == [3]
        share = max(1, usable_cores() // 3)
        assert orm.call("threads") == [{"torch": share, "omp": str(share)}] * 2
        prm.shutdown(), orm.shutdown()
    finally:
        placement.remove()


def test_memory_figures_ride_back_on_calls(ray_cluster):
    """memory() answers from the figures of each rank's latest call without a remote call of its own;
    a rank not called yet is asked."""
    from orchestration.base_group import CALLS
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1, "c": {"device": "CPU", "ranks": 2, "workers": ["orm"]}}})
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Counter, plan["orm"], placement=placement)
        g.call("bump", [1], dispatch="slice")  # rank 0 only (rank 1's slice is empty)
        before = CALLS.remote
        assert g.memory() == [{"rss_bytes": 1001}, {"rss_bytes": 1000}]
        assert CALLS.remote == before + 1  # rank 1 was asked; rank 0's figures came with bump
        g.call("bump")
        before = CALLS.remote
        assert g.memory() == [{"rss_bytes": 1002}, {"rss_bytes": 1001}]
        assert CALLS.remote == before
        local = LocalWorkerGroup(Counter, plan["orm"])
        local.call("bump")
        assert local.memory() == [{"rss_bytes": 1001}] * 2
        g.shutdown()
    finally:
        placement.remove()


def test_rank_seconds_ride_back_on_calls(ray_cluster):
    """Each call brings back the seconds its method ran on the rank (the slowest rank's per call),
    so overhead_s is what the calls cost around the work; in-process ranks cost nothing around it.
    A call waited for in another thread (one watching a call made ahead) is no time of the driver's."""
    from orchestration.base_group import CALLS
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1, "c": {"device": "CPU", "ranks": 2, "workers": ["orm"]}}})
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Counter, plan["orm"], placement=placement)
        role0, over0 = CALLS.role_s, CALLS.overhead_s
        slept = g.call("slept", [0.3, 0.2], dispatch="slice")
        waited, overhead = CALLS.role_s - role0, CALLS.overhead_s - over0
        # The slowest rank counts, not the sum: below it by the other rank's sleep (whatever the load).
        assert max(slept) <= waited - overhead < sum(slept) and overhead >= 0
        role0, over0 = CALLS.role_s, CALLS.overhead_s
        future = g.async_call("slept", [0.2, 0.2], dispatch="slice")
        watcher = threading.Thread(target=lambda: (CALLS.watching(), future.get()))
        watcher.start()
        watcher.join()
        # The driver's time is the send only; the thread's 0.2 s wait would be counted in it otherwise.
        assert CALLS.role_s - role0 < 0.15 and CALLS.overhead_s - over0 >= 0
        g.shutdown()
        local = LocalWorkerGroup(Counter, plan["orm"])
        role0, over0 = CALLS.role_s, CALLS.overhead_s
        local.call("nap", [0.05, 0.05], dispatch="slice")
        assert CALLS.role_s - role0 >= 0.1 and CALLS.overhead_s - over0 == pytest.approx(0.0, abs=1e-6)
    finally:
        placement.remove()


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_a_deferred_method_rides_on_the_next_call(ray_cluster, backend):
    """defer() runs a method first thing in the group's next call, inside that call's round trip;
    a rank the call does not reach gets it as a call of its own; each rank's result is kept;
    drop_deferred() forgets it; a failure names both methods."""
    from orchestration.base_group import CALLS
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1, "c": {"device": "CPU", "ranks": 2, "workers": ["orm"]}}})
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Counter, plan["orm"], placement=placement) if backend == "ray" else \
            LocalWorkerGroup(Counter, plan["orm"])
        g.defer("bump")
        before = CALLS.remote
        assert g.call("bump", [7], dispatch="slice") == [2]  # rank 0 only has an item: bumped twice
        assert CALLS.remote - before == (2 if backend == "ray" else 0)  # rank 0's call carried it; rank 1's own
        assert g.deferred_results() == [{"bump": 1}, {"bump": 1}]
        assert g.call("bump") == [3, 2]  # ran once per rank, not again
        g.defer("bump")
        assert g.drop_deferred() and not g.drop_deferred()
        assert g.call("bump") == [4, 3]
        g.defer("bump")
        with pytest.raises(WorkerError, match=r"bump\+nap\(\)"):
            g.call("nap", "x")  # sum("x") fails after the deferred bump ran
        if backend == "ray":
            g.shutdown()
    finally:
        placement.remove()


def test_a_call_after_another_groups_call_starts_once_that_one_finished(ray_cluster):
    """after(): the next call of a group waits, where it runs, for other groups' calls (an offload
    freeing devices), without the driver waiting; its result stays the caller's to collect."""
    import time

    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1, "a": {"device": "CPU", "ranks": 1, "workers": ["orm"]},
                                        "b": {"device": "CPU", "ranks": 2, "workers": ["prm"]}}})
    placement = create_placement(plan, timeout_s=30)
    try:
        a = WorkerGroup(Counter, plan["orm"], placement=placement)
        b = WorkerGroup(Counter, plan["prm"], placement=placement)
        b.call("now")  # warm
        napping = a.async_call("nap", [0.5], dispatch="slice")
        b.after([napping])
        sent = time.perf_counter()
        started = b.async_call("now")
        assert time.perf_counter() - sent < 0.3  # the driver did not wait for the nap
        assert not napping.ready()
        woke = napping.get()[0]
        assert min(started.get()) >= woke  # both ranks of b ran after a's nap ended
        assert napping.ready()
        assert b.call("now")  # the wait applied to one call only
        a.shutdown()
        b.shutdown()
    finally:
        placement.remove()


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_a_calls_answer_is_another_calls_argument_without_the_driver(ray_cluster, backend):
    """ResultOf: rank 0's answer of one group's call (or a key of it) is a top-level argument of
    another group's call, which starts once it exists; the driver does not wait for it."""
    import time

    from orchestration.base_group import ResultOf
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1, "a": {"device": "CPU", "ranks": 1, "workers": ["orm"]},
                                        "b": {"device": "CPU", "ranks": 2, "workers": ["prm"]}}})
    placement = create_placement(plan, timeout_s=30)
    try:
        make = (lambda role: WorkerGroup(Counter, plan[role], placement=placement)) if backend == "ray" else \
            (lambda role: LocalWorkerGroup(Counter, plan[role]))
        a, b = make("orm"), make("prm")
        answer = a.async_call("later", 0.4, 41, execute="first")
        sent = time.perf_counter()
        got = b.async_call("plus_one", ResultOf(answer, "value"), stamp=ResultOf(answer))
        if backend == "ray":
            assert time.perf_counter() - sent < 0.3  # submitted without waiting for a's answer
        first = answer.get()
        for value, stamp, at in got.get():  # both ranks of b
            assert value == 42 and stamp == first and at >= first["at"]
        if backend == "ray":
            a.shutdown()
            b.shutdown()
    finally:
        placement.remove()
