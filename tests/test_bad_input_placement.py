"""Bad placement, cluster and backend input, as a user types it (command-line overrides of
`python -m orchestration.plan`, an ms-swift YAML file): each ends in one line
`error: config key 'X'=V <problem>. Fix: <what to set>` naming the key the user changes, and
exit 2, before anything starts (no Ray cluster, no actor)."""
import inspect
import sys

import pytest
from hydra import compose, initialize_config_module

from orchestration import plan as plan_cli
from orchestration.cluster import check_local_size
from orchestration.config import ClusterConfig, ConfigError, PlanConfig, register_schema, unknown_override
from orchestration.launch import check_local_backend
from orchestration.placement import PlacementError
from orchestration.planner import PlanError, make_plan

DEVICE_GROUPS = ["placement=empty", "+placement.device_groups.nproc_per_node=2"]

# (what the user did, overrides, ms-swift YAML file text or None, the key the line must name)
CASES = [
    # a. an ms-swift YAML whose top level is not a mapping
    ("YAML file holding a list", [], "- train\n- rollout\n", "config_file"),
    ("YAML file holding a scalar", [], "42\n", "config_file"),
    # b. device_groups entries added on the command line with fields missing
    ("a group added without nproc_per_node", ["placement=empty", "+placement.device_groups.g1.device=GPU"], None,
     "placement.device_groups.nproc_per_node"),
    ("a group with a device only", [*DEVICE_GROUPS, "+placement.device_groups.g1.device=GPU"], None,
     "placement.device_groups.g1.ranks"),
    ("a group with ranks but no workers", [*DEVICE_GROUPS, "+placement.device_groups.g1.ranks=2"], None,
     "placement.device_groups.g1.workers"),
    ("a group added beside the default train/rollout", ["+placement.device_groups.g1.ranks=2"], None,
     "placement.train"),
    ("device_groups with no group", DEVICE_GROUPS, None, "placement.device_groups"),
    # e. a placement with no devices names the key to set
    ("no devices at all", ["placement=empty"], None, "placement.train.gpus"),
    ("every role set to 0 devices", ["placement.train.gpus=0", "placement.rollout.gpus=0"], None,
     "placement.train.gpus"),
    # f. more bad placement/cluster input
    ("negative gpus", ["placement.train.gpus=-2"], None, "placement.train.gpus"),
    ("gpus not a number", ["placement.train.gpus=abc"], None, "placement.train.gpus"),
    ("unknown role in colocate_groups", ["placement=colocate", "placement.colocate_groups=[[train,critic]]"], None,
     "placement.colocate_groups"),
    ("colocate_groups not a list of lists", ["placement.colocate_groups=[train,rollout]"], None,
     "placement.colocate_groups"),
    ("a role twice in one colocate group", ["placement=colocate", "placement.colocate_groups=[[train,train]]"],
     None, "placement.colocate_groups"),
    ("overlapping ranks", [*DEVICE_GROUPS, "+placement.device_groups.a={ranks:[0,1],workers:[sampler]}",
                           "+placement.device_groups.b={ranks:[1],workers:[prm]}"], None,
     "placement.device_groups.b.ranks"),
    ("ranks string with garbage", [*DEVICE_GROUPS,
                                   "+placement.device_groups.a={ranks:'list(range(a,b))',workers:[sampler]}"], None,
     "placement.device_groups.a.ranks"),
    ("ranks of 0", [*DEVICE_GROUPS, "+placement.device_groups.a={ranks:0,workers:[sampler]}"], None,
     "placement.device_groups.a.ranks"),
    ("nproc_per_node 0", ["placement=empty", "+placement.device_groups.nproc_per_node=0",
                          "+placement.device_groups.a={ranks:1,workers:[sampler]}"], None,
     "placement.device_groups.nproc_per_node"),
    ("unknown device kind", [*DEVICE_GROUPS, "+placement.device_groups.a={device:TPU,ranks:1,workers:[sampler]}"],
     None, "placement.device_groups.a.device"),
    ("unknown worker role", [*DEVICE_GROUPS, "+placement.device_groups.a={ranks:1,workers:[critic]}"], None,
     "placement.device_groups.a.workers"),
    ("Megatron nproc_per_node 0", ["placement.nproc_per_node=0"], None, "placement.nproc_per_node"),
    ("more ranks than nodes hold", ["placement.nproc_per_node=1"], None, "placement.nproc_per_node"),
    ("sleep level out of range", ["placement.sleep_level=5"], None, "placement.sleep_level"),
    ("num_cpus negative", ["placement.train.num_cpus=-1"], None, "placement.train.num_cpus"),
    ("simulate_gpus negative", ["cluster.simulate_gpus=-1"], None, "cluster.simulate_gpus"),
    ("num_cpus 0", ["cluster.num_cpus=0"], None, "cluster.num_cpus"),
    ("placement timeout 0", ["cluster.placement_timeout_s=0"], None, "cluster.placement_timeout_s"),
    ("unknown worker backend", ["backend.workers=threads"], None, "backend.workers"),
    ("YAML role entry not a mapping", [], "train: 4\n", "config_file"),
    ("YAML gpus negative", [], "train: {gpus: -1}\n", "placement.train.gpus"),
    ("YAML gpus not a number", [], "train: {gpus: abc}\n", "config_file"),
    ("YAML group without ranks", [], "device_groups:\n  nproc_per_node: 2\n  g1: {device: GPU}\n",
     "placement.device_groups.g1.ranks"),
    ("YAML device_groups a list", [], "device_groups: [a, b]\n", "config_file"),
]


def planned(overrides: list[str], tmp_path, text) -> int:
    """Exit code of `python -m orchestration.plan <overrides>` (the command-line check, then the
    main body on the composed config); its error line goes to stderr."""
    if text is not None:
        path = tmp_path / "swift.yaml"
        path.write_text(text)
        overrides = [*overrides, f"config_file={path}"]
    problem = unknown_override(overrides, PlanConfig)  # what checked_command_line runs first
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    register_schema(PlanConfig)
    with initialize_config_module(config_module="conf", version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    try:
        inspect.unwrap(plan_cli.main)(cfg)
    except SystemExit as e:
        return e.code
    return 0


@pytest.mark.parametrize("overrides,text,key", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_naming_the_key(overrides, text, key, tmp_path, capsys):
    code = planned(overrides, tmp_path, text)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: config key '{key}'") and ". Fix: " in err, err


def test_bad_input_never_starts_anything(monkeypatch, tmp_path, capsys):
    def started(*args, **kwargs):
        raise AssertionError("a cluster was started for an invalid config")

    monkeypatch.setattr(plan_cli, "launch_report", started)
    assert planned(["placement.train.gpus=-2", "plan.launch=true"], tmp_path, None) == 2
    assert "'placement.train.gpus'=-2" in capsys.readouterr().err


class Lockstep:
    LOCKSTEP_METHODS = ("train_step",)


class Free:
    pass


@pytest.mark.parametrize("placement,role,cls,keys", [
    ({"train": {"gpus": 2}}, "train", Lockstep, ["placement.train.gpus=1"]),
    ({"device_groups": {"nproc_per_node": 2, "g": {"ranks": 2, "workers": ["default"]}}}, "default", Lockstep,
     ["placement.device_groups.g.ranks=1"]),
    ({"train": {"gpus": 1}, "rollout": {"gpus": 2, "vllm_tensor_parallel_size": 2}}, "rollout", Free,
     ["placement.rollout.vllm_tensor_parallel_size=1"]),
])
def test_local_backend_refuses_ranks_that_meet_in_collectives(placement, role, cls, keys):
    """c. backend.workers=local builds every rank in one process: a trainer of 2 ranks (data
    parallel) cannot run there; refused before any rank is built, naming both keys."""
    with pytest.raises(ConfigError) as info:
        check_local_backend(make_plan(placement), {role: cls})
    msg = str(info.value)
    assert msg.startswith("config key 'backend.workers'='local'") and "Fix: set backend=ray" in msg, msg
    assert all(k in msg for k in keys) and len(msg.splitlines()) == 1, msg
    check_local_backend(make_plan(placement), {role: Free} if cls is Lockstep else {})  # one rank each: fine


def test_local_cluster_smaller_than_the_plan_is_refused_before_it_starts():
    """d. plan.launch=true with cluster.simulate_gpus below what the plan reserves."""
    with pytest.raises(ConfigError, match=r"^config key 'cluster.simulate_gpus'=1 .* reserves 4\. Fix: set "
                                          r"cluster.simulate_gpus=4"):
        check_local_size(ClusterConfig(simulate_gpus=1), {"GPU": 4.0, "CPU": 0.0})
    with pytest.raises(ConfigError, match=r"^config key 'cluster.num_cpus'=2 .*Fix: "):
        check_local_size(ClusterConfig(num_cpus=2), {"GPU": 0.0, "CPU": 3.0})
    check_local_size(ClusterConfig(simulate_gpus=4), {"GPU": 4.0})


def test_plan_cli_reports_a_cluster_that_cannot_hold_the_plan_in_one_line(monkeypatch, tmp_path, capsys):
    """d. A joined cluster too small for the plan (PlacementError) ends in one line, exit 2."""
    def too_small(*args, **kwargs):
        raise PlacementError("config key 'placement' plans node 0, which needs {'GPU': 4.0}, but no unused alive "
                             "node has it. Fix: give the roles fewer devices")

    monkeypatch.setattr(plan_cli, "launch_report", too_small)
    assert planned(["placement.train.gpus=2", "placement.rollout.gpus=2", "plan.launch=true"], tmp_path, None) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: config key 'placement' plans node 0") and len(err.splitlines()) == 1, err


def test_bare_device_groups_name_their_own_keys():
    """RayHelper.initialize(device_groups) gets keys as the user wrote them, without 'placement.'."""
    from orchestration.decorators import plan_device_groups

    with pytest.raises(PlanError, match=r"^config key 'device_groups.g.ranks'=\[0, 0\] lists a rank twice"):
        plan_device_groups({"nproc_per_node": 2, "g": {"ranks": [0, 0], "workers": ["m"]}})
