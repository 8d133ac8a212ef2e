"""The teacher's forward options (TeacherConfig.packing / chunked_logprobs, the trainer's
options of the same names) on CPU with a tiny real model: top-k, tail and full-vocabulary
logprobs of ragged, right-padded rows equal the plain forward's. (compile with inductor: on the
GPU, the gpu-marked test below.)"""
import pytest
import torch

from roles.batch import Batch, pad_sequences
from roles.engines import train_kernels
from roles.teacher import Teacher, TeacherConfig
from tests.test_teacher import make_batch

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "tiny_qwen2"
OPTIONS = [{"chunked_logprobs": True}, {"packing": True}, {"packing": True, "chunked_logprobs": True}]


def ragged_batch() -> Batch:
    """Chat-formatted rows of different lengths, plus a one-token row (nothing to predict)."""
    batch = make_batch(MODEL, 6)
    seqs = [row[m.bool()].tolist() for row, m in zip(batch.input_ids, batch.attention_mask)] + [[5]]
    ids, mask = pad_sequences(seqs, 0)
    assert len(set(mask.sum(1).tolist())) > 2
    return Batch(input_ids=ids, attention_mask=mask, loss_mask=mask.float())


@pytest.fixture(scope="module")
def plain():
    return Teacher(MODEL, TeacherConfig(device="cpu", micro_batch_per_device=3))


FUSED = [{"compile": True, "fused_logprobs": True, "packing": True}]


def test_packing_alone_takes_the_head_over_the_packed_tokens_only(monkeypatch, plain):
    """With packing (no compile, no chunks) the top-k, tail and full vocabulary come from the
    output head over the packed real tokens: the padded [b, T, V] logits are never made."""
    batch = ragged_batch()
    fast = Teacher(MODEL, TeacherConfig(device="cpu", micro_batch_per_device=3, packing=True))

    def padded(*args):
        raise AssertionError("the padded logits were computed")
    monkeypatch.setattr(fast, "_torch_forward", padded)
    for got, want in zip(fast.logits(batch, topk=7, tail=True, temperature=0.7),
                         plain.logits(batch, topk=7, tail=True, temperature=0.7)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(fast.logits(batch, topk=None), plain.logits(batch, topk=None), atol=2e-5, rtol=0)


@pytest.mark.parametrize("options", OPTIONS + FUSED, ids=lambda o: "+".join(o))
def test_options_give_the_plain_forwards_topk_tail_and_full_vocabulary(monkeypatch, plain, options):
    """(fused_logprobs: its compiled function traced by dynamo and AOTAutograd here.)"""
    import functools

    monkeypatch.setattr(train_kernels, "LOGPROB_CHUNK", 16)  # several chunks per micro-batch, the last partial
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    batch = ragged_batch()
    fast = Teacher(MODEL, TeacherConfig(device="cpu", micro_batch_per_device=3, **options))
    kept = batch.attention_mask[:, 1:].bool()
    for temperature in (1.0, 0.7):
        want_v, want_i, want_t = plain.logits(batch, topk=7, tail=True, temperature=temperature)
        got_v, got_i, got_t = fast.logits(batch, topk=7, tail=True, temperature=temperature)
        assert got_v.shape == want_v.shape and got_i.dtype == torch.long
        torch.testing.assert_close(got_v, want_v, atol=2e-5, rtol=0)
        torch.testing.assert_close(got_t, want_t, atol=2e-5, rtol=0)
        # The same tokens, in the same order (ties aside: there are none at this precision).
        assert torch.equal(got_i, want_i)
        assert (got_v[:, 1:][~kept] == 0).all() and (got_v[:, 0] == 0).all() and (got_t[:, 1:][~kept] == 0).all()
    want = plain.logits(batch, topk=None)
    got = fast.logits(batch, topk=None)
    assert got.shape == (*batch.input_ids.shape, plain.vocab_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert (got[:, 1:][~kept] == 0).all()
    torch.testing.assert_close(got[:, 1:][kept].exp().sum(-1), torch.ones(int(kept.sum())), atol=1e-5, rtol=0)


def test_chunked_micro_batches_are_sized_without_the_logits():
    """Automatic micro-batches: without the [b, T, V] float32 logits more rows fit the budget,
    and the outputs are the same."""
    batch = ragged_batch()
    from roles.batch import fitting_rows, token_bytes

    t = Teacher(MODEL, TeacherConfig(device="cpu", micro_batch_memory_mb=2.0, chunked_logprobs=True))
    B, T = batch.input_ids.shape
    assert fitting_rows(B, T, token_bytes(t.model, False, logits=False), 2.0) > \
        fitting_rows(B, T, token_bytes(t.model, False), 2.0) > 1
    plain = Teacher(MODEL, TeacherConfig(device="cpu", micro_batch_memory_mb=2.0))
    torch.testing.assert_close(t.logits(batch, topk=3)[0], plain.logits(batch, topk=3)[0], atol=2e-5, rtol=0)


@pytest.mark.parametrize("options", [{"fused_logprobs": True}, {"fused_logprobs": True, "compile": True,
                                                                "chunked_logprobs": True}])
def test_fused_logprobs_need_compile_and_not_chunked(options):
    with pytest.raises(ValueError, match="teacher fused_logprobs is a compiled function: set teacher.engine.compile"):
        Teacher(MODEL, TeacherConfig(device="cpu", **options))


def test_options_survive_offload_and_need_the_torch_engine(plain):
    batch = ragged_batch()
    fast = Teacher(MODEL, TeacherConfig(device="cpu", packing=True, chunked_logprobs=True))
    want = fast.logits(batch, topk=4)
    fast.offload()
    fast.onload()
    got = fast.logits(batch, topk=4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match=r"teacher \['packing'\] need the torch engine, not vllm"):
        Teacher(MODEL, TeacherConfig(device="cpu", packing=True), engine="vllm")


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"compile": True}, {"compile": True, "chunked_logprobs": True},
                                     {"compile": True, "packing": True, "chunked_logprobs": True},
                                     {"compile": True, "fused_logprobs": True},
                                     {"compile": True, "packing": True, "fused_logprobs": True}],
                         ids=lambda o: "+".join(o))
def test_compiled_teacher_on_the_gpu_equals_the_plain_forward(options):
    """fp32 on the GPU (the varlen kernel is 16-bit only: rows of SDPA when packed)."""
    batch = ragged_batch()
    plain = Teacher(MODEL, TeacherConfig(device="cuda", dtype="float32"))
    fast = Teacher(MODEL, TeacherConfig(device="cuda", dtype="float32", **options))
    want_v, want_i, want_t = plain.logits(batch, topk=16, tail=True)
    got_v, got_i, got_t = fast.logits(batch, topk=16, tail=True)
    torch.testing.assert_close(got_v, want_v, atol=1e-4, rtol=0)
    torch.testing.assert_close(got_t, want_t, atol=1e-4, rtol=0)
    assert (got_i == want_i).float().mean() > 0.99
    torch.testing.assert_close(fast.logits(batch, topk=None), plain.logits(batch, topk=None), atol=1e-4, rtol=0)


class _NoTruth(torch.nn.Module):
    """A wrapper like torch.compile's: calls go to the model, but asking whether it is truthy
    raises (torch.compile's OptimizedModule has no len())."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def __len__(self):
        raise TypeError("does not support len()")


@pytest.mark.parametrize("chunked", [False, True])
def test_a_compiled_forward_is_called_not_asked_for_its_truth(plain, chunked):
    """Regression: the teacher picked its compiled forward with `run or model`, which asks the
    compiled module for len() and raised TypeError on the GPU for compile without packing."""
    fast = Teacher(MODEL, TeacherConfig(device="cpu", micro_batch_per_device=3, chunked_logprobs=chunked))
    fast._run = _NoTruth(fast.model.base_model if chunked else fast.model)
    batch = ragged_batch()
    torch.testing.assert_close(fast.logits(batch, topk=None), plain.logits(batch, topk=None), atol=1e-5, rtol=0)
