"""What the two torch decode loops share: the dynamic one (`torch_generate`) and the static
one (`torch_decode`) start from the same left-padded prompt batch, choose tokens with the
same sampling head and return the same `Generated` rows.

The sampling head applies temperature, then top-k, then top-p. The logprob reported for a
token is that of the temperature-scaled distribution before top-k/top-p filtering
(temperature 1 for greedy), i.e. what a full forward of prompt + completion gives with the
same temperature. Only the random draw differs between the loops: each passes its own
`draw` (per-row generators in one, per-row seeds hashed with the step in the other).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch


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


def collect(token_rows: list[list[int]], logprob_rows: list[list[float]], stopped_at: list[int]) -> Generated:
    """Rows cut after their stop token (`stopped_at`: its step, -1 for none)."""
    result = Generated([], [], [])
    for row, lp, at in zip(token_rows, logprob_rows, stopped_at):
        end = at + 1 if at >= 0 else len(row)
        result.tokens.append(row[:end])
        result.logprobs.append(lp[:end])
        result.finish_reasons.append("stop" if at >= 0 else "length")
    return result


@torch.compiler.disable
def cumulative(probs: torch.Tensor) -> torch.Tensor:
    """probs.cumsum(-1), outside a compiled decode step: Inductor's split scan fails to generate
    code for [256, 151936] on CUDA (InductorError "list indices must be integers or slices, not
    NoneType", torch 2.11), where the 512-row step compiles."""
    return probs.cumsum(-1)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus to -inf (one token always survives)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass of the tokens ranked above it already reaches top_p.
        drop_sorted = (cumulative(sorted_probs) - sorted_probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
           draw: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B], logprob [B]) from float32 logits [B, V]: greedy at temperature 0, else
    `draw(probs)` picks a token per row from the filtered probabilities [B, V]."""
    if temperature == 0:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits / temperature
    logp = torch.log_softmax(scaled, -1)
    token = draw(filter_logits(scaled, top_k, top_p).softmax(-1))
    return token, logp.gather(-1, token[:, None]).squeeze(-1)
