"""The GRPO quickstart driver end to end on Ray actors with the production engines: a
tensor-parallel vLLM rollout and a tensor-parallel Megatron-core trainer
(`python -m algorithms.grpo +experiment=grpo_quickstart backend.rollout=vllm
backend.train=megatron`, both over 2 ranks), with tiny overrides. DeepSpeed's ZeRO-2
trainer (train step, logprobs, the weights a sync hands out, offload, checkpoints) is checked
against the torch engine in tests/test_deepspeed_engine.py, and a driver on DeepSpeed ranks in
its SFT run."""
import math

import pytest

from algorithms import grpo
from tests.driver_helpers import prepared

pytest.importorskip("megatron.core")

TINY_GRPO = ["+experiment=grpo_quickstart", "run.steps=2", "run.prompts_per_step=4", "data.train_size=32",
             "data.eval_size=4", "run.eval_max_new_tokens=12", "algorithm.num_generations=4",
             "algorithm.max_new_tokens=12", "algorithm.warmup_sft_steps=2", "algorithm.warmup_sft_batch=8",
             "trainer.warmup_steps=0", "algorithm.beta=0.04"]  # the quickstart has no KL; this run does


# Its parts run in CI: vLLM's tensor-parallel engines in test_vllm_engine, Megatron's dp2xtp2 ranks in
# test_megatron_engine, GRPO on Ray in test_experiments_run (two nodes) and test_restarts.
@pytest.mark.slow
def test_grpo_quickstart_with_vllm_and_megatron_tensor_parallel_engines(ray_cluster, tmp_path):
    """One tensor-parallel vLLM engine over the 2 rollout ranks
    (placement.rollout.vllm_tensor_parallel_size=2), colocated with 2 Megatron TP=2 trainer
    ranks and the reference policy: the SFT warm start, then weights synced to both engine
    ranks every step, two optimizer updates per generated batch (steps_per_generation=2)."""
    pytest.importorskip("vllm")
    from algorithms.records.trackers import read_metrics

    _, typed, plan = prepared(grpo.GRPOConfig, TINY_GRPO + [
        "backend.rollout=vllm", "backend.train=megatron", "megatron.tensor_parallel_size=2",
        "placement.train.gpus=2", "placement.rollout.gpus=2", "placement.rollout.vllm_tensor_parallel_size=2",
        "algorithm.steps_per_generation=2"])
    grpo.validate(typed, plan)
    assert plan["train"].world_size == 2
    assert plan["rollout"].tensor_parallel_size == 2 and plan["rollout"].world_size == 2
    record = grpo.run(typed, plan, tmp_path)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] >= 0]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1]
    for r in rows[-2:]:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/kl"]) and r["rollout/generate_s"] > 0
        assert "reward/mean" in r
        assert r["staleness/max"] == 0  # generated with the weights just synced
    # The sync rides on the trainer's offload and the rollout's next call: its figures are in the
    # record of the step whose rollout turn took the weights.
    assert rows[-1]["sync/rollout/path"] == "shm" and rows[-1]["sync/rollout/mb"] > 0
    for key in ("reward/mean", "reward/accuracy", "reward/prm", "reward/format", "train/kl", "train/clip_ratio/region",
                "advantages/std", "rollout/completion_length", "grpo/zero_std_groups", "time/generate",
                "time/ref_logprobs", "time/train", "time/sync_weights"):
        assert key in rows[1], key
    assert rows[-1]["train/step"] == 4  # 2 steps x 2 updates each
    # The reference policy is a role on the trainer's (shared) devices, offloaded between uses.
    assert rows[1]["move/reference_onload_bytes"] > 0 and rows[1]["move/reference_offload_bytes"] > 0
    assert rows[1]["mem/reference_rss_bytes"] > 0
    assert (tmp_path / "sft_warmup" / "metrics.jsonl").is_file()
    assert (tmp_path / "checkpoints" / "step_2" / "config.json").is_file() and record["checkpoint"]
