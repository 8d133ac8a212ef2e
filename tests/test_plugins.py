"""ms-swift plugin files (external_plugins): a plugin written for ms-swift, its import line
changed to algorithms.plugins, registers rewards that reward_funcs and orm_model name; they are
called with the completions and the rows' columns, in the driver and in the ORM role."""
from __future__ import annotations

import textwrap

import pytest
import yaml
from omegaconf import OmegaConf

from algorithms.cli import write_example
from algorithms.config.schema import prepare
from algorithms.config.swift_keys import translate
from algorithms.config.swift_values import SWIFT_FORMAT
from algorithms.distill import DistillConfig
from algorithms.grpo import GRPOConfig
from algorithms.objectives.rewards import Rewards, reward_specs
from algorithms.records.trackers import read_metrics
from orchestration.config import ConfigError
from orchestration.launch import driver_group
from roles.orm import ORM

# ms-swift's examples/train/grpo/plugin/plugin.py: CountdownORM and MultiModalAccuracyORM as
# written there (math_verify, not installed here, left out), with the import line changed.
PLUGIN = textwrap.dedent('''
    import re
    from typing import List

    from algorithms.plugins import ORM, orms


    class CountdownORM(ORM):

        def __call__(self, completions, target, nums, **kwargs) -> List[float]:
            rewards = []
            for completion, gt, numbers in zip(completions, target, nums):
                try:
                    match = re.search(r'<answer>(.*?)<\\/answer>', completion)
                    if match is None:
                        rewards.append(0.0)
                        continue
                    equation = match.group(1).strip()
                    if '=' in equation:
                        equation = equation.split('=')[0]
                    used_numbers = [int(n) for n in re.findall(r'\\d+', equation)]
                    if sorted(used_numbers) != sorted(numbers):
                        rewards.append(0.0)
                        continue
                    allowed_pattern = r'^[\\d+\\-*/().\\s]+$'
                    if not re.match(allowed_pattern, equation):
                        rewards.append(0.0)
                        continue
                    result = eval(equation, {'__builtins__': None}, {})
                    rewards.append(1.0 if abs(float(result) - float(gt)) < 1e-5 else 0.0)
                except Exception:
                    rewards.append(0.0)
            return rewards


    orms['external_countdown'] = CountdownORM


    class MultiModalAccuracyORM(ORM):

        def __call__(self, completions, solution, **kwargs) -> List[float]:
            rewards = []
            for content, sol in zip(completions, solution):
                reward = 0.0
                sol_match = re.search(r'<answer>(.*?)</answer>', sol)
                ground_truth = sol_match.group(1).strip() if sol_match else sol.strip()
                content_match = re.search(r'<answer>(.*?)</answer>', content)
                student_answer = content_match.group(1).strip() if content_match else content.strip()
                if student_answer == ground_truth:
                    reward = 1.0
                rewards.append(reward)
            return rewards


    orms['external_r1v_acc'] = MultiModalAccuracyORM
''')


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "plugin.py"
    path.write_text(PLUGIN)
    return str(path)


def test_reward_names_resolve_to_the_plugin_and_to_ms_swift_builtins(plugin):
    file = {"external_plugins": plugin, "reward_funcs": ["external_r1v_acc", "format", "accuracy"]}
    _, out, _ = translate(file, "grpo", OmegaConf.structured(GRPOConfig))
    assert out["algorithm.reward_funcs"] == [f"{plugin}:external_r1v_acc", "format", "accuracy"]
    assert out["algorithm.format_pattern"] == SWIFT_FORMAT  # ms-swift's format: <think>/<answer> tags
    fmt = ORM(kind="format", format_pattern=SWIFT_FORMAT)
    assert fmt.score(["p"] * 3, ["<think>a\nb</think>\n<answer>4</answer>", "x<think>a</think><answer>4</answer>",
                                 "<think>a</think><answer>4</answer>\nmore"]) == [1.0, 0.0, 0.0]


def test_a_file_without_reward_funcs_has_no_rewards_and_grpo_refuses_it(plugin):
    _, out, _ = translate({"rlhf_type": "grpo", "num_generations": 4}, "grpo", OmegaConf.structured(GRPOConfig))
    assert out["algorithm.reward_funcs"] == []
    typed = OmegaConf.structured(GRPOConfig)
    OmegaConf.update(typed, "algorithm.reward_funcs", out["algorithm.reward_funcs"], merge=False)
    from algorithms import grpo
    from orchestration.planner import make_plan
    with pytest.raises(ConfigError, match="algorithm.reward_funcs") as e:
        grpo.validate(OmegaConf.to_object(typed), make_plan({"colocate_groups": [["train", "rollout"]],
                                                             "train": {"gpus": 1}, "rollout": {"gpus": 1}}))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, message", [("raise RuntimeError('boom')\n", "(line 1): RuntimeError: boom"),
                                           ("from swift.rewards import ORM\n", "No module named 'swift'")])
def test_a_plugin_that_fails_to_import_is_named_before_start(tmp_path, text, message):
    bad = tmp_path / "bad_plugin.py"
    bad.write_text(text)
    with pytest.raises(ConfigError) as e:
        translate({"external_plugins": [str(bad)], "reward_funcs": ["format"]}, "grpo",
                  OmegaConf.structured(GRPOConfig))
    assert str(bad) in str(e.value) and message in str(e.value)
    with pytest.raises(ConfigError, match="registered by no file of external_plugins"):
        translate({"reward_funcs": ["external_countdown"]}, "grpo", OmegaConf.structured(GRPOConfig))


def test_countdown_gets_the_rows_columns_in_the_driver_and_the_orm_role(plugin):
    algo = GRPOConfig().algorithm
    algo.reward_funcs = [f"{plugin}:external_countdown"]
    specs = reward_specs(algo)
    assert specs[0][3] == {"kind": "plugin", "plugin": f"{plugin}:external_countdown"}
    rows = [{"target": 24, "nums": [3, 8, 1]}, {"target": 24, "nums": [3, 8, 1]}, {"target": 10, "nums": [5, 2]}]
    texts = ["<answer>3*8*1</answer>", "<answer>3*8+1</answer>", "<answer>5*2</answer>"]
    local = Rewards(specs, {})
    try:
        scores, means = local.score(["p"] * 3, texts, ["24", "24", "10"], rows)
    finally:
        local.shutdown()
    assert scores.tolist() == [1.0, 0.0, 1.0] and means == {"external_countdown": pytest.approx(2 / 3)}
    # The orm role imports the file in its own process (on Ray: another process) from its config.
    group = driver_group(ORM, {"config": specs[0][3]}, "orm")
    try:
        role = Rewards(specs, {"orm": group})
        assert role.score(["p"] * 3, texts, ["24", "24", "10"], rows)[0].tolist() == [1.0, 0.0, 1.0]
    finally:
        group.shutdown()


def test_the_reference_is_the_solution_when_rows_carry_none(plugin):
    orm = ORM(kind="plugin", plugin=f"{plugin}:external_r1v_acc")
    assert orm.score(["p", "p"], ["<answer>25</answer>", "26"], ["25", "<answer>25</answer>"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="registers no reward 'nope'"):
        ORM(kind="plugin", plugin=f"{plugin}:nope")


def test_orm_model_names_a_plugin_or_math(plugin):
    cfg = OmegaConf.structured(DistillConfig)
    _, out, _ = translate({"external_plugins": [plugin], "orm_model": "external_r1v_acc"}, "distill", cfg)
    assert out == {"orm.kind": "plugin", "orm.plugin": f"{plugin}:external_r1v_acc"}
    _, out, _ = translate({"orm_model": "math"}, "distill", cfg)
    math = ORM(kind=out["orm.kind"])
    assert math.score(["p"] * 2, [r"so \boxed{7}", r"\boxed{8}"], [r"\boxed{7}", "7"]) == [1.0, 0.0]


def test_a_grpo_run_scores_with_the_plugin_and_ms_swift_format(plugin, tmp_path, monkeypatch):
    """ms-swift's reward_funcs [external_r1v_acc, format] with the plugin file, in one GRPO run."""
    from tests.driver_helpers import composed
    from algorithms import grpo

    example = write_example(str(tmp_path / "example"))
    monkeypatch.chdir(example)
    file = yaml.safe_load((example / "grpo_colocate.yaml").read_text())
    file.update(external_plugins=plugin, reward_funcs=["external_r1v_acc", "format"])
    (example / "plugin_run.yaml").write_text(yaml.safe_dump(file))
    overrides = ["config_file=plugin_run.yaml", "run.steps=1", "backend.workers=local"]
    typed, plan = prepare(composed(GRPOConfig, overrides), GRPOConfig, cli=overrides)
    grpo.validate(typed, plan)
    grpo.run(typed, plan, tmp_path / "run")
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert {"reward/external_r1v_acc", "reward/format"} <= set(last)
    assert 0.0 <= last["reward/external_r1v_acc"] <= 1.0
