"""DeepSpeed ZeRO engine of the Trainer on CPU (gloo, fp32): ZeRO-2 and ZeRO-3 over a real
2-rank Ray worker group against the torch engine (loss curve, HF weights, logprobs),
checkpoint round trips (into the same group and into the torch engine), offload/onload,
ZeRO-Offload on one rank, and the SFT driver end to end with backend.train=deepspeed."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from orchestration.planner import make_plan
from roles.engines.deepspeed_trainer import resolve_options
from roles.models import ModelConfig, build_model
from roles.trainer import Trainer, TrainerConfig
from tests.test_trainer import sft_batch

pytest.importorskip("deepspeed")

MODEL = "tiny_qwen2"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def config(**overrides) -> TrainerConfig:
    base = dict(lr=1e-3, weight_decay=0.1, warmup_steps=1, total_steps=10, micro_batch_per_device=3,
                device="cpu", dtype="float32")
    return TrainerConfig(**{**base, **overrides})


def close(got: dict, want: dict, rel: float = 1e-3) -> None:
    for key in ("loss", "grad_norm", "lr"):
        assert math.isclose(got[key], want[key], rel_tol=rel), (key, got[key], want[key])
    assert got["tokens"] == want["tokens"] and got["step"] == want["step"]


def test_options_are_validated_naming_the_key():
    with pytest.raises(ValueError, match="deepspeed.zero_stage=1"):
        resolve_options({"zero_stage": 1})
    with pytest.raises(ValueError, match="deepspeed.offload_param needs deepspeed.zero_stage=3"):
        resolve_options({"zero_stage": 2, "offload_param": True})
    with pytest.raises(ValueError, match=r"\['stage'\].*deepspeed"):
        resolve_options({"stage": 3})


# ZeRO-2 shares ZeRO-3's path here but for the sharding deepspeed does itself: CI runs stage 3.
@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_zero_two_ranks_match_the_torch_engine(ray_cluster, tmp_path, stage):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    batch = sft_batch(7, seed=3)  # sliced 4 + 3: 2 and 1 micro-batches, so rank 1 adds an idle pass
    ckpt = tmp_path / "ckpt"
    kwargs = {"model": MODEL, "config": config(), "engine": "deepspeed", "engine_options": {"zero_stage": stage}}
    plan = make_plan({"device_groups": {"nproc_per_node": 1, "g": {"device": "CPU", "ranks": 2, "workers": ["train"]}}})
    placement = create_placement(plan, timeout_s=60)
    group = None
    try:
        group = WorkerGroup(Trainer, plan["train"], kwargs, placement=placement, timeout_s=300)
        steps = [group.call("train_step", batch, dispatch="slice") for _ in range(3)]
        group.call("save", str(ckpt))
        saved_weights = group.call("state_dict_buckets", 1024, execute="first")  # rank 0 alone, as weight sync asks
        moved = group.call("offload")
        with pytest.raises(Exception, match="offloaded; call onload"):
            group.call("train_step", batch, dispatch="slice")
        group.call("onload")
        steps += [group.call("train_step", batch, dispatch="slice") for _ in range(2)]
        logprobs = group.call("logprobs", batch, dispatch="slice", collect="flatten")
        group.call("load", str(ckpt))
        resumed = [group.call("train_step", batch, dispatch="slice") for _ in range(2)]
    finally:
        if group is not None:
            group.shutdown()
        placement.remove()

    single = Trainer(MODEL, config())
    want = [single.train_step(batch) for _ in range(3)]
    ref_saved = {n: t.clone() for n, t in single.engine.named_weights()}
    want += [single.train_step(batch) for _ in range(2)]
    for ranks, ref in zip(steps, want):
        assert ranks[0] == ranks[1]  # every rank reports the same global metrics
        close(ranks[0], ref)
    # Weights handed out for a sync: HF names and order, the torch engine's values (AdamW
    # turns summation-order noise of near-zero gradients into ~1e-5 weight differences).
    got = [t for bucket in saved_weights for t in bucket]
    assert [n for n, _ in got] == list(ref_saved)
    for name, t in got:
        torch.testing.assert_close(t, ref_saved[name], atol=1e-4, rtol=0, msg=name)
    torch.testing.assert_close(logprobs, single.logprobs(batch), atol=1e-4, rtol=0)
    assert all(m["model_bytes"] > 0 and m["optimizer_bytes"] > 0 for m in moved)
    # Round trip: the group continues from its checkpoint exactly as it went on before.
    for before, after in zip(steps[3:], resumed):
        assert after == before
    # The checkpoint is plain HF weights plus a torch-format AdamW state: transformers and
    # the torch engine (one rank) load it and continue the same curve.
    plain = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)
    for name, t in ref_saved.items():
        torch.testing.assert_close(plain.state_dict()[name], t, atol=1e-4, rtol=0, msg=name)
    torch_resumed = Trainer(MODEL, config())
    torch_resumed.load(ckpt)
    assert torch_resumed.step == 3
    for ref in want[3:]:
        close(torch_resumed.train_step(batch), ref)


def test_zero_offload_one_rank_matches_the_torch_engine(tmp_path):
    """ZeRO-3 with optimizer and parameters in host memory (torch AdamW on the host
    partitions), continuing from a torch-engine checkpoint's weights and AdamW moments."""
    batch = sft_batch(5, seed=4)
    single = Trainer(MODEL, config())
    single.train_step(batch)
    single.save(tmp_path / "torch")
    warm = ModelConfig(name="warm", path=str(tmp_path / "torch"), dtype="float32")
    options = {"zero_stage": 3, "offload_optimizer": True, "offload_param": True}
    ds, plain = Trainer(warm, config(), engine="deepspeed", engine_options=options), Trainer(warm, config())
    ds.load_optimizer_moments(tmp_path / "torch")
    plain.load_optimizer_moments(tmp_path / "torch")
    close(ds.train_step(batch), plain.train_step(batch))
    moved = ds.offload()  # ZeRO-Offload keeps both in host memory already
    assert moved["model_bytes"] == moved["optimizer_bytes"] == 0
    with pytest.raises(RuntimeError, match="offloaded; call onload"):
        ds.logprobs(batch)
    ds.onload()
    for _ in range(2):
        close(ds.train_step(batch), plain.train_step(batch))


@pytest.mark.parametrize("made_again", [False, True])
def test_a_new_engine_after_the_process_group_was_destroyed(made_again):
    """Another library in the process may destroy the default process group DeepSpeed's groups
    were made from (a vLLM engine does when it shuts down, in a process that ran a DeepSpeed
    engine before it), and another may make a new one before the next DeepSpeed engine starts:
    that engine starts on the group there is and trains as the torch engine does."""
    import torch.distributed as dist

    batch = sft_batch(5, seed=4)
    Trainer(MODEL, config(), engine="deepspeed", engine_options={"zero_stage": 2}).train_step(batch)
    dist.destroy_process_group()
    if made_again:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ds = Trainer(MODEL, config(), engine="deepspeed", engine_options={"zero_stage": 2})
    close(ds.train_step(batch), Trainer(MODEL, config()).train_step(batch))


def test_zero3_keeps_its_linear_to_its_own_forwards():
    """ZeRO-3 replaces torch.nn.functional.linear process-wide (a linear that keeps no gathered
    weight for the backward); every other model of the process then ran it, and a compiled one
    trained wrong gradients on the GPU. The engine's own forwards still run it; after them,
    and after the engine is built, the process has torch's."""
    import torch.nn.functional as F

    before = {k: v for k, v in vars(F).items() if callable(v)}
    ds = Trainer(MODEL, config(), engine="deepspeed", engine_options={"zero_stage": 3})
    assert F.linear is torch._C._nn.linear
    seen = []
    ds.model.model.layers[0].mlp.register_forward_pre_hook(lambda module, args: seen.append(F.linear))
    ds.train_step(sft_batch(4))
    assert seen and all(f.__module__ == "deepspeed.runtime.zero.linear" for f in seen)
    assert [k for k, v in before.items() if getattr(F, k) is not v] == []


# In CI: ZeRO-3 on two Ray ranks (test_zero_two_ranks_match_the_torch_engine) and the SFT driver in
# process (test_experiments_run, test_resume).
@pytest.mark.slow
def test_sft_driver_end_to_end_with_zero3_on_two_ranks(ray_cluster, tmp_path):
    """`python -m algorithms.sft +experiment=sft_quickstart backend.train=deepspeed ...` with the
    Llama preset, run in-process on the test cluster: evaluations at the run.eval_every cadence
    and the end, weight syncs to the evaluator from rank 0's copy, a Llama checkpoint."""
    from algorithms import sft
    from algorithms.sft import SFTConfig
    from tests.driver_helpers import TINY, check_checkpoint, check_outputs, prepared

    cfg, typed, plan = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, "model=tiny_llama",
                                               "run.eval_every=2", "placement.train.gpus=2",
                                               "backend.train=deepspeed", "deepspeed.zero_stage=3"])
    assert typed.backend.workers == "ray" and plan["train"].world_size == 2
    record = sft.run(typed, plan, tmp_path)
    records = check_outputs(tmp_path, 3, {"train"})
    assert {r["step"] for r in records if "eval/accuracy" in r} == {0, 2, 3}
    assert records[-1]["train/step"] == 3.0 and records[-1]["train/sequences"] == 4.0
    assert records[-1]["train/loss"] < records[1]["train/loss"]
    # Each sync sent the whole model (gathered), not a rank's ZeRO-3 shard.
    mib = sum(t.numel() * t.element_size() for t in build_model("tiny_llama").parameters()) / 2**20
    for r in (records[0], records[-1]):
        assert math.isclose(r["sync/evaluator/mb"], mib, rel_tol=1e-3), (r["sync/evaluator/mb"], mib)
    check_checkpoint(record["checkpoint"], "llama")


@pytest.mark.gpu
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_on_the_gpu(stage):
    """bf16 ZeRO (bf16 weights, fp32 masters) on one CUDA device over an NCCL process group,
    against the torch engine's bf16 autocast; offload releases the device memory it reports."""
    import torch.distributed as dist

    batch = sft_batch(8)
    gpu = config(device="cuda", dtype="bfloat16")
    ds = Trainer(MODEL, gpu, engine="deepspeed", engine_options={"zero_stage": stage})
    single = Trainer(MODEL, gpu)
    assert dist.get_backend() == "nccl" and ds.engine.device.type == "cuda"
    for _ in range(3):
        got, want = ds.train_step(batch), single.train_step(batch)
        assert math.isclose(got["loss"], want["loss"], rel_tol=3e-2), (got["loss"], want["loss"])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moved = ds.offload()
    released = before - torch.cuda.memory_allocated()
    print(f"zero-{stage}: moved {moved}, released {released} bytes")
    assert released >= 0.9 * (moved["model_bytes"] + moved["optimizer_bytes"]) > 0
    ds.onload()
    got, want = ds.train_step(batch), single.train_step(batch)
    assert math.isclose(got["loss"], want["loss"], rel_tol=3e-2), (got["loss"], want["loss"])
