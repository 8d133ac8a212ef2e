"""LoRA on the trainer (roles.lora): only the adapter trains, the base with the adapter off is the
reference and the self-teacher, each kind of weight sync gives the rollout the trainer's merged
model, and the checkpoint is PEFT's format beside a plain merged model."""
from __future__ import annotations

import json

import peft
import pytest
import torch

from roles.batch import Batch, SamplingParams
from roles.engines.torch_engine import token_logprobs
from roles.lora import LoraConfig, adapter_state, adapter_weights, hf_name, lora_problems, unknown_targets
from roles.models import build_model
from roles.rollout import Rollout
from roles.teacher import Teacher
from roles.trainer import ADAPTER_DIR, BaseTeacher, Trainer

MODEL = "tiny_qwen2"
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0}


def _batch(seed: int = 0, rows: int = 4, width: int = 12) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    mask[0, width - 3:] = 0  # one row right-padded
    return Batch(input_ids=ids * mask, attention_mask=mask, loss_mask=mask.clone())


def _trainer(**lora) -> Trainer:
    return Trainer(MODEL, {"lr": 5e-2, "device": "cpu", "lora": {**LORA, **lora}})


@pytest.fixture(scope="module")
def trained() -> Trainer:
    trainer = _trainer()
    for step in range(3):
        trainer.train_step(_batch(step))
    return trainer


def _merged_model(trainer: Trainer):
    model = build_model(MODEL)
    got = model.load_state_dict(dict(p for b in trainer.state_dict_buckets(1000) for p in b), strict=False)
    assert not got.unexpected_keys and set(got.missing_keys) <= {"lm_head.weight"}
    return model


def _logprobs(model, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return token_logprobs(logits, batch.input_ids, 1.0) * batch.attention_mask


def test_only_the_adapter_trains_and_holds_optimizer_state(trained):
    trainable = {n for n, p in trained.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # Optimizer state exists for the adapter's parameters only.
    state = trained.engine.optimizer.state
    assert len(state) == len(trainable) and all(p.requires_grad for p in state)
    # The base stays as built.
    base = build_model(MODEL).state_dict()
    for name, t in trained.model.state_dict().items():
        if ".base_layer." in name:
            assert torch.equal(t, base[hf_name(name)]), name


def test_base_logprobs_equal_a_separately_loaded_base_model(trained):
    batch = _batch(7)
    base = _logprobs(build_model(MODEL), batch)
    assert torch.allclose(trained.base_logprobs(batch), base, atol=1e-5)
    assert (trained.logprobs(batch) - base).abs().max() > 1e-2  # the adapter did change the policy


@pytest.mark.parametrize("topk", [None, 5])
def test_base_teacher_equals_a_teacher_of_the_base_model(trained, topk):
    batch = _batch(8)
    want = Teacher(MODEL, {"device": "cpu"}).logits(batch, topk=topk, temperature=0.9)
    got = trained.base_teacher(batch, topk, 0.9)
    if topk is None:
        assert torch.allclose(got, want, atol=1e-5)
    else:
        assert torch.allclose(got[0], want[0], atol=1e-5) and torch.equal(got[1], want[1])


def test_train_step_with_the_base_as_reference_and_teacher_equals_passing_their_answers():
    batch = _batch(3)
    inside, outside = _trainer(), _trainer()
    a = inside.train_step(batch, reference=True, teacher=BaseTeacher(None, 1.0))
    given = Batch(**{**batch.__dict__, "ref_logprobs": outside.base_logprobs(batch),
                     "teacher_logprobs": outside.base_teacher(batch, None, 1.0)})
    b = outside.train_step(given)
    assert a["loss"] == b["loss"]


def test_merged_weights_are_the_trainers_model(trained):
    batch = _batch(9)
    assert torch.allclose(_logprobs(_merged_model(trained), batch), trained.logprobs(batch), atol=1e-5)
    adapted = {n for b in trained.state_dict_buckets(1000, part="adapted") for n, _ in b}
    full = {n for b in trained.state_dict_buckets(1000) for n, _ in b}
    assert adapted < full and all(n.endswith("proj.weight") for n in adapted)


def _greedy(rollout: Rollout, prompts) -> list:
    return rollout.generate(prompts, SamplingParams(max_new_tokens=10, temperature=0.0)).completion_ids


def _hf_greedy(model, prompts) -> list:
    out = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _no_eos(rows):
    return [r for r in rows]


def test_each_kind_of_sync_gives_the_rollout_the_trainers_merged_model():
    trainer = _trainer()
    merged_rollout = Rollout(MODEL, config={"device": "cpu"})
    adapter_rollout = Rollout(MODEL, config={"device": "cpu", "lora_rank": LORA["rank"], "lora_alpha": LORA["alpha"]})
    merged_rollout.update_weights(trainer.state_dict_buckets(64), 0)  # the first sync is whole
    for step in range(1, 3):
        trainer.train_step(_batch(step))
        adapted = trainer.state_dict_buckets(64, part="adapted")
        adapter = trainer.state_dict_buckets(64, part="adapter")
        merged_rollout.update_weights(adapted, step, part="adapted")
        adapter_rollout.update_weights(adapter, step, part="adapter")
        want = _hf_greedy(_merged_model(trainer), PROMPTS)
        stop = merged_rollout.eos_ids
        for got in (_greedy(merged_rollout, PROMPTS), _greedy(adapter_rollout, PROMPTS)):
            for g, w in zip(got, want):  # the rollout stops at eos; HF was told not to
                cut = next((i + 1 for i, t in enumerate(w) if t in stop), len(w))
                assert g == w[:cut]
        sizes = [sum(t.numel() * t.element_size() for b in parts for _, t in b)
                 for parts in (trainer.state_dict_buckets(64), adapted, adapter)]
        assert sizes[2] < sizes[1] < sizes[0]


def test_an_adapter_sync_to_a_rollout_without_lora_is_refused(trained):
    rollout = Rollout(MODEL, config={"device": "cpu"})
    with pytest.raises(ValueError, match="lora_rank=0"):
        rollout.update_weights(trained.state_dict_buckets(64, part="adapter"), 1, part="adapter")


def test_checkpoint_is_peft_adapter_beside_a_plain_merged_model(trained, tmp_path):
    trained.save(tmp_path)
    config = json.loads((tmp_path / ADAPTER_DIR / "adapter_config.json").read_text())
    assert config["r"] == LORA["rank"] and config["peft_type"] == "LORA"
    batch = _batch(10)
    loaded = peft.PeftModel.from_pretrained(build_model(MODEL), str(tmp_path / ADAPTER_DIR))
    assert torch.allclose(_logprobs(loaded, batch), trained.logprobs(batch), atol=1e-5)
    plain = build_model({"name": "merged", "path": str(tmp_path)})
    assert type(plain).__name__ == "Qwen2ForCausalLM"
    assert torch.allclose(_logprobs(plain, batch), trained.logprobs(batch), atol=1e-5)


def test_resume_restores_adapter_and_optimizer_bitwise(tmp_path):
    straight, first = _trainer(), _trainer()
    for step in range(2):
        straight.train_step(_batch(step))
        first.train_step(_batch(step))
    first.save(tmp_path)
    resumed = _trainer()
    resumed.load(tmp_path)
    for step in range(2, 4):
        a, b = straight.train_step(_batch(step)), resumed.train_step(_batch(step))
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for (n, x), (_, y) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(x, y), n


def test_a_trained_output_head_stays_tied_and_round_trips(tmp_path):
    """modules_to_save=[lm_head] on a model with tied embeddings trains one copy shared by both
    (merged weights and the checkpoint agree with the trainer); adapter names map back exactly."""
    trainer = _trainer(modules_to_save=["lm_head"])
    for step in range(2):
        trainer.train_step(_batch(step))
    named = dict(trainer.engine.named_weights())
    saved = dict(adapter_weights(named.items()))
    assert all(n.startswith("base_model.model.") for n in saved)
    back = adapter_state(saved)
    assert set(back) == {n for n in named if ".lora_" in n or ".modules_to_save." in n}
    batch = _batch(11)
    assert torch.allclose(_logprobs(_merged_model(trainer), batch), trainer.logprobs(batch), atol=1e-5)
    trainer.save(tmp_path)
    loaded = peft.PeftModel.from_pretrained(build_model(MODEL), str(tmp_path / ADAPTER_DIR))
    assert torch.allclose(_logprobs(loaded, batch), trainer.logprobs(batch), atol=1e-5)


@pytest.mark.parametrize("lora, problem", [
    ({"rank": -1}, "lora.rank=-1 must be >= 1"),
    ({"rank": 4, "alpha": 0}, "lora.alpha=0"),
    ({"rank": 4, "dropout": 1.0}, "lora.dropout=1.0"),
    ({"rank": 4, "target_modules": []}, "lora.target_modules is empty"),
])
def test_bad_lora_values_are_named(lora, problem):
    assert any(problem in p for p in lora_problems(LoraConfig(**lora)))
    with pytest.raises(ValueError, match="trainer config"):
        Trainer(MODEL, {"device": "cpu", "lora": lora})


def test_unknown_target_module_is_named():
    model = build_model(MODEL)
    assert unknown_targets(model, LoraConfig(rank=4, target_modules=["q_proj", "c_attn"])) == ["c_attn"]
    # An embedding is no linear layer: it trains whole, in modules_to_save.
    assert unknown_targets(model, LoraConfig(rank=4, target_modules=["embed_tokens"],
                                             modules_to_save=["embed_tokens"])) == ["embed_tokens"]
    with pytest.raises(ValueError, match=r"modules \['c_attn'\]"):
        _trainer(target_modules=["c_attn"])


def test_megatron_lora_refuses_what_it_does_not_map_naming_the_engines_that_serve():
    # (LoRA on the Megatron engine itself: tests/test_megatron_lora.py)
    with pytest.raises(ValueError, match=r"cannot map modules_to_save.*backend.train=torch or deepspeed"):
        Trainer(MODEL, {"device": "cpu", "lora": {**LORA, "modules_to_save": ["lm_head"]}}, engine="megatron")


def test_the_frozen_base_is_kept_in_the_compute_dtype():
    """Under bf16 autocast the base never updates, so it is held in bf16 (half the memory and the
    offload bytes); the adapter keeps fp32 master weights and its optimizer state."""
    trainer = Trainer(MODEL, {"lr": 1e-2, "device": "cpu", "dtype": "bfloat16", "lora": LORA})
    assert {p.dtype for p in trainer.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in trainer.engine.params} == {torch.float32}
    before = trainer.train_step(_batch(0))["loss"]
    moved = trainer.offload()
    trainer.onload()
    assert moved["model_bytes"] < sum(p.numel() * 4 for p in trainer.model.parameters()) * 0.6
    assert trainer.train_step(_batch(0))["loss"] < before


def test_forward_options_give_the_same_lora_steps():
    """The torch engine's forward options (chunked logprobs, packing, activation checkpointing)
    run through the adapted model and give the plain forward's LoRA updates."""
    def losses(**options):
        trainer = Trainer(MODEL, {"lr": 5e-2, "device": "cpu", "lora": LORA, **options})
        return [trainer.train_step(_batch(step))["loss"] for step in range(3)]

    plain = losses()
    for options in ({"chunked_logprobs": True}, {"packing": True}, {"activation_checkpointing": True}):
        assert losses(**options) == pytest.approx(plain, rel=1e-5), options
