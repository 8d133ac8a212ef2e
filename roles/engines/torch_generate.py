"""Batched autoregressive generation over a transformers causal LM with a KV cache.

Prompts are left-padded into one [B, P] batch; the prefill and every decode step pass the
2D attention mask, position ids counted over real tokens only and a `DynamicCache`, the
same inputs `model.generate` builds, so greedy decoding matches it token for token.
Rows that have stopped keep decoding pad tokens (as `generate` does) until all rows stop
or `max_new_tokens` is reached; their extra tokens are dropped.

Tokens are chosen by the sampling head in `decoding` (temperature, top-k, top-p; greedy at
temperature 0). Per-row `torch.Generator`s make a sample depend only on its own seed, not
on which other rows share its batch.

On CUDA (`torch_decode.STATIC_DEVICES`) `generate_batch` hands the batch to
`torch_decode.generate_static`: a static KV cache and the decode step as a CUDA graph
(both kept for later calls that fit them when a `decoder` holds them), sampling seeded by
each row's generator seed, for models whose cache is keys and values in every layer
(`torch_decode.unsupported` says why another is not: Qwen3.5's linear attention, sliding
windows). CPU, and those models on CUDA, keep this loop (`decode_path` names the one taken).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
from transformers import DynamicCache

from roles.engines import torch_decode
from roles.engines.decoding import Generated, collect, left_pad, sample


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generators: Optional[list[torch.Generator]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], logprob [B]) from float32 logits [B, V]; row i draws with generators[i]
    (None: torch's global generator)."""
    def draw(probs: torch.Tensor) -> torch.Tensor:
        if generators is None:
            return torch.multinomial(probs, 1).squeeze(-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p; one noise row per generator.
        noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=g) for g in generators])
        return (probs / noise).argmax(-1)

    return sample(logits, temperature, top_k, top_p, draw)


def attention_kernels(device: torch.device):
    """On CUDA: scaled-dot-product attention without cuDNN's kernel, which builds a plan for
    every new shape; a decode step's shape is new at every token of every batch whose prompt
    width differs (a first full-length generate ran ~3x slower with it). Elsewhere: as is."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def decode_path(model) -> str:
    """The loop `generate_batch` runs for `model` where it sits: "static" (torch_decode) or
    "dynamic" (this module's, with transformers' own cache)."""
    device = next(model.parameters()).device
    return "static" if device.type in torch_decode.STATIC_DEVICES and torch_decode.supports(model) else "dynamic"


@torch.inference_mode()
def generate_batch(model, prompts: Sequence[Sequence[int]], *, temperature: float, top_k: int, top_p: float,
                   max_new_tokens: int, stop_ids: Sequence[int], pad_id: int,
                   generators: Optional[list[torch.Generator]] = None,
                   decoder: Optional[torch_decode.StaticDecoder] = None) -> Generated:
    """Generate one completion per prompt (token-id lists) in a single batch. `decoder`: the
    static path's buffers and graph kept across calls (torch_decode.StaticDecoder)."""
    device = next(model.parameters()).device
    if decode_path(model) == "static":
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

