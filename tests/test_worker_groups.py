"""Worker groups on real Ray (fake GPUs, two simulated nodes) and the local backend.

Every dispatch/collect case runs on both backends and must give identical results.
"""
import dataclasses

import numpy as np
import pytest
import torch

from orchestration.base_group import WorkerError
from orchestration.local import LocalWorkerGroup
from orchestration.planner import make_plan
from tests.roles_for_tests import Probe


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    texts: list
    temperature: float = 1.0

    def __len__(self):
        return len(self.texts)


@dataclasses.dataclass
class Options:
    """A dataclass without __len__ is an option bundle: sent whole, never sliced."""
    stop_ids: tuple = ()
    names: list = dataclasses.field(default_factory=list)


@pytest.fixture(scope="module")
def ray_groups(ray_cluster):
    """Ray groups for a 4-GPU colocated layout: train and rollout share the 4 devices."""
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"colocate_groups": [["train", "rollout"]], "train": {"gpus": 4}, "rollout": {"gpus": 4}})
    placement = create_placement(plan, timeout_s=30)
    groups = {r: WorkerGroup(Probe, plan[r], {"scale": 2.0}, placement=placement) for r in ("train", "rollout")}
    yield groups
    for g in groups.values():
        g.shutdown()
    placement.remove()


@pytest.fixture(scope="module")
def local_group():
    plan = make_plan({"train": {"gpus": 4}})
    return LocalWorkerGroup(Probe, plan["train"], {"scale": 2.0})


@pytest.fixture(params=["ray", "local"])
def group(request, ray_groups, local_group):
    return ray_groups["train"] if request.param == "ray" else local_group


def same(a, b):
    """Deep equality over lists/tuples/dicts/tensors/arrays/dataclasses."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


CASES = {
    "slice 10 over 4 -> 3,3,2,2": (("rank_and_len", list(range(10))), dict(dispatch="slice", collect="flatten"),
                                   [(0, 3), (1, 3), (2, 2), (3, 2)]),
    "slice fewer items than workers skips": (("rank_and_len", [7, 8]), dict(dispatch="slice", collect="flatten"),
                                             [(0, 1), (1, 1)]),
    "slice fewer items than workers: lockstep methods get empty slices": (
        ("rank_and_len_lockstep", [7, 8]), dict(dispatch="slice", collect="flatten"), [(0, 1), (1, 1), (2, 0), (3, 0)]),
    "slice tensor round trip": (("echo", torch.arange(10.0)), dict(dispatch="slice", collect="flatten"),
                                torch.arange(10.0)),
    "slice array scaled": (("scaled", np.arange(6.0).reshape(6, 1)), dict(dispatch="slice", collect="flatten"),
                           np.arange(6.0).reshape(6, 1) * 2),
    "slice batch dataclass": (("echo", Batch(torch.arange(10).reshape(5, 2), torch.ones(5, 2), list("abcde"), 0.5)),
                              dict(dispatch="slice", collect="flatten"),
                              Batch(torch.arange(10).reshape(5, 2), torch.ones(5, 2), list("abcde"), 0.5)),
    "slice sends strings and dicts whole": (("tag", [1, 2, 3, 4, 5], "L"), dict(dispatch="slice", extra={"k": 9}),
                                            [[("L", 9, 1), ("L", 9, 2)], [("L", 9, 3)], [("L", 9, 4)], [("L", 9, 5)]]),
    "tuple returns flatten element-wise": (("pair", list("abcd")), dict(dispatch="slice", collect="flatten"),
                                           (list("abcd"), [0, 1, 2, 3])),
    "all sends the same": (("echo", "hello"), dict(dispatch="all"), ["hello"] * 4),
    "execute first unwraps": (("whoami",), dict(execute="first", collect=lambda r: r["rank"]), 0),
    "collect none lists per worker": (("tensor_rank",), {}, [torch.full((2,), float(i)) for i in range(4)]),
    "flatten tensors": (("tensor_rank",), dict(collect="flatten"), torch.tensor([0., 0, 1, 1, 2, 2, 3, 3])),
    "flatten arrays": (("array_rank",), dict(collect="flatten"), np.array([[i] * 3 for i in range(4)])),
    "flatten dicts key-wise": (("metrics", 5), dict(collect="flatten"), {"rank": [0, 1, 2, 3], "n": [5] * 4}),
    "callable collect": (("echo", 3), dict(collect=sum), 12),
    "callable dispatch": (("echo", 100), dict(dispatch=lambda n, i, x: ((x + i,), {}), collect="flatten"),
                          [100, 101, 102, 103]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dispatch_semantics_identical_on_both_backends(name, ray_groups, local_group):
    (method, *args), kwargs, expected = CASES[name]
    kwargs = dict(kwargs)
    if name == "execute first unwraps":
        kwargs.pop("collect")
        for g in (ray_groups["train"], local_group):
            assert g.call(method, *args, **kwargs)["rank"] == 0
        return
    results = [g.call(method, *args, **kwargs) for g in (ray_groups["train"], local_group)]
    assert same(results[0], expected), results[0]
    assert same(results[1], expected), results[1]


def test_option_dataclass_is_sent_whole(group):
    assert group.call("echo", Options((1, 2), ["a"]), dispatch="slice") == [Options((1, 2), ["a"])] * 4


def test_async_call_returns_future(group):
    fut = group.async_call("echo", [1, 2, 3, 4], dispatch="slice", collect="flatten")
    assert fut.get() == [1, 2, 3, 4] and fut.get() == [1, 2, 3, 4]


def test_remote_exception_names_role_rank_method(group):
    with pytest.raises(WorkerError) as info:
        group.call("fail", "boom-message")
    err = info.value
    assert (err.role, err.rank, err.method) == ("train", 1, "fail")
    text = str(err)
    assert "train rank 1 failed in fail(): ValueError: boom-message" in text
    assert "remote traceback" in text and "roles_for_tests.py" in text


def test_remote_exception_is_caught_by_its_own_type(group):
    """As with Ray's own errors, `except ValueError` catches a ValueError raised in a worker."""
    try:
        group.call("fail", "typed")
    except ValueError as err:  # noqa: PERF203
        assert isinstance(err, WorkerError) and (err.role, err.rank, err.method) == ("train", 1, "fail")
        assert isinstance(err.cause, ValueError) and err.cause.args == ("typed",)
    else:
        pytest.fail("no error raised")
    with pytest.raises(TypeError) as info:  # dict + int on every rank: a TypeError, not a ValueError
        group.call("add", {}, 1)
    assert not isinstance(info.value, ValueError) and info.value.method == "add"


def test_top_level_object_refs_arrive_resolved(group):
    """Like any Ray call: a top-level ObjectRef (positional or keyword) arrives as its value, sent
    whole even with dispatch='slice'; a ref nested in a list stays a ref."""
    import ray

    if not ray.is_initialized():
        pytest.skip("needs the session's Ray cluster")
    ref = ray.put([1, 2, 3])
    assert group.call("echo", ref) == [[1, 2, 3]] * 4
    assert group.call("echo", x=ref) == [[1, 2, 3]] * 4
    assert group.call("add", ref, [4], dispatch="slice") == [[1, 2, 3, 4]]  # [4] is sliced; the ref goes whole
    nested = group.call("echo", [ref], execute="first")
    assert isinstance(nested[0], ray.ObjectRef) and ray.get(nested[0]) == [1, 2, 3]


def test_local_rank_matches_the_visible_device(ray_groups):
    """Ray shows each GPU actor its own device only, so LOCAL_RANK is 0 on every rank (the index
    of that device among the visible ones): torch.cuda.set_device(LOCAL_RANK) works everywhere."""
    for role in ("train", "rollout"):
        infos = ray_groups[role].call("whoami")
        for info in infos:
            visible = info["cuda"].split(",")
            assert len(visible) == 1 and info["env"]["LOCAL_RANK"] == "0", (role, info)
        assert len({i["cuda"] for i in infos}) == 4  # four different GPUs of the node


def test_local_backend_local_rank_is_the_planned_device():
    """In-process every device is visible: LOCAL_RANK is the planned device's index on the node."""
    plan = make_plan({"device_groups": {"nproc_per_node": 4,
                                        "a": {"device": "GPU", "ranks": [0, 1], "workers": ["train"]},
                                        "b": {"device": "GPU", "ranks": [2, 3], "workers": ["rollout"]}}})
    group = LocalWorkerGroup(Probe, plan["rollout"])
    assert [i["env"]["LOCAL_RANK"] for i in group.call("whoami")] == ["2", "3"]


def test_mismatched_slice_lengths_are_refused(group):
    with pytest.raises(ValueError, match="one length"):
        group.call("add", [1, 2, 3], [1, 2], dispatch="slice")


def test_rank_environment(ray_groups):
    infos = ray_groups["train"].call("whoami")
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    for i in infos:
        assert i["env"]["WORLD_SIZE"] == "4" and i["env"]["MASTER_ADDR"] == infos[0]["env"]["MASTER_ADDR"]
        assert int(i["env"]["MASTER_PORT"]) > 0
    assert len({i["pid"] for i in infos}) == 4  # one process per rank


def test_colocated_roles_share_devices(ray_groups):
    train = [i["cuda"] for i in ray_groups["train"].call("whoami")]
    rollout = [i["cuda"] for i in ray_groups["rollout"].call("whoami")]
    assert all(c for c in train) and train == rollout  # rank i of both roles on the same GPU
    assert len(set(train)) == 4


def test_tensor_parallel_engines_take_one_share_and_answer_once(ray_cluster):
    """4 ranks with 2 per engine: peers get the same share and meet at their first rank's
    address; only first ranks answer; 'first' runs the whole first engine; a custom dispatch
    is still asked per rank. The local backend refuses such a plan."""
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"train": {"gpus": 1}, "rollout": {"gpus": 4, "vllm_tensor_parallel_size": 2}})
    placement = create_placement(plan, timeout_s=30)
    try:
        group = WorkerGroup(Probe, plan["rollout"], placement=placement)
        everyone = [group._wait([group._submit(i, "whoami", (), {})], "whoami", [i], 30)[0] for i in range(4)]
        tp = [(e["env"]["ENGINE_TP_SIZE"], e["env"]["ENGINE_TP_RANK"]) for e in everyone]
        assert tp == [("2", "0"), ("2", "1")] * 2
        ports = [e["env"]["ENGINE_TP_MASTER_PORT"] for e in everyone]
        assert ports[0] == ports[1] != ports[2] == ports[3] != everyone[0]["env"]["MASTER_PORT"]
        assert group.call("rank_and_len", list(range(5)), dispatch="slice", collect="flatten") == [(0, 3), (2, 2)]
        assert group.call("rank_and_len", [7], dispatch="slice", collect="flatten") == [(0, 1)]  # engine 2 idle
        assert group.call("rank_and_len_lockstep", [7], dispatch="slice", collect="flatten") == [(0, 1), (2, 0)]
        assert group.call("echo", 3) == [3, 3]
        assert group.call("whoami", execute="first")["rank"] == 0
        per_rank = group.call("echo", dispatch=lambda n, i: ((n * 10 + i,), {}))
        assert per_rank == [40, 42]  # asked for ranks 0..3 of 4, first ranks answer
        group.shutdown()
    finally:
        placement.remove()
    with pytest.raises(ValueError, match="backend.workers=ray"):
        LocalWorkerGroup(Probe, plan["rollout"])


def test_separate_roles_get_disjoint_devices(ray_cluster):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"train": {"gpus": 2}, "rollout": {"gpus": 2}})
    placement = create_placement(plan, timeout_s=30)
    try:
        groups = [WorkerGroup(Probe, plan[r], placement=placement) for r in ("train", "rollout")]
        seen = [{i["cuda"] for i in g.call("whoami")} for g in groups]
        assert len(seen[0]) == 2 and len(seen[1]) == 2 and not (seen[0] & seen[1])
        for g in groups:
            g.shutdown()
    finally:
        placement.remove()


# A driver in its own process joining a running cluster (cluster.address):
# tests/test_gkd_driver.py::test_gkd_cli_quickstart_on_ray; `python -m orchestration.plan
# plan.launch=true`: tests/test_config.py::test_plan_cli_launch_places_on_a_fresh_local_cluster;
# the grpo_two_nodes experiment on both nodes: tests/test_experiments_run.py (on Ray).
def test_two_node_layout_spans_both_nodes(ray_cluster):
    import ray
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"nnodes": 2, "nproc_per_node": 1, "train": {"gpus": 1}, "rollout": {"gpus": 1}})
    placement = create_placement(plan, timeout_s=30)
    try:
        groups = {r: WorkerGroup(Probe, plan[r], placement=placement) for r in ("train", "rollout")}
        nodes = {r: {info["node_id"] for info in g.infos} for r, g in groups.items()}
        assert len(nodes["train"]) == 1 and len(nodes["rollout"]) == 1 and nodes["train"] != nodes["rollout"]
        assert nodes["train"] == {placement.node_ids[0]} and nodes["rollout"] == {placement.node_ids[1]}
        assert len({n["NodeID"] for n in ray.nodes() if n["Alive"]}) == 2
        for g in groups.values():
            g.shutdown()
    finally:
        placement.remove()


def test_unsatisfiable_plan_fails_fast_naming_resources(ray_cluster):
    from orchestration.placement import PlacementError, create_placement

    with pytest.raises(PlacementError, match="needs {'GPU': 16.0}.*simulate_gpus"):
        create_placement(make_plan({"train": {"gpus": 16}}), timeout_s=5)


def test_cpu_group_places_processes(ray_cluster):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1,
                                        "rm": {"device": "CPU", "ranks": 2, "workers": ["prm", "orm"]}}})
    placement = create_placement(plan, timeout_s=30)
    try:
        prm = WorkerGroup(Probe, plan["prm"], placement=placement)
        orm = WorkerGroup(Probe, plan["orm"], placement=placement)
        assert prm.call("echo", [1, 2, 3], dispatch="slice", collect="flatten") == [1, 2, 3]
        assert [i["cuda"] for i in orm.call("whoami")] == ["", ""]
        assert [i["env"]["LOCAL_RANK"] for i in orm.call("whoami")] == ["0", "1"]  # no device: order on the node
        prm.shutdown(), orm.shutdown()
    finally:
        placement.remove()


def test_dead_actor_is_reported_not_waited_for(ray_cluster):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"train": {"gpus": 2}})
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Probe, plan["train"], placement=placement)
        with pytest.raises(WorkerError, match="train rank 1 failed in die\\(\\): the actor process died"):
            g.call("die")
        g.shutdown()
    finally:
        placement.remove()


def test_silent_worker_is_reported_after_the_call_timeout(ray_cluster):
    """A rank that stops answering (sleeping past the bound, or SIGSTOPped) is reported like a
    dead one: role, rank, method and seconds waited; the group still shuts down after."""
    import os
    import signal
    import time
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"train": {"gpus": 2}})
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Probe, plan["train"], placement=placement, timeout_s=60)
        g.timeout_s = 2.0  # what cluster.call_timeout_s=2 gives, once the actors have started
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"train rank 1 failed in nap\(\): no answer after 2\.\ds: the actor "
                                              rf"process \(pid {g.infos[1]['pid']}\) stopped answering"):
            g.call("nap", 120)
        assert time.monotonic() - start < 20
        g.shutdown()

        g = WorkerGroup(Probe, plan["train"], placement=placement, timeout_s=60)
        g.timeout_s = 2.0
        stopped = g.infos[0]["pid"]
        os.kill(stopped, signal.SIGSTOP)
        with pytest.raises(WorkerError, match=r"train rank 0 failed in echo\(\): no answer after 2\.\ds"):
            g.call("echo", 1)
        g.shutdown()  # returns although rank 0 cannot run its exit
        deadline = time.monotonic() + 30
        while _alive(stopped) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(stopped)
    finally:
        placement.remove()


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_negative_call_timeout_is_refused():
    from orchestration.cluster import init_cluster
    from orchestration.config import ClusterConfig, ConfigError

    with pytest.raises(ConfigError, match=r"'cluster.call_timeout_s'=-1 must be >= 0.*Fix"):
        init_cluster(ClusterConfig(call_timeout_s=-1))


def test_failure_while_others_block_is_raised_at_once(ray_cluster):
    import time
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"train": {"gpus": 2}})
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Probe, plan["train"], placement=placement)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="train rank 1 failed in fail_or_hang\\(\\): RuntimeError: rank 1 gave up"):
            g.call("fail_or_hang")
        assert time.monotonic() - start < 60  # rank 0 would block for 120 s
        g.shutdown()
    finally:
        placement.remove()


def test_constructor_failure_names_init(ray_cluster):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"train": {"gpus": 1}})
    placement = create_placement(plan, timeout_s=30)
    try:
        with pytest.raises(WorkerError, match="train rank 0 failed in __init__\\(\\): TypeError"):
            WorkerGroup(Probe, plan["train"], {"no_such_arg": 1}, placement=placement)
    finally:
        placement.remove()
    with pytest.raises(WorkerError, match="train rank 0 failed in __init__"):
        LocalWorkerGroup(Probe, plan["train"], {"no_such_arg": 1})


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
    """A group's num_cpus sets its ranks' torch and OpenMP threads; the others split the cores, less
    one for the driver and Ray, by the processes planned on the node (here 1 + 2)."""
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup, usable_cores

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
        share = max(1, (usable_cores() - 1) // 3)
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
    so role_s - rank_s is what the calls cost around the work; in-process ranks count both alike."""
    from orchestration.base_group import CALLS
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1, "c": {"device": "CPU", "ranks": 2, "workers": ["orm"]}}})
    placement = create_placement(plan, timeout_s=30)
    try:
        g = WorkerGroup(Counter, plan["orm"], placement=placement)
        role0, rank0 = CALLS.role_s, CALLS.rank_s
        slept = g.call("slept", [0.3, 0.2], dispatch="slice")
        ran, waited = CALLS.rank_s - rank0, CALLS.role_s - role0
        # The slowest rank counts, not the sum: below it by the other rank's sleep (whatever the load).
        assert max(slept) <= ran < sum(slept) and waited >= ran
        g.shutdown()
        local = LocalWorkerGroup(Counter, plan["orm"])
        role0, rank0 = CALLS.role_s, CALLS.rank_s
        local.call("nap", [0.05, 0.05], dispatch="slice")
        assert CALLS.rank_s - rank0 == pytest.approx(CALLS.role_s - role0) and CALLS.rank_s - rank0 >= 0.1
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


def test_shared_arguments_go_into_the_object_store_once(ray_groups):
    """dispatch='all' puts a large argument once (every rank gets the same ObjectRef, resolved on
    arrival); small ones travel inline; lockstep ranks without items share one empty share."""
    import ray

    from orchestration import dispatch as dsp

    g = ray_groups["train"]
    big, small = np.arange(100_000, dtype=np.float32), {"k": 1}
    args, kwargs = g._shared((big, 3), {"opts": small, "more": [big]})
    assert isinstance(args[0], ray.ObjectRef) and args[1] == 3
    assert kwargs["opts"] is small and isinstance(kwargs["more"], ray.ObjectRef)
    puts = []
    shared = g._shared
    g._shared = lambda a, k: puts.append(1) or shared(a, k)  # count the shares put, then put them
    try:
        echoed = g.call("echo", big)
    finally:
        del g._shared
    assert len(echoed) == 4 and all(np.array_equal(e, big) for e in echoed)
    assert len(puts) == 1  # one share for the 4 ranks
    shares = dsp.split("slice", 4, ([1, 2],), {}, keep_empty=True)
    assert shares[2] is shares[3] and shares[2][0] == ([],)


# A local cluster's actors run at the driver's niceness and its calls carry objects up to
# cluster.inline_object_mb inline: tests/test_cleanup.py's driver, which starts one.


def test_tensors_cross_as_arrays_and_arrive_whole(ray_groups):
    """CPU tensors travel as numpy arrays both ways: dtype (bfloat16 too), shape, values, a
    non-contiguous layout and requires_grad survive, and what arrives is writable."""
    g = ray_groups["train"]
    for t in [torch.randn(3, 4), torch.randn(3, 4).to(torch.bfloat16), torch.arange(6).view(2, 3).t(),
              torch.ones(2, requires_grad=True), torch.tensor(3.0), torch.zeros(0, 5), torch.tensor([True, False])]:
        back = g.call("echo", t, execute="first")
        assert (back.dtype, back.shape, back.requires_grad) == (t.dtype, t.shape, t.requires_grad)
        assert torch.equal(back.detach(), t.detach())
    big = torch.randn(256, 1024)  # over Ray's inline size: read from the object store
    back = g.call("echo", big, execute="first")
    back.mul_(2)  # its own memory, not the store's read-only buffer
    assert torch.equal(back, big * 2)
