"""Rollout and Sampler on tiny CPU models (fp32): generation against transformers, logprobs
against a full forward, seeds, stops, sleep/wake, weight updates, and hosting in worker groups.
"""
import dataclasses

import pytest
import torch

from algorithms.data.tasks import arithmetic_examples
from orchestration.local import LocalWorkerGroup
from orchestration.planner import make_plan
from roles.batch import SamplingParams, batch_from_completions
from roles.engines.torch_engine import token_logprobs
from roles.models import build_model, load_tokenizer
from roles.rollout import Rollout
from roles.sampler import Sampler

CPU = {"device": "cpu"}
OTHER = {"name": "tiny_qwen2", "tokenizer": "char", "seed": 1}  # same shapes, other weights
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
# Prompts of different lengths (left padding differs per row).
PROMPTS = [e.prompt for e in arithmetic_examples(4, seed=0)] + ["((1+2)*3)-4+5*6-7"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def rollout():
    return Rollout("tiny_qwen2", config=CPU)


def bucketed(model, per_bucket=5):
    """(name, tensor) buckets the way a trainer's state_dict_buckets hands them over."""
    items = list(model.state_dict().items())
    return [items[i:i + per_bucket] for i in range(0, len(items), per_bucket)]


def weights(r):
    return {n: p.detach().clone() for n, p in r.model.named_parameters()}


def lively(model):
    """The model's state with matrices scaled 4x: a fresh init decodes greedily into one repeated
    token, the scaled one into varied, context-dependent text that also hits eos."""
    return {n: t * 4 if t.ndim == 2 else t for n, t in model.state_dict().items()}


@pytest.mark.parametrize("preset", ["tiny_qwen2", "tiny_llama"])
def test_greedy_matches_transformers_generate(preset):
    model, tok = build_model(preset), load_tokenizer(preset)
    model.load_state_dict(lively(model))
    r = Rollout(preset, config=CPU)
    r.update_weights([lively(r.model)], version=1)
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS]
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    got = r.generate(PROMPTS, dataclasses.replace(GREEDY, max_new_tokens=24))
    ref = model.generate(**enc, do_sample=False, max_new_tokens=24, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[:, enc["input_ids"].shape[1]:]
    assert {"stop", "length"} == set(got.finish_reasons)
    assert len({tuple(ids) for ids in got.completion_ids}) == len(PROMPTS)
    for ids, reason, row in zip(got.completion_ids, got.finish_reasons, ref.tolist()):
        assert ids == row[:len(ids)]
        if reason == "stop":
            assert ids[-1] == tok.eos_token_id and row[len(ids):] == [tok.pad_token_id] * (len(row) - len(ids))
        else:
            assert len(ids) == 24
    assert got.prompt_ids == [[t for t, m in zip(ids, mask) if m]
                              for ids, mask in zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist())]
    assert got.texts == tok.batch_decode(got.completion_ids, skip_special_tokens=True)


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1.0, max_new_tokens=16, n=2, seed=0),
    SamplingParams(temperature=0.7, max_new_tokens=16, n=2, seed=1),
    SamplingParams(temperature=0.7, top_k=3, max_new_tokens=16, n=2, seed=2),
    SamplingParams(temperature=1.0, top_p=0.3, max_new_tokens=16, n=2, seed=3),
    GREEDY,
], ids=["t1", "t0.7", "t0.7-topk", "t1-topp", "greedy"])
def test_logprobs_match_a_full_forward(rollout, sampling):
    c = rollout.generate(PROMPTS, sampling)
    batch = batch_from_completions(c, rollout.pad_id)
    with torch.no_grad():
        logits = rollout.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    ref = token_logprobs(logits, batch.input_ids, sampling.temperature or 1.0)
    mask = batch.loss_mask.bool()
    assert mask.sum() == sum(len(x) for x in c.completion_ids)
    torch.testing.assert_close(batch.old_logprobs[mask], ref[mask], atol=1e-4, rtol=0)
    # Filtering decides what is drawn, not the reported logprobs: each token lies in the top-k
    # and the nucleus (the mass of the tokens more likely than it is below top_p).
    probs = torch.softmax(logits[:, :-1] / (sampling.temperature or 1.0), -1)
    picked = probs.gather(-1, batch.input_ids[:, 1:, None])
    above = probs > picked
    if sampling.top_k:
        assert above.sum(-1)[mask[:, 1:]].max() < sampling.top_k
    if sampling.top_p < 1:
        assert (probs * above).sum(-1)[mask[:, 1:]].max() < sampling.top_p


def test_seeds_reproduce_and_samples_are_grouped(rollout):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=7)
    a, b = rollout.generate(PROMPTS, sampling), rollout.generate(PROMPTS, sampling)
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert a.prompt_index == [i for i in range(len(PROMPTS)) for _ in range(3)]
    assert all(a.prompt_ids[k] == a.prompt_ids[3 * (k // 3)] for k in range(len(a)))
    assert len(set(map(tuple, a.completion_ids))) > len(PROMPTS)  # samples of one prompt differ
    assert rollout.generate(PROMPTS, dataclasses.replace(sampling, seed=8)).completion_ids != a.completion_ids
    # A sample depends on its seed and row only, not on how the request is chunked.
    chunked = Rollout("tiny_qwen2", config={**CPU, "max_batch_size": 4}).generate(PROMPTS, sampling)
    assert chunked.completion_ids == a.completion_ids
    # Unseeded requests follow the rollout's own generator: fresh each call, reproducible per config seed.
    free = dataclasses.replace(sampling, seed=None)
    x, y = Rollout("tiny_qwen2", config=CPU), Rollout("tiny_qwen2", config=CPU)
    first = x.generate(PROMPTS, free).completion_ids
    assert first == y.generate(PROMPTS, free).completion_ids != x.generate(PROMPTS, free).completion_ids


def test_max_new_tokens_and_stop_tokens(rollout):
    c = rollout.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=3))
    assert all(len(ids) == 6 and r == "length" for ids, r in zip(c.completion_ids, c.finish_reasons))
    stop = c.completion_ids[0][2]
    s = rollout.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=6, seed=3, stop_token_ids=(stop,)))
    for full, ids, reason in zip(c.completion_ids, s.completion_ids, s.finish_reasons):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert ids == full[:cut] and reason == ("stop" if stop in full else "length")
    assert s.finish_reasons[0] == "stop" and len(s.completion_ids[0]) <= 3
    assert rollout.generate(PROMPTS, dataclasses.replace(GREEDY, max_new_tokens=0)).completion_ids == [[]] * 5


def test_ignore_eos_decodes_max_new_tokens_past_the_eos():
    rollout = Rollout("tiny_qwen2", config=CPU)
    first = rollout.generate(PROMPTS[:1], GREEDY).completion_ids[0]
    rollout.eos_ids = {first[1]}  # the model's second greedy token now ends the completion
    assert rollout.generate(PROMPTS[:1], GREEDY).completion_ids[0] == first[:first.index(first[1]) + 1]
    full = rollout.generate(PROMPTS[:1], dataclasses.replace(GREEDY, ignore_eos=True))
    assert full.completion_ids[0] == first and full.finish_reasons == ["length"]
    stopped = rollout.generate(PROMPTS[:1], dataclasses.replace(GREEDY, ignore_eos=True, stop_token_ids=(first[3],)))
    assert stopped.completion_ids[0][-1] == first[3] and stopped.finish_reasons == ["stop"]


def test_prompt_forms(rollout):
    tok = rollout.tokenizer
    chat_ids = tok(tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)["input_ids"]
    by_text = rollout.generate(PROMPTS[:1], GREEDY)
    by_messages = rollout.generate([[{"role": "user", "content": PROMPTS[0]}]], GREEDY)
    by_ids = rollout.generate([chat_ids], GREEDY)
    assert by_text.prompt_ids == by_messages.prompt_ids == by_ids.prompt_ids == [chat_ids]
    assert by_text.completion_ids == by_messages.completion_ids == by_ids.completion_ids
    raw = rollout.generate(PROMPTS[:1], GREEDY, chat=False)
    assert raw.prompt_ids == [tok(PROMPTS[0])["input_ids"]]
    assert raw.texts == [tok.decode(raw.completion_ids[0], skip_special_tokens=True)]
    with pytest.raises(TypeError, match="list of prompts"):
        rollout.generate(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        rollout.generate(PROMPTS, {"temperature": 1.0, "top_p": 0, "max_new_tokens": 4})
    with pytest.raises(ValueError, match="max_new_tokens"):
        rollout.generate(PROMPTS, {"temperature": 1.0})


def test_sleep_level_1_round_trip_is_bit_identical():
    r = Rollout("tiny_qwen2", config=CPU)
    before, out = weights(r), r.generate(PROMPTS, GREEDY)
    r.sleep(1)
    assert r.sleep_level == 1 and all(p.numel() == 0 for p in r.model.parameters())
    with pytest.raises(RuntimeError, match=r"asleep \(sleep\(level=1\)\); call wake_up\(\)"):
        r.generate(PROMPTS, GREEDY)
    r.wake_up()
    after = weights(r)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert r.model.lm_head.weight is r.model.model.embed_tokens.weight  # ties survive
    assert r.generate(PROMPTS, GREEDY) == out


def test_sleep_level_2_needs_new_weights():
    r, other = Rollout("tiny_qwen2", config=CPU), Rollout(OTHER, config=CPU)
    target = other.generate(PROMPTS, GREEDY)
    r.sleep(2)
    with pytest.raises(RuntimeError, match="wake_up.*update_weights"):
        r.generate(PROMPTS, GREEDY)
    r.wake_up()
    with pytest.raises(RuntimeError, match="discarded by sleep\\(level=2\\); call update_weights"):
        r.generate(PROMPTS, GREEDY)
    r.update_weights(bucketed(other.model), version=5)
    got = r.generate(PROMPTS, GREEDY)
    assert got.completion_ids == target.completion_ids and got.weight_version == [5] * len(PROMPTS)
    # Weights loaded while asleep wait in host memory and arrive with wake_up().
    r.sleep(2)
    r.update_weights(bucketed(build_model("tiny_qwen2")), version=6)
    r.wake_up()
    assert r.generate(PROMPTS, GREEDY).completion_ids == Rollout("tiny_qwen2", config=CPU).generate(
        PROMPTS, GREEDY).completion_ids


def test_update_weights_changes_outputs_and_checks_names(tmp_path):
    r, other = Rollout("tiny_qwen2", config=CPU), Rollout(OTHER, config=CPU)
    mine, target = r.generate(PROMPTS, GREEDY), other.generate(PROMPTS, GREEDY)
    assert mine.completion_ids != target.completion_ids
    good = list(other.model.state_dict().items())
    before = weights(r)
    with pytest.raises(ValueError, match=r"1 unknown names \['model.nope.weight'\]"):
        r.update_weights([good + [("model.nope.weight", torch.zeros(2))]], version=1)
    with pytest.raises(ValueError, match=r"1 wrong shapes \['model.norm.weight: got \(3,\), model has \(128,\)'\]"):
        r.update_weights([[(n, torch.zeros(3) if n == "model.norm.weight" else t) for n, t in good]], version=1)
    with pytest.raises(ValueError, match=r"1 weights missing \['model.norm.weight'\]"):
        r.update_weights([[(n, t) for n, t in good if n != "model.norm.weight"]], version=1)
    assert all(torch.equal(before[n], p) for n, p in weights(r).items()) and r.weight_version == 0
    r.update_weights(bucketed(other.model), version=1)
    assert r.weight_version == 1 and r.generate(PROMPTS, GREEDY).completion_ids == target.completion_ids
    # From a directory written by save_pretrained (the tied head is not stored there).
    build_model("tiny_qwen2").save_pretrained(tmp_path)
    r.update_weights_from_path(tmp_path, version=2)
    assert r.weight_version == 2 and r.generate(PROMPTS, GREEDY).completion_ids == mine.completion_ids
    r.update_weights(str(tmp_path), version=3)
    assert r.weight_version == 3


def test_sampler_returns_n_candidates_per_prompt():
    s = Sampler("tiny_qwen2", config=CPU)
    c = s.sample(PROMPTS, 4, SamplingParams(temperature=1.0, max_new_tokens=8, seed=0))
    assert len(c) == 4 * len(PROMPTS) and c.prompt_index == [i for i in range(len(PROMPTS)) for _ in range(4)]
    assert c == s.rollout.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=8, n=4, seed=0))
    other = Rollout(OTHER, config=CPU)
    s.sleep(2)
    s.wake_up()
    s.update_weights(bucketed(other.model), version=3)
    assert s.weight_version == 3
    assert s.sample(PROMPTS, 1, GREEDY).completion_ids == other.generate(PROMPTS, GREEDY).completion_ids


def _same_as_direct(a, b):
    """Slices restart prompt_index at 0 on each worker, and a smaller batch pads differently,
    which moves logprobs in the last float bits; everything else is identical."""
    fields = [f.name for f in dataclasses.fields(a) if f.name not in ("prompt_index", "logprobs")]
    close = all(abs(x - y) < 1e-5 for p, q in zip(a.logprobs, b.logprobs) for x, y in zip(p, q))
    return all(getattr(a, f) == getattr(b, f) for f in fields) and close


def test_worker_groups_match_the_direct_object(ray_cluster, rollout):
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    sampling = GREEDY  # an options dataclass (no __len__): sent whole to every worker
    direct = rollout.generate(PROMPTS, sampling)
    plan = make_plan({"device_groups": {"nproc_per_node": 1,
                                        "gen": {"device": "CPU", "ranks": 2, "workers": ["rollout"]}}})
    local = LocalWorkerGroup(Rollout, plan["rollout"], {"model": "tiny_qwen2", "config": CPU})
    got = local.call("generate", PROMPTS, sampling, dispatch="slice", collect="flatten")
    assert _same_as_direct(got, direct) and got.prompt_index == [0, 1, 2, 0, 1]
    placement = create_placement(plan, timeout_s=60)
    group = None
    try:
        group = WorkerGroup(Rollout, plan["rollout"], {"model": "tiny_qwen2", "config": CPU}, placement=placement)
        remote = group.call("generate", PROMPTS, sampling, dispatch="slice", collect="flatten")
        assert _same_as_direct(remote, got)  # actors run one intra-op thread: last-bit logprob changes
        group.call("sleep", 1)
        with pytest.raises(Exception, match="rollout rank [01] failed in generate.*call wake_up"):
            group.call("generate", PROMPTS, sampling, dispatch="slice", collect="flatten")
        group.call("wake_up")
        assert group.call("generate", PROMPTS, sampling, dispatch="slice", collect="flatten") == remote
    finally:
        if group is not None:
            group.shutdown()
        placement.remove()


def test_sleep_times_its_parts_and_the_run_log_records_them(tmp_path):
    """The torch rollout's sleep reports the seconds of its parts (decode buffers dropped,
    weights copied out, memory returned), which the run log records per part beside the whole."""
    import io

    from algorithms.config.schema import LoopConfig
    from algorithms.records.runlog import RunLog

    r = Rollout("tiny_qwen2", config=CPU)
    r.generate(PROMPTS, GREEDY)
    moved = r.sleep(1)
    parts = ("buffers_s", "weights_s", "free_s")
    assert all(moved[k] >= 0 for k in parts)
    assert sum(moved[k] for k in parts) == pytest.approx(moved["seconds"], abs=1e-3)
    log = RunLog(tmp_path, 1, LoopConfig(), stream=io.StringIO())
    slow = {**moved, "weights_s": moved["weights_s"] + 1.0}
    log.moved("rollout", "sleep", [moved, slow])  # two ranks: the slower one's parts
    record = log.step(1, {})
    assert record["move/rollout_sleep_weights_s"] == pytest.approx(slow["weights_s"], abs=1e-5)
    assert record["move/rollout_sleep_free_s"] == pytest.approx(moved["free_s"], abs=1e-5)
    assert record["move/rollout_sleep_bytes"] == 2 * moved["model_bytes"]
