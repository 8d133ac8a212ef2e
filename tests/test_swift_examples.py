"""ms-swift's own 11 Ray example YAMLs, as ms-swift ships them, with only their hub ids made local
(`rayroles example`: tiny stand-ins in a local hub cache, HF_HUB_CACHE pointing there).

Every file is prepared and checked as the driver's main does before anything starts; every
file that runs here runs two steps on the session's Ray cluster (simulated GPUs, its own
placement: 4 or 8 devices, colocated or separate). CI runs them with changes for time: the
torch engines in place of vLLM (`backend.rollout=torch`, `backend.teacher=torch`, and a rollout
replica of one rank where the file gives vLLM two) and completions of at most 16 new tokens (the
files allow up to 8192, and a random-weight stand-in rarely stops by itself), five of them under
the `slow` marker (SLOW_IN_CI); the `slow` tests also run every file exactly as written, vLLM
and lengths included.
"""
from __future__ import annotations

import importlib
import importlib.util

import pytest
import yaml

from algorithms.cli import driver_of
from algorithms.config.schema import prepare
from algorithms.config.swift_examples import EXAMPLE_FILES, write_swift_examples
from algorithms.records.trackers import read_metrics
from orchestration.config import ConfigError
from tests.driver_helpers import composed

SCHEMAS = {"sft": "SFTConfig", "grpo": "GRPOConfig", "gkd": "GKDConfig", "distill": "DistillConfig"}
# Files refused before start, with the one reason each is refused for.
REFUSED = {
    # An API model (qwen-max) through an OpenAI-compatible client: nothing here calls an external API.
    "examples/sampler/distill/distill.yaml": "sampler_engine",
}
RUNS = [name for name in EXAMPLE_FILES if name not in REFUSED]
# The frozen-lake file reports to swanlab, a tracker whose package is not among the pinned ones:
# without it the file is refused in one line naming the pip command, and runs reporting to jsonl.
FROZEN_LAKE = "examples/ray/grpo/multi_turn/frozen_lake_colocate.yaml"
NO_SWANLAB = importlib.util.find_spec("swanlab") is None


def trackers(name: str) -> list[str]:
    return ["run.loggers=[jsonl]"] if name == FROZEN_LAKE and NO_SWANLAB else []


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_swift_examples(tmp_path_factory.mktemp("swift_examples"))


@pytest.fixture
def in_example(example, monkeypatch):
    monkeypatch.chdir(example)
    monkeypatch.setenv("HF_HUB_CACHE", str(example / "hub"))
    return example


def prepared(name: str, overrides: list[str]):
    driver = driver_of(name)
    module = importlib.import_module(f"algorithms.{driver}")
    schema = getattr(module, SCHEMAS[driver])
    args = [f"config_file={name}", *overrides]
    typed, plan = prepare(composed(schema, args), schema, cli=args)
    module.validate(typed, plan)
    return module, typed, plan


def test_the_files_are_ms_swifts_own(example):
    """Each file holds ms-swift's keys and values (its hub ids included), unedited."""
    for name in EXAMPLE_FILES:
        data = yaml.safe_load((example / name).read_text())
        assert data.get("model"), name
        tuner = data.get("tuner_type") or (data.get("train") or {}).get("tuner_type")
        assert tuner in (None, "lora"), name
    gkd = yaml.safe_load((example / EXAMPLE_FILES[0]).read_text())
    assert gkd["model"] == "Qwen/Qwen3.5-2B" and gkd["teacher_model"] == "Qwen/Qwen3.5-4B"
    assert gkd["train"]["tensor_model_parallel_size"] == 2 and gkd["sequence_parallel"] is True
    assert gkd["dataset"] == ["AI-ModelScope/alpaca-gpt4-data-zh#2000", "AI-ModelScope/alpaca-gpt4-data-en#2000"]


@pytest.mark.parametrize("name", RUNS)
def test_each_file_is_read_and_checked_before_start(in_example, name):
    module, typed, plan = prepared(name, ["run.steps=2", *trackers(name)])
    assert typed.run.steps == 2
    assert str(in_example / "hub") in str(typed.model.path)


@pytest.mark.parametrize("name,key", sorted(REFUSED.items()))
def test_a_refused_file_names_its_one_reason(in_example, name, key):
    with pytest.raises(ConfigError) as refused:
        prepared(name, ["run.steps=2"])
    message = str(refused.value)
    # The file's other keys refused are the ones that only serve that one: named with it.
    problems = message.split("cannot honour: ", 1)[1].split(". Fix:")[0].split("; ")
    assert problems[0].startswith(key) and all(key in p for p in problems), message


@pytest.mark.skipif(not NO_SWANLAB, reason="swanlab is installed")
def test_a_tracker_whose_package_is_missing_is_named_with_its_install_line(in_example):
    with pytest.raises(ConfigError, match=r"'swanlab', which is not installed. Fix: pip install"):
        prepared(FROZEN_LAKE, ["run.steps=2"])


def run_two_steps(name: str, overrides: list[str], tmp_path):
    module, typed, plan = prepared(name, ["run.steps=2", *trackers(name), *overrides])
    module.run(typed, plan, tmp_path / "run")
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps[-1] == 2, steps


def torch_engines(name: str) -> list[str]:
    """CI's changes to a file: torch engines for the rollout and teacher (one rank per rollout
    replica: the torch rollout spans no tensor-parallel group) and short completions."""
    if driver_of(name) == "sft":
        return []
    rollout = yaml.safe_load(open(name)).get("rollout") or {}
    spans = ["placement.rollout.vllm_tensor_parallel_size=1"] if rollout.get("vllm_tensor_parallel_size", 1) > 1 else []
    teacher = ["backend.teacher=torch"] if driver_of(name) == "gkd" else []
    return ["backend.rollout=torch", *teacher, *spans, "algorithm.max_new_tokens=16"]


# Files whose run CI leaves to the `slow` tests, for time: each repeats a layout or a driver of a
# file CI runs (the separate rollout of ray_grpo_separate, the colocated GRPO and GKD of
# rollout_colocate_teacher_colocate), and OPD-RL and multi-turn runs of both drivers run in-process
# in tests/test_opd.py and tests/test_multi_turn.py.
SLOW_IN_CI = ("examples/ray/gkd/rollout_separate_teacher_colocate.yaml", "examples/ray/grpo/ray_grpo_colocate.yaml",
              "examples/ray/grpo/opd_rl_colocate.yaml", "examples/ray/gkd/multi_turn_colocate.yaml", FROZEN_LAKE)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_IN_CI else n for n in RUNS])
def test_each_file_runs_two_steps_on_ray(in_example, name, tmp_path, ray_cluster):
    run_two_steps(name, torch_engines(name), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_each_file_runs_two_steps_as_written(in_example, name, tmp_path, ray_cluster):
    run_two_steps(name, [], tmp_path)
