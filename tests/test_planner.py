"""Planner table tests: valid layouts of both ms-swift forms, and invalid ones with their messages."""
import pytest

from orchestration.device_groups import parse_ranks
from orchestration.planner import PlanError, make_plan

# The ms-swift documentation's own examples (reference/ms-swift-ray-support.md).
SWIFT_COLOCATE_GRPO = {"colocate_groups": [["train", "rollout"]], "offload_model": True,
                       "offload_optimizer": True, "sleep_level": 1,
                       "train": {"gpus": 4}, "rollout": {"gpus": 4}}
SWIFT_SEPARATE_GRPO = {"train": {"gpus": 4}, "rollout": {"gpus": 4}}
SWIFT_GKD_COLOCATED_TEACHER = {**SWIFT_COLOCATE_GRPO, "teacher_model": "Qwen/Qwen3-8B",
                               "offload_teacher_model": True}
SWIFT_GKD_TEACHER_GROUP = {**SWIFT_COLOCATE_GRPO,
                           "teacher": {"gpus": 2, "model": "Qwen/Qwen3-8B", "vllm_tensor_parallel_size": 2}}
SWIFT_SAMPLING = {"device_groups": {
    "nproc_per_node": 4,
    "sample_group": {"device": "GPU", "ranks": "list(range(0, 2))", "workers": ["sampler"]},
    "rm_group": {"device": "GPU", "ranks": "list(range(2, 4))", "workers": ["prm", "orm"]}}}
SAMPLING_CPU_RM = {"device_groups": {
    "nproc_per_node": 2,
    "sample_group": {"device": "GPU", "ranks": 2, "workers": ["sampler"]},
    "rm_group": {"device": "CPU", "ranks": 3, "workers": ["prm", "orm"]}}}


def summary(plan):
    """role -> (device, ranks, nodes, colocated_with) for compact expectations."""
    return {r.role: (r.device, list(r.ranks), sorted(set(r.nodes)), sorted(r.colocated_with))
            for r in plan.roles.values()}


VALID = [
    ("swift colocate grpo", SWIFT_COLOCATE_GRPO,
     {"train": ("GPU", [0, 1, 2, 3], [0], ["rollout"]), "rollout": ("GPU", [0, 1, 2, 3], [0], ["train"])}),
    ("swift separate grpo", SWIFT_SEPARATE_GRPO,
     {"train": ("GPU", [0, 1, 2, 3], [0], []), "rollout": ("GPU", [4, 5, 6, 7], [0], [])}),
    ("swift gkd colocated teacher", SWIFT_GKD_COLOCATED_TEACHER,
     {"train": ("GPU", [0, 1, 2, 3], [0], ["rollout", "teacher"]),
      "rollout": ("GPU", [0, 1, 2, 3], [0], ["teacher", "train"]),
      "teacher": ("GPU", [0, 1, 2, 3], [0], ["rollout", "train"])}),
    ("swift gkd teacher group", SWIFT_GKD_TEACHER_GROUP,
     {"train": ("GPU", [0, 1, 2, 3], [0], ["rollout"]), "rollout": ("GPU", [0, 1, 2, 3], [0], ["train"]),
      "teacher": ("GPU", [4, 5], [0], [])}),
    ("swift sampling device_groups", SWIFT_SAMPLING,
     {"sampler": ("GPU", [0, 1], [0], []), "prm": ("GPU", [2, 3], [0], ["orm"]),
      "orm": ("GPU", [2, 3], [0], ["prm"])}),
    ("sampling with a CPU reward group", SAMPLING_CPU_RM,
     {"sampler": ("GPU", [0, 1], [0], []), "prm": ("CPU", [0, 1, 2], [0], ["orm"]),
      "orm": ("CPU", [0, 1, 2], [0], ["prm"])}),
    ("train only", {"train": {"gpus": 2}}, {"train": ("GPU", [0, 1], [0], [])}),
    ("rollout only", {"rollout": {"gpus": 1}}, {"rollout": ("GPU", [0], [0], [])}),
    ("colocated teacher without colocate_groups", {"teacher_model": "t", "train": {"gpus": 2}, "rollout": {"gpus": 1}},
     {"train": ("GPU", [0, 1], [0], ["teacher"]), "rollout": ("GPU", [2], [0], []),
      "teacher": ("GPU", [0, 1], [0], ["train"])}),
    ("separate with teacher group", {"train": {"gpus": 1}, "rollout": {"gpus": 1}, "teacher": {"gpus": 1}},
     {"train": ("GPU", [0], [0], []), "rollout": ("GPU", [1], [0], []), "teacher": ("GPU", [2], [0], [])}),
    ("teacher colocated via colocate_groups", {"colocate_groups": [["train", "teacher"]], "train": {"gpus": 2},
                                               "teacher": {"gpus": 2}, "rollout": {"gpus": 2}},
     {"train": ("GPU", [0, 1], [0], ["teacher"]), "teacher": ("GPU", [0, 1], [0], ["train"]),
      "rollout": ("GPU", [2, 3], [0], [])}),
    ("two nodes megatron", {"nnodes": 2, "nproc_per_node": 4, "train": {"gpus": 4}, "rollout": {"gpus": 4}},
     {"train": ("GPU", [0, 1, 2, 3], [0], []), "rollout": ("GPU", [4, 5, 6, 7], [1], [])}),
    ("two nodes derived per-node count", {"nnodes": 2, "train": {"gpus": 8}},
     {"train": ("GPU", list(range(8)), [0, 1], [])}),
    ("colocate spanning two nodes", {"nnodes": 2, "colocate_groups": [["train", "rollout"]],
                                     "train": {"gpus": 4}, "rollout": {"gpus": 4}},
     {"train": ("GPU", [0, 1, 2, 3], [0, 1], ["rollout"]), "rollout": ("GPU", [0, 1, 2, 3], [0, 1], ["train"])}),
    ("device_groups int ranks take next free", {"device_groups": {
        "nproc_per_node": 4, "a": {"device": "GPU", "ranks": [0, 1], "workers": ["sampler"]},
        "b": {"device": "GPU", "ranks": 2, "workers": ["orm"]}}},
     {"sampler": ("GPU", [0, 1], [0], []), "orm": ("GPU", [2, 3], [0], [])}),
    ("device_groups string list ranks", {"device_groups": {
        "nproc_per_node": 2, "g": {"device": "GPU", "ranks": "[0, 1]", "workers": ["default"]}}},
     {"default": ("GPU", [0, 1], [0], [])}),
    ("device_groups across nodes", {"device_groups": {
        "nproc_per_node": 2, "s": {"device": "GPU", "ranks": "list(range(0, 2))", "workers": ["sampler"]},
        "r": {"device": "GPU", "ranks": "list(range(2, 4))", "workers": ["prm"]}}},
     {"sampler": ("GPU", [0, 1], [0], []), "prm": ("GPU", [2, 3], [1], [])}),
    ("device_groups single worker string", {"device_groups": {
        "nproc_per_node": 1, "g": {"device": "cpu", "ranks": 2, "workers": "orm"}}},
     {"orm": ("CPU", [0, 1], [0], [])}),
    ("device_groups explicit ranks out of order", {"device_groups": {
        "nproc_per_node": 4, "a": {"device": "GPU", "ranks": 2, "workers": ["sampler"]},
        "b": {"device": "GPU", "ranks": [0, 1], "workers": ["prm"]}}},
     {"sampler": ("GPU", [2, 3], [0], []), "prm": ("GPU", [0, 1], [0], [])}),
    ("two CPU groups count separately", {"device_groups": {
        "nproc_per_node": 1, "a": {"device": "CPU", "ranks": 2, "workers": ["prm"]},
        "b": {"device": "CPU", "ranks": 1, "workers": ["orm"]}}},
     {"prm": ("CPU", [0, 1], [0], []), "orm": ("CPU", [2], [0], [])}),
    ("sft default role on 8 ranks", {"device_groups": {
        "nproc_per_node": 8, "default": {"device": "GPU", "ranks": 8, "workers": ["default"]}}},
     {"default": ("GPU", list(range(8)), [0], [])}),
    ("None values are unset", {"train": {"gpus": 1, "model": None}, "teacher_model": None, "colocate_groups": None,
                               "device_groups": None, "offload_teacher_model": False},
     {"train": ("GPU", [0], [0], [])}),
]


@pytest.mark.parametrize("cfg,expected", [(c, e) for _, c, e in VALID], ids=[n for n, _, _ in VALID])
def test_valid_layouts(cfg, expected):
    assert summary(make_plan(cfg)) == expected


def test_colocate_flags_go_to_the_right_roles():
    plan = make_plan(SWIFT_GKD_COLOCATED_TEACHER)
    assert (plan["train"].offload_model, plan["train"].offload_optimizer, plan["train"].sleep_level) == (True, True, 0)
    assert (plan["rollout"].offload_model, plan["rollout"].sleep_level) == (False, 1)
    assert plan["teacher"].offload_model and plan["teacher"].model == "Qwen/Qwen3-8B"
    assert plan.nnodes == 1 and plan.devices_per_node == 4
    # Separate roles never offload or sleep: nothing shares their devices.
    sep = make_plan({**SWIFT_SEPARATE_GRPO, "offload_model": True, "sleep_level": 1})
    assert not sep["train"].offload_model and sep["rollout"].sleep_level == 0


def test_teacher_group_tp_and_demand():
    plan = make_plan(SWIFT_GKD_TEACHER_GROUP)
    assert plan["teacher"].tensor_parallel_size == 2
    assert plan.demand() == {"GPU": 6.0, "CPU": 0.0}
    assert make_plan(SAMPLING_CPU_RM).demand() == {"GPU": 2.0, "CPU": 3.0}


def test_device_groups_tp_goes_to_the_vllm_roles_of_the_group():
    """vllm_tensor_parallel_size in a device group (beyond ms-swift's form): its vLLM roles get it,
    a trainer colocated in the same group keeps one rank per model copy."""
    plan = make_plan({"device_groups": {"nproc_per_node": 4, "g": {"device": "GPU", "ranks": 4,
                                                                   "workers": ["sampler", "train"],
                                                                   "vllm_tensor_parallel_size": 2}}})
    assert plan["sampler"].tensor_parallel_size == 2 and plan["train"].tensor_parallel_size == 1
    assert plan["sampler"].ranks == plan["train"].ranks == (0, 1, 2, 3)


def test_two_node_local_devices():
    plan = make_plan({"nnodes": 2, "nproc_per_node": 4, "train": {"gpus": 4}, "rollout": {"gpus": 4}})
    assert plan["rollout"].local_devices == (0, 1, 2, 3) and plan["rollout"].nodes == (1, 1, 1, 1)


@pytest.mark.parametrize("text,expected", [
    (2, 2), ([0, 1], [0, 1]), ("list(range(0, 2))", [0, 1]), ("list(range(3))", [0, 1, 2]),
    ("[4, 5]", [4, 5]), ("4,5", [4, 5]), (" list( range(2 ,4) ) ", [2, 3])])
def test_parse_ranks(text, expected):
    assert parse_ranks(text, "k") == expected


@pytest.mark.parametrize("text", ["__import__('os')", "list(range(0, 2)); x", "[0, 'a']", "[]", True, "[0, 0]", -1])
def test_parse_ranks_refuses_unsafe_or_bad(text):
    with pytest.raises(PlanError, match="config key 'placement.k'=.*Fix: "):
        parse_ranks(text, "k")


INVALID = [
    ("unequal colocated counts", {"colocate_groups": [["train", "rollout"]], "train": {"gpus": 4}, "rollout": {"gpus": 2}},
     "colocate_groups", "equal device counts"),
    ("role in two colocate groups", {"colocate_groups": [["train", "rollout"], ["rollout", "teacher"]],
                                     "train": {"gpus": 1}, "rollout": {"gpus": 1}, "teacher": {"gpus": 1}},
     "colocate_groups", "in two colocate groups"),
    ("unknown role in colocate_groups", {"colocate_groups": [["train", "critic"]], "train": {"gpus": 1}},
     "colocate_groups", "unknown role 'critic'"),
    ("colocated role without devices", {"colocate_groups": [["train", "rollout"]], "train": {"gpus": 1}},
     "colocate_groups", "has no devices"),
    ("unknown top-level key", {"train": {"gpus": 1}, "gpus_per_node": 8}, "gpus_per_node", "unknown key"),
    ("unknown role entry key", {"train": {"gpus": 1, "gpu": 2}}, "train.gpu", "unknown key"),
    ("tp does not divide", {"train": {"gpus": 2}, "rollout": {"gpus": 3, "vllm_tensor_parallel_size": 2}},
     "rollout.vllm_tensor_parallel_size", "does not divide"),
    ("tp on train", {"train": {"gpus": 2, "vllm_tensor_parallel_size": 2}}, "train.vllm_tensor_parallel_size",
     "no vLLM engine"),
    ("zero gpus", {"train": {"gpus": 0}}, "train.gpus", "integer >= 1"),
    ("missing gpus", {"train": {"model": "m"}}, "train.gpus", "missing"),
    ("more ranks than nodes x devices", {"nnodes": 1, "nproc_per_node": 4, "train": {"gpus": 4}, "rollout": {"gpus": 4}},
     "nproc_per_node", "needs device rank 7"),
    ("bad sleep level", {"train": {"gpus": 1}, "sleep_level": 3}, "sleep_level", "must be 0, 1 or 2"),
    ("offload teacher without colocated teacher", {"train": {"gpus": 1}, "teacher": {"gpus": 1},
                                                   "offload_teacher_model": True},
     "offload_teacher_model", "colocated with the trainer"),
    ("mixed forms", {"train": {"gpus": 1}, "device_groups": {"nproc_per_node": 1}}, "train", "mixed"),
    ("overlapping ranks", {"device_groups": {
        "nproc_per_node": 4, "a": {"device": "GPU", "ranks": [0, 1], "workers": ["sampler"]},
        "b": {"device": "GPU", "ranks": "list(range(1, 3))", "workers": ["prm"]}}},
     "device_groups.b.ranks", "rank 1 is also used by group 'a'"),
    ("CPU ranks given as a list", {"device_groups": {
        "nproc_per_node": 1, "rm": {"device": "CPU", "ranks": [0, 1], "workers": ["orm"]}}},
     "device_groups.rm.ranks", "write ranks: 2"),
    ("unknown worker", {"device_groups": {
        "nproc_per_node": 1, "g": {"device": "GPU", "ranks": 1, "workers": ["critic"]}}},
     "device_groups.g.workers", "unknown role 'critic'"),
    ("worker in two groups", {"device_groups": {
        "nproc_per_node": 2, "a": {"device": "GPU", "ranks": 1, "workers": ["orm"]},
        "b": {"device": "GPU", "ranks": 1, "workers": ["orm"]}}},
     "device_groups.b.workers", "already in group 'a'"),
    ("device_groups without nproc_per_node", {"device_groups": {
        "g": {"device": "GPU", "ranks": 1, "workers": ["orm"]}}}, "device_groups.nproc_per_node", "missing"),
    ("device_groups ranks beyond nnodes", {"nnodes": 1, "device_groups": {
        "nproc_per_node": 2, "g": {"device": "GPU", "ranks": [0, 1, 2], "workers": ["sampler"]}}},
     "nnodes", "needs device rank 2"),
    ("unknown device kind", {"device_groups": {
        "nproc_per_node": 1, "g": {"device": "TPU", "ranks": 1, "workers": ["orm"]}}},
     "device_groups.g.device", "unknown device"),
    ("unknown group key", {"device_groups": {
        "nproc_per_node": 1, "g": {"device": "GPU", "ranks": 1, "workers": ["orm"], "gpus": 1}}},
     "device_groups.g.gpus", "unknown key"),
    ("device_groups tp on a CPU group", {"device_groups": {
        "nproc_per_node": 1, "g": {"device": "CPU", "ranks": 2, "workers": ["sampler"], "vllm_tensor_parallel_size": 2}}},
     "device_groups.g.vllm_tensor_parallel_size", "CPU groups run no vLLM engine"),
    ("device_groups tp does not divide", {"device_groups": {
        "nproc_per_node": 4, "g": {"device": "GPU", "ranks": 3, "workers": ["sampler"], "vllm_tensor_parallel_size": 2}}},
     "device_groups.g.vllm_tensor_parallel_size", "does not divide the group's 3 ranks"),
    ("device_groups tp without a vLLM role", {"device_groups": {
        "nproc_per_node": 2, "g": {"device": "GPU", "ranks": 2, "workers": ["train"], "vllm_tensor_parallel_size": 2}}},
     "device_groups.g.vllm_tensor_parallel_size", "no role of ['train'] runs a vLLM engine"),
    ("no roles", {"offload_model": True}, "train.gpus", "no train or rollout role has devices"),
]


@pytest.mark.parametrize("cfg,key,fragment", [(c, k, f) for _, c, k, f in INVALID], ids=[n for n, *_ in INVALID])
def test_invalid_layouts_name_key_and_fix(cfg, key, fragment):
    with pytest.raises(PlanError) as info:
        make_plan(cfg)
    assert info.value.key == key
    msg = str(info.value)
    assert msg.startswith(f"config key 'placement.{key}'") and fragment in msg and "Fix: " in msg


def test_any_role_names_for_the_decorator_front_end():
    dg = {"device_groups": {"nproc_per_node": 2, "a": {"device": "GPU", "ranks": 2, "workers": ["model1"]},
                            "b": {"device": "CPU", "ranks": 1, "workers": ["model2", "model3"]}}}
    with pytest.raises(PlanError, match="unknown role 'model1'"):
        make_plan(dg)
    plan = make_plan(dg, any_role_names=True)
    assert summary(plan) == {"model1": ("GPU", [0, 1], [0], []), "model2": ("CPU", [0], [0], ["model3"]),
                             "model3": ("CPU", [0], [0], ["model2"])}
    bad = {"device_groups": {"nproc_per_node": 1, "a": {"device": "GPU", "ranks": 1, "workers": ["no spaces"]}}}
    with pytest.raises(PlanError, match="unknown role 'no spaces'"):
        make_plan(bad, any_role_names=True)


def test_a_role_colocated_beside_another_shares_its_bundles():
    """GRPO's reference policy: added beside the trainer, it takes the trainer's devices and
    joins every colocation of them."""
    from orchestration.planner import with_colocated_role

    plan = make_plan({"colocate_groups": [["train", "rollout"]], "train": {"gpus": 2}, "rollout": {"gpus": 2},
                      "offload_model": True, "sleep_level": 1})
    both = with_colocated_role(plan, "reference", "train", offload_model=True)
    ref, train = both["reference"], both["train"]
    assert ref.ranks == train.ranks and ref.nodes == train.nodes and ref.local_devices == train.local_devices
    assert set(ref.colocated_with) == {"train", "rollout"} and ref.offload_model and not ref.offload_optimizer
    assert "reference" in train.colocated_with and "reference" in both["rollout"].colocated_with
    assert both.demand() == plan.demand() and "reference" not in plan.roles
    with pytest.raises(PlanError, match="already planned"):
        with_colocated_role(both, "reference", "train", offload_model=False)
