"""Options of the torch training engine's forward past eager torch, all off by default.

* packing: the real tokens of a micro-batch as one [1, N] sequence (no padding computed),
  position ids restarting per row and attention kept inside each row by FlashAttention's
  variable-length kernel (`torch.nn.attention.varlen`; on CPU one SDPA call per row). The
  logits come back in the padded [B, T, V] layout, zero on padding.
* compile: the model's forward through `torch.compile` (the module itself, its parameters
  and state dict stay as they are: offload, weight sync and checkpoints see no wrapper).
* activation_checkpointing: each decoder layer recomputed in the backward (transformers'
  gradient checkpointing, non-reentrant): less activation memory for longer sequences.
* cuda_graphs: the compiled forward and backward replayed as CUDA graphs (torch.compile's
  'reduce-overhead' mode), so the host no longer launches each kernel. A graph is recorded per
  input shape; packed micro-batches are padded to `pack_bucket` lengths so that ragged batches
  reuse a few. The engine keeps gradient buffers of its own (a graph's outputs are overwritten
  by its next replay, so gradients are accumulated into them, never taken from the graph).

`chunked_token_logprobs` computes aligned token logprobs from the last hidden states and
the output head a chunk of positions at a time, forward and backward, so that no [B, T, V]
float32 logits tensor is ever held. `chunked_vocab_logprobs` does the same for the teacher's
top-k (or full-vocabulary) logprobs and tail mass, forward only.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from roles.batch import tensor_to

PACKED_ATTENTION = "packed_varlen"
# Positions per chunk of the chunked log-softmax (times the vocabulary: the float32 block held).
LOGPROB_CHUNK = 4096


@dataclass
class TrainKernelOptions:
    packing: bool = False
    compile: bool = False
    activation_checkpointing: bool = False
    cuda_graphs: bool = False
    fused_logprobs: bool = False


def pack_bucket(n: int) -> int:
    """`n` rounded up to one of 8 evenly spaced sizes per power of two (at most 1/8 more): the
    packed lengths a CUDA-graphed forward records graphs for."""
    step = 1 << max(n.bit_length() - 4, 0)
    return -(-n // step) * step


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
            scale: Optional[float]) -> torch.Tensor:
    """Causal attention of [N, H, D] queries over [N, Hkv, D] keys within each cu-delimited
    row: FlashAttention's varlen kernel on CUDA in 16-bit, else one SDPA call per row. Grouped
    keys and values (fewer heads than the queries) are read per group where the kernel can."""
    if q.is_cuda and torch.is_autocast_enabled("cuda"):  # as autocast does for SDPA (rotary made q, k float32)
        q, k, v = (t.to(torch.get_autocast_dtype("cuda")) for t in (q, k, v))
    flash = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    kernel, params = _varlen_kernel() if flash else (None, frozenset())
    if k.shape[1] != q.shape[1] and "enable_gqa" not in params:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if flash:
        causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        return kernel(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal, **gqa)
    return rows_attention(q, k, v, cu, scale)


@functools.cache
def _varlen_kernel() -> tuple[Callable, frozenset]:
    """torch's FlashAttention varlen kernel and the names of its parameters (they differ between
    torch versions), read once: an eager packed forward calls `_varlen` once per layer."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                   scale: Optional[float]) -> torch.Tensor:
    """`_varlen` as one causal SDPA call per row (the reference; CPU and float32)."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop > start:
            rows = [t[start:stop].transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, n, D]
            out[start:stop] = F.scaled_dot_product_attention(*rows, is_causal=True, scale=scale)[0].transpose(0, 1)
    return out


def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                      max_length_q=None, **kwargs):
    """transformers attention interface for a packed [1, N] batch (queries [1, H, N, D])."""
    out = _varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_seq_lens_q,
                  max_length_q, scaling)
    return out[None], None  # [1, N, H, D]


AttentionInterface.register(PACKED_ATTENTION, _packed_attention)


def use_packing(model, on: bool) -> None:
    """Attention of `model` through the packed kernel (on), or the implementation it had before.
    Set for as long as packing is on, so that checkpointed layers recompute the same way."""
    config = model.config  # the previous one is kept on the module: the config is saved with checkpoints
    if on and config._attn_implementation != PACKED_ATTENTION:
        model.unpacked_attention = config._attn_implementation
        config._attn_implementation = PACKED_ATTENTION
    elif not on and config._attn_implementation == PACKED_ATTENTION:
        config._attn_implementation = model.unpacked_attention


@dataclass
class Packed:
    """A micro-batch's real tokens as one sequence: the model's keyword inputs (on the model's
    device) and where each packed token sits in the [B * T] layout (`flat`, the first `real`)."""
    inputs: dict
    flat: torch.Tensor
    real: int
    shape: torch.Size

    def unpack(self, values: torch.Tensor, skip: int = 0) -> torch.Tensor:
        """Per-token `values` [n, ...] of packed tokens `skip`, `skip` + 1, ... back in the
        [B, T, ...] layout, zero elsewhere."""
        n = self.real - skip
        full = values.new_zeros(self.shape.numel(), *values.shape[1:]).index_copy(0, self.flat[skip:], values[:n])
        return full.view(*self.shape, *values.shape[1:])


def pack(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, bucket: bool = False) -> Packed:
    """The real tokens of `input_ids` packed into one [1, N] sequence for `model` (packing on),
    position ids restarting per row. `bucket`: padded to `pack_bucket` length by one more row
    of padding tokens, and the longest row rounded the same way. The indices are computed where
    `attention_mask` is: given host tensors, nothing here waits for the device (they reach it
    through pinned memory)."""
    if model.config._attn_implementation != PACKED_ATTENTION:
        raise RuntimeError(f"packing needs model.config._attn_implementation = '{PACKED_ATTENTION}' "
                           "(use_packing sets it)")
    device = model.get_input_embeddings().weight.device
    valid = attention_mask.bool()
    lengths = valid.sum(1)
    longest = int(lengths.max())
    ids = input_ids.to(valid.device)[valid][None]
    positions = (valid.long().cumsum(1) - 1)[valid][None]
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    flat = valid.reshape(-1).nonzero()[:, 0]  # where each packed token sits in [B * T]
    real = len(flat)
    if bucket:
        pad = pack_bucket(real) - real
        ids = F.pad(ids, (0, pad))
        positions = torch.cat([positions, torch.arange(pad, device=positions.device)[None]], 1)
        cu = torch.cat([cu, cu.new_tensor([real + pad])])
        longest = pack_bucket(max(longest, pad))
    ids, positions, cu, flat = (tensor_to(t, device) for t in (ids, positions, cu, flat))
    inputs = dict(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=longest, max_length_k=longest, use_cache=False)
    return Packed(inputs, flat, real, valid.shape)


def packed_forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, run=None,
                   base: bool = False, bucket: bool = False) -> torch.Tensor:
    """The model's output for the real tokens packed into one sequence (`pack`), scattered back
    to [B, T, ...] (zero on padding): logits, or with `base` the last hidden states of
    `model.base_model`. `run` calls the module (a compiled forward); default: the module."""
    p = pack(model, input_ids, attention_mask, bucket)
    target = model.base_model if base else model
    out = (target if run is None else run)(**p.inputs)
    return p.unpack((out.last_hidden_state if base else out.logits)[0])


def topk_logprobs(scaled: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(`scaled`) [.., V] at `indices` [.., k], and the log mass outside them [..],
    exactly (a log-sum-exp over the other tokens, where log(1 - sum p) would cancel)."""
    lse = scaled.logsumexp(-1, keepdim=True)
    top = scaled.gather(-1, indices) - lse
    return top, logsumexp_outside(scaled, indices, torch.finfo(scaled.dtype).min) - lse[..., 0]


def logsumexp_outside(values: torch.Tensor, indices: torch.Tensor, fill: float) -> torch.Tensor:
    """log-sum-exp over the last dim of `values` without the entries at `indices`, which count
    as `fill` (-inf, or the dtype's lowest where a gradient flows), through a boolean mask that a
    compiled graph fuses into the reduction."""
    outside = torch.ones_like(values, dtype=torch.bool).scatter(-1, indices, False)
    return torch.where(outside, values, fill).logsumexp(-1)


def vocab_logprobs(logits: torch.Tensor, topk: Optional[int], tail: bool,
                   temperature: float) -> tuple[torch.Tensor, ...]:
    """log softmax(logits / temperature) [.., V] in float32 as (values,); with `topk` its k
    largest values and their token ids [.., k], plus with `tail` the log mass outside them [..]
    (a log-sum-exp over the other tokens: exact where log(1 - sum p) would cancel)."""
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    if topk is None:
        return (logprobs,)
    values, index = torch.topk(logprobs, topk, dim=-1)
    if not tail:
        return values, index
    return values, index, logsumexp_outside(logprobs, index, float("-inf"))


def next_token_vocab_logprobs(model, topk: Optional[int], tail: bool, temperature: float,
                              **inputs) -> tuple[torch.Tensor, ...]:
    """`vocab_logprobs` of the model's logits at every position of `inputs` (HF layout: row t
    predicts token t + 1): the teacher's forward as one function (compiled: teacher.fused_logprobs)."""
    hidden = model.base_model(**inputs).last_hidden_state
    return vocab_logprobs(model.get_output_embeddings()(hidden), topk, tail, temperature)


def next_token_logprobs(model, targets: torch.Tensor, temperature: float, entropy: bool,
                        topk_indices: Optional[torch.Tensor] = None, **inputs) -> tuple[Optional[torch.Tensor], ...]:
    """log softmax(head(last hidden state) / temperature)[target] at every position of `inputs`
    ([.., T] for targets [.., T]: the token each position predicts); with `entropy` the entropy
    of each position's distribution (no gradient: it is logged), else None; with `topk_indices`
    [.., T, k] the log-softmax at those tokens and the log mass outside them (`topk_logprobs`),
    else None, None. Compiled as one function (`fused_token_logprobs`), the output head, the
    float32 log-softmax and the picks run over the 16-bit logits; no float32 [.., T, V] tensor
    is kept."""
    hidden = model.base_model(**inputs).last_hidden_state
    logits = model.get_output_embeddings()(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = logits.logsumexp(-1)
    picked = logits.gather(-1, targets[..., None])[..., 0] - lse
    top, rest = topk_logprobs(logits, topk_indices) if topk_indices is not None else (None, None)
    ent = None
    if entropy:  # logged only: no gradient
        plain = logits.detach()
        ent = lse.detach() - (torch.softmax(plain, -1) * plain).sum(-1)
    return picked, ent, top, rest


def plain_head(model) -> bool:
    """Whether the model's logits are its output head's projection of the last hidden states
    (what the chunked and fused logprobs compute from): no bias, no logit soft-capping."""
    return getattr(model.get_output_embeddings(), "bias", None) is None and \
        not getattr(model.config, "final_logit_softcapping", None)


def check_plain_head(model, option: str) -> None:
    """Raise unless `plain_head(model)`."""
    if not plain_head(model):
        raise ValueError(f"{option} needs logits that are the output head's projection of the last hidden "
                         "states (no bias, no logit soft-capping); turn it off for this model")


def fused_token_logprobs(model, run: Callable, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         temperature: float, packing: bool, bucket: bool = False, entropy: bool = False,
                         topk_indices: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], ...]:
    """Through `run`, a compiled `next_token_logprobs` of `model`: [B, T] logprobs aligned like
    `torch_engine.token_logprobs` (out[:, t] = log p(ids[t] | ids[:t]); 0 at t = 0 and wherever
    ids[t] is padding); with `entropy` the entropies aligned the same way, else None; with
    `topk_indices` [B, T, k] (aligned: the tokens of position t's distribution, the teacher's
    top k in GKD) the log-softmax at them [B, T, k] and the log mass outside them [B, T], else
    None, None. With `packing` the micro-batch runs packed (`pack`), and a row's first real
    token, which nothing predicts in the packed sequence, gets 0."""
    device = model.get_input_embeddings().weight.device
    if packing:
        p = pack(model, input_ids, attention_mask, bucket)
        ids = p.inputs["input_ids"]
        index = None
        if topk_indices is not None:  # packed like the tokens whose distributions they pick from
            packed = tensor_to(topk_indices.reshape(p.shape.numel(), -1), device)[p.flat]
            index = F.pad(packed[1:], (0, 0, 0, ids.shape[1] - p.real + 1))[None]
        outs = run(F.pad(ids[:, 1:], (0, 1)), temperature, entropy, index, **p.inputs)
        # Packed token j + 1 is predicted at j unless it starts a row (the positions restart).
        follows = p.inputs["position_ids"][0, 1:p.real] > 0
        return tuple(t if t is None else p.unpack(torch.where(follows.view(-1, *[1] * (t.dim() - 2)),
                                                              t[0, :p.real - 1], 0.0), skip=1) for t in outs)
    ids, mask = tensor_to(input_ids, device), tensor_to(attention_mask, device)
    if ids.shape[1] < 2:  # one position: nothing is predicted (the model takes no empty sequence)
        zero = torch.zeros(ids.shape, dtype=torch.float32, device=device)
        top = None if topk_indices is None else torch.zeros(*ids.shape, topk_indices.shape[-1], device=device)
        return zero, zero.clone() if entropy else None, top, None if top is None else zero.clone()
    index = None if topk_indices is None else tensor_to(topk_indices, device)[:, 1:]
    outs = run(ids[:, 1:], temperature, entropy, index, input_ids=ids[:, :-1], attention_mask=mask[:, :-1],
               use_cache=False)
    valid = mask.bool()
    return tuple(t if t is None else torch.where(valid.view(*valid.shape, *[1] * (t.dim() - 2)),
                                                 F.pad(t, (0, 0) * (t.dim() - 2) + (1, 0)), 0.0) for t in outs)


class _ChunkedLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[target], LOGPROB_CHUNK rows at a time;
    the backward recomputes each chunk's softmax instead of keeping it. The matmuls run in the
    autocast dtype of the forward (the backward runs outside autocast: without this it would
    multiply in float32), the softmax in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, target, temperature, chunk):
        kind = hidden.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype
        w = weight.to(dtype)
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        with torch.autocast(kind, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                logits = (hidden[s:s + chunk].to(dtype) @ w.T).float() / temperature
                out[s:s + chunk] = logits.gather(-1, target[s:s + chunk, None])[:, 0] - logits.logsumexp(-1)
        ctx.save_for_backward(hidden, weight, target)
        ctx.temperature, ctx.chunk, ctx.dtype = temperature, chunk, dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, target = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk].to(ctx.dtype)
            probs = ((h @ w.T).float() / ctx.temperature).softmax(-1)
            # d logp[target] / d logits = onehot(target) - softmax, scaled by 1 / temperature.
            g = -probs * grad_out[s:s + ctx.chunk, None]
            g.scatter_add_(-1, target[s:s + ctx.chunk, None], grad_out[s:s + ctx.chunk, None].float())
            g = (g / ctx.temperature).to(ctx.dtype)
            if grad_hidden is not None:
                grad_hidden[s:s + ctx.chunk] = g @ w
            if grad_weight is not None:
                grad_weight += (g.T @ h).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, head: torch.nn.Module, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor, temperature: float,
                           chunk: Optional[int] = None) -> torch.Tensor:
    """[B, T] logprobs aligned like `torch_engine.token_logprobs` (out[:, t] = log p(ids[t] |
    ids[:t]), 0 at t = 0 and wherever ids[t] is padding) from last hidden states [B, T, H] and
    an output head without bias, never holding more than `chunk` (default LOGPROB_CHUNK, read at
    call time) rows of logits."""
    if getattr(head, "bias", None) is not None:
        raise ValueError("chunked_token_logprobs needs an output head without bias")
    target_valid = attention_mask[:, 1:].bool()
    picked = _ChunkedLogprobs.apply(hidden[:, :-1][target_valid], head.weight, input_ids[:, 1:][target_valid],
                                    float(temperature), chunk or LOGPROB_CHUNK)
    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=hidden.device)
    out[:, 1:] = out[:, 1:].masked_scatter(target_valid, picked)
    return out


@torch.no_grad()
def chunked_vocab_logprobs(hidden: torch.Tensor, head: torch.nn.Module, topk: Optional[int], tail: bool,
                           temperature: float, out_device: torch.device,
                           chunk: Optional[int] = None) -> tuple[torch.Tensor, ...]:
    """log softmax(head(hidden) / temperature) of [N, H] hidden states, `chunk` rows at a time:
    (values [N, k], indices [N, k]) and with `tail` the log mass outside the top k [N]; with
    `topk` None (values [N, V],). Outputs land on `out_device` chunk by chunk, so the device
    holds one chunk's float32 logits at most. The same operations, row for row, as the
    teacher's plain forward (`vocab_logprobs` of the output head's logits).
    `chunk`: rows per chunk, default LOGPROB_CHUNK."""
    n, chunk = hidden.shape[0], chunk or LOGPROB_CHUNK
    width = head.out_features if topk is None else topk
    values = torch.empty(n, width, dtype=torch.float32, device=out_device)
    indices = torch.empty(n, width, dtype=torch.long, device=out_device) if topk is not None else None
    tails = torch.empty(n, dtype=torch.float32, device=out_device) if tail else None
    outs = tuple(t for t in (values, indices, tails) if t is not None)
    for s in range(0, n, chunk):
        for out, got in zip(outs, vocab_logprobs(head(hidden[s:s + chunk]), topk, tail, temperature)):
            out[s:s + chunk] = got.to(out_device)
    return outs
