"""Every shipped experiment (conf/experiment/*.yaml) validates as shipped on a CPU machine and
runs one step with its driver's real validate() and run(), shrunk to a tiny model and data.

The two-node layout and the distill quickstart's device groups run on the session's Ray
cluster; the others run in-process (backend.workers=local). Separate groups, a standalone
teacher group and sampling device groups run on Ray in test_overlap.py, test_restarts.py,
test_swift_args.py (the gkd_teacher_group file) and test_distill.py (in `make test-all`). Every layout keeps its
form with one rank per group, GPU experiments run a CPU-sized model in fp32.
"""
import importlib

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from algorithms.config.schema import prepare
from algorithms.records.trackers import read_metrics
from orchestration.config import register_schema

pytestmark = pytest.mark.usefixtures("one_thread")

# Driver module (algorithms.<driver>) -> its typed schema, as its main() uses it.
DRIVERS = {"sft": "SFTConfig", "grpo": "GRPOConfig", "gkd": "GKDConfig", "distill": "DistillConfig"}
# Every shipped experiment: the driver it is written for (its name or its header comment says
# which), where its one-step run places the roles, and the overrides that shrink its layout.
# Layouts keep their form (colocated, separate, two nodes, a standalone teacher group, a GPU
# group beside a CPU group) with one rank per group: each Ray actor costs seconds to start,
# and in-process a trainer has one rank.
ONE_RANK = ["placement.train.gpus=1", "placement.rollout.gpus=1"]
EXPERIMENTS = {
    "sft_quickstart": ("sft", "local", []),
    "grpo_quickstart": ("grpo", "local", []),
    "grpo_multi_turn": ("grpo", "local", []),
    "grpo_gpu": ("grpo", "local", []),
    "grpo_gpu_async": ("grpo", "local", []),
    "grpo_colocate": ("grpo", "local", ONE_RANK),
    "grpo_separate": ("grpo", "local", ONE_RANK),
    "grpo_two_nodes": ("grpo", "ray", ONE_RANK + ["placement.nproc_per_node=1"]),
    "gkd_quickstart": ("gkd", "local", []),
    "gkd_gpu": ("gkd", "local", []),
    "gkd_colocated_teacher": ("gkd", "local", ONE_RANK),
    "gkd_teacher_group": ("gkd", "local", ONE_RANK + ["placement.teacher.gpus=1"]),
    "grpo_gpu_colocate_2gpu": ("grpo", "local", ONE_RANK),
    "grpo_gpu_separate_2gpu": ("grpo", "local", []),  # on Ray in tests/test_multi_gpu.py (--simulate)
    "gkd_gpu_colocate_2gpu": ("gkd", "local", ONE_RANK),
    "gkd_gpu_separate_2gpu": ("gkd", "local", []),
    "gkd_gpu_teacher_group_3gpu": ("gkd", "local", []),
    # Two steps: the second step's generation is sent while the first step is scored.
    "distill_quickstart": ("distill", "ray", ["placement.device_groups.rm_group.ranks=1", "run.steps=2"]),
    "sampling_device_groups": ("distill", "local", ["placement.device_groups.nproc_per_node=1",
                                                   "placement.device_groups.sample_group.ranks=[0]",
                                                   "placement.device_groups.rm_group.ranks=1"]),
}

# One step of a tiny model on a few examples, short generations, fp32 CPU engines.
TINY = ["run.steps=1", "run.prompts_per_step=4", "run.eval_every=0", "run.eval_max_new_tokens=4",
        "data.train_size=16", "data.eval_size=2", "model=nano_qwen2", "trainer.warmup_steps=0",
        "rollout.dtype=float32"]
TINY_BY_DRIVER = {
    "sft": [],
    "grpo": ["algorithm.num_generations=2", "algorithm.max_new_tokens=4", "algorithm.warmup_sft_batch=4",
             "algorithm.warmup_sft_examples=0"],
    "gkd": ["algorithm.max_new_tokens=4", "teacher.model=nano_qwen2", "teacher.warmup_batch=2",
            "teacher.engine.dtype=float32"],
    "distill": ["algorithm.num_return_sequences=2", "algorithm.n_best_to_keep=1", "algorithm.max_new_tokens=4",
                "algorithm.sft_batch=2"],
}
# Warm-up phases an experiment may switch on: kept on (one step) where it does, off where not.
WARMUPS = ("algorithm.warmup_sft_steps", "teacher.warmup_steps", "algorithm.sft_steps")


def driver_of(name):
    driver = EXPERIMENTS[name][0]
    module = importlib.import_module(f"algorithms.{driver}")
    return module, getattr(module, DRIVERS[driver])


def compose_experiment(name, overrides=()):
    _, schema = driver_of(name)
    register_schema(schema)
    with initialize_config_module(config_module="conf", version_base=None):
        return compose(config_name="config", overrides=[f"+experiment={name}", *overrides])


def tiny_overrides(name, tmp_path):
    driver, workers, layout = EXPERIMENTS[name]
    shipped = compose_experiment(name)
    overrides = [*TINY, *TINY_BY_DRIVER[driver], f"backend.workers={workers}", *layout]
    for key in WARMUPS:
        if (OmegaConf.select(shipped, key) or 0) > 1:
            overrides.append(f"{key}=1")
    # A teacher named by the placement is replaced by a small preset sharing the student's vocabulary.
    for key in ("placement.teacher_model", "placement.teacher.model"):
        if OmegaConf.select(shipped, key) is not None:
            overrides.append(f"{key}=nano_qwen2")
    if driver == "gkd":
        overrides.append(f"teacher.cache_dir={tmp_path / 'teachers'}")
    return overrides


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_experiment_validates_as_shipped(name):
    """What `python -m algorithms.<driver> +experiment=NAME` checks before starting, on this
    CPU machine (GPU layouts are simulated)."""
    module, schema = driver_of(name)
    typed, plan = prepare(compose_experiment(name), schema)
    module.validate(typed, plan)


def layout_form(plan):
    """What a shrunk layout keeps of the shipped one: per role its device kind, the roles it
    shares devices with, and the nodes it spans."""
    return {role: (p.device, p.colocated_with, sorted(set(p.nodes))) for role, p in plan.roles.items()}


def run_one_step(name, tmp_path):
    module, schema = driver_of(name)
    cfg = compose_experiment(name, tiny_overrides(name, tmp_path))
    typed, plan = prepare(cfg, schema)
    assert layout_form(plan) == layout_form(prepare(compose_experiment(name), schema)[1])
    module.validate(typed, plan)
    module.run(typed, plan, tmp_path / "run")
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(typed.run.steps + 1))


@pytest.mark.parametrize("name", sorted(n for n, (_, workers, _) in EXPERIMENTS.items() if workers == "local"))
def test_experiment_runs_one_step_in_process(name, tmp_path):
    run_one_step(name, tmp_path)


@pytest.mark.parametrize("name", sorted(n for n, (_, workers, _) in EXPERIMENTS.items() if workers == "ray"))
def test_experiment_runs_one_step_on_ray(name, tmp_path, ray_cluster):
    run_one_step(name, tmp_path)
