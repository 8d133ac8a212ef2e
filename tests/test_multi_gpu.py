"""Several GPUs of one host: where each rank runs, NCCL weight sync between GPUs, separate
placement on distinct devices (marked multi_gpu: skipped unless torch sees 2+ CUDA devices;
run them alone, `pytest -m multi_gpu tests/test_multi_gpu.py`, as they start a cluster of the
host's real GPUs). On any machine: the multi-GPU experiments' layouts, the variables that
switch NVLink multicast off in every process, and benchmarks/multi_gpu.py's --simulate path."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from orchestration.cluster import NO_MULTICAST_ENV, job_runtime_env
from orchestration.config import PlanConfig, placement_dict, register_schema, validate
from orchestration.planner import make_plan

REPO = Path(__file__).resolve().parent.parent


def plan_of(experiment: str):
    register_schema(PlanConfig)
    with initialize_config_module(config_module="conf", version_base=None):
        cfg = compose(config_name="config", overrides=[f"+experiment={experiment}"])
    return make_plan(placement_dict(validate(cfg, PlanConfig)))


# ----------------------------------------------------------------------------- any machine

@pytest.mark.parametrize("experiment, ranks", [
    ("grpo_gpu_colocate_2gpu", {"train": (0, 1), "rollout": (0, 1)}),
    ("grpo_gpu_separate_2gpu", {"train": (0,), "rollout": (1,)}),
    ("gkd_gpu_colocate_2gpu", {"train": (0, 1), "rollout": (0, 1), "teacher": (0, 1)}),
    ("gkd_gpu_separate_2gpu", {"train": (0,), "rollout": (1,), "teacher": (0,)}),
    ("gkd_gpu_teacher_group_3gpu", {"train": (0,), "rollout": (1,), "teacher": (2,)}),
])
def test_multi_gpu_experiments_place_roles_on_the_gpus_they_name(experiment, ranks):
    plan = plan_of(experiment)
    assert {role: p.ranks for role, p in plan.roles.items()} == ranks
    assert all(p.device == "GPU" and set(p.nodes) == {0} for p in plan.roles.values())
    assert plan.demand()["GPU"] == len({r for rs in ranks.values() for r in rs})


def test_job_runtime_env_leaves_the_submitted_jobs_own_variables(monkeypatch):
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    env = dict(NO_MULTICAST_ENV)
    monkeypatch.delenv(RAY_JOB_CONFIG_JSON_ENV_VAR, raising=False)
    assert job_runtime_env(env) == {"env_vars": env}
    # `ray job submit --runtime-env-json` set one of them: Ray would refuse the driver setting it again.
    job = {"runtime_env": {"env_vars": {"NCCL_NVLS_ENABLE": "1"}}}
    monkeypatch.setenv(RAY_JOB_CONFIG_JSON_ENV_VAR, json.dumps(job))
    assert job_runtime_env(env) == {"env_vars": {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}}


# Run in a fresh process: a cluster started without the variables (as `ray start` on another
# shell would) that init_cluster joins. A local cluster's workers: tests/test_cleanup.py's driver.
ENV_SCRIPT = """
import json, os, ray
from ray.cluster_utils import Cluster
from orchestration.cluster import NO_MULTICAST_ENV, init_cluster
from orchestration.config import ClusterConfig

@ray.remote(num_cpus=0)
def seen():
    return {k: os.environ.get(k) for k in NO_MULTICAST_ENV}

out = {}
cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, object_store_memory=128 * 2**20,
                                                            node_ip_address="127.0.0.1", include_dashboard=False))
os.environ["NCCL_NVLS_ENABLE"] = "2"  # exported by the user before the run: kept
init_cluster(ClusterConfig(address=cluster.address, log_to_driver=False))
out["joined"] = ray.get(seen.remote())
ray.shutdown()
cluster.shutdown()
print("RESULT", json.dumps(out))
"""


def test_no_multicast_variables_reach_ray_workers_of_a_joined_cluster():
    env = {k: v for k, v in os.environ.items() if k not in NO_MULTICAST_ENV and k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", ENV_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-4000:]
    seen = json.loads(line[len("RESULT "):])
    # The joined cluster's processes never had them: they came with the job's runtime env.
    assert seen["joined"] == {**NO_MULTICAST_ENV, "NCCL_NVLS_ENABLE": "2"}


def multi_gpu_module():
    """benchmarks/multi_gpu.py, imported (benchmarks/ is not a package)."""
    if "multi_gpu" in sys.modules:
        return sys.modules["multi_gpu"]
    spec = importlib.util.spec_from_file_location("multi_gpu", REPO / "benchmarks" / "multi_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_benchmark_refuses_runs_that_need_more_gpus_than_the_host_has():
    bench = multi_gpu_module()
    with pytest.raises(SystemExit, match="train megatron_dp2_tp2 needs 4.*--simulate N"):
        bench.main(["train", "--simulate", "2"])
    with pytest.raises(SystemExit, match="placement gkd teacher_group needs 3"):
        bench.main(["placement", "--simulate", "2", "--modes", "colocate", "teacher_group"])


def test_benchmark_simulated_on_cpu(ray_cluster, tmp_path, one_thread):
    """Every part of benchmarks/multi_gpu.py on simulated GPUs with a tiny model: GRPO colocated,
    separate with overlap and colocated with overlap, Megatron TP=2 against the torch reference,
    and gloo weight sync between two (simulated) GPUs. The GRPO runs are also the real runs of
    the overlap, of colocated turns and of overlap on shared devices: their metrics and
    timelines are checked as such."""
    bench = multi_gpu_module()
    res = bench.main(["all", "--simulate", "4", "--out", str(tmp_path), "--algorithms", "grpo", "--modes",
                      "colocate", "overlap", "colocate_overlap", "--steps", "3", "--no-plot", "--variants",
                      "megatron_tp2", "--train-steps", "2", "--layouts", "between_gpus", "--reps", "2"])
    colocate, overlap, shared = res["placement"]
    assert (colocate["mode"], overlap["mode"], shared["mode"]) == ("colocate", "overlap", "colocate_overlap")
    assert shared["ranks"] == colocate["ranks"] and shared["staleness_max"] == 1
    assert colocate["ranks"] == {"train": [0, 1], "rollout": [0, 1]} and overlap["ranks"] == {"train": [0],
                                                                                             "rollout": [1]}
    assert overlap["staleness_max"] == 1 and colocate["staleness_max"] == 0
    assert colocate["step_vs_colocate"] == 1.0 and overlap["step_vs_colocate"] > 0
    assert all(0 <= r[f"idle_{x}"] <= 1 for r in res["placement"] for x in ("train", "rollout"))
    torch_, tp2 = res["train"]
    assert torch_["variant"] == "torch" and tp2["variant"] == "megatron_tp2" and len(tp2["cuda_visible_devices"]) == 2
    assert len(set(tp2["cuda_visible_devices"])) == 2  # one (simulated) GPU per TP rank
    assert tp2["losses_match"] and len(tp2["losses"]) == 2 and tp2["loss_rel_diff_max"] < 1e-4
    (sync,) = res["sync"]
    assert sync["path"] == "collective" and sync["exact"] and sync["bytes"] > 0
    assert sync["cuda_visible_devices"][0] != sync["cuda_visible_devices"][1]
    table = (tmp_path / "table.md").read_text()
    assert "| overlap |" in table and "| megatron_tp2 | 2 |" in table and "| between_gpus | collective |" in table
    assert json.loads((tmp_path / "results.json").read_text())["host"] == {"gpus": 4, "simulated": True,
                                                                           "device": "cpu"}
    check_overlap_run(tmp_path / "grpo_overlap")
    check_colocated_run(tmp_path / "grpo_colocate")
    check_overlap_run(tmp_path / "grpo_colocate_overlap")  # on the devices the trainer uses


def check_overlap_run(run_dir: Path) -> None:
    """algorithm.max_staleness=1 on separate devices, or on shared ones where no role takes turns:
    generation of the next batch overlaps training, and nothing sleeps or offloads."""
    from algorithms.records.trackers import read_metrics
    from tests.test_overlap import spans

    records, timeline = read_metrics(run_dir / "metrics.jsonl"), read_metrics(run_dir / "timeline.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["staleness/max"] for r in records[1:]] == [0.0, 1.0, 1.0]
    for r in records[1:]:
        assert r["train/loss"] == r["train/loss"] and "time/wait_rollout" in r and r["rollout/generate_s"] > 0
        assert not any(k.startswith("move/") for k in r)  # nothing takes turns
    gen, train = spans(timeline, "rollout", "generate"), spans(timeline, "train", "train")
    assert gen[3][0] < train[2][1]  # batch 3 was started before training on batch 2 ended
    assert records[-1]["mem/train_rss_peak_bytes"] > 50 * 2**20 and records[-1]["mem/rollout_rss_bytes"] > 50 * 2**20


def check_colocated_run(run_dir: Path) -> None:
    """Trainer and rollout on the same devices take turns, offloading and sleeping between them."""
    from algorithms.records.trackers import read_metrics
    from tests.test_overlap import spans

    records, timeline = read_metrics(run_dir / "metrics.jsonl"), read_metrics(run_dir / "timeline.jsonl")
    step = records[2]
    # Trainer weights + AdamW moments go to host and back; the rollout's weights sleep and wake.
    assert step["move/train_offload_bytes"] > 2 * step["move/rollout_sleep_bytes"] > 0
    assert step["move/train_onload_bytes"] == step["move/train_offload_bytes"]
    assert step["move/rollout_wake_up_bytes"] == step["move/rollout_sleep_bytes"]
    assert all(step[f"move/{k}_s"] >= 0 for k in ("train_offload", "train_onload", "rollout_sleep", "rollout_wake_up"))
    for role in ("train", "rollout"):
        assert step[f"mem/{role}_rss_bytes"] > 50 * 2**20
        assert step[f"mem/{role}_rss_peak_bytes"] >= step[f"mem/{role}_rss_bytes"]
        assert step[f"mem/{role}_device_peak_bytes"] == 0  # no CUDA device here
    # Onload, offload, wake-up and sleep ride on the roles' calls (inside their phases; the move/
    # figures above show each ran): a step's phases are the calls themselves.
    for phase in ("generate", "train", "sync_weights"):
        assert f"time/{phase}" in step, phase
    # Colocated roles take turns: the rollout never generates while the trainer trains.
    gen, train = spans(timeline, "rollout", "generate"), spans(timeline, "train", "train")
    assert all(gen[k][1] <= train[k][0] for k in (1, 2, 3)) and all(train[k][1] <= gen[k + 1][0] for k in (1, 2))


# ----------------------------------------------------------------------------- several GPUs

class GpuProbe:
    """What a rank sees of its GPU after doing what the engines do (set_device(LOCAL_RANK))."""

    def __init__(self):
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))

    def seen(self) -> dict:
        return {"local_rank": int(os.environ["LOCAL_RANK"]), "visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "current": torch.cuda.current_device(), "count": torch.cuda.device_count(),
                "uuid": str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid),
                "env": {k: os.environ.get(k) for k in NO_MULTICAST_ENV}}


@pytest.fixture(scope="module")
def gpu_cluster():
    """A local cluster of this host's real GPUs (init_cluster, as the drivers start it)."""
    import ray

    from orchestration.cluster import init_cluster
    from orchestration.config import ClusterConfig

    if ray.is_initialized():
        pytest.fail("a Ray cluster (with simulated GPUs) already runs in this session; run the multi_gpu tests "
                    "alone: pytest -m multi_gpu tests/test_multi_gpu.py")
    init_cluster(ClusterConfig(simulate_missing_gpus=False, log_to_driver=False))
    assert ray.cluster_resources().get("GPU") == torch.cuda.device_count()
    # Physical GPU k (what Ray writes in CUDA_VISIBLE_DEVICES) -> its UUID, seen from here (all GPUs).
    yield {k: str(torch.cuda.get_device_properties(k).uuid) for k in range(torch.cuda.device_count())}
    ray.shutdown()


def groups(plan, roles: dict):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    place = create_placement(plan, 120)
    return place, {role: WorkerGroup(cls, plan[role], kwargs, placement=place, timeout_s=600)
                   for role, (cls, kwargs) in roles.items()}


@pytest.mark.multi_gpu
@pytest.mark.parametrize("experiment", ["grpo_gpu_colocate_2gpu", "grpo_gpu_separate_2gpu", "gkd_gpu_separate_2gpu"])
def test_every_rank_agrees_on_its_gpu(gpu_cluster, experiment):
    """LOCAL_RANK, CUDA_VISIBLE_DEVICES and torch.cuda.current_device() agree in every actor of
    the shipped layouts, each rank's device is the physical GPU the plan gives it, and the
    multicast switches are set everywhere."""
    plan = plan_of(experiment)
    place, started = groups(plan, {role: (GpuProbe, {}) for role in plan.roles})
    try:
        seen = {role: g.call("seen") for role, g in started.items()}
    finally:
        for g in started.values():
            g.shutdown()
        place.remove()
    for role, ranks in seen.items():
        for rank, s in enumerate(ranks):
            assert s["count"] == 1 and s["local_rank"] == s["current"] == 0, (role, rank, s)
            assert s["visible"] == str(plan[role].ranks[rank]), (role, rank, s)
            assert s["uuid"] == gpu_cluster[int(s["visible"])], (role, rank, s)
            assert s["env"] == NO_MULTICAST_ENV, (role, rank, s)
    uuids = {role: [s["uuid"] for s in ranks] for role, ranks in seen.items()}
    if plan["train"].colocated_with:
        assert uuids["train"] == uuids["rollout"] and len(set(uuids["train"])) == 2
    else:  # separate placement: trainer and rollout on different physical GPUs
        assert not set(uuids["train"]) & set(uuids["rollout"])
    if "teacher" in uuids:
        assert uuids["teacher"] == uuids["train"]  # gkd_gpu_separate_2gpu: the teacher beside the trainer


@pytest.mark.multi_gpu
def test_nccl_weight_sync_between_two_gpus_is_exact(gpu_cluster):
    """Trainer on GPU 0, rollout on GPU 1: `auto` picks the NCCL broadcast, and after a train
    step and a sync the rollout holds the trainer's weights bit for bit."""
    import torch.distributed  # noqa: F401  (NCCL must be built in)

    from orchestration.config import WeightSyncConfig
    from orchestration.weight_sync import WeightSync
    from tests.test_trainer import sft_batch

    bench = multi_gpu_module()
    ws = bench._benchmark("weight_sync")
    assert torch.distributed.is_nccl_available()
    plan = make_plan({"train": {"gpus": 1}, "rollout": {"gpus": 1}})
    kwargs = {"model": "tiny_qwen2", "config": {"device": "cuda", "dtype": "bfloat16"}}
    place, started = groups(plan, {"train": (ws.BenchTrainer, {**kwargs, "config": {**kwargs["config"], "lr": 1e-3}}),
                                   "rollout": (ws.BenchRollout, kwargs)})
    trainer, rollout = started["train"], started["rollout"]
    try:
        visible = [trainer.infos[0]["cuda_visible_devices"], rollout.infos[0]["cuda_visible_devices"]]
        trainer.call("train_step", sft_batch(8), dispatch="slice")
        sync = WeightSync(trainer, WeightSyncConfig(path="auto", checksum="full"))
        try:
            (record,) = sync.sync([rollout], version=1)
        finally:
            sync.close()
        want, got = trainer.call("fingerprint", execute="first"), rollout.call("fingerprint", execute="first")
    finally:
        trainer.shutdown(), rollout.shutdown()
        place.remove()
    assert visible[0] != visible[1]
    assert record.path == "collective" and record.bytes > 0
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name].to(got[name].dtype), got[name]), name
