"""Trainer on tiny presets (CPU, fp32): training, micro-batching, offload, checkpoints,
weight buckets, and data parallel over a real 2-rank Ray worker group."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from algorithms.data.tasks import arithmetic_examples
from orchestration.local import LocalWorkerGroup
from orchestration.planner import make_plan
from roles.batch import Batch, pad_sequences
from roles.engines.torch_engine import token_logprobs
from roles.engines.torch_trainer import lr_multiplier
from roles.models import load_tokenizer
from roles.trainer import Trainer, TrainerConfig, resolve_trainer_config

MODEL = "tiny_qwen2"


def sft_batch(n: int, seed: int = 0, model: str = MODEL) -> Batch:
    """Chat-formatted arithmetic problems; the loss counts the assistant reply tokens."""
    tok = load_tokenizer(model)
    seqs, masks = [], []
    for ex in arithmetic_examples(n, seed=seed):
        out = tok.apply_chat_template(ex.messages(), return_assistant_tokens_mask=True, return_dict=True)
        seqs.append(out["input_ids"])
        masks.append(out["assistant_masks"])
    ids, attn = pad_sequences(seqs, tok.pad_token_id)
    loss_mask = torch.zeros(ids.shape)
    for i, m in enumerate(masks):
        loss_mask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=loss_mask)


def config(**overrides) -> TrainerConfig:
    base = dict(lr=1e-3, warmup_steps=2, total_steps=12, micro_batch_per_device=4, device="cpu", dtype="float32")
    return TrainerConfig(**{**base, **overrides})


def weights(trainer: Trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def optimizer_tensors(trainer: Trainer) -> list:
    return [v.clone() for s in trainer.engine.optimizer.state.values() for v in s.values()]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def batch():
    return sft_batch(8)


def test_config_is_validated():
    with pytest.raises(ValueError, match="schedule='step'"):
        resolve_trainer_config({"schedule": "step"})
    with pytest.raises(ValueError, match="min_lr"):
        resolve_trainer_config({"lr": 1e-4, "min_lr": 1e-3})
    with pytest.raises(ValueError, match="cuda_graphs=true replays compiled graphs: set compile=true"):
        resolve_trainer_config({"cuda_graphs": True})
    with pytest.raises(Exception, match="momentum"):
        resolve_trainer_config({"momentum": 0.9})
    cfg = resolve_trainer_config({"lr": 3e-4, "betas": [0.9, 0.95]})
    assert cfg.lr == 3e-4 and cfg.betas == (0.9, 0.95) and cfg.schedule == "cosine"


def test_lr_schedule_warmup_then_cosine():
    assert [lr_multiplier(s, 2, 10, "cosine") for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_multiplier(6, 2, 10, "cosine") == pytest.approx(0.5)
    assert lr_multiplier(10, 2, 10, "cosine") == pytest.approx(0.0) == lr_multiplier(50, 2, 10, "cosine")
    assert lr_multiplier(50, 2, 10, "constant") == 1.0


def test_lr_schedule_linear_and_min_lr_floor():
    assert lr_multiplier(6, 2, 10, "linear") == pytest.approx(0.5)
    assert lr_multiplier(10, 2, 10, "linear") == pytest.approx(0.0)
    # min_lr / lr = 0.1: both decays end there and stay, the warmup is unchanged.
    assert lr_multiplier(10, 2, 10, "cosine", 0.1) == pytest.approx(0.1) == lr_multiplier(40, 2, 10, "linear", 0.1)
    assert lr_multiplier(6, 2, 10, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_multiplier(0, 2, 10, "cosine", 0.1) == 0.5


def test_training_lowers_loss_on_a_fixed_batch(batch):
    trainer = Trainer(MODEL, config(total_steps=100))
    metrics = [trainer.train_step(batch) for _ in range(8)]
    assert set(metrics[0]) == {"loss", "grad_norm", "lr", "tokens", "sequences", "step"}
    assert metrics[0]["tokens"] == batch.loss_mask.sum().item() and metrics[0]["sequences"] == 8
    assert [m["lr"] for m in metrics[:3]] == pytest.approx([5e-4, 1e-3, 1e-3])
    assert [m["step"] for m in metrics] == list(range(1, 9)) and trainer.step == 8
    assert metrics[-1]["loss"] < 0.8 * metrics[0]["loss"], [m["loss"] for m in metrics]
    # The reported loss is the token-mean NLL of the weights before the update.
    fresh = Trainer(MODEL, config())
    nll = -(fresh.logprobs(batch) * batch.loss_mask).sum() / batch.loss_mask.sum()
    assert metrics[0]["loss"] == pytest.approx(nll.item(), abs=1e-5)


def _step_with_grads(trainer: Trainer, batch: Batch):
    """One train_step, keeping a copy of the gradients the optimizer sees."""
    grads, original = {}, trainer.engine.optimizer_step

    def capture(grad_clip):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return original(grad_clip)

    trainer.engine.optimizer_step = capture
    try:
        return trainer.train_step(batch), grads
    finally:
        trainer.engine.optimizer_step = original


def test_micro_batching_gives_the_same_loss_and_gradients(batch):
    whole, whole_grads = _step_with_grads(Trainer(MODEL, config(micro_batch_per_device=0)), batch)
    ones, ones_grads = _step_with_grads(Trainer(MODEL, config(micro_batch_per_device=1)), batch)
    assert ones["loss"] == pytest.approx(whole["loss"], abs=1e-5)
    assert ones["grad_norm"] == pytest.approx(whole["grad_norm"], abs=1e-5)
    for name, g in whole_grads.items():
        torch.testing.assert_close(ones_grads[name], g, atol=1e-5, rtol=0, msg=name)


def test_automatic_micro_batch_fits_the_budget_and_changes_nothing(batch):
    """micro_batch_per_device=0 takes the whole share when it fits micro_batch_memory_mb, else the
    most rows that fit; either way the step equals one pass over the whole batch."""
    from roles.batch import fitting_rows, token_bytes

    roomy = Trainer(MODEL, config(micro_batch_per_device=0))
    width = batch.input_ids.shape[1]
    per_row = width * token_bytes(roomy.model, backward=True)
    assert roomy._micro_size(batch, backward=True) == len(batch)
    tight_mb = 3 * per_row / 2**20  # three rows fit
    assert fitting_rows(len(batch), width, token_bytes(roomy.model, True), tight_mb) == 3
    assert fitting_rows(len(batch), width, token_bytes(roomy.model, True), tight_mb / 10) == 1
    tight = Trainer(MODEL, config(micro_batch_per_device=0, micro_batch_memory_mb=tight_mb))
    assert tight._micro_size(batch, backward=True) == 3
    whole, whole_grads = _step_with_grads(roomy, batch)
    split, split_grads = _step_with_grads(tight, batch)
    assert split["loss"] == pytest.approx(whole["loss"], abs=1e-5)
    for name, g in whole_grads.items():
        torch.testing.assert_close(split_grads[name], g, atol=1e-5, rtol=0, msg=name)
    with pytest.raises(ValueError, match="micro_batch_memory_mb=0"):
        resolve_trainer_config({"micro_batch_memory_mb": 0})


@pytest.mark.parametrize("optimizer", ["adamw_fused", "adamw_foreach", "adamw_for_loop"])
def test_optimizer_kernels_give_the_same_update(batch, optimizer):
    """trainer.optimizer picks torch's AdamW kernel; adam_eps and betas reach every param group."""
    plain = Trainer(MODEL, config(adam_eps=1e-6, betas=(0.8, 0.95)))
    other = Trainer(MODEL, config(adam_eps=1e-6, betas=(0.8, 0.95), optimizer=optimizer))
    groups = other.engine.optimizer.param_groups
    assert all(g["eps"] == 1e-6 and g["betas"] == (0.8, 0.95) for g in groups)
    flag = {"adamw_fused": ("fused", True), "adamw_foreach": ("foreach", True), "adamw_for_loop": ("foreach", False)}
    assert all(g[flag[optimizer][0]] is flag[optimizer][1] for g in groups)
    for _ in range(2):
        plain.train_step(batch), other.train_step(batch)
    for name, w in weights(plain).items():
        torch.testing.assert_close(weights(other)[name], w, atol=1e-6, rtol=1e-5, msg=name)
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        resolve_trainer_config({"optimizer": "sgd"})


def test_train_and_eval_mode_switch_only_when_they_change(batch):
    """train_step runs in train mode and logprobs in eval mode; consecutive steps do not walk the
    submodules again (a switch is counted by the modules whose train() ran)."""
    trainer = Trainer(MODEL, config())
    switches = []
    for module in trainer.model.modules():
        original = module.train
        module.train = lambda mode=True, _o=original, _m=module: (switches.append(_m), _o(mode))[1]
    trainer.train_step(batch)
    assert trainer.model.training and all(m.training for m in trainer.model.modules())
    first = len(switches)
    assert first > 0
    trainer.train_step(batch)
    assert len(switches) == first
    trainer.logprobs(batch)
    assert not any(m.training for m in trainer.model.modules()) and len(switches) > first


def test_the_fused_kernel_clips_as_clip_grad_norm(batch):
    """adamw_fused clips by dividing the gradients inside the kernel (grad_scale); the update equals
    clip_grad_norm_ then the per-tensor kernel, and differs from an unclipped one (a large adam_eps
    lets the gradient scale show in the update)."""
    def run(optimizer, grad_clip):
        trainer = Trainer(MODEL, config(optimizer=optimizer, grad_clip=grad_clip, adam_eps=1e-3))
        norms = [trainer.train_step(batch)["grad_norm"] for _ in range(2)]
        return weights(trainer), norms

    fused, norms = run("adamw_fused", 0.05)
    assert min(norms) > 0.05  # clipping acted on both steps
    reference, reference_norms = run("adamw_for_loop", 0.05)
    assert norms == pytest.approx(reference_norms, rel=1e-5)
    unclipped, _ = run("adamw_fused", 0.0)
    for name, w in reference.items():
        torch.testing.assert_close(fused[name], w, atol=1e-6, rtol=1e-5, msg=name)
    assert max(float((unclipped[n] - w).abs().max()) for n, w in reference.items()) > 1e-4
    assert not hasattr(Trainer(MODEL, config(optimizer="adamw_fused")).engine.optimizer, "grad_scale")


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_a_non_finite_gradient_norm_skips_the_update(batch, optimizer):
    """A step whose gradient norm is not finite changes no weight, optimizer step or lr; the
    fused kernel skips it on the device (found_inf) without the host reading the norm first."""
    trainer = Trainer(MODEL, config(optimizer=optimizer, warmup_steps=2))
    trainer.train_step(batch)
    before, lr = weights(trainer), trainer.engine.current_lr()
    nan_loss = lambda logprobs, mb, extras: ((logprobs * float("nan")).sum(), {})
    trainer.loss_fn = nan_loss
    out = trainer.train_step(batch)
    assert not math.isfinite(out["grad_norm"]) and out["step"] == 1.0
    assert trainer.engine.current_lr() == lr
    for name, w in weights(trainer).items():
        assert torch.equal(w, before[name]), name
    assert not hasattr(trainer.engine.optimizer, "found_inf")


def test_loss_function_contract(batch):
    """The loss sees aligned logprobs, aligned logits/entropy on request, and global counts."""
    seen = []

    def loss_fn(logprobs, mb, extras):
        seen.append((logprobs.detach(), mb, extras))
        picked = torch.log_softmax(extras["logits"][:, 1:], -1).gather(-1, mb.input_ids[:, 1:, None])[..., 0]
        torch.testing.assert_close(picked * mb.attention_mask[:, 1:], logprobs[:, 1:].detach(), atol=1e-6, rtol=0)
        assert extras["entropy"].shape == logprobs.shape and (extras["entropy"][:, 0] == 0).all()
        loss = -(logprobs * mb.loss_mask).sum() / extras["global_tokens"]
        return loss, {"count": 2.0}

    trainer = Trainer(MODEL, config(micro_batch_per_device=3), loss_fn=loss_fn, loss_inputs=("logits", "entropy"))
    expected = trainer.logprobs(batch)
    metrics = trainer.train_step(batch)
    assert len(seen) == 3 and metrics["count"] == pytest.approx(2.0)
    for _, _, e in seen:
        assert e["global_tokens"] == batch.loss_mask.sum().item()
        assert (e["global_sequences"], e["global_micro_batches"], e["temperature"]) == (8, 3, 1.0)
    got = torch.zeros_like(expected)
    for i, (lp, mb, _) in enumerate(seen):
        got[3 * i:3 * i + len(mb), :lp.shape[1]] = lp
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_logprobs_match_a_direct_forward(batch):
    trainer = Trainer(MODEL, config())
    model = trainer.model
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    direct = token_logprobs(logits, batch.input_ids, temperature=0.7) * batch.attention_mask
    lp, ent = trainer.logprobs(batch, temperature=0.7, entropy=True)
    assert lp.shape == batch.input_ids.shape and (lp[:, 0] == 0).all()
    assert (lp[batch.attention_mask == 0] == 0).all() and (ent[batch.attention_mask == 0] == 0).all()
    torch.testing.assert_close(lp, direct, atol=1e-5, rtol=0)
    assert (ent[:, 1:][batch.attention_mask[:, 1:] == 1] > 0).all()


def test_offload_onload_round_trip_is_bit_identical(batch):
    trainer, twin = Trainer(MODEL, config()), Trainer(MODEL, config())
    trainer.train_step(batch), twin.train_step(batch)
    before_w, before_o = weights(trainer), optimizer_tensors(trainer)
    before_buckets = trainer.state_dict_buckets(1)
    moved = trainer.offload(model=True, optimizer=True)
    n_params = sum(p.numel() * 4 for p in trainer.model.parameters())
    assert n_params <= moved["model_bytes"] and moved["optimizer_bytes"] >= 2 * n_params
    # The live tensors are really released.
    assert all(p.numel() == 0 for p in trainer.model.parameters())
    assert all(v.numel() == 0 for s in trainer.engine.optimizer.state.values() for v in s.values())
    with pytest.raises(RuntimeError, match="onload"):
        trainer.train_step(batch)
    # Weights can still be read for a sync while offloaded.
    for a, b in zip(sum(trainer.state_dict_buckets(1), []), sum(before_buckets, [])):
        assert a[0] == b[0] and torch.equal(a[1], b[1])
    back = trainer.onload()
    assert back["model_bytes"] == moved["model_bytes"] and back["optimizer_bytes"] == moved["optimizer_bytes"]
    for k, v in weights(trainer).items():
        assert torch.equal(v, before_w[k]), k
    assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(trainer), before_o))
    # Offloading only the optimizer leaves the model usable for logprobs.
    trainer.offload(model=False, optimizer=True)
    assert torch.equal(trainer.logprobs(batch), twin.logprobs(batch))
    trainer.onload()
    assert trainer.train_step(batch)["loss"] == twin.train_step(batch)["loss"]


def test_save_load_continue_matches_training_straight_through(batch, tmp_path):
    straight = Trainer(MODEL, config())
    expected = [straight.train_step(batch)["loss"] for _ in range(6)]
    first = Trainer(MODEL, config())
    losses = [first.train_step(batch)["loss"] for _ in range(3)]
    first.save(tmp_path / "ckpt")
    resumed = Trainer(MODEL, config(seed=7))  # different RNG, restored by load
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 3
    after = [resumed.train_step(batch) for _ in range(3)]
    assert losses + [m["loss"] for m in after] == pytest.approx(expected, abs=1e-6, rel=0)
    assert [m["lr"] for m in after] == pytest.approx([1e-3 * lr_multiplier(s, 2, 12, "cosine") for s in (3, 4, 5)])


def test_load_optimizer_moments_keeps_this_runs_lr_and_step(batch, tmp_path):
    """A follow-on phase takes the checkpoint's AdamW moments but its own lr, schedule and step."""
    first = Trainer(MODEL, config())
    for _ in range(3):
        first.train_step(batch)
    first.save(tmp_path / "ckpt")
    follow = Trainer(tmp_path / "ckpt", config(lr=5e-4, schedule="constant", warmup_steps=0))
    follow.load_optimizer_moments(tmp_path / "ckpt")
    saved = first.engine.optimizer.state_dict()["state"]
    got = follow.engine.optimizer.state_dict()["state"]
    assert saved.keys() == got.keys()
    for k in saved:
        assert torch.equal(saved[k]["exp_avg_sq"], got[k]["exp_avg_sq"]) and float(got[k]["step"]) == 3
    assert follow.step == 0 and follow.engine.current_lr() == 5e-4
    assert follow.train_step(batch)["lr"] == 5e-4


def test_checkpoint_loads_with_plain_transformers(batch, tmp_path):
    trainer = Trainer(MODEL, config())
    trainer.train_step(batch)
    trainer.save(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert tok("12+7").input_ids == trainer.tokenizer("12+7").input_ids
    with torch.no_grad():
        ours = trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        theirs = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    assert torch.equal(ours, theirs)


def test_state_dict_buckets_cover_all_weights_in_order_and_respect_size(batch):
    trainer = Trainer(MODEL, config())
    limit_mb = 0.1
    buckets = trainer.state_dict_buckets(limit_mb)
    flat = [item for b in buckets for item in b]
    names = [n for n, _ in flat]
    # Every parameter once (the tied output head is the embedding), in state_dict order.
    params = dict(trainer.model.named_parameters())
    assert set(params) <= set(names) and len(names) == len(set(names))
    assert names == [n for n in trainer.model.state_dict() if n in names]
    assert "lm_head.weight" not in names and trainer.model.config.tie_word_embeddings
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= limit_mb * 2**20 or len(b) == 1
    assert len(buckets) > 3
    assert [n for b in trainer.state_dict_buckets(limit_mb) for n, _ in b] == names
    # Host copies: a later step does not change what was handed out.
    snapshot = {n: t.clone() for n, t in flat}
    trainer.train_step(batch)
    assert all(torch.equal(t, snapshot[n]) for n, t in flat)
    assert not torch.equal(params[names[0]].detach(), snapshot[names[0]])
    half = trainer.state_dict_buckets(1024, dtype="bfloat16")
    assert len(half) == 1 and all(t.dtype == torch.bfloat16 for _, t in half[0])


def test_trainer_under_local_worker_group_equals_direct(batch):
    plan = make_plan({"device_groups": {"nproc_per_node": 1, "g": {"device": "CPU", "ranks": 1, "workers": ["train"]}}})
    group = LocalWorkerGroup(Trainer, plan["train"], {"model": MODEL, "config": config()})
    direct = Trainer(MODEL, config())
    for _ in range(2):
        got = group.call("train_step", batch, dispatch="slice", collect="flatten")
        want = direct.train_step(batch)
        assert got == {k: [v] for k, v in want.items()}
    assert torch.equal(group.call("logprobs", batch, dispatch="slice", collect="flatten"), direct.logprobs(batch))


# Two data-parallel ranks against one rank (losses, gradient norms, replicas, logprobs):
# tests/test_loopback.py::test_two_rank_run_with_collective_sync_listens_only_on_loopback, on the
# two ranks whose sockets it checks.


def empty_slice_kwargs(micro_batch: int) -> dict:
    from algorithms.objectives.losses import make_loss

    return {"model": MODEL, "loss_fn": make_loss("sft"),  # a loss that reports metrics (nll)
            "config": dict(lr=1e-3, device="cpu", dtype="float32", warmup_steps=0, total_steps=10,
                           micro_batch_per_device=micro_batch)}


class TrainerPerMicroBatch:
    """One Trainer per micro_batch_per_device in each rank's process, all on the rank's one
    data-parallel process group, so a single 2-rank group serves every case; its train_step and
    logprobs are lockstep methods as the Trainer's are."""

    LOCKSTEP_METHODS = Trainer.LOCKSTEP_METHODS

    def __init__(self, micro_batches: list):
        self.trainers = {m: Trainer(**empty_slice_kwargs(m)) for m in micro_batches}

    def train_step(self, batch, micro_batch):
        return self.trainers[micro_batch].train_step(batch)

    def logprobs(self, batch, micro_batch):
        return self.trainers[micro_batch].logprobs(batch)


@pytest.fixture(scope="module")
def empty_slice_group(ray_cluster):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"device_groups": {"nproc_per_node": 1, "g": {"device": "CPU", "ranks": 2, "workers": ["train"]}}})
    placement = create_placement(plan, timeout_s=60)
    group = None
    try:
        group = WorkerGroup(TrainerPerMicroBatch, plan["train"], {"micro_batches": [0, 2]}, placement=placement,
                            timeout_s=180)
        yield group
    finally:
        if group is not None:
            group.shutdown()
        placement.remove()


@pytest.mark.parametrize("micro_batch", [0, 2])
def test_a_rank_with_an_empty_slice_still_joins_the_collectives(empty_slice_group, micro_batch):
    """One row over two data-parallel ranks: rank 1's slice is empty, yet it must take part
    in the gradient and metric sums (skipping it would leave rank 0 waiting; summing fewer
    metric names than rank 0 would too); the update equals a single trainer's. Micro-batch 0
    (the whole share at once) included."""
    batch = sft_batch(1, seed=5)
    dp = empty_slice_group.call("train_step", batch, micro_batch, dispatch="slice")
    dp_logprobs = empty_slice_group.call("logprobs", batch, micro_batch, dispatch="slice", collect="flatten")
    single = Trainer(**empty_slice_kwargs(micro_batch))
    want = single.train_step(batch)
    assert len(dp) == 2 and dp[0] == dp[1] and dp[0]["sequences"] == 1
    assert math.isclose(dp[0]["loss"], want["loss"], abs_tol=1e-5)
    assert math.isclose(dp[0]["nll"], want["nll"], abs_tol=1e-5)
    torch.testing.assert_close(dp_logprobs, single.logprobs(batch), atol=1e-5, rtol=0)
