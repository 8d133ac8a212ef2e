"""On a real CUDA GPU (skipped elsewhere): the torch engines on the device, offload and
sleep really releasing device memory, and a colocated GRPO run of the real driver with
trainer and rollout sharing one GPU through Ray."""

import pytest
import torch

from roles.batch import SamplingParams
from roles.models import build_model, load_tokenizer
from roles.rollout import Rollout
from roles.trainer import Trainer, TrainerConfig
from tests.test_trainer import sft_batch

pytestmark = pytest.mark.gpu
MODEL = "tiny_qwen2"
PROMPTS = ["3+4", "(2+8)+2", "9+9+9", "1+1"]


def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_trainer_trains_in_bf16_on_the_gpu():
    trainer = Trainer(MODEL, TrainerConfig(lr=3e-3, warmup_steps=0, total_steps=20, device="cuda", dtype="bfloat16"))
    assert next(trainer.model.parameters()).device.type == "cuda"
    batch = sft_batch(16)
    losses = [trainer.train_step(batch)["loss"] for _ in range(10)]
    assert losses[-1] < 0.7 * losses[0]


def test_rollout_greedy_on_gpu_equals_transformers_generate_there():
    model, tok = build_model(MODEL).cuda().eval(), load_tokenizer(MODEL)
    rollout = Rollout(MODEL, config={"device": "cuda", "dtype": "float32"})
    got = rollout.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=16))
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt").to("cuda")
    ref = model.generate(**enc, do_sample=False, max_new_tokens=16, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:].tolist()
    for ids, row in zip(got.completion_ids, ref):
        assert ids == row[:len(ids)]


def test_offload_and_sleep_release_device_memory_and_restore_it_exactly():
    trainer = Trainer("small_qwen2", TrainerConfig(lr=1e-3, warmup_steps=0, total_steps=10, device="cuda"))
    trainer.train_step(sft_batch(8))  # optimizer state exists
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    live = allocated()
    moved = trainer.offload()
    assert live - allocated() >= 0.9 * (moved["model_bytes"] + moved["optimizer_bytes"]) > 0
    trainer.onload()
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())

    rollout = Rollout("small_qwen2", config={"device": "cuda"})
    want = rollout.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8)).completion_ids
    awake = allocated()
    rollout.sleep(1)
    assert awake - allocated() > 0.9 * sum(p.numel() * p.element_size() for p in rollout.model.parameters())
    rollout.wake_up()
    assert rollout.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8)).completion_ids == want


def test_grpo_driver_colocated_on_one_gpu(tmp_path):
    """The real GRPO driver: trainer and rollout as Ray actors sharing the one GPU (0.5 each),
    taking turns with offload and sleep."""
    from hydra import compose, initialize_config_module

    from algorithms import grpo
    from algorithms.config.schema import prepare
    from algorithms.records.trackers import read_metrics
    from orchestration.config import register_schema

    register_schema(grpo.GRPOConfig)
    with initialize_config_module(config_module="conf", version_base=None):
        cfg = compose(config_name="config", overrides=[
            "+experiment=grpo_quickstart", "run.steps=3", "run.prompts_per_step=4", "algorithm.num_generations=4",
            "algorithm.warmup_sft_steps=0", "trainer.warmup_steps=0", "data.train_size=50", "data.eval_size=8", "cluster.simulate_missing_gpus=false"])
    typed, plan = prepare(cfg, grpo.GRPOConfig)
    grpo.validate(typed, plan)
    try:
        grpo.run(typed, plan, tmp_path)
    finally:
        import ray
        ray.shutdown()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["time/train"] > 0 for r in records[1:])


@pytest.mark.parametrize("preset,compile_decode", [("tiny_qwen2", False), ("tiny_llama", False), ("tiny_qwen2", True)])
def test_graph_decode_greedy_equals_transformers_generate(preset, compile_decode):
    """The CUDA-graph decode path (fp32, so both sides compute the same numbers), its step
    compiled or not, against HF `generate` on weights that decode varied text, stops included."""
    from roles.engines import torch_decode
    from tests.test_rollout import PROMPTS as ROLLOUT_PROMPTS, lively

    model, tok = build_model(preset).cuda().eval(), load_tokenizer(preset)
    model.load_state_dict(lively(model))
    rollout = Rollout(preset, config={"device": "cuda", "dtype": "float32", "compile_decode": compile_decode})
    rollout.update_weights([lively(rollout.model)], version=1)
    graphs = torch_decode.COUNTS["graph"]
    got = rollout.generate(ROLLOUT_PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=40))
    assert torch_decode.COUNTS["graph"] == graphs + 1
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in ROLLOUT_PROMPTS]
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt").to("cuda")
    ref = model.generate(**enc, do_sample=False, max_new_tokens=40, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:].tolist()
    assert len({tuple(ids) for ids in got.completion_ids}) == len(ROLLOUT_PROMPTS)
    for ids, reason, row in zip(got.completion_ids, got.finish_reasons, ref):
        assert ids == row[:len(ids)]
        assert len(ids) == 40 if reason == "length" else ids[-1] == tok.eos_token_id


def test_graph_decode_samples_as_the_eager_steps_and_logprobs_match_a_forward(monkeypatch):
    from roles.batch import batch_from_completions
    from roles.engines import torch_decode
    from roles.engines.torch_engine import token_logprobs

    rollout = Rollout("small_qwen2", config={"device": "cuda", "dtype": "float32", "max_batch_size": 64})
    sampling = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=48, n=5, seed=3)
    graphed = rollout.generate(PROMPTS, sampling)
    monkeypatch.setattr(torch_decode, "CUDA_GRAPHS", False)
    eager = rollout.generate(PROMPTS, sampling)
    assert graphed.completion_ids == eager.completion_ids
    assert len({tuple(c) for c in graphed.completion_ids}) > len(PROMPTS)
    batch = batch_from_completions(graphed, rollout.pad_id)
    with torch.no_grad():
        logits = rollout.model(input_ids=batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda()).logits
    ref = token_logprobs(logits, batch.input_ids.cuda(), 0.8).cpu()
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(batch.old_logprobs[mask], ref[mask], atol=2e-3, rtol=0)


def test_packed_flash_varlen_attention_equals_attention_row_by_row():
    from roles.engines.train_kernels import _varlen, rows_attention

    gen = torch.Generator("cuda").manual_seed(0)
    cu = torch.tensor([0, 5, 5, 40, 41, 100], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(100, h, 64, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
               for h in (14, 2, 2))
    got = _varlen(q, k, v, cu, 59, 0.125)
    want = rows_attention(q, k.repeat_interleave(7, 1), v.repeat_interleave(7, 1), cu, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert (got.float() - want.float()).abs().mean() < 2e-3
    # Gradients too: grouped keys and values (2 heads for 14 queries) sum their group's share.
    grad_out = torch.randn(got.shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    got_grads = torch.autograd.grad(got, (q, k, v), grad_out)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g.float(), w.float(), atol=5e-2, rtol=5e-2, msg=name)


@pytest.mark.parametrize("options", [{"compile": True}, {"compile": True, "packing": True},
                                     {"packing": True, "activation_checkpointing": True}])
def test_trainer_forward_options_train_as_the_plain_engine(options):
    """torch.compile, packing and checkpointing on the GPU: the same losses, gradient norms
    and logprobs as the plain forward (fp32, ragged rows; packing's 16-bit flash kernel:
    the test above)."""
    from roles.engines.train_kernels import TrainKernelOptions

    cfg = TrainerConfig(lr=1e-3, warmup_steps=0, total_steps=10, device="cuda", dtype="float32")
    plain, fast = Trainer(MODEL, cfg), Trainer(MODEL, cfg)
    fast.engine.set_options(TrainKernelOptions(**options))
    for step in range(3):
        batch = sft_batch(16, seed=step)
        a, b = plain.train_step(batch), fast.train_step(batch)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                   rel=1e-3)
    torch.testing.assert_close(fast.logprobs(batch), plain.logprobs(batch), atol=1e-4, rtol=0)
    lp = fast.engine.token_logprobs(batch.input_ids, batch.attention_mask, 1.0)[0].detach().cpu()
    torch.testing.assert_close(lp, plain.logprobs(batch), atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", [{}, {"packing": True},
                                     {"packing": True, "cuda_graphs": True, "dtype": "bfloat16"}])
def test_fused_logprobs_train_as_the_compiled_full_logits(options):
    """trainer.fused_logprobs (the output head and log-softmax compiled with the model; ragged
    rows, 4 micro-batches a step): the steps and logprobs of the compiled trainer that makes the
    full logits, fp32 (close in bf16, where the two compiled graphs round differently)."""
    import dataclasses

    from torch._dynamo.utils import counters

    from tests.test_train_kernels import loss_logging_entropy

    cfg = dataclasses.replace(TrainerConfig(lr=1e-3, warmup_steps=0, total_steps=10, device="cuda", dtype="float32",
                                            micro_batch_per_device=4, compile=True), **options)
    rel = 1e-2 if cfg.dtype == "bfloat16" else 1e-4
    kw = dict(loss_fn=loss_logging_entropy, loss_inputs=("entropy",))
    full, fused = Trainer(MODEL, cfg, **kw), Trainer(MODEL, dataclasses.replace(cfg, fused_logprobs=True), **kw)
    counters["inductor"].clear()
    for step in range(4):
        batch = sft_batch(16, seed=step)
        a, b = full.train_step(batch), fused.train_step(batch)
        assert a["loss"] == pytest.approx(b["loss"], rel=rel) and a["entropy"] == pytest.approx(b["entropy"], rel=rel)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=10 * rel)
    assert counters["inductor"]["cudagraph_skips"] == 0
    torch.testing.assert_close(fused.logprobs(batch), full.logprobs(batch), atol=500 * rel / 100, rtol=0)


@pytest.mark.parametrize("mode", ["renorm", "tail"])
def test_gkd_student_topk_trains_as_the_compiled_full_logits(mode):
    """GKD's student against a top-k teacher with fused_logprobs (bf16, packing, inductor): the
    log-softmax at the teacher's tokens from the compiled function gives the steps of the
    compiled trainer that makes the full logits."""
    import dataclasses

    from algorithms.objectives.losses import GKDLoss

    cfg = TrainerConfig(lr=1e-3, warmup_steps=0, total_steps=10, device="cuda", dtype="bfloat16",
                        micro_batch_per_device=4, compile=True, packing=True)
    loss = dict(beta=0.5, temperature=0.9, sft_alpha=0.0, topk_mode=mode, teacher_temperature_applied=True)
    full = Trainer(MODEL, cfg, loss_fn=GKDLoss(**loss), loss_inputs=("logits",))
    fused = Trainer(MODEL, dataclasses.replace(cfg, fused_logprobs=True), loss_fn=GKDLoss(**loss, student_topk=True),
                    loss_inputs=("student_topk",))
    teacher = Trainer(MODEL, TrainerConfig(device="cuda", dtype="float32"))
    torch.manual_seed(0)
    with torch.no_grad():  # another model than the student
        for p in teacher.model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    for step in range(3):
        batch = sft_batch(16, seed=step)
        with torch.no_grad():
            logits = teacher.engine.forward(batch.input_ids, batch.attention_mask).float().cpu()
        top = torch.topk(torch.log_softmax(logits[:, :-1] / 0.9, -1), k=4, dim=-1)
        batch.teacher_logprobs = torch.nn.functional.pad(top.values, (0, 0, 1, 0))
        batch.teacher_indices = torch.nn.functional.pad(top.indices, (0, 0, 1, 0))
        a, b = full.train_step(batch, 0.9), fused.train_step(batch, 0.9)
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-2) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                   rel=1e-1)


@pytest.mark.parametrize("dtype,rel", [("bfloat16", 5e-2), ("float32", 1e-4)])
def test_cuda_graphed_trainer_trains_as_the_compiled_one(dtype, rel):
    """trainer.cuda_graphs (packing, ragged rows, steps of 4 micro-batches and of 1): the compiled
    forward and backward replay as CUDA graphs (torch reports no skipped graph), and the steps
    and logprobs equal the compiled trainer's without graphs, through an offload and onload (the
    weights come back at new addresses: the graphs re-record). A step's first gradients are the
    backward graph's outputs; left there, the next micro-batch's replay would overwrite them."""
    import dataclasses

    from torch._dynamo.utils import counters

    cfg = TrainerConfig(lr=1e-3, warmup_steps=0, total_steps=10, device="cuda", dtype=dtype,
                        micro_batch_per_device=4, compile=True, packing=True)
    compiled, graphed = Trainer(MODEL, cfg), Trainer(MODEL, dataclasses.replace(cfg, cuda_graphs=True))
    counters["inductor"].clear()
    for step, rows in enumerate([16, 4, 16, 16, 4, 16]):
        batch = sft_batch(rows, seed=step)
        a, b = compiled.train_step(batch), graphed.train_step(batch)
        assert a["loss"] == pytest.approx(b["loss"], rel=rel / 5) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                      rel=rel)
        if step == 2:
            for trainer in (compiled, graphed):
                trainer.offload()
                trainer.onload()
    assert counters["inductor"]["cudagraph_skips"] == 0
    torch.testing.assert_close(graphed.logprobs(batch), compiled.logprobs(batch), atol=rel, rtol=0)
