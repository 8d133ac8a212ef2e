"""Batched autoregressive generation over a transformers causal LM with a KV cache.

Prompts are left-padded into one [B, P] batch; the prefill and every decode step pass the
2D attention mask, position ids counted over real tokens only and a `DynamicCache`, the
same inputs `model.generate` builds, so greedy decoding matches it token for token.
Rows that have stopped keep decoding pad tokens (as `generate` does) until all rows stop
or `max_new_tokens` is reached; their extra tokens are dropped.

Sampling applies temperature, then top-k, then top-p. The logprob reported for a token is
that of the temperature-scaled distribution before top-k/top-p filtering (temperature 1
for greedy), i.e. what a full forward of prompt + completion gives with the same
temperature. Per-row `torch.Generator`s make a sample depend only on its own seed, not on
which other rows share its batch.

On CUDA (`torch_decode.STATIC_DEVICES`) `generate_batch` hands the batch to
`torch_decode.generate_static`: a static KV cache and the decode step as a CUDA graph
(both kept for later calls that fit them when a `decoder` holds them), sampling seeded by
each row's generator seed. CPU keeps this loop.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from transformers import DynamicCache

from roles.engines import torch_decode


@dataclass
class Generated:
    tokens: list[list[int]]  # completion tokens per row, the stop token included when hit
    logprobs: list[list[float]]  # sampling-distribution logprob per completion token
    finish_reasons: list[str]  # "stop" or "length"


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device):
    """[B, P] ids, attention mask and position ids (0.. over real tokens, 0 on padding)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    return ids, mask, positions


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (one token always survives)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass of the tokens ranked above it already reaches top_p.
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generators: Optional[list[torch.Generator]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], logprob [B]) from float32 logits [B, V]."""
    if temperature == 0:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, -1)
    probs = filter_logits(scaled, top_k, top_p).softmax(-1)
    if generators is None:
        token = torch.multinomial(probs, 1).squeeze(-1)
    else:
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p; one noise row per generator.
        noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=g) for g in generators])
        token = (probs / noise).argmax(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def attention_kernels(device: torch.device):
    """On CUDA: scaled-dot-product attention without cuDNN's kernel, which builds a plan for
    every new shape; a decode step's shape is new at every token of every batch whose prompt
    width differs (a first full-length generate ran ~3x slower with it). Elsewhere: as is."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@torch.inference_mode()
def generate_batch(model, prompts: Sequence[Sequence[int]], *, temperature: float, top_k: int, top_p: float,
                   max_new_tokens: int, stop_ids: Sequence[int], pad_id: int,
                   generators: Optional[list[torch.Generator]] = None,
                   decoder: Optional[torch_decode.StaticDecoder] = None) -> Generated:
    """Generate one completion per prompt (token-id lists) in a single batch. `decoder`: the
    static path's buffers and graph kept across calls (torch_decode.StaticDecoder)."""
    device = next(model.parameters()).device
    if device.type in torch_decode.STATIC_DEVICES and torch_decode.supports(model):
        seeds = None if generators is None else [g.initial_seed() for g in generators]
        with attention_kernels(device):
            return torch_decode.generate_static(model, prompts, temperature=temperature, top_k=top_k, top_p=top_p,
                                                max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=pad_id,
                                                seeds=seeds, decoder=decoder)
    with attention_kernels(device):
        if max_new_tokens <= 0:
            return Generated([[] for _ in prompts], [[] for _ in prompts], ["length"] * len(prompts))
        ids, mask, positions = left_pad(prompts, pad_id, device)
        batch = ids.shape[0]
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
        cache = DynamicCache(config=model.config)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        tokens, logprobs, stopped_at = [], [], torch.full((batch,), -1, dtype=torch.long, device=device)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        for step in range(max_new_tokens):
            token, logprob = sample_next(out.logits[:, -1].float(), temperature, top_k, top_p, generators)
            token = token.masked_fill(done, pad_id)
            tokens.append(token)
            logprobs.append(logprob)
            hit = ~done & torch.isin(token, stops)
            stopped_at = torch.where(hit, step, stopped_at)
            done = done | hit
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                        past_key_values=cache, use_cache=True)
        del cache, out
        return collect(torch.stack(tokens, 1).tolist(), torch.stack(logprobs, 1).float().tolist(), stopped_at.tolist())


def collect(token_rows: list[list[int]], logprob_rows: list[list[float]], stopped_at: list[int]) -> Generated:
    """Rows cut after their stop token (`stopped_at`: its step, -1 for none)."""
    result = Generated([], [], [])
    for row, lp, at in zip(token_rows, logprob_rows, stopped_at):
        end = at + 1 if at >= 0 else len(row)
        result.tokens.append(row[:end])
        result.logprobs.append(lp[:end])
        result.finish_reasons.append("stop" if at >= 0 else "length")
    return result
