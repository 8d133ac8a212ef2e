"""The static-KV-cache decode path (roles/engines/torch_decode.py), which the torch Rollout
takes on CUDA, run on CPU: the Rollout tests of greedy decoding against transformers,
logprobs against a full forward, seeds and stops, plus its batched seeded sampler. (The same
path with the decode step captured as a CUDA graph: tests/test_gpu.py.)"""
import dataclasses

import pytest
import torch

from roles.batch import SamplingParams
from roles.engines import torch_decode
from roles.engines.decoding import filter_logits
from roles.engines.torch_generate import generate_batch
from roles.models import build_model
from roles.rollout import Rollout
from tests import test_rollout
from tests.test_rollout import CPU, GREEDY, PROMPTS, lively

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def static_path(monkeypatch):
    """generate_batch takes the static path on CPU too; yields the number of calls that did."""
    monkeypatch.setattr(torch_decode, "STATIC_DEVICES", {"cpu", "cuda"})
    before = torch_decode.COUNTS["eager"]
    yield lambda: torch_decode.COUNTS["eager"] - before


@pytest.mark.parametrize("preset", ["tiny_qwen2", "tiny_llama"])
def test_greedy_matches_transformers_generate(static_path, preset):
    test_rollout.test_greedy_matches_transformers_generate(preset)
    assert static_path() == 1


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=0),
    SamplingParams(temperature=0.7, top_k=3, max_new_tokens=16, n=2, seed=2),
    SamplingParams(temperature=1.0, top_p=0.3, max_new_tokens=16, n=2, seed=3),
    GREEDY,
], ids=["t1", "t0.7-topk", "t1-topp", "greedy"])
def test_logprobs_match_a_full_forward(static_path, sampling):
    test_rollout.test_logprobs_match_a_full_forward(Rollout("tiny_qwen2", config=CPU), sampling)
    assert static_path() == 1


def test_seeds_stops_and_chunking(static_path):
    rollout = Rollout("tiny_qwen2", config=CPU)
    test_rollout.test_seeds_reproduce_and_samples_are_grouped(rollout)
    test_rollout.test_max_new_tokens_and_stop_tokens(rollout)
    assert static_path() > 5


def test_static_path_equals_the_dynamic_loop_and_stops_early():
    model = build_model("tiny_qwen2").eval()
    model.load_state_dict(lively(model))
    prompts = [[5, 6, 7, 8, 9], [10, 11], list(range(3, 20)), [20]]
    kw = dict(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=40, pad_id=0)
    for stops in ([], [2], [model.generation_config.eos_token_id]):
        want = generate_batch(model, prompts, **kw, stop_ids=stops)
        got = torch_decode.generate_static(model, prompts, **kw, stop_ids=stops)
        assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
        torch.testing.assert_close(sum(got.logprobs, []), sum(want.logprobs, []), atol=1e-5, rtol=0)
    # Every row stops at its first token: the loop ends at the first done check, all rows "stop".
    first = [row[0] for row in want.tokens]
    short = torch_decode.generate_static(model, prompts, **kw, stop_ids=first)
    assert short.tokens == [[t] for t in first] and set(short.finish_reasons) == {"stop"}


def test_seeded_rows_do_not_depend_on_their_batch_mates():
    model = build_model("tiny_qwen2").eval()
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14], [20], [7, 7, 7, 7]]
    kw = dict(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12, stop_ids=[], pad_id=0)
    full = torch_decode.generate_static(model, prompts, **kw, seeds=[11, 12, 13, 14])
    part = torch_decode.generate_static(model, prompts[2:0:-1], **kw, seeds=[13, 12])
    assert part.tokens == full.tokens[2:0:-1]  # logprobs: equal up to rounding (other padding width)
    torch.testing.assert_close(part.logprobs, full.logprobs[2:0:-1], atol=1e-5, rtol=0)
    other = torch_decode.generate_static(model, prompts, **kw, seeds=[11, 12, 13, 15])
    assert other.tokens[:3] == full.tokens[:3] and other.tokens[3] != full.tokens[3]


def test_batched_sampler_draws_from_the_filtered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])
    rows = 40000
    seeds = torch.arange(rows, dtype=torch.long) * 7919 + 3
    for step, (top_k, top_p) in enumerate([(0, 1.0), (3, 1.0), (0, 0.8)]):
        token, logprob = torch_decode.sample_rows(logits.expand(rows, -1), 1.0, top_k, top_p, seeds,
                                                  torch.tensor([step]))
        probs = torch.softmax(logits, -1)
        torch.testing.assert_close(logprob, probs.log()[token])  # unfiltered logprob of the drawn token
        want = torch.softmax(torch_decode_filter(logits, top_k, top_p), -1)
        freq = torch.bincount(token, minlength=len(logits)).double() / rows
        assert (freq - want.double()).abs().max() < 0.01, (top_k, top_p, freq, want)
        assert (freq[want == 0] == 0).all()
    u = torch_decode.row_uniforms(seeds, torch.tensor([0]))
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    again = torch_decode.row_uniforms(seeds, torch.tensor([1]))
    assert abs(float(torch.corrcoef(torch.stack([u, again]))[0, 1])) < 0.02  # steps draw afresh


def torch_decode_filter(logits, top_k, top_p):
    return filter_logits(logits[None], top_k, top_p)[0]


def test_cpu_default_is_still_the_dynamic_loop():
    before = dict(torch_decode.COUNTS)
    Rollout("tiny_qwen2", config=CPU).generate(PROMPTS, dataclasses.replace(GREEDY, max_new_tokens=4))
    assert torch_decode.COUNTS == before and "cpu" not in torch_decode.STATIC_DEVICES


def test_compiled_decode_step_equals_the_eager_step():
    """rollout.compile_decode: the decode step through torch.compile (on CPU here, without a
    graph) decodes the same tokens and logprobs, and a second call runs the compiled step again."""
    model = build_model("tiny_qwen2").eval()
    model.load_state_dict(lively(model))
    prompts = [[5, 6, 7, 8, 9], [10, 11], list(range(3, 20))]
    kw = dict(temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=12, stop_ids=[2], pad_id=0, seeds=[1, 2, 3],
              graphs=False)
    want = torch_decode.generate_static(model, prompts, **kw)
    decoder = torch_decode.StaticDecoder(compile=True)
    for _ in range(2):
        got = torch_decode.generate_static(model, prompts, **kw, decoder=decoder)
        assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    assert decoder.decode is not torch_decode.decode_step


def test_compiled_decode_compiles_each_setting_past_dynamo_limit():
    """Each sampling setting compiles the decode step once; dynamo's own limit (shared by every
    rollout of the process; 1 here) does not send the later ones to the uncompiled step."""
    from torch._dynamo.utils import counters

    model = build_model("tiny_qwen2").eval()
    decoder = torch_decode.StaticDecoder(compile=True)
    before = counters["stats"]["unique_graphs"]
    # config.patch, not monkeypatch: deleting a dynamo config key on undo hides it for good.
    graphs = []  # compiled graphs after each setting (the step compiles in pieces around the cumsum)
    with torch._dynamo.config.patch(recompile_limit=1):
        for top_k in (3, 4):
            torch_decode.generate_static(model, [[5, 6, 7]], temperature=0.8, top_k=top_k, top_p=1.0,
                                         max_new_tokens=3, stop_ids=[2], pad_id=0, seeds=[1], graphs=False,
                                         decoder=decoder)
            graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs[0] >= 1 and graphs[1] > graphs[0]  # the second setting compiled too, past the limit
    assert torch._dynamo.config.recompile_limit == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_compiled_sampling_at_qwen2_vocabulary_and_256_rows(top_p):
    """The compiled decode step's sampling at 256 rows of Qwen2's 151,936 logits (a compacted
    512-row call's first bucket). Compiled, the cumsums over the vocabulary once failed in
    Inductor's code generation (split scan); they run outside the graph and the compiled draw
    equals the eager one."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = 3 * torch.randn(256, 151936, device="cuda", generator=gen)
    seeds = torch.arange(256, device="cuda", dtype=torch.int64) * 7919
    step = torch.tensor(3, device="cuda")
    eager = torch_decode.sample_rows(logits, 1.0, 0, top_p, seeds, step)
    compiled = torch.compile(torch_decode.sample_rows, dynamic=False)(logits, 1.0, 0, top_p, seeds, step)
    assert torch.equal(compiled[0], eager[0])
    assert torch.allclose(compiled[1], eager[1], atol=1e-4)
