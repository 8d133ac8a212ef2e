"""The torch training engine's forward options on CPU (roles/engines/train_kernels.py):
packing, activation checkpointing and the chunked log-softmax give the logprobs, losses and
gradients of the plain forward, and logprobs still match the rollout's. (torch.compile: on
the GPU, tests/test_gpu.py.)"""
import copy

import pytest
import torch

from roles.batch import SamplingParams, batch_from_completions
from roles.engines import train_kernels
from roles.engines.torch_engine import token_entropy, token_logprobs
from roles.engines.train_kernels import TrainKernelOptions
from roles.rollout import Rollout
from roles.trainer import Trainer, TrainerConfig, sft_loss
from tests.test_trainer import sft_batch

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = TrainerConfig(device="cpu", dtype="float32", lr=1e-3, warmup_steps=0, total_steps=10)


def ragged(rows=5, width=14, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 60, (rows, width), generator=gen)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(torch.randint(2, width + 1, (rows,), generator=gen).tolist()):
        mask[i, :n] = 1
    mask[0] = 1
    return ids * mask, mask


def loss_logging_entropy(logprobs, batch, extras):
    """The SFT loss, logging the mean entropy as GRPO's loss does (loss_inputs=('entropy',))."""
    loss, _ = sft_loss(logprobs, batch, extras)
    mask = batch.loss_mask.to(logprobs.device)
    return loss, {"entropy": (extras["entropy"] * mask).sum() / mask.sum()}


def weighted_logprob_sum(lp, mask):
    return (lp * mask * torch.arange(1, mask.shape[1] + 1)).sum()


def grads(engine, fn):
    engine.model.zero_grad(set_to_none=True)
    fn().backward()
    return {n: p.grad.clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("preset", ["tiny_qwen2", "tiny_llama"])
def test_packing_and_checkpointing_give_the_plain_forward_and_gradients(preset):
    engine = Trainer(preset, CFG).engine
    engine.model.train()
    ids, mask = ragged()
    plain = lambda: weighted_logprob_sum(token_logprobs(engine.forward(ids, mask), ids, 0.7), mask)  # noqa: E731
    want_logits = engine.forward(ids, mask).detach()
    want = grads(engine, plain)
    engine.set_options(TrainKernelOptions(packing=True, activation_checkpointing=True))
    assert engine.model.is_gradient_checkpointing
    got_logits = engine.forward(ids, mask).detach()
    torch.testing.assert_close(got_logits[mask.bool()], want_logits[mask.bool()], atol=2e-5, rtol=1e-5)
    assert (got_logits[~mask.bool()] == 0).all()
    got = grads(engine, plain)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-4)
    engine.set_options(TrainKernelOptions())  # off again: the model's own attention and no checkpointing
    assert engine.model.config._attn_implementation == "sdpa" and not engine.model.is_gradient_checkpointing
    torch.testing.assert_close(engine.forward(ids, mask).detach(), want_logits)


@pytest.mark.parametrize("packing", [False, True])
def test_chunked_logprobs_equal_the_full_log_softmax_with_gradients(monkeypatch, packing):
    monkeypatch.setattr(train_kernels, "LOGPROB_CHUNK", 7)  # several chunks, the last one partial
    engine = Trainer("tiny_qwen2", CFG).engine
    ids, mask = ragged(seed=1)
    full = lambda: torch.where(mask.bool(), token_logprobs(engine.forward(ids, mask), ids, 0.7), 0.0)  # noqa: E731
    want_lp = full().detach()
    want = grads(engine, lambda: weighted_logprob_sum(full(), mask))
    engine.set_options(TrainKernelOptions(packing=packing))
    got_lp = engine.token_logprobs(ids, mask, 0.7)[0]
    torch.testing.assert_close(got_lp.detach(), want_lp, atol=2e-5, rtol=0)
    got = grads(engine, lambda: weighted_logprob_sum(engine.token_logprobs(ids, mask, 0.7)[0], mask))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("packing, bucket", [(False, False), (True, False), (True, True)])
def test_fused_logprobs_equal_the_full_log_softmax_with_gradients(packing, bucket):
    """fused_token_logprobs' layout (the shift, packing, the bucket's padding row) with the
    function it compiles run eagerly (compiled: tests/test_gpu.py and the trainer test below)."""
    import functools

    engine = Trainer("tiny_qwen2", CFG).engine
    ids, mask = ragged(rows=6, width=23, seed=4)
    full = lambda: torch.where(mask.bool(), token_logprobs(engine.forward(ids, mask), ids, 0.7), 0.0)  # noqa: E731
    want_lp = full().detach()
    want = grads(engine, lambda: weighted_logprob_sum(full(), mask))
    engine.set_options(TrainKernelOptions(packing=packing))
    run = functools.partial(train_kernels.next_token_logprobs, engine.model)
    fused = lambda: train_kernels.fused_token_logprobs(engine.model, run, ids, mask, 0.7, packing, bucket,  # noqa: E731
                                                       entropy=True)
    got_lp, got_entropy, _, _ = fused()
    torch.testing.assert_close(got_lp.detach(), want_lp, atol=2e-5, rtol=0)
    with torch.no_grad():
        want_entropy = torch.where(mask.bool(), token_entropy(engine.forward(ids, mask), 0.7), 0.0)
    assert not got_entropy.requires_grad
    torch.testing.assert_close(got_entropy, want_entropy, atol=2e-5, rtol=0)
    got = grads(engine, lambda: weighted_logprob_sum(fused()[0], mask))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("packing, bucket", [(False, False), (True, False), (True, True)])
def test_fused_logprobs_at_the_teachers_tokens_equal_the_full_log_softmax_with_gradients(packing, bucket):
    """With topk_indices (GKD's student against a top-k teacher): the log-softmax at those tokens
    and the mass outside them, aligned like the logprobs, as the full logits give them."""
    import functools

    import torch.nn.functional as F

    engine = Trainer("tiny_qwen2", CFG).engine
    ids, mask = ragged(rows=6, width=23, seed=7)
    vocab = engine.model.config.vocab_size
    indices = torch.stack([torch.randperm(vocab, generator=torch.Generator().manual_seed(i))[:4]
                           for i in range(ids.numel())]).view(*ids.shape, 4)
    valid = mask.bool()

    def full():
        top, rest = train_kernels.topk_logprobs(engine.forward(ids, mask)[:, :-1].float() / 0.7, indices[:, 1:])
        return torch.where(valid[..., None], F.pad(top, (0, 0, 1, 0)), 0.0), torch.where(valid, F.pad(rest, (1, 0)), 0.0)

    def weighted(top, rest):
        return (top * torch.arange(1, 5)).mul(valid[..., None]).sum() + (rest * valid).sum() * 0.3

    want_top, want_rest = (t.detach() for t in full())
    want = grads(engine, lambda: weighted(*full()))
    engine.set_options(TrainKernelOptions(packing=packing))
    run = functools.partial(train_kernels.next_token_logprobs, engine.model)
    fused = lambda: train_kernels.fused_token_logprobs(engine.model, run, ids, mask, 0.7, packing, bucket,  # noqa: E731
                                                       topk_indices=indices)[2:]
    got_top, got_rest = fused()
    assert got_top.shape == (*ids.shape, 4) and got_rest.shape == ids.shape
    torch.testing.assert_close(got_top.detach(), want_top, atol=2e-5, rtol=0)
    torch.testing.assert_close(got_rest.detach(), want_rest, atol=2e-5, rtol=0)
    got = grads(engine, lambda: weighted(*fused()))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-4, msg=name)


def test_fused_logprobs_of_one_position_are_zero():
    """A micro-batch cut to one position (rows of one token, or only padding) predicts nothing."""
    import functools

    engine = Trainer("tiny_qwen2", CFG).engine
    run = functools.partial(train_kernels.next_token_logprobs, engine.model)
    ids, mask = torch.tensor([[5], [6]]), torch.tensor([[1], [0]])
    lp, entropy, _, _ = train_kernels.fused_token_logprobs(engine.model, run, ids, mask, 1.0, False, entropy=True)
    assert lp.shape == entropy.shape == (2, 1) and not lp.any() and not entropy.any()


def test_packed_fused_logprobs_give_a_rows_first_token_zero():
    """Left padding: packed, nothing predicts a row's first real token, so it gets 0; every
    later token equals the unpacked logprob."""
    import functools

    engine = Trainer("tiny_qwen2", CFG).engine
    ids, mask = ragged(rows=4, width=9, seed=5)
    ids, mask = ids.flip(1), mask.flip(1)  # real tokens at the end of each row
    want = torch.where(mask.bool(), token_logprobs(engine.forward(ids, mask), ids, 1.0), 0.0).detach()
    engine.set_options(TrainKernelOptions(packing=True))
    run = functools.partial(train_kernels.next_token_logprobs, engine.model)
    with torch.no_grad():
        got = train_kernels.fused_token_logprobs(engine.model, run, ids, mask, 1.0, packing=True)[0]
    first = mask.long().argmax(1)
    rows = torch.arange(len(ids))
    assert (got[rows, first] == 0).all() and (got[~mask.bool()] == 0).all()
    later = mask.bool().clone()
    later[rows, first] = False
    assert later.any()
    torch.testing.assert_close(got[later], want[later], atol=2e-5, rtol=0)


def test_chunked_logprobs_multiply_in_the_autocast_dtype_forward_and_backward():
    """Under bf16 autocast (as the trainer on a GPU) every matmul of the chunked log-softmax,
    the backward's too, runs in bf16 (a backward runs outside autocast: it used to multiply
    float32 master weights in float32, several times slower on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.dtypes.append(args[-2].dtype)
            return func(*args, **(kwargs or {}))

    engine = Trainer("tiny_qwen2", CFG).engine
    head = engine.model.get_output_embeddings()
    ids, mask = ragged(rows=3, width=9, seed=6)
    hidden = torch.randn(3, 9, head.in_features, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with MatmulDtypes() as forward:
            lp = train_kernels.chunked_token_logprobs(hidden, head, ids, mask, 0.7, chunk=4)
        want = torch.where(mask.bool(), token_logprobs(head(hidden), ids, 0.7), 0.0)
    with MatmulDtypes() as backward:
        weighted_logprob_sum(lp, mask).backward()
    assert forward.dtypes and backward.dtypes
    assert set(forward.dtypes) == set(backward.dtypes) == {torch.bfloat16}
    assert hidden.grad.dtype == torch.float32 and head.weight.grad.dtype == torch.float32
    torch.testing.assert_close(lp, want, atol=0.05, rtol=0)  # the full logits' bf16 matmul


@pytest.mark.parametrize("n, want", [(1, 1), (15, 15), (16, 16), (17, 18), (100, 104), (1024, 1024), (1025, 1152),
                                     (8192, 8192), (8193, 9216), (20000, 20480)])
def test_packed_lengths_round_up_to_eight_sizes_per_power_of_two(n, want):
    assert train_kernels.pack_bucket(n) == want
    assert want - n <= max(n // 8, 1) and train_kernels.pack_bucket(want) == want


def test_bucketed_packing_gives_the_unbucketed_outputs_and_gradients():
    """The padding row a bucketed packed forward adds changes no real token's output or gradient."""
    engine = Trainer("tiny_qwen2", CFG).engine
    engine.set_options(TrainKernelOptions(packing=True))
    ids, mask = ragged(rows=6, width=23, seed=2)
    assert train_kernels.pack_bucket(int(mask.sum())) > int(mask.sum())  # a padding row is added
    outputs = {}
    for bucket in (False, True):
        engine.model.zero_grad(set_to_none=True)
        logits = train_kernels.packed_forward(engine.model, ids, mask, bucket=bucket)
        weighted_logprob_sum(token_logprobs(logits, ids, 0.7), mask).backward()
        outputs[bucket] = logits.detach(), {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    torch.testing.assert_close(outputs[True][0], outputs[False][0], atol=2e-5, rtol=1e-5)
    for name, grad in outputs[False][1].items():
        torch.testing.assert_close(outputs[True][1][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_cuda_graph_options_copy_gradients_out_of_the_graph_pool_and_train_as_the_plain_engine(monkeypatch):
    """cuda_graphs' engine side (on CPU torch.compile records no graphs, so without compile here,
    and a replay is simulated): a step's first micro-batch takes the backward's outputs as its
    gradients; the next replay overwrites those (here with NaN), so before it the engine copies
    them out and later micro-batches accumulate into the copies. Steps of one and of four
    micro-batches, through an offload, equal the plain trainer's; bucketed packing."""
    import dataclasses

    cfg = dataclasses.replace(CFG, micro_batch_per_device=3)
    plain, graphed = Trainer("tiny_qwen2", cfg), Trainer("tiny_qwen2", cfg)
    graphed.engine.set_options(TrainKernelOptions(packing=True, cuda_graphs=True))
    pool, replays, backward = [], [], graphed.engine.backward

    def graph_backward(loss):
        first = all(p.grad is None for p in graphed.engine.params)
        backward(loss)
        if first:  # what a graph's backward returns lives in its pool
            pool.extend(p.grad for p in graphed.engine.params)

    def replay():
        for grad in pool:
            grad.fill_(float("nan"))
        pool.clear()
        replays.append(1)

    monkeypatch.setattr(graphed.engine, "backward", graph_backward)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", replay)
    for step, rows in enumerate([10, 3, 10, 3]):  # 4 micro-batches, then 1
        batch = sft_batch(rows, seed=step)
        a, b = plain.train_step(batch), graphed.train_step(batch)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                   rel=1e-4)
        assert all(p.grad is None for t in (plain, graphed) for p in t.engine.params)
        if step == 1:
            for t in (plain, graphed):
                t.offload(model=True, optimizer=True)
                t.onload()
    assert len(replays) == 10
    for (name, p), q in zip(plain.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def test_train_steps_with_packing_and_checkpointing_follow_the_plain_ones():
    plain, packed = Trainer("tiny_qwen2", CFG), Trainer("tiny_qwen2", CFG)
    packed.engine.set_options(TrainKernelOptions(packing=True, activation_checkpointing=True))
    for step in range(3):
        batch = sft_batch(12, seed=step)
        a, b = plain.train_step(batch), packed.train_step(batch)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"],
                                                                                                   rel=1e-4)
    for (name, p), q in zip(plain.model.named_parameters(), packed.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)
    torch.testing.assert_close(packed.logprobs(batch), plain.logprobs(batch), atol=1e-5, rtol=0)


def test_packed_chunked_logprobs_match_the_rollouts():
    rollout = Rollout("tiny_qwen2", config={"device": "cpu"})
    c = rollout.generate(["1+2", "(3+4)*5", "9"], SamplingParams(temperature=0.8, max_new_tokens=10, n=2, seed=0))
    batch = batch_from_completions(c, rollout.pad_id)
    engine = Trainer("tiny_qwen2", CFG).engine
    engine.set_options(TrainKernelOptions(packing=True))
    with torch.no_grad():
        lp = engine.token_logprobs(batch.input_ids, batch.attention_mask, 0.8)[0]
    mask = batch.loss_mask.bool()
    torch.testing.assert_close(lp[mask], batch.old_logprobs[mask], atol=1e-4, rtol=0)


def test_packing_leaves_the_saved_config_alone(tmp_path):
    trainer = Trainer("tiny_qwen2", CFG)
    trainer.engine.set_options(TrainKernelOptions(packing=True))
    trainer.save(tmp_path / "ckpt")
    text = (tmp_path / "ckpt" / "config.json").read_text()
    assert train_kernels.PACKED_ATTENTION not in text and "unpacked" not in text
    copy.deepcopy(trainer.model.config)  # still an ordinary config


def test_trainer_config_switches_the_options_on_and_chunked_logprobs_match():
    """trainer.packing / activation_checkpointing / chunked_logprobs reach the torch engine; a
    step and the logprobs with them equal the plain trainer's; other engines refuse them."""
    import dataclasses

    plain = Trainer("tiny_qwen2", CFG)
    fast = Trainer("tiny_qwen2", dataclasses.replace(CFG, packing=True, activation_checkpointing=True,
                                                    chunked_logprobs=True))
    assert fast.engine.kernels == TrainKernelOptions(packing=True, activation_checkpointing=True)
    batch = sft_batch(12, seed=3)
    torch.testing.assert_close(fast.logprobs(batch), plain.logprobs(batch), atol=1e-5, rtol=0)
    a, b = plain.train_step(batch), fast.train_step(batch)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    with pytest.raises(ValueError, match=r"trainer \['packing'\] need the torch engine, not deepspeed"):
        Trainer("tiny_qwen2", dataclasses.replace(CFG, packing=True), engine="deepspeed")


def test_packing_alone_takes_logprobs_and_entropy_from_the_packed_tokens_only(monkeypatch):
    """trainer.packing without compile: the train step, its logged entropy and the logprobs come
    from the output head over the packed real tokens (the padded [B, T, V] logits are never made)
    and equal the plain trainer's; with chunked_logprobs the chunked head serves what it can."""
    import dataclasses

    kw = dict(loss_fn=loss_logging_entropy, loss_inputs=("entropy",))
    plain = Trainer("tiny_qwen2", CFG, **kw)
    packed = Trainer("tiny_qwen2", dataclasses.replace(CFG, packing=True), **kw)
    assert packed.engine.packed_logprobs and not plain.engine.packed_logprobs

    def padded_logits(*args):
        raise AssertionError("the padded logits were computed")
    monkeypatch.setattr(packed.engine, "forward", padded_logits)
    batch = sft_batch(12, seed=5)
    for _ in range(2):
        a, b = plain.train_step(batch), packed.train_step(batch)
        for key in ("loss", "grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
    torch.testing.assert_close(packed.logprobs(batch), plain.logprobs(batch), atol=1e-5, rtol=0)
    chunked = Trainer("tiny_qwen2", dataclasses.replace(CFG, packing=True, chunked_logprobs=True))
    monkeypatch.setattr(chunked.engine, "_packed_logprobs", padded_logits)
    torch.testing.assert_close(chunked.logprobs(batch), Trainer("tiny_qwen2", CFG).logprobs(batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize("option", ["fused_logprobs", "chunked_logprobs"])
def test_compiled_logprob_options_train_as_the_plain_trainer(monkeypatch, option):
    """trainer.fused_logprobs (the compiled function takes the train step, its logged entropy
    and the logprobs) and chunked_logprobs with compile (the compiled base model under the
    chunked head) give the plain trainer's step (traced by dynamo and AOTAutograd; inductor's
    code: tests/test_gpu.py)."""
    import dataclasses
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    kw = dict(loss_fn=loss_logging_entropy, loss_inputs=("entropy",)) if option == "fused_logprobs" else {}
    plain = Trainer("tiny_qwen2", CFG, **kw)
    fast = Trainer("tiny_qwen2", dataclasses.replace(CFG, compile=True, packing=True, **{option: True}), **kw)
    compiled = {"fused_logprobs": "_compiled_logprobs", "chunked_logprobs": "_compiled_base"}[option]
    calls = []
    monkeypatch.setattr(fast.engine, compiled, functools.partial(
        lambda run, *a, **k: calls.append(1) or run(*a, **k), getattr(fast.engine, compiled)))
    batch = sft_batch(12, seed=3)
    a, b = plain.train_step(batch), fast.train_step(batch)
    assert calls, f"{option} did not run its compiled function"
    for key in ("loss", "grad_norm", "entropy") if kw else ("loss", "grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-4), key
    torch.testing.assert_close(fast.logprobs(batch), plain.logprobs(batch), atol=1e-5, rtol=0)


@pytest.mark.parametrize("keys, problem", [
    ({"fused_logprobs": True}, "fused_logprobs=true is a compiled function: set compile=true too"),
    ({"fused_logprobs": True, "compile": True, "chunked_logprobs": True}, "fused_logprobs and chunked_logprobs"),
    ({"cuda_graphs": True}, "cuda_graphs=true replays compiled graphs: set compile=true too")])
def test_logprob_and_graph_options_that_need_another_are_refused(keys, problem):
    from roles.trainer import resolve_trainer_config

    with pytest.raises(ValueError, match=problem):
        resolve_trainer_config(keys)


def test_the_varlen_kernel_and_its_parameter_names_are_read_once():
    """An eager packed forward calls `_varlen` per layer: the kernel's signature (its parameters
    differ between torch versions) is read on the first call only, and names what it takes."""
    from torch.nn.attention.varlen import varlen_attn

    train_kernels._varlen_kernel.cache_clear()
    kernel, params = train_kernels._varlen_kernel()
    assert kernel is varlen_attn
    assert {"query", "key", "value", "scale"} <= params
    assert train_kernels._varlen_kernel() == (kernel, params)
    assert train_kernels._varlen_kernel.cache_info().hits == 1
