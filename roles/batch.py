"""The data that crosses role boundaries: small dataclasses of tensors and lists, and what
roles do with a Batch (slice it, move it to the device, size its micro-batches).

Conventions (every role follows them):
* Sequences are right-padded to one length T; `attention_mask` is 1 on real tokens.
* Per-token fields have shape [B, T] and are aligned with `input_ids`: position t holds
  the value for token t given tokens < t (log p(input_ids[t] | input_ids[:t])); position 0
  and padding hold 0.
* `loss_mask` is 1 on the tokens a loss counts (the response/completion tokens).
All batch types slice along the first axis (orchestration's dispatch='slice') and
concatenate back (collect='flatten'), so every field is per-sample.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class SamplingParams:
    # Longest completion in tokens; required (the drivers pass algorithm.max_new_tokens, or
    # run.eval_max_new_tokens for eval).
    max_new_tokens: int
    # Softmax temperature; 0 means greedy.
    temperature: float = 1.0
    # Nucleus sampling mass; 1.0 disables it.
    top_p: float = 1.0
    # Keep only the k most likely tokens; 0 disables it.
    top_k: int = 0
    # Completions per prompt.
    n: int = 1
    # Token ids that end a completion (the tokenizer's eos is always one, unless ignore_eos).
    stop_token_ids: tuple[int, ...] = ()
    # Decode max_new_tokens tokens whatever end-of-sequence token the model emits (fixed-size
    # workloads for benchmarks); stop_token_ids still stop.
    ignore_eos: bool = False
    # Seed of the sampling generator; None draws from the global generator.
    seed: Optional[int] = None
    # Report each sampled token's logprob (the behaviour policy's, for an importance ratio).
    # vLLM computes them for this only; the torch engine has them anyway.
    logprobs: bool = True


@dataclass
class Completions:
    """Output of Rollout.generate / Sampler.sample: one entry per completion, grouped by
    prompt (the n completions of prompt i are consecutive)."""
    prompt_index: list[int]  # index of the prompt in the request
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    texts: list[str]
    logprobs: list[list[float]]  # sampling-distribution logprob of each completion token
    finish_reasons: list[str]  # "stop" (a stop token) or "length" (max_new_tokens)
    weight_version: list[int] = field(default_factory=list)  # version of the weights that generated it
    # Multi-turn trajectories (roles/multi_turn.py): 1 on the model's tokens, 0 on the environment's
    # and tools' tokens appended between turns (their logprobs are 0). Empty: every token is the model's.
    completion_mask: list[list[int]] = field(default_factory=list)
    # Multi-turn: per trajectory what the environment reported (num_turns, total_reward,
    # step_rewards, tool_calls, tool_errors, error); empty for single-turn generation.
    rollout_infos: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.completion_ids)


@dataclass
class Batch:
    """A training/scoring batch: prompt + completion token ids with masks and per-token fields."""
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] float, 1 on tokens the loss counts
    old_logprobs: Optional[torch.Tensor] = None  # [B, T] behaviour-policy logprobs
    # [B, T] the rollout engine's sampling logprobs, kept apart where old_logprobs are the
    # trainer's own (GRPO's rollout_importance_sampling_mode); None: old_logprobs are the rollout's.
    rollout_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None  # [B, T] reference-policy logprobs
    advantages: Optional[torch.Tensor] = None  # [B] per-sequence (or [B, T] per-token)
    teacher_logprobs: Optional[torch.Tensor] = None  # [B, T, k] top-k (or [B, T, V] full) teacher logprobs
    teacher_indices: Optional[torch.Tensor] = None  # [B, T, k] token ids of the top-k, None for full vocab
    rewards: Optional[torch.Tensor] = None  # [B]
    sft_weight: Optional[torch.Tensor] = None  # [B] weight of a row in an SFT term (None: 1 for every row)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def pad_sequences(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to a [B, T] tensor and its attention mask."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


def batch_from_completions(c: Completions, pad_id: int) -> Batch:
    """Prompt + completion as one sequence; the loss counts completion tokens (of a multi-turn
    trajectory, the model's: `completion_mask`), and the sampling logprobs become
    `old_logprobs` at their aligned positions."""
    seqs = [p + r for p, r in zip(c.prompt_ids, c.completion_ids)]
    ids, mask = pad_sequences(seqs, pad_id)
    loss_mask = torch.zeros(ids.shape, dtype=torch.float32)
    old = torch.zeros(ids.shape, dtype=torch.float32)
    for i, (p, r) in enumerate(zip(c.prompt_ids, c.completion_ids)):
        loss_mask[i, len(p):len(p) + len(r)] = 1.0
        if c.completion_mask:  # multi-turn: the model's own tokens only
            loss_mask[i, len(p):len(p) + len(r)] = torch.tensor(c.completion_mask[i], dtype=torch.float32)
        if c.logprobs and c.logprobs[i]:
            old[i, len(p):len(p) + len(r)] = torch.tensor(c.logprobs[i], dtype=torch.float32)
    # Completions generated without logprobs (SamplingParams.logprobs false) have no behaviour
    # logprobs: None, never zeros that would read as probability 1.
    reported = any(len(lp) for lp in c.logprobs)
    return Batch(input_ids=ids, attention_mask=mask, loss_mask=loss_mask, old_logprobs=old if reported else None)


def slice_batch(batch: Batch, start: int, stop: int, width: Optional[int] = None) -> Batch:
    """Rows [start, stop) of every per-sample field; per-token fields ([B, T, ...]) cut to
    the first `width` positions (right padding only, so nothing real is cut)."""
    T = batch.input_ids.shape[1]
    fields = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor) and v.ndim >= 1:
            v = v[start:stop]
            if width is not None and v.ndim >= 2 and v.shape[1] == T:
                v = v[:, :width]
        elif isinstance(v, list):
            v = v[start:stop]
        fields[f.name] = v
    return dataclasses.replace(batch, **fields)


def tensor_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; host to CUDA through pinned memory without waiting (a plain copy waits
    until the device has run everything queued before it)."""
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def batch_to(batch: Batch, device: torch.device) -> Batch:
    """`batch` with its host tensors on CUDA `device` (`tensor_to`); elsewhere `batch` itself
    (the engines move their inputs)."""
    if device.type != "cuda":
        return batch
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    for name, v in moved.items():
        if isinstance(v, torch.Tensor) and v.device.type == "cpu":
            moved[name] = tensor_to(v, device)
    return dataclasses.replace(batch, **moved)


def token_bytes(model: torch.nn.Module, backward: bool, logits: bool = True) -> float:
    """Rough activation bytes per token of a forward (with `backward`, also what it keeps for the
    backward): the fp32 logits and their softmax (unless `logits` is False: a chunked
    log-softmax), plus a few hidden-size tensors per layer."""
    c = getattr(model, "config", None)
    vocab = getattr(c, "vocab_size", 32_000) if logits else 0
    hidden, layers = getattr(c, "hidden_size", 1024), getattr(c, "num_hidden_layers", 24)
    return 4.0 * ((3 if backward else 2) * vocab + (16 if backward else 4) * hidden * layers)


def fitting_rows(rows: int, width: int, per_token: float, budget_mb: float) -> int:
    """Rows per pass for an automatic micro-batch: all `rows` when `rows` x `width` tokens of
    `per_token` bytes fit `budget_mb` MiB, else the most that fit (at least 1)."""
    return max(1, min(rows, int(budget_mb * 2**20 // (max(width, 1) * per_token))))
