"""Loss functions for the Trainer: SFT, GRPO and GKD (pure torch; no Ray, no role imports).

Call contract (roles.trainer.Trainer): `loss, metrics = loss_fn(logprobs, batch, extras)` once
per micro-batch; the step loss is the sum of the returned values over all micro-batches of
all ranks.
* `logprobs` [b, t]: the current policy's token logprobs with grad, aligned like every
  per-token field of `roles.batch.Batch` (position t = log p(token t | tokens < t)).
* `extras`: 'global_tokens' / 'global_sequences' (loss tokens / sequences of the whole step),
  'temperature' (the trainer's), and what `loss_fn.loss_inputs` asks for: 'logits' [b, t, V]
  aligned (row t = distribution of token t) and already divided by extras['temperature'];
  'entropy' [b, t] (only logged); 'student_topk' ([b, t, k], [b, t]): the log-softmax at
  extras['temperature'] at batch.teacher_indices and the log mass outside them (GKD against a
  top-k teacher, without the logits).
* `metrics`: floats or 0-d tensors (the trainer reads them once per step), means over this
  call's loss tokens; same keys on every call.

Reduction: every loss is numerator / denominator, in a unit (loss tokens, sequences, or
micro-batches for 'bnpo').
* Pure functions (`sft_loss`, `grpo_loss`, `gkd_loss`): reduction='mean' gives the ratio on
  the inputs, 'sum' the numerator; `loss_denominator(loss_type, loss_mask)` gives the rest.
* Callables from `make_loss`: reduction='global' (default) returns numerator / the step's
  global count of the unit read from extras ('global_tokens', 'global_sequences' or
  'global_micro_batches'), so Σ over micro-batches and ranks equals one 'mean' over the whole
  step; 'sum' returns the numerator (the caller divides by Σ `loss_fn.denominator(batch)`);
  'mean' normalises by this micro-batch alone.
Units: SFT, GKD and GRPO 'dapo' count loss tokens (numerator = token sum); GRPO 'grpo' counts
sequences (numerator = sum of per-sequence token means); 'dr_grpo' counts sequences (numerator
= token sum / max_completion_length); 'bnpo' counts micro-batches (numerator = the micro-batch
token mean), so 'bnpo' normalises per micro-batch and 'dapo' by the global token count, as in TRL.
"""
from __future__ import annotations

import inspect
import math
from typing import Literal, Optional, Union

import torch

# The masked-mean helpers live with the correction, which every loss module here may import.
from algorithms.objectives.rollout_correction import (RolloutCorrection, _masked, _masked_mean, _rows_mean,
                                                      off_policy_sequence_keep, rollout_is_metrics, rollout_is_weights,
                                                      rollout_offpolicy_metrics)
from roles.batch import Batch
from roles.engines.train_kernels import topk_logprobs

Reduction = Literal["mean", "sum"]
StepReduction = Literal["global", "mean", "sum"]
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
TOPK_MODES = ("renorm", "tail")


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")


def _at_least_one(count: Union[float, torch.Tensor]) -> Union[float, torch.Tensor]:
    return count.clamp(min=1.0) if isinstance(count, torch.Tensor) else max(count, 1.0)


def _finish(numerator: torch.Tensor, denominator: Union[float, torch.Tensor], reduction: str) -> torch.Tensor:
    return numerator if reduction == "sum" else numerator / _at_least_one(denominator)


# The unit each loss_type normalises by, and the extras key holding the step's global count of it.
_UNITS = {"grpo": "global_sequences", "dr_grpo": "global_sequences", "bnpo": "global_micro_batches",
          "dapo": "global_tokens"}


def loss_denominator(loss_type: str, loss_mask: torch.Tensor) -> Union[float, torch.Tensor]:
    """Denominator of one micro-batch for a loss_type (SFT and GKD use 'dapo': tokens, a 0-d
    tensor where the mask lives)."""
    if loss_type in ("grpo", "dr_grpo"):
        return float(loss_mask.shape[0])
    if loss_type == "bnpo":
        return 1.0
    if loss_type == "dapo":
        return (loss_mask > 0).sum().float()
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def _step_reduce(numerator: torch.Tensor, reduction: str, unit: str, local: float, extras: Optional[dict]):
    """Scale a numerator per the callables' reduction (see the module docstring)."""
    if reduction == "sum":
        return numerator
    if reduction == "mean":
        return numerator / _at_least_one(local)
    if not extras or unit not in extras:
        raise ValueError(f"reduction='global' needs extras[{unit!r}] (the step's global count); the trainer "
                         f"must provide it, or build the loss with reduction='sum' or 'mean'")
    return numerator / max(float(extras[unit]), 1.0)


def _check_step_reduction(reduction: str) -> None:
    if reduction not in ("global", "mean", "sum"):
        raise ValueError(f"reduction must be 'global', 'mean' or 'sum', got {reduction!r}")


# ----------------------------------------------------------------------------- SFT

def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor,
             reduction: Reduction = "mean") -> tuple[torch.Tensor, dict]:
    """Token-level negative log-likelihood over `loss_mask` (denominator: loss tokens)."""
    _check_reduction(reduction)
    numerator = -_masked(logprobs, loss_mask).sum()
    nll = _masked_mean(-logprobs, loss_mask)
    return _finish(numerator, loss_mask.sum(), reduction), {"nll": nll}


# ----------------------------------------------------------------------------- GRPO

def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def grpo_loss(logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, *,
              epsilon: float, epsilon_high: Optional[float], beta: float, loss_type: str,
              old_logprobs: Optional[torch.Tensor] = None, ref_logprobs: Optional[torch.Tensor] = None,
              max_completion_length: Optional[int] = None, token_weights: Optional[torch.Tensor] = None,
              reduction: Reduction = "mean") -> tuple[torch.Tensor, dict]:
    """Clipped-ratio policy loss with an optional k3 KL penalty, TRL GRPOTrainer semantics.

    Per token: ratio r = exp(logp - old_logp) (old_logprobs None: the detached current logprobs,
    r = 1 with the policy gradient kept), loss_t = -min(r*A, clip(r, 1-epsilon, 1+epsilon_high)*A)
    + beta * k3(logp, ref), times `token_weights` [B, T] when given (no gradient flows through
    them: the rollout correction's importance weights, `rollout_is_weights`). `advantages` is
    [B] (per sequence) or [B, T]. Aggregation by `loss_type` (see the module docstring for the
    numerator/denominator of each).
    Metrics: clip_ratio/low (r < 1-eps with A < 0), clip_ratio/high (r > 1+eps_high with
    A > 0), clip_ratio/region (either), ratio_mean, and kl (mean k3) when ref_logprobs is given.
    The settings have no defaults here: GRPOAlgorithm holds them (epsilon_high None: epsilon).
    """
    _check_reduction(reduction)
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (its normaliser)")
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError(f"beta={beta} needs ref_logprobs (reference-policy logprobs); set beta=0 to skip the KL")
    eps_low = epsilon
    eps_high = epsilon if epsilon_high is None else epsilon_high
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    adv = advantages.to(logprobs.dtype)
    if adv.ndim == 1:
        adv = adv.unsqueeze(1)

    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    metrics = {}
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)
        metrics["kl"] = _masked_mean(kl, loss_mask)
        if beta != 0.0:
            per_token = per_token + beta * kl
    if token_weights is not None:  # as ms-swift: the whole token loss, KL term included
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    per_token = _masked(per_token, loss_mask)

    if loss_type == "grpo":
        numerator = (per_token.sum(-1) / loss_mask.sum(-1).clamp(min=1)).sum()
    elif loss_type == "bnpo":
        numerator = per_token.sum() / loss_mask.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        numerator = per_token.sum() / max_completion_length
    else:  # dapo
        numerator = per_token.sum()

    with torch.no_grad():
        low = (ratio < 1 - eps_low) & (adv < 0)
        high = (ratio > 1 + eps_high) & (adv > 0)
        metrics["clip_ratio/low"] = _masked_mean(low.float(), loss_mask)
        metrics["clip_ratio/high"] = _masked_mean(high.float(), loss_mask)
        metrics["clip_ratio/region"] = _masked_mean((low | high).float(), loss_mask)
        metrics["ratio_mean"] = _masked_mean(ratio, loss_mask)
    return _finish(numerator, loss_denominator(loss_type, loss_mask), reduction), metrics


# ----------------------------------------------------------------------------- GKD

def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dim from log-probabilities; terms with p = 0 count 0."""
    p = p_log.exp()
    diff = torch.where(p > 0, p_log - q_log, torch.zeros((), dtype=p_log.dtype, device=p_log.device))
    return (p * diff).sum(-1)


def generalized_jsd(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-position generalized JSD over the last dim, TRL GKDTrainer.generalized_jsd_loss convention.

    beta = 0: KL(teacher || student) (forward); beta = 1: KL(student || teacher) (reverse);
    else beta * KL(teacher || M) + (1 - beta) * KL(student || M), M = beta*P_t + (1-beta)*P_s.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"GKD beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return _kl(teacher_logprobs, student_logprobs)
    if beta == 1.0:
        return _kl(student_logprobs, teacher_logprobs)
    mixture = torch.logsumexp(torch.stack([student_logprobs + math.log(1 - beta),
                                           teacher_logprobs + math.log(beta)]), dim=0)
    return beta * _kl(teacher_logprobs, mixture) + (1 - beta) * _kl(student_logprobs, mixture)


def _topk_distributions(student, teacher_logprobs, teacher_indices, temperature, topk_mode,
                        teacher_temperature_applied):
    """Student and teacher log-distributions over the k teacher tokens ('renorm') or the k
    tokens plus one tail bucket ('tail'), both at the loss temperature. The student as logits
    [N, V], or as its log-softmax at the teacher's tokens and the log mass outside them at that
    temperature, ([N, k], [N]) (`topk_logprobs`); the teacher's values [N, k]."""
    if topk_mode == "tail" and temperature != 1.0 and not teacher_temperature_applied:
        raise ValueError(
            "topk_mode='tail' with temperature != 1 needs the teacher's top-k logprobs taken at that "
            "temperature (the tail mass at another temperature is unknown from k values): have the "
            "teacher apply the temperature and pass teacher_temperature_applied=True, or use topk_mode='renorm'")
    if topk_mode == "renorm":  # the student's log-sum-exp over the vocabulary cancels here
        s_top = student[0] if isinstance(student, tuple) else student.gather(-1, teacher_indices) / temperature
        t = teacher_logprobs if teacher_temperature_applied else teacher_logprobs / temperature
        return torch.log_softmax(s_top, dim=-1), torch.log_softmax(t, dim=-1)
    s_top, s_rest = student if isinstance(student, tuple) else topk_logprobs(student / temperature, teacher_indices)
    # Both tails are floored at the same tiny mass: when k covers (nearly) the whole vocabulary a
    # rounding-level teacher tail against an exactly-zero student tail would otherwise give inf.
    floor = math.log(torch.finfo(s_top.dtype).tiny)
    s_tail = s_rest[:, None].clamp(min=floor)
    t_mass = torch.logsumexp(teacher_logprobs, dim=-1, keepdim=True)
    t_tail = torch.log(-torch.expm1(t_mass.clamp(max=0))).clamp(min=floor)  # log(1 - sum p_topk)
    t = torch.log_softmax(torch.cat([teacher_logprobs, t_tail], dim=-1), dim=-1)  # absorbs rounding
    return torch.cat([s_top, s_tail], dim=-1), t


def gkd_loss(student_logits: Union[torch.Tensor, tuple], teacher_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
             beta: float, temperature: float, topk_mode: str, teacher_indices: Optional[torch.Tensor] = None,
             teacher_temperature_applied: bool = False, reduction: Reduction = "mean") -> tuple[torch.Tensor, dict]:
    """Generalized JSD between student and teacher next-token distributions, masked token mean.

    All inputs are aligned with each other: student_logits [B, T, V] (or, against a top-k
    teacher, the student's log-softmax at the loss temperature at the teacher's tokens and the
    log mass outside them, ([B, T, k], [B, T]): `Trainer` loss input 'student_topk'), loss_mask [B, T], and
    the teacher either full vocabulary (teacher_logprobs [B, T, V], teacher_indices None; exact)
    or top-k (teacher_logprobs and teacher_indices [B, T, k]):
    * 'renorm': both distributions restricted to the k teacher tokens and renormalised;
    * 'tail': the k tokens plus one bucket holding the remaining mass 1 - Σp_topk, for the
      teacher and the student alike; exact divergence of those (k+1)-way distributions.
    `temperature` divides the student logits and the teacher logprobs before normalising (for
    full vocabulary and 'renorm' this equals tempering the teacher's logits). With
    `teacher_temperature_applied` the teacher values are already at that temperature.
    Only positions with loss_mask > 0 are computed. Denominator: loss tokens.
    beta, temperature and topk_mode have no defaults here: GKDAlgorithm holds them.
    """
    _check_reduction(reduction)
    if temperature <= 0:
        raise ValueError(f"GKD temperature must be > 0, got {temperature}")
    if isinstance(student_logits, tuple) and (teacher_indices is None or student_logits[0].shape != teacher_indices.shape):
        raise ValueError("the student's top-k logprobs need a top-k teacher whose teacher_indices have their shape")
    if teacher_indices is None and teacher_logprobs.shape != student_logits.shape:
        raise ValueError(f"full-vocabulary teacher logprobs {tuple(teacher_logprobs.shape)} must match the "
                         f"student logits {tuple(student_logits.shape)}")
    if teacher_indices is not None and teacher_indices.shape != teacher_logprobs.shape:
        raise ValueError(f"teacher_indices {tuple(teacher_indices.shape)} and teacher_logprobs "
                         f"{tuple(teacher_logprobs.shape)} must have the same shape")
    if topk_mode not in TOPK_MODES:
        raise ValueError(f"topk_mode must be one of {TOPK_MODES}, got {topk_mode!r}")
    # Select the loss positions first: prompt and padding rows cost nothing and cannot leak nan.
    active = loss_mask > 0
    if isinstance(student_logits, tuple):
        s_logits = tuple(t[active].float() for t in student_logits)
        dtype = torch.float32
    else:
        dtype = torch.promote_types(student_logits.dtype, torch.float32)
        s_logits = student_logits[active].to(dtype)
    t_logp = teacher_logprobs[active].to(dtype)
    metrics = {}
    if teacher_indices is None:
        s = torch.log_softmax(s_logits / temperature, dim=-1)
        t = torch.log_softmax(t_logp if teacher_temperature_applied else t_logp / temperature, dim=-1)
    else:
        s, t = _topk_distributions(s_logits, t_logp, teacher_indices[active].long(), temperature,
                                   topk_mode, teacher_temperature_applied)
        metrics["teacher_topk_mass"] = t_logp.detach().exp().sum(-1).mean() if len(t_logp) else 0.0
    per_token = generalized_jsd(s, t, beta)
    numerator = per_token.sum()
    metrics["jsd"] = per_token.detach().mean() if per_token.numel() else 0.0
    return _finish(numerator, active.sum(), reduction), metrics


# ----------------------------------------------------------------------------- Trainer callables

class SFTLoss:
    """NLL over `batch.loss_mask` (unit: loss tokens)."""
    loss_inputs: tuple = ()

    def __init__(self, reduction: StepReduction = "global"):
        _check_step_reduction(reduction)
        self.reduction = reduction

    def denominator(self, batch: Batch) -> float:
        return loss_denominator("dapo", batch.loss_mask)

    def __call__(self, logprobs: torch.Tensor, batch: Batch, extras: Optional[dict] = None):
        numerator, metrics = sft_loss(logprobs, batch.loss_mask.to(logprobs.device), reduction="sum")
        return _step_reduce(numerator, self.reduction, "global_tokens", self.denominator(batch), extras), metrics


class GRPOLoss:
    """GRPO on a batch with `advantages` ([B] or [B, T]), optional `old_logprobs` (behaviour
    policy; None = on-policy single update) and `ref_logprobs` (needed when beta != 0).
    `correction` (None: none) weighs or masks tokens by the trainer-over-rollout importance
    weight, measures the gap (metrics rollout_correction/*) or masks off-policy sequences:
    `RolloutCorrection`. The settings are required: their defaults live once, in GRPOAlgorithm."""
    loss_inputs: tuple = ()

    def __init__(self, *, epsilon: float, epsilon_high: Optional[float], beta: float, loss_type: str,
                 max_completion_length: Optional[int] = None, correction: Optional[RolloutCorrection] = None,
                 reduction: StepReduction = "global"):
        _check_step_reduction(reduction)
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        if loss_type == "dr_grpo" and not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (its normaliser)")
        self.epsilon, self.epsilon_high, self.beta = epsilon, epsilon_high, beta
        self.loss_type, self.max_completion_length, self.reduction = loss_type, max_completion_length, reduction
        self.correction = correction

    def denominator(self, batch: Batch) -> float:
        return loss_denominator(self.loss_type, batch.loss_mask)

    def __call__(self, logprobs: torch.Tensor, batch: Batch, extras: Optional[dict] = None):
        if batch.advantages is None:
            raise ValueError("GRPO loss needs batch.advantages (see algorithms.objectives.advantages.group_advantages)")
        device = logprobs.device
        old = None if batch.old_logprobs is None else batch.old_logprobs.to(device)
        ref = None if batch.ref_logprobs is None else batch.ref_logprobs.to(device)
        mask, advantages = batch.loss_mask.to(device), batch.advantages.to(device)
        weights, corrected = None, {}
        if self.correction is not None:
            mask, weights, corrected = self._correct(logprobs, batch, old, mask, advantages)
        numerator, metrics = grpo_loss(
            logprobs, advantages, mask, old_logprobs=old, ref_logprobs=ref, token_weights=weights,
            epsilon=self.epsilon, epsilon_high=self.epsilon_high, beta=self.beta, loss_type=self.loss_type,
            max_completion_length=self.max_completion_length, reduction="sum")
        metrics.update(corrected)
        if extras and extras.get("entropy") is not None:
            metrics["entropy"] = _masked_mean(extras["entropy"], batch.loss_mask.to(device))
        loss = _step_reduce(numerator, self.reduction, _UNITS[self.loss_type], self.denominator(batch), extras)
        return loss, metrics

    def _correct(self, logprobs: torch.Tensor, batch: Batch, old: Optional[torch.Tensor], mask: torch.Tensor,
                 advantages: torch.Tensor) -> tuple:
        """(loss mask, importance weights or None, metrics) of the rollout correction. The trainer's
        old logprobs are batch.old_logprobs under a mode (None: the detached current ones), else
        the detached current ones, old_logprobs being the rollout's then."""
        c = self.correction
        if c.mode != "none":
            if batch.rollout_logprobs is None:
                raise ValueError(f"rollout correction {c.mode!r} needs batch.rollout_logprobs (the rollout's sampling "
                                 "logprobs; batch.old_logprobs are then the trainer's own, or None)")
            rollout = batch.rollout_logprobs.to(logprobs.device)
            trainer = logprobs.detach() if old is None else old
        else:
            if old is None:
                raise ValueError("the rollout-correction metrics and off-policy sequence mask need "
                                 "batch.old_logprobs (the rollout's sampling logprobs)")
            rollout, trainer = old, logprobs.detach()
        figures, weights = {}, None
        if c.mode != "none" or c.log_metrics:
            figures = rollout_offpolicy_metrics(trainer, rollout, mask)
        if c.mode != "none":
            weights = rollout_is_weights(trainer - rollout, mask, c.mode, c.threshold)
            figures.update(rollout_is_metrics(trainer - rollout, weights, mask, c.mode, c.threshold))
        metrics = {f"rollout_correction/{k}": v for k, v in figures.items()}
        if c.off_policy_sequence_mask_delta is not None:  # after the metrics, as ms-swift
            keep = off_policy_sequence_keep(logprobs, rollout, mask, advantages, c.off_policy_sequence_mask_delta)
            metrics["off_policy_masked"] = _rows_mean((~keep).float(), mask.sum(-1) > 0)
            mask = mask * keep[:, None].to(mask.dtype)
        return mask, weights, metrics


class GKDLoss:
    """Generalized JSD to the teacher (`batch.teacher_logprobs`, plus `batch.teacher_indices`
    for top-k) + `sft_alpha` * NLL of the batch tokens at temperature 1 (unit: loss tokens).

    Needs extras['logits'] (aligned, divided by extras['temperature']; they are rescaled to
    this loss's `temperature`, so the two may differ). `lmbda` and `seq_kd` are data-side: the
    driver picks where completions come from (student generations with probability lmbda, else
    dataset responses, or teacher generations when seq_kd); this loss is the same for all.
    As in ms-swift, the SFT term counts only completions the student did not write: rows with
    `batch.sft_weight` 0 (the driver marks its on-policy generations so) are left out of it.
    The settings are required: their defaults live once, in GKDAlgorithm.
    """
    loss_inputs: tuple = ("logits",)

    def __init__(self, *, beta: float, temperature: float, sft_alpha: float, topk_mode: str,
                 teacher_temperature_applied: bool = False, reduction: StepReduction = "global",
                 student_topk: bool = False):
        _check_step_reduction(reduction)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"GKD beta must be in [0, 1], got {beta}")
        if topk_mode not in TOPK_MODES:
            raise ValueError(f"topk_mode must be one of {TOPK_MODES}, got {topk_mode!r}")
        if sft_alpha < 0:
            raise ValueError(f"sft_alpha must be >= 0, got {sft_alpha}")
        if temperature <= 0:
            raise ValueError(f"GKD temperature must be > 0, got {temperature}")
        self.beta, self.temperature, self.sft_alpha = beta, temperature, sft_alpha
        self.topk_mode, self.teacher_temperature_applied, self.reduction = topk_mode, teacher_temperature_applied, reduction
        if student_topk and sft_alpha > 0:
            raise ValueError("GKD student_topk gives the student's distribution at the teacher's top-k tokens only; "
                             "sft_alpha > 0 needs the full logits (student_topk=False)")
        # Against a top-k teacher the trainer may give the student's log-softmax at the teacher's
        # tokens (at this loss's temperature: the driver trains at it) instead of the full logits,
        # which its fused_logprobs path never makes.
        self.student_topk = student_topk
        self.loss_inputs = ("student_topk",) if student_topk else ("logits",)

    def denominator(self, batch: Batch) -> float:
        return loss_denominator("dapo", batch.loss_mask)

    def __call__(self, logprobs: torch.Tensor, batch: Batch, extras: Optional[dict] = None):
        extras = extras or {}
        student = self._student_topk(batch, extras) if self.student_topk else self._student_logits(batch, extras)
        device = (student[0] if isinstance(student, tuple) else student).device
        mask = batch.loss_mask.to(device)
        indices = None if batch.teacher_indices is None else batch.teacher_indices.to(device)
        numerator, metrics = gkd_loss(
            student, batch.teacher_logprobs.to(device), mask, teacher_indices=indices, beta=self.beta,
            temperature=self.temperature, topk_mode=self.topk_mode,
            teacher_temperature_applied=self.teacher_temperature_applied, reduction="sum")
        if self.sft_alpha > 0:  # the full logits (student_topk refuses sft_alpha)
            active = mask > 0
            rows = student[active].float()
            target = batch.input_ids.to(device)[active].unsqueeze(-1)
            nll = torch.logsumexp(rows, dim=-1) - rows.gather(-1, target).squeeze(-1)
            weight = torch.ones_like(mask) if batch.sft_weight is None else (
                batch.sft_weight.to(device, mask.dtype)[:, None].expand_as(mask))
            numerator = numerator + self.sft_alpha * (nll * weight[active]).sum()
            metrics["sft_nll"] = nll.detach().mean() if nll.numel() else 0.0
        return _step_reduce(numerator, self.reduction, "global_tokens", self.denominator(batch), extras), metrics

    def _student_logits(self, batch: Batch, extras: dict) -> torch.Tensor:
        """The student's aligned logits at temperature 1 (gkd_loss applies this loss's)."""
        logits = extras.get("logits")
        if logits is None:
            raise ValueError("GKD loss needs extras['logits'] (the student's aligned [B, T, V] logits); "
                             "give the trainer loss_inputs=loss_fn.loss_inputs")
        if batch.teacher_logprobs is None:
            raise ValueError("GKD loss needs batch.teacher_logprobs (from Teacher.logits)")
        if logits.shape[:2] != batch.loss_mask.shape:
            raise ValueError(f"extras['logits'] {tuple(logits.shape)} must be aligned with the batch "
                             f"{tuple(batch.loss_mask.shape)}")
        return logits * float(extras.get("temperature", 1.0))

    def _student_topk(self, batch: Batch, extras: dict) -> tuple:
        """The student's log-softmax at the teacher's tokens and the mass outside them, as the
        trainer gave them (at its temperature, which must be this loss's)."""
        student = extras.get("student_topk")
        if student is None:
            raise ValueError("GKD loss with student_topk needs extras['student_topk']; give the trainer "
                             "loss_inputs=loss_fn.loss_inputs")
        if batch.teacher_logprobs is None or batch.teacher_indices is None:
            raise ValueError("GKD loss with student_topk needs a top-k teacher's batch.teacher_logprobs and "
                             "batch.teacher_indices (from Teacher.logits with topk)")
        trained = extras.get("temperature")  # the Trainer passes its train_step temperature
        if trained is None or float(trained) != self.temperature:
            raise ValueError(f"GKD student_topk comes at the trainer's temperature {trained}; "
                             f"train at the loss temperature {self.temperature}")
        return student


_LOSSES = {"sft": SFTLoss, "grpo": GRPOLoss, "gkd": GKDLoss}


def make_loss(name: str, **params):
    """A picklable loss callable for the Trainer: 'sft', 'grpo' or 'gkd' with its parameters."""
    if name not in _LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(_LOSSES)}")
    cls = _LOSSES[name]
    signature = inspect.signature(cls).parameters
    accepted = list(signature)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"loss {name!r} does not take {unknown}; it takes {accepted}")
    missing = [p for p, v in signature.items() if v.default is v.empty and p not in params]
    if missing:
        raise ValueError(f"loss {name!r} needs {missing} (the algorithm config's values)")
    return cls(**params)
