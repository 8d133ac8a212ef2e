"""GRPO driver end to end on the local backend with tiny sizes (the quickstart's layout)."""
import math


from algorithms import grpo
from algorithms.records.trackers import read_metrics
from tests.driver_helpers import run_one_thread


def test_grpo_runs_end_to_end_and_logs_rewards(tmp_path):
    run_one_thread(grpo, grpo.GRPOConfig, [
        "+experiment=grpo_quickstart", "backend=local", "algorithm.warmup_sft_steps=2", "run.steps=2",
        "run.prompts_per_step=2", "data.eval_size=4", "run.eval_max_new_tokens=12", "run.save_final=false",
        "trainer.warmup_steps=0", "algorithm.beta=0.0"], tmp_path)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] >= 0]
    steps = [r["step"] for r in records]
    assert steps[-3:] == [0, 1, 2]
    assert "eval/accuracy" in records[-3] and "eval/accuracy" in records[-1]
    for r in records[-2:]:
        assert "reward/mean" in r and math.isfinite(r["train/loss"]) and "time/generate" in r
