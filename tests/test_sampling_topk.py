"""top_k / top_p sampling (GRPO's algorithm.top_k, algorithm.top_p; ms-swift's keys) in the
torch rollout's two decode loops and the vLLM rollout: top_k=1 samples the greedy tokens, top_k=k
only the k most likely, top_p only the nucleus; the reported logprob stays that of the
temperature-scaled distribution before the cut (a full forward's)."""
import dataclasses

import pytest
import torch

from algorithms import grpo
from algorithms.config.schema import prepare
from algorithms.config.swift_keys import translate
from orchestration.config import ConfigError
from roles.batch import SamplingParams, batch_from_completions
from roles.engines import torch_decode
from roles.engines.torch_engine import token_logprobs
from roles.rollout import Rollout
from tests.driver_helpers import composed
from tests.test_rollout import CPU, PROMPTS, lively
from tests.test_swift_args import defaults

GREEDY = SamplingParams(temperature=0, max_new_tokens=16)
# Flat enough that unrestricted sampling often leaves the top 3 (asserted below).
HOT = SamplingParams(temperature=2.0, max_new_tokens=16, n=3, seed=5)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def ranks_and_logprobs(model, completions, pad_id, temperature):
    """Per completion token: its rank in the full forward's distribution (0: the most likely),
    that forward's logprob at `temperature` and the rollout's; and the distribution's mass above it."""
    batch = batch_from_completions(completions, pad_id)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    probs = torch.softmax(logits[:, :-1] / temperature, -1)
    picked = probs.gather(-1, batch.input_ids[:, 1:, None])
    mask = batch.loss_mask[:, 1:].bool()
    ranks = (probs > picked).sum(-1)[mask]
    above = (probs * (probs > picked)).sum(-1)[mask]
    ref = token_logprobs(logits, batch.input_ids, temperature)[:, 1:][mask]
    return ranks, above, ref, batch.old_logprobs[:, 1:][mask]


@pytest.fixture(scope="module")
def rollout():
    r = Rollout("tiny_qwen2", config=CPU)
    r.update_weights([lively(r.model)], version=1)
    return r


@pytest.fixture(params=["dynamic", "static"])
def decode(request, monkeypatch):
    """The rollout's decode loop: the dynamic one (CPU's) or the static one (CUDA's, here on CPU)."""
    if request.param == "static":
        monkeypatch.setattr(torch_decode, "STATIC_DEVICES", {"cpu", "cuda"})
    return request.param


def test_top_k_1_samples_the_greedy_tokens(rollout, decode):
    greedy = rollout.generate(PROMPTS, GREEDY)
    assert rollout.engine_info()["decode"] == decode
    for seed in (1, 2):
        one = rollout.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=16, n=2, seed=seed))
        assert one.completion_ids == [ids for ids in greedy.completion_ids for _ in range(2)]
        free = rollout.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=seed))
        assert free.completion_ids != one.completion_ids  # without the cut it samples


def test_top_k_samples_only_the_k_most_likely_and_reports_the_uncut_logprob(rollout, decode):
    free = ranks_and_logprobs(rollout.model, rollout.generate(PROMPTS, HOT), rollout.pad_id, HOT.temperature)
    assert free[0].max() >= 3  # unrestricted, tokens outside the top 3 are drawn
    ranks, _, ref, reported = ranks_and_logprobs(rollout.model, rollout.generate(PROMPTS, dataclasses.replace(
        HOT, top_k=3)), rollout.pad_id, HOT.temperature)
    assert ranks.max() < 3 and ranks.max() > 0  # within the top 3, not only the first
    torch.testing.assert_close(reported, ref, atol=1e-4, rtol=0)


def test_top_p_samples_only_the_nucleus(rollout, decode):
    _, above, ref, reported = ranks_and_logprobs(rollout.model, rollout.generate(PROMPTS, dataclasses.replace(
        HOT, top_p=0.5)), rollout.pad_id, HOT.temperature)
    assert above.max() < 0.5  # the tokens ranked above each drawn one hold less than top_p
    torch.testing.assert_close(reported, ref, atol=1e-4, rtol=0)


def test_the_vllm_rollout_honours_top_k():
    pytest.importorskip("vllm")
    ref = Rollout("tiny_qwen2", config=CPU)
    fast = Rollout("tiny_qwen2", config=CPU, engine="vllm")
    gen = torch.Generator().manual_seed(1)
    # Sharper logits than the preset's init (as tests/test_vllm_engine.py): fewer near-ties between engines.
    weights = [(n, torch.ones_like(p) + 0.1 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                else 0.12 * torch.randn(p.shape, generator=gen)) for n, p in ref.model.named_parameters()]
    ref.update_weights([weights], version=1)
    fast.update_weights([weights], version=1)
    one = fast.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=16, n=2, seed=3))
    assert one.completion_ids == [ids for ids in ref.generate(PROMPTS, GREEDY).completion_ids for _ in range(2)]
    free = ranks_and_logprobs(ref.model, fast.generate(PROMPTS, HOT), ref.pad_id, HOT.temperature)
    assert free[0].max() >= 3
    ranks, _, want, reported = ranks_and_logprobs(ref.model, fast.generate(PROMPTS, dataclasses.replace(HOT, top_k=3)),
                                                  ref.pad_id, HOT.temperature)
    assert 0 < ranks.max() < 3
    torch.testing.assert_close(reported, want, atol=1e-3, rtol=0)


def test_grpo_keys_map_and_bad_values_are_refused():
    _, out, _ = translate({"top_k": 80, "top_p": 0.9}, "grpo", defaults())
    assert out["algorithm.top_k"] == 80 and out["algorithm.top_p"] == 0.9
    base = ["+experiment=grpo_quickstart", "backend=local"]
    typed, plan = prepare(composed(grpo.GRPOConfig, base + ["algorithm.top_k=-1"]), grpo.GRPOConfig)
    grpo.validate(typed, plan)  # -1: no cut, as in ms-swift and vLLM
    for override, key in (("algorithm.top_k=-2", "algorithm.top_k"), ("algorithm.top_p=0", "algorithm.top_p"),
                          ("algorithm.top_p=1.5", "algorithm.top_p")):
        typed, plan = prepare(composed(grpo.GRPOConfig, base + [override]), grpo.GRPOConfig)
        with pytest.raises(ConfigError, match=f"'{key}'"):
            grpo.validate(typed, plan)
