"""A checkpoint saved by plain transformers (not by this project) works in every role, and one
saved by this project loads with plain transformers."""
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from algorithms.data.tasks import ArithmeticConfig, arithmetic_examples
from algorithms.data.prompts import batch_of, encode_examples
from orchestration.local import LocalWorkerGroup
from orchestration.planner import make_plan
from roles.batch import SamplingParams
from roles.orm import ORM
from roles.prm import PRM
from roles.rollout import Rollout
from roles.sampler import Sampler
from roles.teacher import Teacher
from roles.tokenizers import build_char_tokenizer
from roles.trainer import Trainer


@pytest.fixture(scope="module")
def user_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "llama"
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=256, tie_word_embeddings=True))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_every_role_loads_and_runs_a_user_checkpoint(user_ckpt):
    tok = build_char_tokenizer()
    examples = arithmetic_examples(4, seed=0, config=ArithmeticConfig(2, 2, 1, 1, "+"))
    batch = batch_of(tok, encode_examples(tok, examples, False))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)

    trainer = Trainer(user_ckpt, {"device": "cpu", "lr": 1e-3, "schedule": "constant"})
    metrics = trainer.train_step(batch)
    assert metrics["tokens"] == batch.loss_mask.sum().item() and torch.isfinite(torch.tensor(metrics["loss"]))

    rollout = Rollout(user_ckpt, config={"device": "cpu"})
    out = rollout.generate([ex.prompt for ex in examples], greedy)
    assert len(out) == 4 and all(len(ids) >= 1 for ids in out.completion_ids)
    # The trained weights move into the rollout and change what it generates with.
    rollout.update_weights(trainer.state_dict_buckets(1.0), version=1)
    assert rollout.weight_version == 1

    teacher = Teacher(user_ckpt, {"device": "cpu"})
    values, indices = teacher.logits(batch, topk=4)
    assert values.shape == (*batch.input_ids.shape, 4) and indices.shape == values.shape

    sampler = Sampler(user_ckpt, config={"device": "cpu"})
    cands = sampler.sample([ex.prompt for ex in examples[:2]], n=3, sampling=SamplingParams(max_new_tokens=6))
    assert len(cands) == 6

    texts = [ex.solution for ex in examples]
    prompts = [ex.prompt for ex in examples]
    assert ORM(kind="model", model=user_ckpt, device="cpu").score(prompts, texts) is not None
    assert len(PRM(kind="model", model=user_ckpt, device="cpu").score_steps(prompts, texts)) == 4


def test_user_checkpoint_rollout_in_a_local_group_equals_direct(user_ckpt):
    prompts = ["1+2", "3+4", "5+6"]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    direct = Rollout(user_ckpt, config={"device": "cpu"}).generate(prompts, greedy)
    group = LocalWorkerGroup(Rollout, make_plan({"rollout": {"gpus": 2}})["rollout"],
                             {"model": user_ckpt, "config": {"device": "cpu"}})
    grouped = group.call("generate", prompts, greedy, dispatch="slice", collect="flatten")
    assert grouped.completion_ids == direct.completion_ids and grouped.texts == direct.texts


CHAT = [{"role": "user", "content": "3+5+7"}, {"role": "assistant", "content": "3+5=8\n8+7=15\n#### 15"}]
# Spaces, blank lines and a `#### N` answer: what a task's prompt and solution look like.
SPACED = "3+5+7\n3+5=8 #### 15\n\n  two  spaces \n"
TINY = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 128}


@pytest.mark.parametrize("kind", ["char", "gpt2"])
def test_trainer_checkpoint_loads_with_plain_transformers(kind, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from roles.tokenizers import LOADER_KWARGS, build_tokenizer

    built = build_tokenizer(kind)
    examples = arithmetic_examples(2, seed=0, config=ArithmeticConfig(2, 2, 1, 1, "+"))
    batch = batch_of(built, encode_examples(built, examples, False))
    trainer = Trainer({"name": "tiny", "tokenizer": kind, **TINY}, {"device": "cpu", "lr": 1e-3})
    trainer.train_step(batch)
    first = trainer.save(tmp_path / "step_1")
    # A second phase starts from the first one's folder (its tokenizer comes back through
    # from_pretrained) and saves again, as a warm start followed by GRPO/GKD does.
    second = Trainer(str(first), {"device": "cpu", "lr": 1e-3})
    second.train_step(batch)
    for ckpt, source in ((first, trainer), (second.save(tmp_path / "step_2"), second)):
        tok = AutoTokenizer.from_pretrained(ckpt)
        assert tok(SPACED)["input_ids"] == built(SPACED)["input_ids"]
        assert tok.decode(tok(SPACED)["input_ids"], skip_special_tokens=False) == SPACED
        assert tok.apply_chat_template(CHAT, tokenize=False) == built.apply_chat_template(CHAT, tokenize=False)
        config = json.loads((ckpt / "tokenizer_config.json").read_text())
        assert not set(LOADER_KWARGS) & set(config), config
        model = AutoModelForCausalLM.from_pretrained(ckpt)
        for name, value in source.model.state_dict().items():
            assert torch.equal(model.state_dict()[name], value), name
        gen = GenerationConfig.from_pretrained(ckpt)
        assert (gen.eos_token_id, gen.pad_token_id) == (built.eos_token_id, built.pad_token_id)
