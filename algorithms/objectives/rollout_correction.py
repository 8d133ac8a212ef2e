"""The train-inference mismatch correction of GRPO (ms-swift's rollout_importance_sampling_mode,
rollout_importance_sampling_threshold, log_rollout_offpolicy_metrics and
off_policy_sequence_mask_delta): the rollout engine's sampling logprobs differ from the trainer's
for the same weights. Holds the settings (`RolloutCorrection`, which `GRPOLoss` applies), the
trainer-over-rollout importance weights, the off-policy sequence mask, and the metrics of the gap
(the `rollout_correction/*` figures; pure torch, detached).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


# The masking helpers of every loss (losses.py imports them from here).
def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where, not multiply: padding may hold inf/nan that 0 * x would spread.
    return torch.where(mask > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A metric: the mean of `x` over `mask`, detached, as a 0-d tensor where `x` lives (read
    by the trainer once per step, so a micro-batch does not wait for the device)."""
    return _masked(x.detach().float(), mask).sum() / mask.sum().clamp(min=1)


# The values of rollout_importance_sampling_mode, as ms-swift.
ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# Log-ratios are clamped to +-20 before exp, as in ms-swift: exp(20) ~ 5e8 is past any useful weight.
_LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class RolloutCorrection:
    """What GRPOLoss does with the gap between the rollout's sampling logprobs and the trainer's
    (GRPOAlgorithm holds the settings and their meaning). With `mode` other than 'none' the
    batch's old_logprobs are the trainer's own (None: the detached current logprobs) and its
    rollout_logprobs the rollout's; with 'none' old_logprobs are the rollout's, the ratio is
    unchanged, and only the metrics (`log_metrics`) or the off-policy sequence mask apply."""
    mode: str
    threshold: float
    log_metrics: bool
    off_policy_sequence_mask_delta: Optional[float]

    def __post_init__(self):
        if self.mode not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout correction mode must be one of {ROLLOUT_CORRECTIONS}, got {self.mode!r}")
        if not self.threshold > 0:
            raise ValueError(f"rollout correction threshold must be > 0, got {self.threshold}")


def _row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of `x` over `mask` [B] (0 for a row without loss tokens)."""
    return _masked(x, mask).sum(-1) / mask.sum(-1).clamp(min=1)


def _rows_mean(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Mean of per-sequence values `x` [B] over the rows with loss tokens (`rows`)."""
    return torch.where(rows, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / rows.sum().clamp(min=1)


def _bounded(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked(log_ratio.detach().float(), mask).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)


def rollout_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, threshold: float) -> torch.Tensor:
    """Importance weights [B, T] (detached) of the trainer over the rollout, from `log_ratio` =
    trainer logprob - rollout logprob per token; w = exp(log_ratio), the sequence weight
    w_seq = exp(mean of the row's log_ratio over its loss tokens) (a geometric mean, as ms-swift).
    token_truncate: min(w, threshold); token_mask: w, 0 where w > threshold; sequence_truncate:
    min(w_seq, threshold) on every token of the row; sequence_mask: w, 0 on the whole row where
    w_seq > threshold."""
    if mode not in ROLLOUT_CORRECTIONS[1:]:
        raise ValueError(f"rollout correction mode must be one of {ROLLOUT_CORRECTIONS[1:]}, got {mode!r}")
    bounded = _bounded(log_ratio, mask)
    w = bounded.exp()
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    if mode == "token_truncate":
        return w.clamp(max=threshold)
    if mode == "token_mask":
        return torch.where(w <= threshold, w, zero)
    seq = _row_mean(bounded, mask).exp()[:, None]
    if mode == "sequence_truncate":
        return seq.clamp(max=threshold).expand_as(w)
    return torch.where(seq <= threshold, w, zero)


def rollout_offpolicy_metrics(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                              mask: torch.Tensor) -> dict:
    """ms-swift's rollout_correction/ diagnostics of the gap between trainer and rollout on the
    sampled tokens (detached 0-d tensors): kl (direct estimate of KL(rollout || trainer)), k3_kl,
    training_ppl / rollout_ppl and their logs (means of per-sequence values), log_ppl_diff
    (rollout minus training mean logprob per sequence: > 0 where the trainer gives the tokens
    less probability), log_ppl_abs_diff, ppl_ratio, chi2_token (E[rho^2] - 1, rho = trainer /
    rollout), chi2_seq (the same of the per-sequence geometric mean of rho), and ratio_max /
    inverse_ratio_max: the largest rho and 1/rho of a loss token (the trainer takes the step's
    largest of these, roles.trainer.PEAK_SUFFIX). Per-sequence values are averaged over the
    rows with loss tokens."""
    trainer, rollout = trainer_logprobs.detach().float(), rollout_logprobs.detach().float()
    rows = mask.sum(-1) > 0
    log_ratio = _masked(trainer - rollout, mask)
    bounded = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    train_mean, rollout_mean = _row_mean(trainer, mask), _row_mean(rollout, mask)
    diff = rollout_mean - train_mean
    seq_rho = _row_mean(log_ratio, mask).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()
    return {"kl": _masked_mean(-log_ratio, mask),
            "k3_kl": _masked_mean((bounded.exp() - bounded - 1).clamp(-10, 10), mask),
            "training_ppl": _rows_mean((-train_mean).exp(), rows), "training_log_ppl": _rows_mean(-train_mean, rows),
            "rollout_ppl": _rows_mean((-rollout_mean).exp(), rows), "rollout_log_ppl": _rows_mean(-rollout_mean, rows),
            "log_ppl_diff": _rows_mean(diff, rows), "log_ppl_abs_diff": _rows_mean(diff.abs(), rows),
            "ppl_ratio": _rows_mean(diff.exp(), rows),
            "chi2_token": _masked_mean(bounded.exp().square(), mask) - 1.0,
            "chi2_seq": _rows_mean(seq_rho.square(), rows) - 1.0,
            "ratio_max": torch.where(mask > 0, bounded, -_LOG_RATIO_BOUND).max().exp(),
            "inverse_ratio_max": torch.where(mask > 0, -bounded, -_LOG_RATIO_BOUND).max().exp()}


def rollout_is_metrics(log_ratio: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, mode: str,
                       threshold: float) -> dict:
    """ms-swift's importance-weight figures (detached 0-d tensors): is_weight_mean, ess (effective
    sample size 1 / E[(w / E[w])^2] of the weights clamped to [1/threshold, threshold]: 1 when all
    are equal) and clipped_frac (tokens, or for the sequence modes rows, truncated or masked)."""
    w = weights.detach().float()
    for_ess = w.clamp(min=1.0 / threshold, max=threshold)
    normalised = for_ess / (_masked_mean(for_ess, mask) + 1e-8)
    metrics = {"is_weight_mean": _masked_mean(w, mask),
               "ess": 1.0 / _masked_mean(normalised.square(), mask).clamp(min=1e-10)}
    bounded = _bounded(log_ratio, mask)
    if mode == "token_truncate":
        metrics["clipped_frac"] = _masked_mean((bounded.exp() > threshold).float(), mask)
    elif mode == "token_mask":
        metrics["clipped_frac"] = _masked_mean((w == 0).float(), mask)
    else:
        metrics["clipped_frac"] = _rows_mean((_row_mean(bounded, mask).exp() > threshold).float(), mask.sum(-1) > 0)
    return metrics


def off_policy_sequence_keep(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                             advantages: torch.Tensor, delta: float) -> torch.Tensor:
    """ms-swift's off-policy sequence mask (DeepSeek-V3.2): False for the rows whose mean over
    their loss tokens of behaviour - current logprob exceeds `delta` and whose advantage is
    negative (they leave the loss), True for the rest [B]."""
    drift = _row_mean(behaviour_logprobs.detach().float() - logprobs.detach().float(), mask)
    adv = advantages.detach().float()
    seq_adv = adv if adv.ndim == 1 else _row_mean(adv, mask)
    return ~((drift > delta) & (seq_adv < 0))
