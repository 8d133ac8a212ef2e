"""Teacher on tiny presets (CPU, fp32): top-k, full-vocab and tail mass against a direct
transformers forward; offload/onload."""
import pytest
import torch

from algorithms.data.tasks import arithmetic_examples
from orchestration.local import LocalWorkerGroup
from orchestration.planner import make_plan
from roles.batch import Batch, pad_sequences
from roles.models import build_model, load_tokenizer
from roles.teacher import Teacher, TeacherConfig

MODEL = "tiny_qwen2"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def make_batch(model: str, n: int = 5) -> Batch:
    tok = load_tokenizer(model)
    seqs = [tok.apply_chat_template(ex.messages(), tokenize=True) for ex in arithmetic_examples(n, seed=1)]
    seqs = [s if isinstance(s, list) else s["input_ids"] for s in seqs]
    ids, attn = pad_sequences(seqs, tok.pad_token_id)
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=attn.float())


def direct_logprobs(model: str, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
    """HF layout: row t is log p(. | tokens <= t), for rows 0..T-2."""
    with torch.no_grad():
        logits = build_model(model)(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)


@pytest.fixture(scope="module")
def teacher():
    return Teacher(MODEL, TeacherConfig(device="cpu"))


@pytest.fixture(scope="module")
def batch():
    return make_batch(MODEL)


def valid(batch: Batch) -> torch.Tensor:
    """[B, T-1] mask of aligned positions 1..T-1 that hold a real token."""
    return batch.attention_mask[:, 1:].bool()


@pytest.mark.parametrize("model", ["tiny_qwen2", "tiny_llama"])
def test_topk_equals_topk_of_a_direct_forward(model):
    batch = make_batch(model)
    values, indices = Teacher(model, {"device": "cpu"}).logits(batch, topk=7)
    B, T = batch.input_ids.shape
    assert values.shape == indices.shape == (B, T, 7) and values.dtype == torch.float32
    ref_values, ref_indices = torch.topk(direct_logprobs(model, batch), 7, dim=-1)
    m = valid(batch)
    assert torch.equal(values[:, 1:][m], ref_values[m]) and torch.equal(indices[:, 1:][m], ref_indices[m])
    # Position 0 and padding hold 0.
    assert (values[:, 0] == 0).all() and (values[:, 1:][~m] == 0).all() and (indices[:, 1:][~m] == 0).all()


def test_full_vocab_equals_direct_forward_and_topk_all(teacher, batch):
    full = teacher.logits(batch, topk=None)
    V = teacher.vocab_size
    assert full.shape == (*batch.input_ids.shape, V)
    m = valid(batch)
    assert torch.equal(full[:, 1:][m], direct_logprobs(MODEL, batch)[m])
    assert (full[:, 0] == 0).all() and (full[:, 1:][~m] == 0).all()
    values, indices = teacher.logits(batch, topk=V)
    assert torch.equal(torch.zeros_like(full).scatter(-1, indices, values)[:, 1:][m], full[:, 1:][m])


def test_tail_mass(teacher, batch):
    values, indices, tail = teacher.logits(batch, topk=5, tail=True)
    m = valid(batch)
    expected = torch.log1p(-values.double().exp().sum(-1))
    torch.testing.assert_close(tail[:, 1:][m].double(), expected[:, 1:][m], atol=1e-5, rtol=0)
    # Top-k plus the tail bucket is a distribution.
    total = torch.logsumexp(torch.cat([values, tail[..., None]], -1), -1)
    torch.testing.assert_close(total[:, 1:][m], torch.zeros(int(m.sum())), atol=1e-5, rtol=0)
    assert (tail[:, 0] == 0).all() and (tail[:, 1:][~m] == 0).all()
    _, _, none_left = teacher.logits(batch, topk=teacher.vocab_size, tail=True)
    assert torch.isneginf(none_left[:, 1:][m]).all()


def test_temperature_and_micro_batches(batch):
    t = Teacher(MODEL, {"device": "cpu", "micro_batch_per_device": 2})
    values, _ = t.logits(batch, topk=3, temperature=0.5)
    ref, _ = torch.topk(direct_logprobs(MODEL, batch, temperature=0.5), 3, dim=-1)
    m = valid(batch)
    torch.testing.assert_close(values[:, 1:][m], ref[m], atol=1e-5, rtol=0)


def test_bad_arguments_are_refused(teacher, batch):
    with pytest.raises(ValueError, match="topk=0"):
        teacher.logits(batch, topk=0)
    with pytest.raises(ValueError, match="tail=True needs topk"):
        teacher.logits(batch, topk=None, tail=True)


def test_offload_onload_round_trip(batch):
    t = Teacher(MODEL, {"device": "cpu"})
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    expected = t.logits(batch, topk=4)
    moved = t.offload()
    assert moved["model_bytes"] >= sum(p.numel() * 4 for p in t.model.parameters())
    assert all(p.numel() == 0 for p in t.model.parameters())
    with pytest.raises(RuntimeError, match="onload"):
        t.logits(batch, topk=4)
    assert t.onload() == moved
    assert all(torch.equal(v, before[k]) for k, v in t.model.state_dict().items())
    got = t.logits(batch, topk=4)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_teacher_under_local_worker_group(teacher, batch):
    plan = make_plan({"device_groups": {"nproc_per_node": 1, "g": {"device": "CPU", "ranks": 2,
                                                                   "workers": ["teacher"]}}})
    group = LocalWorkerGroup(Teacher, plan["teacher"], {"model": MODEL, "config": {"device": "cpu"}})
    values, indices = group.call("logits", batch, topk=4, dispatch="slice", collect="flatten")
    ref_values, ref_indices = teacher.logits(batch, topk=4)
    m = valid(batch)
    torch.testing.assert_close(values[:, 1:][m], ref_values[:, 1:][m], atol=1e-5, rtol=0)
    assert torch.equal(indices[:, 1:][m], ref_indices[:, 1:][m])
    # One row over two ranks: the second rank is called with an empty slice (lockstep) and
    # returns empty tensors of the same trailing shape.
    one = Batch(input_ids=batch.input_ids[:1], attention_mask=batch.attention_mask[:1], loss_mask=batch.loss_mask[:1])
    values, indices, tails = group.call("logits", one, topk=4, tail=True, dispatch="slice", collect="none")[1]
    assert values.shape == (0, batch.input_ids.shape[1], 4) and indices.shape == values.shape
    assert tails.shape == (0, batch.input_ids.shape[1])
