"""Every shipped YAML composes and validates; ms-swift files load; the plan CLI runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from orchestration.config import (ConfigError, PlanConfig, apply_placement, placement_dict, read_config_file,
                                  register_schema, split_config_file, validate)
from orchestration.planner import make_plan

CONF = Path(__file__).resolve().parent.parent / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
PLACEMENTS = sorted(p.stem for p in (CONF / "placement").glob("*.yaml") if p.stem != "empty")


def compose_plan_config(overrides):
    register_schema(PlanConfig)
    with initialize_config_module(config_module="conf", version_base=None):
        return compose(config_name="config", overrides=overrides)


# Words naming a driver in an experiment's file name or header comment.
DRIVER_WORDS = {"sft": ("sft",), "grpo": ("grpo",), "gkd": ("gkd",), "distill": ("distill", "sampling")}


def test_every_experiment_names_a_driver_that_runs_it():
    """Each shipped experiment is listed with its driver in tests/test_experiments_run.py (which
    runs it for one step), the driver module has validate/run/main, and the file's name or
    header comment names that driver."""
    import importlib

    from tests.test_experiments_run import EXPERIMENTS as RUN

    assert sorted(RUN) == EXPERIMENTS, "list a new experiment in tests/test_experiments_run.EXPERIMENTS"
    for name, (driver, workers, _) in RUN.items():
        module = importlib.import_module(f"algorithms.{driver}")
        assert all(callable(getattr(module, f, None)) for f in ("validate", "run", "main")), driver
        assert workers in ("local", "ray"), name
        header = (CONF / "experiment" / f"{name}.yaml").read_text().split("defaults:")[0].lower()
        assert any(w in name or w in header for w in DRIVER_WORDS[driver]), f"{name} does not name {driver}"


def test_shipped_placements_exist():
    assert {"colocate", "separate"} <= set(PLACEMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_validates_and_plans(name):
    cfg = compose_plan_config([f"+experiment={name}"])
    typed = validate(cfg, PlanConfig)
    plan = make_plan(placement_dict(typed))
    assert plan.roles
    # Experiments that run on a CPU machine simulate exactly the GPUs their plan needs.
    if typed.cluster.simulate_gpus is not None:
        assert typed.cluster.simulate_gpus == plan.demand()["GPU"]


@pytest.mark.parametrize("name", PLACEMENTS)
def test_every_placement_option_composes(name):
    typed = validate(compose_plan_config([f"placement={name}"]), PlanConfig)
    assert make_plan(placement_dict(typed)).roles


def test_every_yaml_field_has_a_comment_above():
    for path in CONF.rglob("*.yaml"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            if not stripped or stripped.startswith(("#", "-")) or stripped == "{}" or ":" not in stripped:
                continue
            if stripped.startswith("defaults:"):
                continue
            above = lines[i - 1].strip() if i else ""
            assert above.startswith("#"), f"{path.relative_to(CONF)}:{i + 1} '{stripped}' has no comment above it"


def test_unknown_key_and_wrong_type_name_the_key():
    with pytest.raises(ConfigError, match="'placement.train.gpuz'"):
        validate({"placement": {"train": {"gpuz": 1}}}, PlanConfig)
    with pytest.raises(ConfigError, match="'cluster.simulate_gpus'"):
        validate({"cluster": {"simulate_gpus": "many"}}, PlanConfig)
    with pytest.raises(ConfigError, match="backend=local"):
        validate({"backend": {"workers": "threads"}}, PlanConfig)


@pytest.mark.parametrize("args, message", [
    (["trainer.lrr=1"], "config key 'trainer.lrr'=1 is not a key of 'trainer' (did you mean 'trainer.lr'?). Fix:"),
    (["run.steps=3", "traner.lr=1"], "config key 'traner.lr'=1 is not a key of the config (did you mean 'trainer'?)."),
    (["placement.train.gpuz=2"], "(did you mean 'placement.train.gpus'?)"),
    (["algorithm.zzz=1"], "config key 'algorithm.zzz'=1 is not a key of 'algorithm'. Fix: use a key of SFTConfig"),
    # a group choice without its file (Hydra's own message spans several lines)
    (["model=tiny_lama"], "config key 'model'=tiny_lama names no file conf/model/tiny_lama.yaml (did you mean "
                          "model=tiny_llama?). Fix: use one of ['nano_qwen2',"),
    (["+experiment=sft_quickstar"], "(did you mean +experiment=sft_quickstart?)"),
    (["placement=nowhere"], "config key 'placement'=nowhere names no file conf/placement/nowhere.yaml. Fix: use one "
                            "of ['colocate', 'empty', 'separate']"),
    # group choices, appended and deleted keys, Hydra's own, lists, free-form values and flags pass
    (["placement=separate", "backend=local", "model=tiny_llama", "+experiment=sft_quickstart", "+new.key=1",
      "~trainer.betas", "hydra.run.dir=.", "hydra/job_logging=none", "trainer.betas.0=0.5", "--cfg", "job",
      "-m", "trainer.lr=1e-3,1e-4", "placement.train.gpus=2", "config_file=x.yaml", "run.loggers=[jsonl]"], None),
])
def test_an_unknown_command_line_key_names_the_nearest_one(args, message):
    from algorithms.sft import SFTConfig
    from orchestration.config import unknown_override

    problem = unknown_override(args, SFTConfig)
    assert problem == message if message is None else message in problem


MS_SWIFT_MEGATRON = """
rlhf_type: gkd
model: Qwen/Qwen3-0.6B
teacher_model: Qwen/Qwen3-8B
beta: 0.5
lmbda: 0.5
colocate_groups: [[train, rollout]]
offload_model: true
offload_optimizer: true
offload_teacher_model: true
sleep_level: 1
gkd_logits_topk: 64
train: {gpus: 4}
rollout: {gpus: 4}
"""
MS_SWIFT_SAMPLING = """
sampler_type: sample
num_return_sequences: 8
device_groups:
  nproc_per_node: 4
  sample_group:
    device: GPU
    ranks: list(range(0, 2))
    workers:
      - sampler
  rm_group:
    device: CPU
    ranks: 2
    workers:
      - prm
      - orm
"""


def _with_file(tmp_path, text):
    path = tmp_path / "swift.yaml"
    path.write_text(text)
    return OmegaConf.merge(OmegaConf.structured(PlanConfig), {"config_file": str(path)})


def test_ms_swift_megatron_file_gives_its_placement(tmp_path):
    cfg = _with_file(tmp_path, MS_SWIFT_MEGATRON)
    placement, items = split_config_file(read_config_file(cfg.config_file))
    assert apply_placement(cfg, placement)
    plan = make_plan(placement_dict(cfg))
    assert plan["teacher"].colocated_with == ("train", "rollout")
    # Top-k is a loss setting, not a placement: the driver's key table maps it (algorithm.logits_topk).
    assert ("gkd_logits_topk", "gkd_logits_topk", 64) in items


def test_ms_swift_file_replaces_the_composed_placement(tmp_path):
    cfg = compose_plan_config(["placement=colocate"])
    cfg = validate(cfg, PlanConfig)
    cfg.config_file = str(tmp_path / "swift.yaml")
    Path(cfg.config_file).write_text(MS_SWIFT_SAMPLING)
    assert apply_placement(cfg, split_config_file(read_config_file(cfg.config_file))[0])
    plan = make_plan(placement_dict(cfg))
    assert set(plan.roles) == {"sampler", "prm", "orm"} and plan["prm"].device == "CPU"


def test_bad_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config_file.*cannot be read"):
        read_config_file(str(tmp_path / "nope.yaml"))
    cfg = _with_file(tmp_path, "train: {gpus: [1, 2]}\n")
    with pytest.raises(ConfigError, match="train.gpus"):
        apply_placement(cfg, read_config_file(cfg.config_file))


def run_cli(*args, timeout=120):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", "orchestration.plan", "hydra/job_logging=none",
                           "hydra/hydra_logging=none", "hydra.run.dir=.", "hydra.output_subdir=null", *args],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=Path(__file__).resolve().parent.parent)


def test_plan_cli_json():
    out = run_cli("+experiment=sampling_device_groups", "plan.json=true")
    assert out.returncode == 0, out.stderr
    rows = {r["role"]: r for r in json.loads(out.stdout)}
    assert rows["sampler"]["device"] == "GPU" and rows["sampler"]["ranks"] == [0, 1]
    assert rows["prm"]["colocated_with"] == ["orm"] and rows["orm"]["device"] == "CPU"
    assert all({"role", "device", "ranks", "nodes", "colocated_with"} <= set(r) for r in rows.values())


def test_plan_cli_table_and_error(tmp_path):
    out = run_cli("+experiment=gkd_teacher_group")
    assert out.returncode == 0, out.stderr
    assert "teacher  GPU     4,5" in out.stdout
    bad = run_cli("placement=colocate", "placement.rollout.gpus=2")
    assert bad.returncode == 2 and "colocated roles need equal device counts" in bad.stderr
    typo = run_cli("plan.jsn=true")  # refused before Hydra composes, with the nearest key
    assert typo.returncode == 2 and typo.stderr.strip() == (
        "error: config key 'plan.jsn'=true is not a key of 'plan' (did you mean 'plan.json'?). Fix: use a key of "
        "PlanConfig (python -m <driver> --cfg job lists them)")
    path = tmp_path / "swift.yaml"
    path.write_text(MS_SWIFT_MEGATRON)
    out = run_cli(f"config_file={path}")
    assert out.returncode == 0 and "teacher" in out.stdout and "not used here" in out.stderr


# A command starting its own local Ray cluster runs in CI in test_cleanup (a killed driver) and
# test_swift_args (`rayroles run` of the teacher-group file).
@pytest.mark.slow
def test_plan_cli_launch_places_on_a_fresh_local_cluster():
    """The quickstart's second command, end to end in its own process and Ray cluster."""
    out = run_cli("+experiment=gkd_colocated_teacher", "plan.launch=true", "placement.train.gpus=1",
                  "placement.rollout.gpus=1", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    placed = [line.split() for line in out.stdout.splitlines()
              if line.split() and line.split()[0] in ("train", "rollout", "teacher") and len(line.split()) == 7]
    by_role = {}
    for role, rank, _node, _nid, devices, _pid, ip in placed:
        by_role.setdefault(role, {})[int(rank)] = devices
        assert ip == "127.0.0.1"  # a driver's local cluster stays on loopback
    assert by_role["train"] == by_role["rollout"] == by_role["teacher"] == {0: "0"}


DRIVER_SCHEMAS = {"sft": ("algorithms.sft", "SFTConfig"), "gkd": ("algorithms.gkd", "GKDConfig"),
                  "grpo": ("algorithms.grpo", "GRPOConfig"), "distill": ("algorithms.distill", "DistillConfig")}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_validates_against_its_driver(name):
    """Driver experiments (<driver>_quickstart, ...) pass the driver's own checks; layout-only
    experiments pass the common run schema."""
    import importlib

    from algorithms.config.schema import DriverConfig, prepare

    prefix = name.split("_")[0]
    schema = DriverConfig
    if prefix in DRIVER_SCHEMAS and not name.endswith(("_colocate", "_separate", "_two_nodes")):
        module, cls = DRIVER_SCHEMAS[prefix]
        schema = getattr(importlib.import_module(module), cls)
    register_schema(schema)
    with initialize_config_module(config_module="conf", version_base=None):
        cfg = compose(config_name="config", overrides=[f"+experiment={name}"])
    typed, plan = prepare(cfg, schema)
    assert plan.roles and typed.run.steps >= 1


def test_sft_phase_keeps_the_runs_engine_sections():
    """GRPO's warm start and distill's SFT run with the run's engines and their options (a
    phase built from a few sections ran Megatron at TP=1 under a TP=2 run)."""
    from algorithms.config.schema import LoopConfig
    from algorithms.sft import phase_config
    from algorithms.grpo import GRPOConfig

    run = GRPOConfig()
    run.backend.train, run.megatron.tensor_parallel_size, run.deepspeed.zero_stage = "megatron", 2, 3
    run.weight_sync.bucket_mb = 8.0
    phase = phase_config(run, run=LoopConfig(steps=3))
    assert phase.backend.train == "megatron" and phase.megatron.tensor_parallel_size == 2
    assert phase.deepspeed.zero_stage == 3 and phase.weight_sync.bucket_mb == 8.0
    assert phase.run.steps == 3 and type(phase.algorithm).__name__ == "SFTAlgorithm"


def test_command_line_wins_over_the_config_file(tmp_path, capsys):
    """A config_file value silently beat the command line (a regression): the file's keys
    apply, then the command line's overrides of the same keys are put back."""
    from algorithms.gkd import GKDConfig
    from algorithms.config.schema import prepare

    path = tmp_path / "swift.yaml"
    path.write_text("max_steps: 7\nlearning_rate: 1.0e-3\nbeta: 0.25\nlmbda: 0.5\n"
                    "colocate_groups: [[train, rollout]]\nsleep_level: 1\nteacher_model: tiny_llama\n"
                    "train: {gpus: 1}\nrollout: {gpus: 1}\n")
    cli = [f"config_file={path}", "run.steps=3", "placement.sleep_level=2", "trainer.weight_decay=0.1"]
    register_schema(GKDConfig)
    with initialize_config_module(config_module="conf", version_base=None):
        cfg = compose(config_name="config", overrides=cli)
    typed, plan = prepare(cfg, GKDConfig, cli=cli)
    assert typed.run.steps == 3 and plan["rollout"].sleep_level == 2  # the command line's
    assert typed.trainer.lr == 1e-3 and typed.algorithm.beta == 0.25 and typed.algorithm.lmbda == 0.5  # the file's
    assert typed.trainer.weight_decay == 0.1 and plan["teacher"].model == "tiny_llama"
    assert "run.steps" in capsys.readouterr().out


def test_an_old_key_on_the_command_line_is_read_as_its_new_key(capsys):
    from algorithms.config.schema import renamed

    assert renamed(["x", "+placement.gkd_logits_topk=8", "run.steps=1", "placement.gkd_logits_topk=null"]) == [
        "x", "algorithm.logits_topk=8", "run.steps=1", "algorithm.logits_topk=null"]
    assert "placement.gkd_logits_topk is now algorithm.logits_topk" in capsys.readouterr().out


def test_the_schedule_spans_every_optimizer_update_of_the_run():
    """prepare derives trainer.total_steps (and warmup_ratio's steps) from the run's optimizer
    updates: one a step, GRPO's steps_per_generation a step."""
    from algorithms.grpo import GRPOConfig
    from algorithms.sft import SFTConfig
    from tests.driver_helpers import prepared

    _, sft_cfg, _ = prepared(SFTConfig, ["+experiment=sft_quickstart", "run.steps=10", "trainer.warmup_ratio=0.1"])
    assert (sft_cfg.trainer.total_steps, sft_cfg.trainer.warmup_steps) == (10, 1)
    _, grpo_cfg, _ = prepared(GRPOConfig, ["+experiment=grpo_quickstart", "run.steps=10",
                                           "algorithm.steps_per_generation=3", "trainer.warmup_ratio=0.1"])
    assert (grpo_cfg.trainer.total_steps, grpo_cfg.trainer.warmup_steps) == (30, 3)
