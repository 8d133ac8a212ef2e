"""vLLM on a real CUDA GPU (skipped elsewhere): the rollout compiled with CUDA graphs, its
sampling logprobs against the trainer's, weight updates from the trainer's device tensors,
sleep levels 1 and 2 with the device memory they free, the top-k teacher, and the GRPO and
GKD drivers with vLLM roles sharing the GPU with the trainer through Ray.

Numbers are bf16 on the engine side against an fp32 trainer/teacher, so the comparisons
use tolerances; the weights are sharp (std 0.12) so that greedy choices are not near ties.
"""
import pytest
import torch

pytest.importorskip("vllm")

from roles.batch import SamplingParams, batch_from_completions  # noqa: E402
from roles.rollout import Rollout  # noqa: E402
from roles.teacher import Teacher  # noqa: E402
from roles.trainer import Trainer, TrainerConfig  # noqa: E402

pytestmark = pytest.mark.gpu
MODEL = "tiny_qwen2"
PROMPTS = ["3+4", "(2+8)+2", "9+9+9", "1+1", "((1+2)*3)-4+5*6-7"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
# Small fixed KV caches: the engines of this module and the trainer share the GPU.
VLLM = {"gpu_memory_utilization": 0.05, "kv_cache_gib": 0.5}


def sharp(model: torch.nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Host tensors of the model's shapes (whatever device it is on), drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return [(n, (1 + 0.1 * torch.randn(p.shape, generator=gen)) if p.dim() == 1
             else 0.12 * torch.randn(p.shape, generator=gen)) for n, p in model.named_parameters()]


@pytest.fixture(scope="module")
def trainer():
    return Trainer(MODEL, TrainerConfig(lr=1e-3, warmup_steps=0, total_steps=10, device="cuda", dtype="float32"))


@pytest.fixture(scope="module")
def rollout(trainer):
    fast = Rollout(MODEL, config={"device": "cuda", "dtype": "bfloat16"}, engine="vllm", engine_options=VLLM)
    a = sharp(trainer.model, seed=1)
    trainer.model.load_state_dict(dict(a), strict=False)
    fast.update_weights(trainer.state_dict_buckets(8, dtype="bfloat16", to_cpu=False), version=1)
    return fast


def agreement(rollout: Rollout, trainer: Trainer, comps, temperature: float) -> tuple[float, float]:
    """(mean, max) |vLLM's sampling logprob - the trainer's| over the completion tokens, the
    trainer's forward taken at `temperature`."""
    batch = batch_from_completions(comps, rollout.pad_id)
    want = trainer.logprobs(batch, temperature)
    diff = (batch.old_logprobs - want)[batch.loss_mask.bool()].abs()
    return float(diff.mean()), float(diff.max())


def test_rollout_runs_compiled_with_cuda_graphs_and_its_logprobs_match_the_trainer(rollout, trainer):
    info = rollout.engine_info()
    print("vLLM settings:", info)
    assert info["enforce_eager"] is False and info["cudagraph_capture_sizes"]
    greedy = rollout.generate(PROMPTS, GREEDY)
    assert all(len(c) > 0 for c in greedy.completion_ids)
    assert len({t for c in greedy.completion_ids for t in c}) > 5
    mean, worst = agreement(rollout, trainer, greedy, 1.0)
    print(f"greedy logprobs vs fp32 trainer: mean {mean:.4f} max {worst:.4f}")
    assert mean < 0.05 and worst < 0.5
    # Greedy: each token is the fp32 model's first choice wherever that choice is clear.
    batch = batch_from_completions(greedy, rollout.pad_id)
    with torch.no_grad():
        logits = trainer.model(batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda()).logits.float()
    top2 = logits.topk(2, -1)
    clear = (top2.values[..., 0] - top2.values[..., 1] > 0.5)[:, :-1].cpu()
    picked = top2.indices[..., 0][:, :-1].cpu() == batch.input_ids[:, 1:]
    shown = batch.loss_mask[:, 1:].bool() & clear
    assert shown.sum() > 20 and bool(picked[shown].all())
    # Sampling at temperature 0.7: logprobs of the temperature-scaled distribution, as the trainer's.
    sampled = rollout.generate(PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=24, n=4, seed=3))
    mean, worst = agreement(rollout, trainer, sampled, 0.7)
    print(f"sampled (T=0.7) logprobs vs fp32 trainer: mean {mean:.4f} max {worst:.4f}")
    assert mean < 0.05 and worst < 0.5
    again = rollout.generate(PROMPTS, SamplingParams(temperature=0.7, max_new_tokens=24, n=4, seed=3))
    assert again.completion_ids == sampled.completion_ids  # seeded rows repeat
    assert len({tuple(c) for c in sampled.completion_ids[:4]}) > 1


def test_weights_from_the_trainers_device_change_the_greedy_output(rollout, trainer):
    before = rollout.generate(PROMPTS, GREEDY).completion_ids
    trainer.model.load_state_dict(dict(sharp(trainer.model, seed=2)), strict=False)
    buckets = trainer.state_dict_buckets(8, dtype="bfloat16", to_cpu=False)
    assert buckets[0][0][1].device.type == "cuda"
    rollout.update_weights(buckets, version=2)
    after = rollout.generate(PROMPTS, GREEDY)
    assert after.completion_ids != before and after.weight_version == [2] * len(PROMPTS)
    mean, worst = agreement(rollout, trainer, after, 1.0)
    assert mean < 0.05 and worst < 0.5


def test_sleep_levels_free_the_device_memory_and_updates_while_asleep_wake_only_the_weights(rollout, trainer):
    want = rollout.generate(PROMPTS, GREEDY).completion_ids
    weight_bytes = rollout.engine_info()["weight_bytes"]
    kv = VLLM["kv_cache_gib"] * 2**30
    slept = rollout.sleep(1)
    print("sleep(1):", slept)
    assert slept["device_bytes_freed"] >= 0.9 * (kv + weight_bytes)
    with pytest.raises(RuntimeError, match="asleep"):
        rollout.generate(PROMPTS, GREEDY)
    woke = rollout.wake_up()
    print("wake_up():", woke)
    assert woke["device_bytes_taken"] >= 0.9 * (kv + weight_bytes)
    assert rollout.generate(PROMPTS, GREEDY).completion_ids == want  # level 1 keeps the weights exactly
    slept = rollout.sleep(2)
    print("sleep(2):", slept)
    assert slept["device_bytes_freed"] >= 0.9 * (kv + weight_bytes)
    # Level 2: an update while asleep allocates the weights only, the KV cache waits for wake_up.
    trainer.model.load_state_dict(dict(sharp(trainer.model, seed=1)), strict=False)
    free = torch.cuda.mem_get_info()[0]
    rollout.update_weights(trainer.state_dict_buckets(8, dtype="bfloat16", to_cpu=False), version=3)
    assert free - torch.cuda.mem_get_info()[0] < kv / 2
    with pytest.raises(RuntimeError, match="asleep"):
        rollout.generate(PROMPTS, GREEDY)
    woke = rollout.wake_up()
    print("wake_up() after a level-2 update:", woke)
    assert woke["device_bytes_taken"] >= 0.9 * kv
    got = rollout.generate(PROMPTS, GREEDY)
    assert got.weight_version == [3] * len(PROMPTS)
    mean, worst = agreement(rollout, trainer, got, 1.0)
    assert mean < 0.05 and worst < 0.5
    # Level 2 then wake without an update: refused until weights arrive.
    rollout.sleep(2)
    rollout.wake_up()
    with pytest.raises(RuntimeError, match="discarded"):
        rollout.generate(PROMPTS, GREEDY)
    rollout.update_weights(trainer.state_dict_buckets(8, dtype="bfloat16", to_cpu=False), version=4)
    assert rollout.generate(PROMPTS, GREEDY).weight_version == [4] * len(PROMPTS)


def test_teacher_top_k_on_the_gpu_matches_the_fp32_teacher(rollout, trainer):
    """Created after the rollout's sleep tests: engines of one process share vLLM's sleep-mode
    allocator, so with two of them a sleep is refused (checked at the end)."""
    slow = Teacher(MODEL, {"device": "cuda"})
    fast = Teacher(MODEL, {"device": "cuda", "dtype": "bfloat16"}, engine="vllm",
                   engine_options={**VLLM, "enforce_eager": True})  # eager: the rollout covers CUDA graphs
    pairs = sharp(slow.model, seed=4)
    slow.update_weights([pairs], version=1)
    fast.update_weights([pairs], version=1)
    batch = batch_from_completions(rollout.generate(PROMPTS, GREEDY), rollout.pad_id)
    want = slow.logits(batch, topk=8, tail=True, temperature=0.8)
    got = fast.logits(batch, topk=8, tail=True, temperature=0.8)
    mask = batch.attention_mask.bool().clone()
    mask[:, 0] = False
    top1 = (got[1][..., 0] == want[1][..., 0])[mask].float().mean()
    err = (got[0][..., 0] - want[0][..., 0])[mask].abs()
    print(f"teacher top-1 agreement {float(top1):.4f}, top-1 logprob error mean {float(err.mean()):.4f} "
          f"max {float(err.max()):.4f}")
    assert top1 > 0.97 and err.mean() < 0.05
    with pytest.raises(RuntimeError, match="one process"):
        rollout.sleep(1)


def _driver_run(driver, run_config, overrides, tmp_path):
    from hydra import compose, initialize_config_module

    from algorithms.config.schema import prepare
    from algorithms.records.trackers import read_metrics
    from orchestration.config import register_schema

    register_schema(run_config)
    with initialize_config_module(config_module="conf", version_base=None):
        cfg = compose(config_name="config", overrides=overrides + ["cluster.simulate_missing_gpus=false"])
    typed, plan = prepare(cfg, run_config)
    driver.validate(typed, plan)
    try:
        driver.run(typed, plan, tmp_path)
    finally:
        import ray
        ray.shutdown()
    return [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] >= 0]


# Eager engines start faster; the compiled path is the rollout's above and the benchmark's.
SMALL_ENGINE = ["vllm.kv_cache_gib=0.5", "vllm.gpu_memory_utilization=0.05", "vllm.enforce_eager=true",
                "rollout.dtype=bfloat16", "run.save_final=false",
                "trainer.warmup_steps=0", "data.train_size=50", "data.eval_size=8", "run.steps=2"]


def test_grpo_driver_with_a_vllm_rollout_colocated_on_one_gpu(tmp_path):
    """Trainer and vLLM rollout as Ray actors sharing the GPU: sleep level 2 while the trainer
    works, weights by CUDA IPC into the sleeping engine."""
    from algorithms import grpo

    records = _driver_run(grpo, grpo.GRPOConfig, [
        "+experiment=grpo_quickstart", "backend.rollout=vllm", "placement.sleep_level=2",
        "run.prompts_per_step=4", "algorithm.num_generations=4", "algorithm.warmup_sft_steps=0", *SMALL_ENGINE],
        tmp_path)
    assert [r["step"] for r in records][-3:] == [0, 1, 2]
    assert all(r["time/train"] > 0 and r["rollout/generate_s"] > 0 for r in records[-2:])
    assert {r.get("sync/rollout/path") for r in records[-2:]} == {"cuda_ipc"}


def test_gkd_driver_with_vllm_rollout_and_teacher_on_one_gpu(tmp_path):
    """Student trainer, vLLM rollout and vLLM top-k teacher as Ray actors on the one GPU,
    every step on-policy."""
    from algorithms import gkd

    records = _driver_run(gkd, gkd.GKDConfig, [
        "+experiment=gkd_quickstart", "backend.rollout=vllm", "backend.teacher=vllm", "placement.sleep_level=2",
        "algorithm.logits_topk=8", "teacher.warmup_steps=0", "teacher.engine.dtype=bfloat16", "algorithm.lmbda=1.0", "run.prompts_per_step=8",
        *SMALL_ENGINE], tmp_path)
    assert [r["step"] for r in records][-3:] == [0, 1, 2]
    assert all(r["time/teacher"] > 0 and r["time/generate"] > 0 for r in records[-2:])
