"""Megatron-core engines on CPU (fp32): HF <-> Megatron weight conversion (Qwen2, Llama,
Qwen3), forward parity with transformers, the Trainer's Megatron engine against the torch
engine (one rank and tensor parallel over a real 2-rank Ray worker group) and the Teacher's
Megatron top-k. LoRA and sequence parallelism: tests/test_megatron_lora.py."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from orchestration.planner import make_plan
from roles.batch import Batch
from roles.engines.megatron_convert import hf_to_megatron, megatron_to_hf
from roles.models import ModelConfig, build_model
from roles.teacher import Teacher
from roles.trainer import Trainer, TrainerConfig
from tests.test_trainer import sft_batch

pytest.importorskip("megatron.core")

UNTIED = ModelConfig(name="untied_llama", arch="llama", tie_word_embeddings=False, rope_theta=500000.0, seed=1)
MODELS = {"tiny_qwen2": "tiny_qwen2", "tiny_llama": "tiny_llama", "untied_llama": UNTIED}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def config(**overrides) -> TrainerConfig:
    base = dict(lr=1e-3, weight_decay=0.1, warmup_steps=1, total_steps=10, micro_batch_per_device=3,
                device="cpu", dtype="float32")
    return TrainerConfig(**{**base, **overrides})


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_megatron_hf_round_trip_is_exact(name, tp):
    hf = build_model(MODELS[name])
    c, state = hf.config, hf.state_dict()
    shards = hf_to_megatron(state, c, tp)
    assert len(shards) == tp and all(s.keys() == shards[0].keys() for s in shards)
    back = megatron_to_hf(shards, c)
    want = {k: v for k, v in state.items() if not (k == "lm_head.weight" and c.tie_word_embeddings)}
    assert list(back) == list(want)  # HF order, tied head once
    for k, v in want.items():
        assert torch.equal(back[k], v), k
    # Layout: rank r's fused qkv holds query group r as [its q heads, k_r, v_r]; fc1 is [gate_r; up_r].
    d, per_group = 32, c.num_attention_heads // c.num_key_value_heads * 32
    groups_here = c.num_key_value_heads // tp
    qkv = shards[-1]["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.shape[0] == groups_here * (per_group + 2 * d)
    g = c.num_key_value_heads - 1  # the last rank's last group
    assert torch.equal(qkv[-2 * d:-d], state["model.layers.1.self_attn.k_proj.weight"][g * d:(g + 1) * d])
    assert torch.equal(qkv[-d:], state["model.layers.1.self_attn.v_proj.weight"][g * d:(g + 1) * d])
    inter = c.intermediate_size // tp
    fc1 = shards[-1]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:inter], state["model.layers.0.mlp.gate_proj.weight"][-inter:])
    vocab = shards[0]["embedding.word_embeddings.weight"].shape[0]
    assert vocab * tp >= c.vocab_size and (vocab * tp) % tp == 0


@pytest.mark.parametrize("name", list(MODELS))
def test_forward_logits_equal_transformers(name):
    from roles.engines.megatron_trainer import gather_vocab, local_logits, setup_parallel, to_megatron

    setup_parallel(1, torch.device("cpu"), seed=0)
    hf = build_model(MODELS[name])
    model = to_megatron(hf, 1, torch.device("cpu")).eval()
    batch = sft_batch(4, seed=1)  # right-padded rows of different lengths
    with torch.no_grad():
        want = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        got = gather_vocab(local_logits(model, batch.input_ids), hf.config.vocab_size)
    valid = batch.attention_mask.bool()
    assert got.shape == want.shape
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)


def test_qwen3_q_k_norms_convert_and_give_transformers_logits():
    """Qwen3's per-head q_norm/k_norm are Megatron's q/k layernorms (norm weights drawn, so a
    wrong mapping shows): the round trip is exact at TP 1 and 2, the logits equal HF's."""
    from roles.engines.megatron_trainer import gather_vocab, local_logits, setup_parallel, to_megatron

    c = Qwen3Config(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(c).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    state = hf.state_dict()
    for tp in (1, 2):
        shards = hf_to_megatron(state, c, tp)
        assert all(torch.equal(s["decoder.layers.1.self_attention.k_layernorm.weight"],
                               state["model.layers.1.self_attn.k_norm.weight"]) for s in shards)
        back = megatron_to_hf(shards, c)
        assert list(back) == list(state) and all(torch.equal(back[k], v) for k, v in state.items())
    setup_parallel(1, torch.device("cpu"), seed=0)
    model = to_megatron(hf, 1, torch.device("cpu")).eval()
    ids = torch.randint(0, 61, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(gather_vocab(local_logits(model, ids), 61), hf(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)


def test_megatron_trainer_matches_torch_and_saves_hf_checkpoints(tmp_path):
    batch = sft_batch(6, seed=2)
    megatron = Trainer("tiny_qwen2", config(), engine="megatron", engine_options={"tensor_parallel_size": 1})
    torch_ = Trainer("tiny_qwen2", config())
    for _ in range(3):
        got, want = megatron.train_step(batch), torch_.train_step(batch)
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert math.isclose(got[key], want[key], rel_tol=1e-4), (key, got[key], want[key])
    torch.testing.assert_close(megatron.logprobs(batch), torch_.logprobs(batch), atol=1e-4, rtol=0)
    names = [n for n, _ in megatron.engine.named_weights()]
    assert names == [n for n, _ in torch_.engine.named_weights()]
    megatron.save(tmp_path / "ckpt")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    for name, t in megatron.engine.named_weights():
        assert torch.equal(plain.state_dict()[name], t), name
    resumed = Trainer("tiny_qwen2", config(), engine="megatron")
    resumed.load(tmp_path / "ckpt")
    assert resumed.step == 3
    assert resumed.train_step(batch) == megatron.train_step(batch)  # weights, AdamW moments and schedule


def teacher_batch() -> Batch:
    return sft_batch(5, seed=4, model="tiny_llama")


def test_megatron_teacher_topk_equals_torch_teacher():
    batch = teacher_batch()
    megatron = Teacher("tiny_llama", {"device": "cpu", "micro_batch_per_device": 2}, engine="megatron")
    plain = Teacher("tiny_llama", {"device": "cpu", "micro_batch_per_device": 2})
    got, want = megatron.logits(batch, 8, tail=True, temperature=0.7), plain.logits(batch, 8, tail=True,
                                                                                     temperature=0.7)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(megatron.logits(batch), plain.logits(batch), atol=1e-5, rtol=0)


class MegatronTrainerAndTeacher:
    """A tensor-parallel Megatron Trainer and Teacher in one rank's process (one TP group),
    so a single worker group exercises both."""

    def __init__(self, trainer: dict, teacher: dict):
        self.trainer = Trainer(**trainer)
        self.teacher = Teacher(**teacher)

    def train_step(self, batch):
        return self.trainer.train_step(batch)

    def logprobs(self, batch):
        return self.trainer.logprobs(batch)

    def state_dict_buckets(self, bucket_mb):
        return self.trainer.state_dict_buckets(bucket_mb)

    def sizes(self):
        return self.trainer.engine.tp, self.trainer.engine.dp_size

    def save(self, path):
        self.trainer.save(path)

    def load(self, path):
        self.trainer.load(path)

    def topk(self, batch, k, temperature):
        return self.teacher.logits(batch, k, tail=True, temperature=temperature)


@pytest.mark.parametrize("ranks", [4], ids=["dp2xtp2"])
def test_tensor_parallel_ranks_match_the_torch_engine(ray_cluster, tmp_path, ranks):
    """TP=2 on 4 ranks (2 data-parallel copies of a 2-rank TP group): the same losses, gradient
    norms, logprobs, weights and teacher top-k as one torch rank; a checkpoint saved after step 3
    and loaded after step 5 (weights, every TP rank's optimizer state, schedule) gives steps 4
    and 5 again to 1e-5 (a sharded run's resume; the driver's resume: tests/test_resume.py)."""
    from orchestration.placement import create_placement
    from orchestration.worker_group import WorkerGroup

    batch = sft_batch(7, seed=3)  # sliced 4 + 3 over the TP peers, joined again inside
    tbatch = teacher_batch()
    options = {"tensor_parallel_size": 2}
    trainer = {"model": "tiny_qwen2", "config": config(), "engine": "megatron", "engine_options": options}
    teacher = {"model": "tiny_llama", "config": {"device": "cpu"}, "engine": "megatron", "engine_options": options}
    plan = make_plan({"device_groups": {"nproc_per_node": 1, "g": {"device": "CPU", "ranks": ranks,
                                                                   "workers": ["train"]}}})
    placement = create_placement(plan, timeout_s=60)
    group = None
    try:
        group = WorkerGroup(MegatronTrainerAndTeacher, plan["train"], {"trainer": trainer, "teacher": teacher},
                            placement=placement, timeout_s=300)
        assert group.call("sizes") == [(2, ranks // 2)] * ranks  # TP=2 x DP=ranks/2
        top = group.call("topk", tbatch, 8, 0.7, dispatch="slice", collect="flatten")
        tp_steps = [group.call("train_step", batch, dispatch="slice") for _ in range(3)]
        group.call("save", str(tmp_path / "ckpt"))
        tp_steps += [group.call("train_step", batch, dispatch="slice") for _ in range(2)]
        tp_logprobs = group.call("logprobs", batch, dispatch="slice", collect="flatten")
        weights = group.call("state_dict_buckets", 1024, execute="first")  # rank 0 alone, as weight sync asks
        group.call("load", str(tmp_path / "ckpt"))
        resumed = [group.call("train_step", batch, dispatch="slice") for _ in range(2)]
    finally:
        if group is not None:
            group.shutdown()
        placement.remove()
    want_top = Teacher("tiny_llama", {"device": "cpu"}).logits(tbatch, 8, tail=True, temperature=0.7)
    assert torch.equal(top[1], want_top[1])
    for got, want in ((top[0], want_top[0]), (top[2], want_top[2])):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    single = Trainer("tiny_qwen2", config())
    for per_rank in tp_steps:
        want = single.train_step(batch)
        assert all(r == per_rank[0] for r in per_rank)  # every rank reports the same global metrics
        assert per_rank[0]["sequences"] == 7 and per_rank[0]["tokens"] == want["tokens"]
        for key in ("loss", "grad_norm"):
            assert math.isclose(per_rank[0][key], want[key], rel_tol=1e-4), (key, per_rank[0][key], want[key])
    torch.testing.assert_close(tp_logprobs, single.logprobs(batch), atol=1e-4, rtol=0)
    for before, after in zip(tp_steps[3:], resumed):
        assert all(r == after[0] for r in after) and after[0]["step"] == before[0]["step"]
        for key in ("loss", "grad_norm", "lr"):
            assert after[0][key] == pytest.approx(before[0][key], rel=1e-5), key
    ref = dict(single.engine.named_weights())
    got = [t for bucket in weights for t in bucket]
    assert [n for n, _ in got] == list(ref)
    for name, t in got:
        torch.testing.assert_close(t, ref[name], atol=1e-4, rtol=0, msg=name)


@pytest.mark.gpu
def test_megatron_engines_on_the_gpu():
    """bf16 autocast training and an fp32 teacher on one CUDA device (NCCL process group)."""
    batch = sft_batch(8)
    gpu = config(device="cuda", dtype="bfloat16")
    megatron = Trainer("tiny_qwen2", gpu, engine="megatron")
    torch_ = Trainer("tiny_qwen2", gpu)
    assert next(megatron.model.parameters()).is_cuda
    for _ in range(5):
        got, want = megatron.train_step(batch), torch_.train_step(batch)
        assert math.isclose(got["loss"], want["loss"], rel_tol=1e-2), (got["loss"], want["loss"])
    tbatch = teacher_batch()
    got = Teacher("tiny_llama", {"device": "cuda"}, engine="megatron").logits(tbatch, 8, tail=True)
    want = Teacher("tiny_llama", {"device": "cuda"}).logits(tbatch, 8, tail=True)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=0)
