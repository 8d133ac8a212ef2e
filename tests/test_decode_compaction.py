"""The static decode path dropping rows that stopped (roles/engines/torch_decode.py, COMPACT):
which smaller buckets live rows move to, that a call compacted on the way decodes the tokens,
logprobs and finish reasons of one that decodes every row to the end (greedy, seeded sampling
with top-k/top-p, compiled step) and greedy those of HF `generate`, that a StaticDecoder keeps
the smaller buckets for later calls, and on a GPU (gpu-marked) the same with CUDA graphs."""
import pytest
import torch

from roles.engines import torch_decode
from roles.engines.decoding import left_pad
from roles.engines.torch_decode import StaticDecoder, compact_rows, generate_static
from roles.models import build_model
from tests.test_rollout import lively

pytestmark = pytest.mark.usefixtures("one_thread")
# 16 rows of 1 to 3 tokens (different prompt lengths: left padding differs per row).
PROMPTS = [[5 + (i * 7) % 90, 3 + (i * 13) % 80, 11 + i % 50][: 1 + i % 3] for i in range(16)]
LONG = (0, 5)  # the rows that never stop
GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0)
SAMPLED = dict(temperature=0.8, top_k=20, top_p=0.9, seeds=[100 + i for i in range(16)])


@pytest.fixture
def model():
    m = build_model("tiny_qwen2").eval()
    m.load_state_dict(lively(m))
    return m


def long_tail(model, sampling: dict, stop_by, max_new_tokens: int = 60) -> list[int]:
    """Stop tokens under which the LONG rows run to max_new_tokens and row i of the others stops
    within its first stop_by(i) tokens: tokens of those rows that the LONG rows never decode."""
    free = generate_static(model, PROMPTS, **sampling, max_new_tokens=max_new_tokens, stop_ids=[], pad_id=0)
    never = set(range(model.config.vocab_size)) - {t for i in LONG for t in free.tokens[i]}
    stops = set()
    for i, row in enumerate(free.tokens):
        if i not in LONG:
            stops.add(next(t for t in reversed(row[:stop_by(i)]) if t in never))
    return sorted(stops)


def decode_both(monkeypatch, model, sampling: dict, stops: list[int], decoder=None, max_new_tokens: int = 60):
    """(compacted, every row to the end, compactions) for one call of each."""
    kw = dict(**sampling, max_new_tokens=max_new_tokens, stop_ids=stops, pad_id=0)
    monkeypatch.setattr(torch_decode, "COMPACT", False)
    full = generate_static(model, PROMPTS, **kw)
    monkeypatch.setattr(torch_decode, "COMPACT", True)
    before = torch_decode.COUNTS["compacted"]
    got = generate_static(model, PROMPTS, **kw, decoder=decoder)
    return got, full, torch_decode.COUNTS["compacted"] - before


def assert_same(got, want):
    assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
    # Logprobs: equal up to float rounding (a smaller batch's kernels may sum in another order).
    for a, b in zip(got.logprobs, want.logprobs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_smaller_buckets_are_fixed_powers_of_compact_at(monkeypatch):
    assert compact_rows(64, 4, graphs=True) == 8  # 32, 16, 8: the smallest holding 4 rows
    assert compact_rows(64, 16, graphs=True) == 16
    assert compact_rows(64, 17, graphs=True) == 32
    assert compact_rows(64, 33, graphs=True) == 64  # no smaller bucket holds them: stay
    assert compact_rows(24, 3, graphs=True) == 8  # 12 and 6 rows aligned to ROW_ALIGN: 16, 8
    assert compact_rows(8, 1, graphs=True) == 8  # already the smallest aligned bucket
    assert compact_rows(5, 2, graphs=False) == 2  # eager: 3, 2, 1 rows
    monkeypatch.setattr(torch_decode, "COMPACT_AT", 0.25)
    assert compact_rows(64, 4, graphs=True) == 8 and compact_rows(64, 17, graphs=True) == 64
    monkeypatch.setattr(torch_decode, "COMPACT", False)
    assert compact_rows(64, 1, graphs=True) == 64


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "t0.8-topk-topp"])
def test_compacted_rows_decode_what_full_rows_do(monkeypatch, model, sampling):
    """Rows stop one after another (row i within 2 + 3i tokens), two run to the end: several
    compactions (a done check every 4 steps), each row's outputs back at its place."""
    monkeypatch.setattr(torch_decode, "DONE_CHECK_EVERY", 4)
    stops = long_tail(model, sampling, lambda i: 2 + 3 * i)
    got, full, compactions = decode_both(monkeypatch, model, sampling, stops)
    assert_same(got, full)
    assert compactions >= 3  # 16 rows -> 8 -> 4 -> 2 at least
    assert [got.finish_reasons[i] for i in LONG] == ["length"] * 2 and [len(got.tokens[i]) for i in LONG] == [60] * 2
    assert got.finish_reasons.count("stop") == 14 and len({len(t) for t in got.tokens}) > 4


def test_compacted_greedy_equals_transformers_generate(monkeypatch, model):
    monkeypatch.setattr(torch_decode, "DONE_CHECK_EVERY", 4)
    stops = long_tail(model, GREEDY, lambda i: 2 + 3 * i)
    got, _, compactions = decode_both(monkeypatch, model, GREEDY, stops)
    assert compactions >= 3
    ids, mask, _ = left_pad(PROMPTS, 0, torch.device("cpu"))
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=60, eos_token_id=stops,
                         pad_token_id=0)[:, ids.shape[1]:].tolist()
    for tokens, reason, row in zip(got.tokens, got.finish_reasons, ref):
        assert tokens == row[:len(tokens)]
        assert len(tokens) == 60 if reason == "length" else tokens[-1] in stops


def test_decoder_keeps_the_smaller_buckets_for_later_calls(monkeypatch, model):
    """A second call on the same StaticDecoder moves its live rows into the buffers the first one
    allocated; together they hold fewer rows than the call's own buffers (COMPACT_AT 1/2)."""
    monkeypatch.setattr(torch_decode, "DONE_CHECK_EVERY", 4)
    stops = long_tail(model, SAMPLED, lambda i: 2 + 3 * i)
    decoder = StaticDecoder(compile=False)
    first, full, compactions = decode_both(monkeypatch, model, SAMPLED, stops, decoder=decoder)
    held = dict(decoder.smaller)
    assert len(held) == compactions and all(b.size.rows < 16 for b in held.values())
    assert sum(b.nbytes() for b in held.values()) < decoder.buffers.nbytes()
    again, _, _ = decode_both(monkeypatch, model, SAMPLED, stops, decoder=decoder)
    assert decoder.smaller == held and all(decoder.smaller[r] is b for r, b in held.items())
    assert_same(first, full)
    assert again.tokens == first.tokens and again.logprobs == first.logprobs
    everything = decoder.buffers.nbytes() + sum(b.nbytes() for b in held.values())
    assert decoder.release() == everything and decoder.smaller == {} and decoder.buffers is None


def test_compiled_step_compacts_like_the_eager_one(monkeypatch, model):
    """rollout.compile_decode: the compiled step runs over the smaller bucket too (compiled for its
    size), decoding what the eager step decodes over every row."""
    stops = long_tail(model, SAMPLED, lambda i: 3, max_new_tokens=24)  # 14 rows stopped by step 3
    monkeypatch.setattr(torch_decode, "DONE_CHECK_EVERY", 4)
    decoder = StaticDecoder(compile=True)
    got, full, compactions = decode_both(monkeypatch, model, SAMPLED, stops, decoder=decoder, max_new_tokens=24)
    assert compactions == 1 and list(decoder.smaller) == [2]  # 16 rows -> the 2 long ones
    assert_same(got, full)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("compile_decode", [False, True])
def test_graph_decode_compacts_into_captured_smaller_buckets(monkeypatch, compile_decode):
    """On CUDA with graphs (fp32): 64 rows, 62 of them stopping early, decode what every row to the
    end decodes; the smaller buckets' graphs are captured once and replayed by the next call."""
    model = build_model("tiny_qwen2").cuda().eval()
    model.load_state_dict(lively(model))
    prompts = PROMPTS * 4
    free = generate_static(model, prompts, **GREEDY, max_new_tokens=200, stop_ids=[], pad_id=0)
    never = set(range(model.config.vocab_size)) - {t for i in LONG for t in free.tokens[i]}
    # A row whose first tokens hold none the LONG rows avoid runs to the end too (on an H100 the
    # greedy tokens differ from CPU's, and some rows had none in their first 8).
    firsts = (next((t for t in row[:16] if t in never), None) for i, row in enumerate(free.tokens) if i % 16 not in LONG)
    stops = sorted({t for t in firsts if t is not None})
    kw = dict(**GREEDY, max_new_tokens=200, stop_ids=stops, pad_id=0)
    monkeypatch.setattr(torch_decode, "COMPACT", False)
    full = generate_static(model, prompts, **kw)
    monkeypatch.setattr(torch_decode, "COMPACT", True)
    decoder = StaticDecoder(compile=compile_decode)
    counts = dict(torch_decode.COUNTS)
    got = generate_static(model, prompts, **kw, decoder=decoder)
    graphs = {rows: b.graph for rows, b in decoder.smaller.items()}
    assert torch_decode.COUNTS["compacted"] > counts["compacted"] and graphs
    assert all(g is not None for g in graphs.values())
    again = generate_static(model, prompts, **kw, decoder=decoder)
    assert {rows: b.graph for rows, b in decoder.smaller.items()} == graphs  # replayed, not captured again
    assert torch_decode.COUNTS["reused"] == counts["reused"] + 1
    assert got.tokens == full.tokens == again.tokens and got.finish_reasons == full.finish_reasons
    assert 8 <= got.finish_reasons.count("length") < 32
