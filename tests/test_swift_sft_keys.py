"""`swift sft` and `swift sample` keys of ms-swift's example files: gradient_accumulation_steps
counts sequences per update over the trainer's ranks, model_name/model_author fill the
self-cognition placeholders, and the keys that cannot be honoured are refused in one line."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from algorithms import sft
from algorithms.config.checks import check_loggers
from algorithms.config.swift_keys import translate
from algorithms.data.user_data import load_user_data
from algorithms.distill import DistillConfig
from orchestration.config import ConfigError

SFT = OmegaConf.structured(sft.SFTConfig)
DISTILL = OmegaConf.structured(DistillConfig)


def test_accumulation_sets_sequences_per_update_from_the_ranks():
    _, out, no_effect = translate({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8,
                                   "per_device_eval_batch_size": 1}, "sft", SFT)
    assert out == {"trainer.micro_batch_per_device": 2, "algorithm.gradient_accumulation_steps": 8}
    assert no_effect == ["per_device_eval_batch_size"]
    cfg = OmegaConf.to_object(SFT)
    cfg = replace(cfg, trainer=replace(cfg.trainer, micro_batch_per_device=2),
                  algorithm=replace(cfg.algorithm, gradient_accumulation_steps=8))
    assert sft.with_accumulation(cfg, 4).run.prompts_per_step == 64  # 2 x 8 x 4 ranks
    assert sft.with_accumulation(replace(cfg, algorithm=sft.SFTAlgorithm()), 4).run.prompts_per_step == \
        cfg.run.prompts_per_step


def test_self_cognition_placeholders_take_the_names(tmp_path):
    path = tmp_path / "self.jsonl"
    rows = [{"query": "Who are you?", "response": "I am {{NAME}}, made by {{AUTHOR}}.", "tag": "en"},
            {"query": "你是谁?", "response": "我是{{NAME}}, 由{{AUTHOR}}训练.", "tag": "zh"},
            {"query": "2+2?", "response": "4"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = load_user_data(str(path)).examples
    _, out, _ = translate({"model_name": ["小黄", "Xiao Huang"], "model_author": "swift"}, "sft", SFT)
    algo = sft.SFTAlgorithm(model_name=out["algorithm.model_name"], model_author=out["algorithm.model_author"])
    filled = sft.with_identity(examples, algo)
    assert [ex.solution for ex in filled] == ["I am Xiao Huang, made by swift.", "我是小黄, 由swift训练.", "4"]
    assert sft.with_identity(examples, sft.SFTAlgorithm()) == examples


@pytest.mark.parametrize("file, message", [
    ({"sampler_engine": "client", "model": "qwen-max", "stream": True,
      "engine_kwargs": '{"base_url": "https://example.invalid/v1"}'}, "nothing here calls an external API"),
    ({"sampler_engine": "pt", "engine_kwargs": {"cache_max_entry_count": 0.7}}, "no 'pt' engine arguments"),
    ({"prm_model": "Qwen/Qwen2.5-Math-PRM-7B"}, "PRM saved here"),
])
def test_sampling_keys_that_cannot_be_honoured_are_refused(file, message):
    with pytest.raises(ConfigError, match=message) as e:
        translate(file, "distill", DISTILL)
    assert "\n" not in str(e.value)


def test_vllm_engine_kwargs_and_swanlab():
    _, out, _ = translate({"sampler_engine": "vllm", "engine_kwargs": '{"max_num_seqs": 64}'}, "distill", DISTILL)
    assert out == {"backend.rollout": "vllm", "vllm.max_num_seqs": 64}
    _, out, _ = translate({"report_to": "swanlab"}, "sft", SFT)
    assert out == {"run.loggers": ["jsonl", "swanlab"]}
    with pytest.raises(ConfigError, match="pip install -c constraints.txt swanlab"):  # not installed here
        check_loggers(out["run.loggers"])
