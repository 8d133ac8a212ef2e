"""The GRPO quickstart driver end to end on Ray actors with the production engines:
vLLM rollout + DeepSpeed trainer, and a tensor-parallel Megatron-core trainer
(`python -m algorithms.grpo +experiment=grpo_quickstart backend.rollout=vllm
backend.train=deepspeed`, its vLLM engine tensor-parallel over 2 ranks, and the Megatron
variant), with tiny overrides."""
import math

import pytest

from algorithms import grpo
from tests.driver_helpers import prepared

pytest.importorskip("deepspeed")
pytest.importorskip("megatron.core")

TINY_GRPO = ["+experiment=grpo_quickstart", "run.steps=2", "run.prompts_per_step=4", "data.train_size=32",
             "data.eval_size=4", "run.eval_max_new_tokens=12", "algorithm.num_generations=4",
             "algorithm.max_new_tokens=12", "algorithm.warmup_sft_steps=2", "algorithm.warmup_sft_batch=8",
             "trainer.warmup_steps=0", "algorithm.beta=0.04"]


def run_grpo(tmp_path, overrides):
    from algorithms.runlog import read_metrics

    _, typed, plan = prepared(grpo.GRPORunConfig, TINY_GRPO + overrides)
    grpo.validate(typed, plan)
    record = grpo.run(typed, plan, tmp_path)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] >= 0]
    assert [r["step"] for r in rows][-3:] == [0, 1, 2]
    for r in rows[-2:]:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/kl"]) and r["rollout/generate_s"] > 0
        assert "reward/mean" in r and r["sync/rollout/mb"] > 0
    assert "eval/accuracy" in rows[-1]
    assert (tmp_path / "checkpoints" / "step_2" / "config.json").is_file() and record["checkpoint"]
    return plan, rows


def test_grpo_quickstart_with_vllm_rollout_and_deepspeed_zero2_trainer(ray_cluster, tmp_path):
    """One tensor-parallel vLLM engine over the 2 rollout ranks
    (placement.rollout.vllm_tensor_parallel_size=2), colocated with 2 DeepSpeed ZeRO-2 trainer
    ranks: weights synced to both engine ranks every step (the SFT warm start runs in the
    Megatron case)."""
    pytest.importorskip("vllm")
    plan, rows = run_grpo(tmp_path, ["backend.rollout=vllm", "backend.train=deepspeed", "deepspeed.zero_stage=2",
                                     "placement.train.gpus=2", "placement.rollout.gpus=2",
                                     "placement.rollout.vllm_tensor_parallel_size=2", "algorithm.warmup_sft_steps=0"])
    assert plan["train"].world_size == 2
    assert plan["rollout"].tensor_parallel_size == 2 and plan["rollout"].world_size == 2
    assert all(r["staleness/max"] == 0 for r in rows[-2:])  # generated with the weights just synced


def test_grpo_quickstart_with_megatron_tensor_parallel_trainer(ray_cluster, tmp_path):
    plan, _ = run_grpo(tmp_path, ["backend.train=megatron", "megatron.tensor_parallel_size=2",
                                  "placement.train.gpus=2", "placement.rollout.gpus=2"])
    assert plan["train"].world_size == 2
