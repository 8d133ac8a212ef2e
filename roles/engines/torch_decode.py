"""Decoding with a static KV cache, and on CUDA with the decode step captured as a CUDA graph.

The dynamic loop of `torch_generate` launches every kernel of every layer from Python at
every token: on a GPU a decode step then costs the same ~20 ms at 64 rows as at 512. Here
the K/V of every layer live in preallocated tensors ([rows, kv_heads, length, head_dim]); a
decode step writes its keys at a slot held in a device tensor, attends over the whole cache
under a boolean mask of the slots filled so far, samples, and advances its own counters in
place. Nothing in a step depends on the host, so on CUDA the step is
captured once and replayed per token (one launch instead of hundreds); the host only looks
at the device every `DONE_CHECK_EVERY` steps to stop when every row has stopped. A
`StaticDecoder` keeps the buffers and the graph for later calls whose rows and length fit
them (`fits`: not more than REUSE_SLACK times the work) and whose sampling settings are the
same; without one (or after `release()`) they live for one call.

Rows that stopped are dropped on the way (COMPACT): at a done check, when the rows still
decoding fit a bucket of COMPACT_AT times the call's rows (or of a power of it: the smaller
buckets are fixed by the call's bucket, aligned like it), their cache slots, counters, seeds
and outputs so far move into that bucket's buffers, and decoding goes on there with its own
graph, captured like any other; the rows' outputs go back to their places at the end. When
most rows stop early and a few run long, the steps after that attend over those few rows
only. A `StaticDecoder` keeps the smaller buckets' buffers and graphs with its own (each at
most COMPACT_AT of it: with 1/2, all of them together less than it again). A row's tokens do
not depend on its batch mates, so compaction changes none (its logprobs up to float rounding:
a smaller batch's kernels may sum in another order).

Sampling is batched and seeded per row without a generator per row: a row's uniform at a
step is a hash of (row seed, step), and the token is where it falls in the cumulative
distribution of the filtered probabilities (inverse-CDF sampling). A sample depends on its
row's seed only, not on its batch mates. Greedy decoding, filtering and reported logprobs are
the sampling head's in `decoding`, as in `torch_generate`.

Prefill runs the model's own attention kernel over the prompt ([rows, P] keys); decode
attends with one scaled-dot-product call per layer in which the query heads of a key/value
head act as that head's queries, so grouped-query K/V are read once, not repeated.
"""
from __future__ import annotations

import logging
import math
import time
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from roles.engines.decoding import Generated, collect, cumulative, left_pad, sample

log = logging.getLogger(__name__)

# Device types on which `generate_batch` takes this path (CPU keeps the dynamic loop).
STATIC_DEVICES = {"cuda"}
# Capture the decode step as a CUDA graph (on CUDA); False decodes the same steps eagerly.
CUDA_GRAPHS = True
# Rows are padded up to a multiple of this, the cache length up to a multiple of CACHE_ALIGN.
ROW_ALIGN, CACHE_ALIGN = 8, 64
# How often (in steps) the host reads whether every row has stopped (a device sync).
DONE_CHECK_EVERY = 16
# Move the rows still decoding into a smaller bucket at a done check (False: every row decodes to
# the end of the call).
COMPACT = True
# The smaller buckets hold COMPACT_AT, COMPACT_AT^2, ... of the call's rows (aligned).
COMPACT_AT = 0.5
# A StaticDecoder's buffers serve a later call whose bucket they hold, unless they hold more than
# this many times its rows x slots (each decode step attends over all of them).
REUSE_SLACK = 2.0
# Compilations of the decode step (compile=True, one per buffer size and sampling setting) before
# dynamo decodes new ones uncompiled. Its own limit (8 per function, shared by every rollout in
# the process) did that from the ninth without a word; each takes tens of seconds, so few happen.
RECOMPILE_LIMIT = 64
# Calls that decoded with a graph / eagerly on this path, calls that replayed a graph captured by
# an earlier call / reused its buffers, moves of the live rows into a smaller bucket, and the host
# seconds spent capturing (the eager first step included); read by tests and benchmarks.
COUNTS = {"graph": 0, "eager": 0, "reused": 0, "buffers_reused": 0, "compacted": 0, "capture_s": 0.0}
ATTENTION = "rollout_static"
_MASK64 = (1 << 64) - 1


def _i64(value: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


_GOLDEN, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def row_uniforms(seeds: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[B] float64 in [0, 1): splitmix64 of (row seed, step); int64 products wrap."""
    z = seeds + (step + 1) * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() * 2.0 ** -53


def sample_rows(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, seeds: torch.Tensor,
                step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], logprob [B]) from float32 logits [B, V]; row i draws with uniform
    row_uniforms(seeds, step)[i]."""
    def draw(probs: torch.Tensor) -> torch.Tensor:
        cdf = cumulative(probs)
        # First index whose cumulative mass exceeds u (a token of zero mass is never picked).
        u = (row_uniforms(seeds, step) * cdf[:, -1].double()).to(cdf.dtype)
        return (cdf <= u[:, None]).sum(-1).clamp_(max=logits.shape[-1] - 1)

    return sample(logits, temperature, top_k, top_p, draw)


class SlotCache(Cache):
    """K/V of every layer in preallocated [B, kv_heads, length, head_dim] tensors. A forward
    writes its keys at positions `slots` (a device tensor) and attends over the first
    `visible` positions (the prompt during prefill, the whole cache when decoding)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):  # no Cache.__init__: no per-layer objects
        shape = (batch, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots = torch.zeros(1, dtype=torch.long, device=device)
        self.visible = length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k.index_copy_(2, self.slots, key_states.to(k.dtype))
        v.index_copy_(2, self.slots, value_states.to(v.dtype))
        return k[:, :, :self.visible], v[:, :, :self.visible]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions and masks are always passed in

    def __len__(self) -> int:
        return len(self.keys)


def _static_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """One query per row: the g query heads of each key/value head become its g queries, one
    SDPA call over [B, kv_heads, g, D] (no repeated K/V). Longer queries (prefill): sdpa."""
    if query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    b, heads, _, d = query.shape
    q = query.reshape(b, key.shape[1], heads // key.shape[1], d)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, 1, heads, d), None


AttentionInterface.register(ATTENTION, _static_attention)


def unsupported(model) -> Optional[str]:
    """Why `model` cannot decode here, None when it can. Asked of the model itself, not of a list
    of names: the cache transformers builds for it must hold every position's keys and values in
    every layer (plain DynamicLayers), which the slot cache replaces; a sliding window, a linear
    attention's recurrent state (Qwen3.5's Gated DeltaNet) or layers sharing K/V are not that.
    And its attention must go through transformers' attention interface, which this path swaps
    for its own kernel."""
    layers = DynamicCache(config=model.config).layers
    other = sorted({type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer})
    if other:
        return f"its cache has {other} layers, not only full keys/values"
    if len(layers) != model.config.num_hidden_layers:
        return f"its cache has {len(layers)} layers for {model.config.num_hidden_layers} blocks (shared K/V)"
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not take transformers' attention interface"
    return None


def supports(model) -> bool:
    """Whether `model` can decode here (`unsupported` says why not)."""
    return unsupported(model) is None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _capture(step) -> Optional["torch.cuda.CUDAGraph"]:
    """Run `step` once eagerly on a side stream (a real decode step; it also initialises
    lazily created kernels' state), then capture it. None if the capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
    except Exception as exc:  # an op that syncs with the host: decode eagerly instead
        log.warning("decode step not captured as a CUDA graph (%s); decoding eagerly", exc)
        return None
    return graph


class Bucket(NamedTuple):
    """Sizes of a call's decode buffers: rows (filler rows included), cache slots, output tokens."""
    rows: int
    length: int
    new_tokens: int


def bucket(count: int, width: int, max_new_tokens: int, graphs: bool) -> Bucket:
    """The buffers a call of `count` prompts of `width` tokens needs: rows aligned to ROW_ALIGN
    when a graph replays them (graphs are captured per shape), slots to CACHE_ALIGN."""
    rows = _round_up(count, ROW_ALIGN) if graphs else count
    return Bucket(rows, _round_up(width + max_new_tokens, CACHE_ALIGN), max_new_tokens)


def fits(held: Optional[Bucket], want: Bucket) -> bool:
    """Whether buffers (and their graph) of bucket `held` serve a call needing `want`: as many
    rows, slots and output tokens or more, and at most REUSE_SLACK times its rows x slots
    (every decode step attends over all the rows and slots held)."""
    return held is not None and held.rows >= want.rows and held.length >= want.length \
        and held.new_tokens >= want.new_tokens and held.rows * held.length <= REUSE_SLACK * want.rows * want.length


def compact_rows(rows: int, live: int, graphs: bool) -> int:
    """Rows of the smallest bucket that holds `live` rows among those a call of `rows` rows
    compacts into (rows x COMPACT_AT^k, k >= 1, aligned as `bucket` aligns); `rows` when none
    does or COMPACT is off."""
    best, scale = rows, COMPACT_AT
    while COMPACT and 0 < COMPACT_AT < 1:
        smaller = _round_up(math.ceil(rows * scale), ROW_ALIGN if graphs else 1)
        if smaller < live or smaller >= best:
            break
        best, scale = smaller, scale * COMPACT_AT
    return best


class _Buffers:
    """Every tensor a decode step reads or writes; a captured graph holds their addresses."""

    def __init__(self, model, size: Bucket, device: torch.device):
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        rows, length = size.rows, size.length
        self.size = size
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads  # no GQA: one per head
        self.cache = SlotCache(cfg.num_hidden_layers, rows, kv_heads, length, head_dim, dtype, device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)  # the slot a decode step writes
        self.valid = torch.zeros(rows, length, dtype=torch.bool, device=device)
        self.seeds = torch.zeros(rows, dtype=torch.long, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.token = torch.zeros(rows, dtype=torch.long, device=device)
        self.position = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.stopped_at = torch.zeros(rows, dtype=torch.long, device=device)
        self.out_tokens = torch.zeros(rows, size.new_tokens, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(rows, size.new_tokens, dtype=torch.float32, device=device)
        self.graph: Optional["torch.cuda.CUDAGraph"] = None  # the decode step captured over these tensors

    def nbytes(self) -> int:
        tensors = self.cache.keys + self.cache.values + [v for v in vars(self).values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


class StaticDecoder:
    """Decode buffers and the decode step's CUDA graphs kept from one `generate_static` call to
    the next: a call whose bucket `fits` them reuses the buffers (and those of the smaller
    buckets its live rows moved to), and replays the graphs when its sampling settings and the
    model's tensors (addresses) are those they were captured with. A call that does not fit
    drops them first. `release()` frees them (Rollout.sleep).
    `compile`: the decode step runs through `torch.compile` (fused kernels; compiled once per
    buffer size and sampling setting, before its graph is captured)."""

    def __init__(self, compile: bool):
        self.buffers: Optional[_Buffers] = None
        self.smaller: dict[int, _Buffers] = {}  # by rows: the buckets `buffers`' live rows move to
        self.graph_key: Optional[tuple] = None  # what every held graph was captured with (_graph_key)
        self.stops: Optional[torch.Tensor] = None
        self.decode = decode_step
        if compile:  # the limit applies while the compiled step is called
            limit = torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)
            self.decode = limit(torch.compile(decode_step, dynamic=False))

    @property
    def graph(self) -> Optional["torch.cuda.CUDAGraph"]:
        """The decode step captured over `buffers`."""
        return self.buffers.graph if self.buffers is not None else None

    def held(self) -> list[_Buffers]:
        return ([self.buffers] if self.buffers is not None else []) + list(self.smaller.values())

    def drop_graphs(self) -> None:
        for b in self.held():
            if b.graph is not None:
                b.graph.reset()
            b.graph = None

    def release(self) -> int:
        """Drop the buffers and the graphs (their memory pools with them); returns the buffers' bytes."""
        freed = sum(b.nbytes() for b in self.held())
        self.drop_graphs()
        self.buffers, self.smaller, self.graph_key, self.stops = None, {}, None, None
        return freed

    def take(self, model, want: Bucket, device: torch.device) -> _Buffers:
        """Buffers for a call of bucket `want`: the held ones when they fit, else new ones."""
        if fits(self.buffers.size if self.buffers is not None else None, want):
            COUNTS["buffers_reused"] += 1
            return self.buffers
        self.release()  # before allocating: never both at once
        self.buffers = _Buffers(model, want, device)
        return self.buffers

    def take_smaller(self, model, rows: int, device: torch.device) -> _Buffers:
        """Buffers of `rows` rows (the slots and output tokens of `buffers`) for the live rows."""
        if rows not in self.smaller:
            size = self.buffers.size
            self.smaller[rows] = _Buffers(model, Bucket(rows, size.length, size.new_tokens), device)
        return self.smaller[rows]

    def settle(self, key: tuple, stops: Sequence[int], device: torch.device) -> None:
        """Graphs captured with other settings (`key`) are dropped, with the stop tokens they read."""
        if key != self.graph_key:
            self.drop_graphs()
            self.graph_key = key
            self.stops = torch.tensor(stops, dtype=torch.long, device=device)


def record(b: _Buffers, logits: torch.Tensor, stops: torch.Tensor, temperature: float, top_k: int,
           top_p: float, pad_id: int) -> None:
    """Sample every row's next token from `logits` [rows, V] at step `b.step`, write it and its
    logprob to the outputs, mark rows that hit a stop token, advance the step."""
    tok, logprob = sample_rows(logits.float(), temperature, top_k, top_p, b.seeds, b.step)
    tok = tok.masked_fill(b.done, pad_id)
    b.out_tokens.index_copy_(1, b.step, tok[:, None])
    b.out_logprobs.index_copy_(1, b.step, logprob[:, None].float())
    hit = ~b.done & (tok[:, None] == stops).any(-1)
    b.stopped_at.copy_(torch.where(hit, b.step, b.stopped_at))
    b.done.logical_or_(hit)
    b.token.copy_(tok)
    b.step.add_(1)


def decode_step(model, b: _Buffers, stops: torch.Tensor, settings: tuple) -> None:
    """One decode step: feed the last sampled token at slot `b.slot`, attend over the filled
    slots, `record` the next one. Reads and writes only `b`'s tensors (a CUDA graph replays it).
    `settings`: (temperature, top_k, top_p, pad_id)."""
    b.valid.index_fill_(1, b.slot, True)
    logits = model(input_ids=b.token[:, None], attention_mask=b.valid[:, None, None, :], position_ids=b.position,
                   past_key_values=b.cache, use_cache=True).logits
    record(b, logits[:, -1], stops, *settings)
    b.position.add_(1)
    b.slot.add_(1)


# What a row carries from step to step besides its K/V; the last three are its outputs.
_ROW_STATE = ("valid", "seeds", "token", "position", "done", "stopped_at", "out_tokens", "out_logprobs")


def compact(src: _Buffers, dst: _Buffers, live: torch.Tensor) -> None:
    """Move rows `live` of `src` (a device index) into the first rows of the smaller `dst`, every
    counter of a decode step with them; dst's other rows repeat the first live one (filler)."""
    index = torch.cat([live, live[:1].expand(dst.size.rows - len(live))])
    for s, d in zip(src.cache.keys + src.cache.values, dst.cache.keys + dst.cache.values):
        torch.index_select(s, 0, index, out=d)
    for name in _ROW_STATE:
        torch.index_select(getattr(src, name), 0, index, out=getattr(dst, name))
    dst.step.copy_(src.step)
    dst.slot.copy_(src.slot)
    dst.cache.slots, dst.cache.visible = dst.slot, dst.size.length


def write_back(top: _Buffers, b: _Buffers, origin: torch.Tensor) -> None:
    """The outputs of `b`'s first rows to rows `origin` of the call's own buffers `top`."""
    for name in _ROW_STATE[-3:]:
        getattr(top, name).index_copy_(0, origin, getattr(b, name)[:len(origin)])


def _graph_key(model, temperature: float, top_k: int, top_p: float, pad_id: int, stops: Sequence[int]) -> tuple:
    """What a captured decode step depends on besides its buffers: the sampling settings and
    stop tokens it was traced with and the addresses of the model's tensors (a sleep and wake
    moves them; loading weights in place does not)."""
    tensors = [t.data_ptr() for t in (*model.parameters(), *model.buffers())]
    return temperature, top_k, top_p, pad_id, tuple(stops), hash(tuple(tensors))


@torch.inference_mode()
def generate_static(model, prompts: Sequence[Sequence[int]], *, temperature: float, top_k: int, top_p: float,
                    max_new_tokens: int, stop_ids: Sequence[int], pad_id: int,
                    seeds: Optional[Sequence[int]] = None, graphs: Optional[bool] = None,
                    decoder: Optional[StaticDecoder] = None):
    """`torch_generate.generate_batch`'s contract; `seeds`: one per row (sampling), None draws
    them from torch's global generator. `graphs` None: CUDA_GRAPHS on CUDA. `decoder` keeps the
    buffers and graphs for later calls; None: they live for this call only."""
    device = next(model.parameters()).device
    count = len(prompts)
    if max_new_tokens <= 0 or not count:
        return Generated([[] for _ in prompts], [[] for _ in prompts], ["length"] * count)
    graphs = (CUDA_GRAPHS if graphs is None else graphs) and device.type == "cuda"
    decoder = decoder if decoder is not None else StaticDecoder(compile=False)
    width = max(len(p) for p in prompts)
    b = decoder.take(model, bucket(count, width, max_new_tokens, graphs), device)
    rows, length = b.size.rows, b.size.length
    # Filler rows (one pad token each) keep the batch at the buffers' size; their output is dropped.
    ids, mask, positions = left_pad(list(prompts) + [[pad_id]] * (rows - count), pad_id, device)
    stop_list = sorted(set(stop_ids))
    decoder.settle(_graph_key(model, temperature, top_k, top_p, pad_id, stop_list), stop_list, device)
    replay = graphs and decoder.graph is not None
    stops, cache = decoder.stops, b.cache
    # Every counter back to the start of a call; K/V left from an earlier call sit behind `valid`.
    b.valid.zero_()
    b.valid[:, :width] = mask.bool()
    if seeds is None:
        seeds = torch.randint(0, 2**62, (count,)).tolist()
    b.seeds.copy_(torch.tensor(list(seeds) + [0] * (rows - count), dtype=torch.long))
    b.step.zero_()
    b.done.zero_()
    b.stopped_at.fill_(-1)
    b.out_tokens.fill_(pad_id)
    b.out_logprobs.zero_()

    cfg = model.config
    saved_attention = cfg._attn_implementation
    cfg._attn_implementation = ATTENTION
    try:  # 4-d boolean masks (True: attend) reach the attention as they are
        # Prefill: causal over the prompt, padding masked; a padding query sees itself (no empty rows).
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        prefill_mask = (causal & b.valid[:, None, :width]) | torch.eye(width, dtype=torch.bool, device=device)
        cache.slots, cache.visible = torch.arange(width, device=device), width
        out = model(input_ids=ids, attention_mask=prefill_mask[:, None], position_ids=positions,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        settings = (temperature, top_k, top_p, pad_id)
        record(b, out.logits[:, -1], stops, *settings)
        del out
        cache.slots, cache.visible = b.slot, length
        b.slot.fill_(width)
        b.position.copy_(positions[:, -1:] + 1)

        def decode() -> None:  # over the buffers decoding now (`b`, rebound by a compaction)
            decoder.decode(model, b, stops, settings)

        def capture() -> int:
            """Capture the decode step over `b` unless it is held or not wanted; the steps that took
            (the capture's eager run is a real decode step)."""
            if not graphs or b.graph is not None or max_new_tokens - taken < 2:
                return 0
            start = time.perf_counter()
            b.graph = _capture(decode)
            COUNTS["capture_s"] += time.perf_counter() - start
            return 1

        taken = 1
        COUNTS["reused"] += replay
        taken += capture()
        COUNTS["graph" if b.graph is not None else "eager"] += 1
        # b's first `real` rows are rows `origin` of the call's own buffers `top` (None: b is top).
        top, real, origin = b, count, None
        while taken < max_new_tokens:
            if taken % DONE_CHECK_EVERY == 0:
                done = b.done[:real].cpu()  # a device sync
                if bool(done.all()):
                    break
                rows = compact_rows(top.size.rows, real - int(done.sum()), graphs)
                if rows < b.size.rows:
                    live = (~done).nonzero()[:, 0].to(device)
                    smaller = decoder.take_smaller(model, rows, device)
                    compact(b, smaller, live)
                    if origin is not None:
                        write_back(top, b, origin)
                    origin = live if origin is None else origin[live]
                    b, real = smaller, len(live)
                    COUNTS["compacted"] += 1
                    if capture():  # its eager run was this step
                        taken += 1
                        continue
            b.graph.replay() if b.graph is not None else decode()
            taken += 1
        if origin is not None:
            write_back(top, b, origin)
    finally:
        cfg._attn_implementation = saved_attention
    return collect(top.out_tokens[:count, :taken].tolist(), top.out_logprobs[:count, :taken].tolist(),
                   top.stopped_at[:count].tolist())
