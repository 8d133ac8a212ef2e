"""The static decode path keeping its buffers and CUDA graph across calls
(roles/engines/torch_decode.StaticDecoder): which calls reuse them (`fits`), that reused
buffers decode exactly what fresh ones do (CPU, eager steps), that Rollout.sleep drops them,
and on a GPU (gpu-marked) that a replayed graph gives the tokens of a fresh capture and HF
`generate`, follows weights loaded in place, and that sleep frees its memory."""
import dataclasses

import pytest
import torch

from roles.batch import SamplingParams
from roles.engines import torch_decode
from roles.engines.torch_decode import Bucket, StaticDecoder, bucket, fits
from roles.models import build_model
from roles.rollout import Rollout
from tests.test_rollout import CPU, GREEDY, PROMPTS, lively

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bucket_and_fit_decision():
    assert bucket(5, 30, 100, graphs=True) == Bucket(8, 192, 100)  # rows to 8, slots to 64
    assert bucket(5, 30, 100, graphs=False) == Bucket(5, 192, 100)
    held = Bucket(512, 320, 256)
    assert fits(held, held)
    assert fits(held, Bucket(256, 320, 256))  # half the rows: 2x the work, at the slack
    assert fits(held, Bucket(512, 192, 128))  # a shorter call, within the slack
    assert not fits(held, Bucket(248, 320, 256))  # more than REUSE_SLACK x the work
    assert not fits(held, Bucket(64, 320, 256))
    assert not fits(held, Bucket(520, 320, 256))  # more rows than held
    assert not fits(held, Bucket(512, 384, 256))  # more slots
    assert not fits(held, Bucket(512, 320, 300))  # more output tokens
    assert not fits(None, held)


def test_no_slack_never_reuses(monkeypatch):
    """REUSE_SLACK 0 (the benchmark's reuse_decode=false): every call allocates and captures."""
    monkeypatch.setattr(torch_decode, "REUSE_SLACK", 0.0)
    assert not fits(Bucket(8, 64, 16), Bucket(8, 64, 16))


@pytest.fixture
def model():
    m = build_model("tiny_qwen2").eval()
    m.load_state_dict(lively(m))
    return m


def test_reused_buffers_decode_what_fresh_ones_do(model):
    """Eager steps on CPU over held buffers (stale K/V and counters from the call before)."""
    decoder = StaticDecoder(compile=False)
    calls = [  # (prompts, max_new_tokens, sampling), each after the one before on one decoder
        ([[5, 6, 7, 8, 9], [10, 11], list(range(3, 20)), [20]], 40, dict(temperature=0.0)),
        ([[10, 11, 12], [7]], 30, dict(temperature=0.0)),  # fits: buffers reused
        ([[4, 4, 4], [9, 8, 7, 6], [3], [12, 13]], 30, dict(temperature=1.0, top_k=5)),  # fits, sampled
        ([[5, 6]], 80, dict(temperature=0.0)),  # more slots and tokens: new buffers
    ]
    reused = []
    for prompts, new_tokens, sampling in calls:
        kw = {"top_k": 0, "top_p": 1.0, "max_new_tokens": new_tokens, "stop_ids": [2], "pad_id": 0,
              "seeds": [100 + i for i in range(len(prompts))], **sampling}
        before = torch_decode.COUNTS["buffers_reused"]
        got = torch_decode.generate_static(model, prompts, **kw, decoder=decoder)
        reused.append(torch_decode.COUNTS["buffers_reused"] - before)
        want = torch_decode.generate_static(model, prompts, **kw)  # fresh buffers
        assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
        torch.testing.assert_close(sum(got.logprobs, []), sum(want.logprobs, []), atol=1e-5, rtol=0)
    assert reused == [0, 1, 1, 0]
    assert decoder.buffers.size == Bucket(1, 128, 80)
    assert decoder.release() > 0 and decoder.buffers is None and decoder.release() == 0


def test_rollout_keeps_the_buffers_until_sleep(monkeypatch):
    monkeypatch.setattr(torch_decode, "STATIC_DEVICES", {"cpu", "cuda"})
    rollout = Rollout("tiny_qwen2", config=CPU)
    rollout.update_weights([lively(rollout.model)], version=1)
    sampling = dataclasses.replace(GREEDY, max_new_tokens=16)
    first = rollout.generate(PROMPTS, sampling).completion_ids
    held = rollout._decoder.buffers
    before = torch_decode.COUNTS["buffers_reused"]
    assert rollout.generate(PROMPTS[:3], sampling).completion_ids == first[:3]
    assert torch_decode.COUNTS["buffers_reused"] == before + 1 and rollout._decoder.buffers is held
    rollout.sleep(1)
    assert rollout._decoder.buffers is None
    rollout.wake_up()
    assert rollout.generate(PROMPTS, sampling).completion_ids == first
    assert torch_decode.COUNTS["buffers_reused"] == before + 1  # fresh buffers after the sleep


# ----------------------------------------------------------------------------- GPU

def allocated() -> int:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.gpu
def test_replayed_graph_gives_the_tokens_of_a_fresh_capture_and_of_hf_generate():
    from roles.models import load_tokenizer

    rollout = Rollout("tiny_qwen2", config={"device": "cuda", "dtype": "float32"})
    rollout.update_weights([lively(rollout.model)], version=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    counts = dict(torch_decode.COUNTS)
    first = rollout.generate(PROMPTS, greedy)
    subset = PROMPTS[:0:-1]  # 4 rows, the longest prompt kept: the same 8-row bucket, replayed
    again = rollout.generate(subset, greedy)
    assert torch_decode.COUNTS["reused"] == counts["reused"] + 1
    assert torch_decode.COUNTS["graph"] == counts["graph"] + 2
    assert again.completion_ids == first.completion_ids[:0:-1]
    # Against HF generate (fp32, the same weights).
    model, tok = build_model("tiny_qwen2").cuda().eval(), load_tokenizer("tiny_qwen2")
    model.load_state_dict(lively(model))
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in subset]
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt").to("cuda")
    ref = model.generate(**enc, do_sample=False, max_new_tokens=40, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:].tolist()
    for ids, row in zip(again.completion_ids, ref):
        assert ids == row[:len(ids)]
    # Weights loaded in place: the replayed graph reads them (the tokens of a fresh capture).
    reused = torch_decode.COUNTS["reused"]
    rollout.update_weights([build_model("tiny_qwen2").state_dict()], version=2)
    got = rollout.generate(PROMPTS, greedy)
    assert torch_decode.COUNTS["reused"] == reused + 1
    fresh = torch_decode.generate_static(rollout.model, [rollout._encode(p, None) for p in PROMPTS],
                                         temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=40,
                                         stop_ids=sorted(rollout.eos_ids), pad_id=rollout.pad_id)
    assert got.completion_ids == fresh.tokens and got.completion_ids != first.completion_ids
    # Seeded sampling (other settings: captured afresh, then replayed) draws the same again.
    sampled = SamplingParams(temperature=0.9, top_k=20, max_new_tokens=40, n=2, seed=5)
    a = rollout.generate(PROMPTS, sampled)
    b = rollout.generate(PROMPTS, sampled)
    assert torch_decode.COUNTS["reused"] == reused + 2
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs


@pytest.mark.gpu
def test_sleep_frees_the_kept_cache_and_graph():
    rollout = Rollout("small_qwen2", config={"device": "cuda", "max_batch_size": 64})
    greedy = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)
    prompts = [f"{i}+{i}" for i in range(64)]
    torch.cuda.empty_cache()
    before = allocated()
    want = rollout.generate(prompts, greedy).completion_ids
    kept = rollout._decoder.buffers.nbytes()
    assert kept > 0 and allocated() - before >= kept  # buffers (and the graph's pool) stay after the call
    awake = allocated()
    weights = sum(p.numel() * p.element_size() for p in rollout.model.parameters())
    rollout.sleep(1)
    assert awake - allocated() >= 0.95 * (weights + kept)  # the weights and the whole decode footprint
    assert rollout._decoder.buffers is None and rollout._decoder.graph is None
    rollout.wake_up()
    captured = torch_decode.COUNTS["graph"] - torch_decode.COUNTS["reused"]
    assert rollout.generate(prompts, greedy).completion_ids == want
    assert torch_decode.COUNTS["graph"] - torch_decode.COUNTS["reused"] == captured + 1  # captured afresh
