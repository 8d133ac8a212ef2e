"""Group-relative advantages for GRPO-style training (pure torch, no roles, no Ray).

Rewards arrive flat, [num_prompts * G], with the G = num_generations completions of one
prompt consecutive (the order Rollout.generate returns them in). Semantics follow TRL's
GRPOTrainer: the baseline is the group mean (or, with `leave_one_out`, the mean of the other
G-1 rewards, as in RLOO), and the scale is the unbiased std of the group, of the whole batch,
or none, with `eps` added to the std.
"""
from __future__ import annotations

import typing
from typing import Literal

import torch

ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS = typing.get_args(ScaleRewards)


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * num_generations], got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    return rewards.view(-1, num_generations)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: ScaleRewards,
                     leave_one_out: bool, eps: float = 1e-4) -> torch.Tensor:
    """[num_prompts * G] advantages, one per completion.

    A_i = (r_i - baseline_i) / (std + eps), where baseline_i is the group mean, or with
    `leave_one_out` the mean of the other G-1 rewards of the group; std is the unbiased std of
    the group ('group'), of all rewards ('batch'), or no scaling at all ('none'). A group (or
    batch) of one reward has std 0.
    """
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    rewards = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    grouped = _grouped(rewards, num_generations)
    g = num_generations
    if leave_one_out:
        if g < 2:
            raise ValueError("leave_one_out needs num_generations >= 2 (the baseline is the mean of the others)")
        baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (g - 1)
    else:
        baseline = grouped.mean(dim=1, keepdim=True)
    advantages = (grouped - baseline).reshape(-1)
    if scale_rewards == "none":
        return advantages
    if scale_rewards == "group":
        std = grouped.std(dim=1) if g > 1 else torch.zeros(grouped.shape[0], dtype=rewards.dtype, device=rewards.device)
        std = std.repeat_interleave(g)
    else:
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
    return advantages / (std + eps)


def zero_variance_groups(rewards: torch.Tensor, num_generations: int, atol: float = 1e-6) -> torch.Tensor:
    """[num_prompts] bool: True where all G rewards of the group are equal (within `atol`).

    Such a group has zero advantage everywhere and teaches nothing; `dynamic_sample` drops it
    and resamples. Per-completion keep mask: `(~zero_variance_groups(r, G)).repeat_interleave(G)`.
    """
    grouped = _grouped(rewards, num_generations)
    return (grouped.max(dim=1).values - grouped.min(dim=1).values) <= atol


def teacher_token_advantages(advantages: torch.Tensor, teacher_logprobs: torch.Tensor, logprobs: torch.Tensor,
                             mask: torch.Tensor, coef: float) -> torch.Tensor:
    """[B, T] per-token advantages with a teacher's signal (on-policy distillation as RL, as
    ms-swift's GRPO with a teacher computes them).

    A_t = A + coef * (teacher_logprobs_t - logprobs_t) where `mask` > 0 (the completion tokens),
    A alone elsewhere. `advantages` is [B] (a sequence's, broadcast over its tokens) or [B, T];
    the others are [B, T], aligned like every per-token field. The log-ratio is the single-sample
    (k1) estimate of -KL(student || teacher) at each sampled token: positive where the teacher
    likes the token more than the student that sampled it. It is added after the rewards'
    group normalisation, itself never normalised; the inputs are plain numbers (no gradient).
    """
    if teacher_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(f"teacher_logprobs {tuple(teacher_logprobs.shape)}, logprobs {tuple(logprobs.shape)} and "
                         f"mask {tuple(mask.shape)} must all be [B, T]")
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or [B, T] for logprobs "
                         f"{tuple(logprobs.shape)}")
    base = advantages.float()
    base = base[:, None].expand(logprobs.shape) if base.ndim == 1 else base
    ratio = (teacher_logprobs.float() - logprobs.float()).detach()
    return base + coef * torch.where(mask > 0, ratio, torch.zeros((), dtype=ratio.dtype))
