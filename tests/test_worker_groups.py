"""Worker groups on real Ray (fake GPUs, two simulated nodes) and the local backend.

Every dispatch/collect case runs on both backends and must give identical results. Failures:
tests/test_worker_failures.py; what rides on the calls (threads, memory figures, deferred
methods, answers as arguments): tests/test_worker_calls.py.
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
