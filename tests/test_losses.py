"""Advantages and losses against values computed by hand (plain python math) or by an
independent, explicit-formula computation written here."""
import math
import pickle

import pytest
import torch

from algorithms.objectives.advantages import group_advantages, zero_variance_groups
from algorithms.objectives.losses import (GKDLoss, GRPOLoss, SFTLoss, gkd_loss, grpo_loss, k3_kl, loss_denominator, make_loss, sft_loss)
from roles.batch import Batch

EPS = 1e-4


def close(tensor, expected, tol=1e-6):
    got = tensor.detach().tolist() if isinstance(tensor, torch.Tensor) else tensor
    if isinstance(got, float):
        got, expected = [got], [expected]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert abs(g - e) <= tol, (got, expected)


# ----------------------------------------------------------------------------- advantages
# Two groups of G=3: [1, 2, 3] (mean 2, unbiased std 1) and [0, 0, 6] (mean 2, std sqrt(12)).
REWARDS = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])
DEVS = [-1.0, 0.0, 1.0, -2.0, -2.0, 4.0]


def test_advantages_group_scale():
    s1, s2 = 1.0, math.sqrt(12.0)
    expected = [d / (s1 + EPS) for d in DEVS[:3]] + [d / (s2 + EPS) for d in DEVS[3:]]
    close(group_advantages(REWARDS, 3, "group", False), expected)


def test_advantages_batch_scale():
    # std over all six rewards: mean 2, squared deviations sum to 26, unbiased var 26/5.
    std = math.sqrt(26.0 / 5.0)
    close(group_advantages(REWARDS, 3, "batch", False), [d / (std + EPS) for d in DEVS])


def test_advantages_no_scale():
    close(group_advantages(REWARDS, 3, "none", False), DEVS)


def test_advantages_leave_one_out():
    # Baseline = mean of the other two: group 1 -> 2.5, 2, 1.5; group 2 -> 3, 3, 0.
    loo = [1 - 2.5, 2 - 2.0, 3 - 1.5, 0 - 3.0, 0 - 3.0, 6 - 0.0]
    close(group_advantages(REWARDS, 3, "none", leave_one_out=True), loo)
    s1, s2 = 1.0, math.sqrt(12.0)
    close(group_advantages(REWARDS, 3, "group", leave_one_out=True),
          [a / (s1 + EPS) for a in loo[:3]] + [a / (s2 + EPS) for a in loo[3:]])


def test_advantages_equal_rewards_and_errors():
    close(group_advantages(torch.tensor([0.5, 0.5]), 2, "group", False), [0.0, 0.0])
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(REWARDS, 4, "group", False)
    with pytest.raises(ValueError, match="leave_one_out"):
        group_advantages(REWARDS, 1, "group", leave_one_out=True)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(REWARDS, 3, "std", False)


def test_zero_variance_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.25, 0.25, 0.25])
    assert zero_variance_groups(rewards, 3).tolist() == [True, False, True]
    keep = (~zero_variance_groups(rewards, 3)).repeat_interleave(3)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3


# ----------------------------------------------------------------------------- GRPO
GRPO_FIXED = dict(epsilon=0.2, epsilon_high=None, beta=0.0, loss_type="grpo")


def grpo(logprobs, advantages, loss_mask, **kw):
    """grpo_loss with the settings a test does not vary: epsilon 0.2, no clip-higher, no KL."""
    return grpo_loss(logprobs, advantages, loss_mask, **{**GRPO_FIXED, **kw})


# Two sequences, T=4. Sequence 0: loss tokens 1..3, ratios 1.5, 0.5, 1.0, advantage +1.
# Sequence 1: loss tokens 1..2, ratios 1.5, 0.5, advantage -1; position 3 is padding holding a
# huge logprob that must not count. old_logprobs = 0, so logprobs = log(ratio).
# With epsilon 0.2 the per-token losses -min(r*A, clip(r)*A) are:
#   seq 0: r=1.5 -> -1.2 (high-clipped), r=0.5 -> -0.5, r=1 -> -1.0      sum -2.7, mean -0.9
#   seq 1: r=1.5 -> +1.5,                r=0.5 -> +0.8 (low-clipped)     sum  2.3, mean 1.15
def _grpo_inputs():
    ln = math.log
    logprobs = torch.tensor([[0.0, ln(1.5), ln(0.5), 0.0], [0.0, ln(1.5), ln(0.5), 100.0]], dtype=torch.float64)
    mask = torch.tensor([[0.0, 1, 1, 1], [0.0, 1, 1, 0]], dtype=torch.float64)
    return logprobs, torch.tensor([1.0, -1.0]), mask, torch.zeros_like(logprobs)


@pytest.mark.parametrize("loss_type, expected", [
    ("grpo", (-0.9 + 1.15) / 2),
    ("bnpo", (-2.7 + 2.3) / 5),
    ("dr_grpo", (-2.7 + 2.3) / (2 * 4)),
    ("dapo", (-2.7 + 2.3) / 5),
])
def test_grpo_loss_types(loss_type, expected):
    logprobs, adv, mask, old = _grpo_inputs()
    loss, m = grpo(logprobs, adv, mask, old_logprobs=old, epsilon=0.2, loss_type=loss_type,
                   max_completion_length=4)
    close(float(loss), expected)
    close(m["clip_ratio/low"], 1 / 5)
    close(m["clip_ratio/high"], 1 / 5)
    close(m["clip_ratio/region"], 2 / 5)
    close(m["ratio_mean"], (1.5 + 0.5 + 1.0 + 1.5 + 0.5) / 5)


def test_grpo_epsilon_high():
    logprobs, adv, mask, old = _grpo_inputs()
    # The high-clipped token now clips at 1.28: seq 0 mean (-1.28 - 0.5 - 1) / 3.
    loss, m = grpo(logprobs, adv, mask, old_logprobs=old, epsilon=0.2, epsilon_high=0.28)
    close(float(loss), ((-1.28 - 0.5 - 1.0) / 3 + 1.15) / 2)
    # With epsilon_high 0.6 nothing is high-clipped (1.5 < 1.6).
    loss, m = grpo(logprobs, adv, mask, old_logprobs=old, epsilon=0.2, epsilon_high=0.6)
    close(float(loss), ((-1.5 - 0.5 - 1.0) / 3 + 1.15) / 2)
    assert m["clip_ratio/high"] == 0.0


@pytest.mark.parametrize("loss_type, numerator, denominator", [
    ("grpo", -0.9 + 1.15, 2.0), ("bnpo", -0.4 / 5, 1.0), ("dr_grpo", -0.4 / 4, 2.0), ("dapo", -0.4, 5.0),
])
def test_grpo_sum_reduction_and_micro_batches(loss_type, numerator, denominator):
    logprobs, adv, mask, old = _grpo_inputs()
    kw = dict(epsilon=0.2, loss_type=loss_type, max_completion_length=4, reduction="sum")
    loss, _ = grpo(logprobs, adv, mask, old_logprobs=old, **kw)
    close(float(loss), numerator)
    assert loss_denominator(loss_type, mask) == denominator
    # Split into two micro-batches: sum(numerators) / sum(denominators).
    parts = [grpo(logprobs[i:i + 1], adv[i:i + 1], mask[i:i + 1], old_logprobs=old[i:i + 1], **kw)[0]
             for i in range(2)]
    split = float(sum(parts)) / sum(loss_denominator(loss_type, mask[i:i + 1]) for i in range(2))
    # bnpo normalises each micro-batch by its own tokens, so it averages the two means instead.
    expected = (-0.9 + 1.15) / 2 if loss_type in ("grpo", "bnpo") else {"dr_grpo": -0.4 / 8, "dapo": -0.4 / 5}[loss_type]
    close(split, expected)


def test_k3_kl_values_and_penalty():
    ln2 = math.log(2.0)
    logprobs = torch.tensor([[0.0, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[0.0, -1.0 + ln2, -1.0 - ln2]], dtype=torch.float64)
    # ref - logp = +ln2 -> 2 - ln2 - 1; -ln2 -> 1/2 + ln2 - 1; their mean is exactly 1/4.
    close(k3_kl(logprobs, ref)[0, 1:], [1 - ln2, ln2 - 0.5])
    mask = torch.tensor([[0.0, 1, 1]], dtype=torch.float64)
    loss, m = grpo(logprobs, torch.zeros(1), mask, ref_logprobs=ref, beta=0.1)
    close(loss, 0.1 * 0.25)
    close(m["kl"], 0.25)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo(logprobs, torch.zeros(1), mask, beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo(logprobs, torch.zeros(1), mask, loss_type="dr_grpo")


def test_grpo_gradients():
    # On-policy (no old_logprobs): ratio 1, d loss / d logp_t = -A / n_tokens / B.
    logprobs = torch.tensor([[0.0, -0.3, -0.7]], requires_grad=True)
    mask = torch.tensor([[0.0, 1, 1]])
    loss, _ = grpo(logprobs, torch.tensor([2.0]), mask)
    loss.backward()
    close(logprobs.grad[0], [0.0, -1.0, -1.0])
    # A clipped token passes no gradient: r = 1.5 > 1.2 with A > 0.
    logprobs = torch.tensor([[0.0, math.log(1.5), 0.0]], requires_grad=True)
    loss, _ = grpo(logprobs, torch.tensor([1.0]), mask, old_logprobs=torch.zeros(1, 3), epsilon=0.2)
    loss.backward()
    close(logprobs.grad[0], [0.0, 0.0, -0.5])


# ----------------------------------------------------------------------------- SFT

def test_sft_loss():
    logprobs = torch.tensor([[0.0, -1.0, -2.0, 5.0], [0.0, -0.5, 7.0, 0.0]])
    mask = torch.tensor([[0.0, 1, 1, 0], [0.0, 1, 0, 0]])
    loss, m = sft_loss(logprobs, mask)
    close(float(loss), 3.5 / 3)
    close(m["nll"], 3.5 / 3)
    loss, _ = sft_loss(logprobs, mask, reduction="sum")
    close(float(loss), 3.5)
    batch = Batch(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4), loss_mask=mask)
    fn = make_loss("sft")
    assert fn.denominator(batch) == 3.0 and fn.loss_inputs == ()
    # Default 'global': this micro-batch's share of a step with 7 loss tokens.
    close(fn(logprobs, batch, {"global_tokens": 7.0})[0], 3.5 / 7)
    close(make_loss("sft", reduction="sum")(logprobs, batch, {})[0], 3.5)
    close(make_loss("sft", reduction="mean")(logprobs, batch, {})[0], 3.5 / 3)
    with pytest.raises(ValueError, match="global_tokens"):
        fn(logprobs, batch, {})


# ----------------------------------------------------------------------------- GKD: independent reference

def _softmax(x):
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def _divergence(p_s, p_t, beta):
    """Explicit generalized JSD of probability vectors: beta=0 KL(t||s), beta=1 KL(s||t)."""
    def kl(p, q):
        return (p * (torch.log(p) - torch.log(q))).sum(-1)
    if beta == 0:
        return kl(p_t, p_s)
    if beta == 1:
        return kl(p_s, p_t)
    m = beta * p_t + (1 - beta) * p_s
    return beta * kl(p_t, m) + (1 - beta) * kl(p_s, m)


def reference_jsd(s_logits, t_logits, mask, beta, temperature):
    d = _divergence(_softmax(s_logits / temperature), _softmax(t_logits / temperature), beta)
    keep = mask > 0
    return float(d[keep].sum() / keep.sum())


def reference_topk(s_logits, t_logits, mask, idx, beta, temperature, mode):
    p_s, p_t = _softmax(s_logits / temperature), _softmax(t_logits / temperature)
    s_k, t_k = p_s.gather(-1, idx), p_t.gather(-1, idx)
    if mode == "renorm":
        s_k, t_k = s_k / s_k.sum(-1, keepdim=True), t_k / t_k.sum(-1, keepdim=True)
    else:
        s_k = torch.cat([s_k, 1 - s_k.sum(-1, keepdim=True)], dim=-1)
        t_k = torch.cat([t_k, 1 - t_k.sum(-1, keepdim=True)], dim=-1)
    d = _divergence(s_k, t_k, beta)
    keep = mask > 0
    return float(d[keep].sum() / keep.sum())


GKD_FIXED = dict(temperature=1.0, topk_mode="renorm")


def gkd(student_logits, teacher_logprobs, loss_mask, **kw):
    """gkd_loss with the settings a test does not vary: temperature 1, 'renorm' top-k."""
    return gkd_loss(student_logits, teacher_logprobs, loss_mask, **{**GKD_FIXED, **kw})


def _gkd_inputs(seed=0, B=2, T=5, V=11):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    t = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    mask = torch.tensor([[0.0, 1, 1, 1, 0], [0.0, 0, 1, 1, 1]], dtype=torch.float64)[:B, :T]
    return s, t, mask


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0, 0.2])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_gkd_full_vocab_matches_reference(beta, temperature):
    s, t, mask = _gkd_inputs()
    teacher_logprobs = torch.log_softmax(t, dim=-1)  # what a Teacher serves (temperature 1)
    loss, m = gkd(s, teacher_logprobs, mask, beta=beta, temperature=temperature)
    close(float(loss), reference_jsd(s, t, mask, beta, temperature))
    close(m["jsd"], float(loss))
    # Teacher values already at the loss temperature give the same loss.
    tempered = torch.log_softmax(t / temperature, dim=-1)
    loss2, _ = gkd(s, tempered, mask, beta=beta, temperature=temperature, teacher_temperature_applied=True)
    close(float(loss2), float(loss))


def test_gkd_temperature_changes_the_loss():
    s, t, mask = _gkd_inputs()
    tl = torch.log_softmax(t, dim=-1)
    losses = [float(gkd(s, tl, mask, beta=0.5, temperature=T)[0]) for T in (0.5, 1.0, 2.0)]
    assert len({round(x, 6) for x in losses}) == 3


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("mode", ["renorm", "tail"])
def test_gkd_topk_with_k_equal_vocab_is_full_vocab(beta, mode):
    s, t, mask = _gkd_inputs()
    tl = torch.log_softmax(t, dim=-1)
    values, indices = torch.topk(tl, k=tl.shape[-1], dim=-1)  # a permutation of the vocabulary
    full = float(gkd(s, tl, mask, beta=beta)[0])
    topk = float(gkd(s, values, mask, teacher_indices=indices, beta=beta, topk_mode=mode)[0])
    close(topk, full)
    # At another temperature: renorm tempers the k values; tail needs them tempered by the teacher.
    full_t = float(gkd(s, tl, mask, beta=beta, temperature=0.7)[0])
    if mode == "renorm":
        got = gkd(s, values, mask, teacher_indices=indices, beta=beta, temperature=0.7, topk_mode=mode)[0]
    else:
        with pytest.raises(ValueError, match="teacher_temperature_applied"):
            gkd(s, values, mask, teacher_indices=indices, beta=beta, temperature=0.7, topk_mode=mode)
        tv, ti = torch.topk(torch.log_softmax(t / 0.7, dim=-1), k=tl.shape[-1], dim=-1)
        got = gkd(s, tv, mask, teacher_indices=ti, beta=beta, temperature=0.7, topk_mode=mode,
                  teacher_temperature_applied=True)[0]
    close(float(got), full_t)

@pytest.mark.parametrize("mode", ["renorm", "tail"])
def test_gkd_from_the_students_topk_logprobs_equals_the_logits_path(mode):
    """The trainer's 'student_topk' input (log-softmax at the teacher's tokens and the mass
    outside them, at the loss temperature) gives the loss and the logits' gradient that the
    full logits give; GKDLoss(student_topk=True) reads it, trained at its temperature."""
    from roles.engines.train_kernels import topk_logprobs

    s, t, mask = _gkd_inputs(seed=3)
    values, indices = torch.topk(torch.log_softmax(t / 0.9, dim=-1), k=4, dim=-1)
    kw = dict(teacher_indices=indices, beta=0.5, temperature=0.9, topk_mode=mode, teacher_temperature_applied=True)
    s_full, s_top = s.clone().requires_grad_(), s.clone().requires_grad_()
    want, want_m = gkd_loss(s_full, values, mask, **kw)
    got, got_m = gkd_loss(topk_logprobs(s_top / 0.9, indices), values, mask, **kw)
    close(float(got), float(want))
    close(float(got_m["jsd"]), float(want_m["jsd"]))
    want.backward()
    got.backward()
    torch.testing.assert_close(s_top.grad, s_full.grad)

    batch = Batch(input_ids=torch.zeros(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5), loss_mask=mask,
                  teacher_logprobs=values, teacher_indices=indices)
    fn = GKDLoss(beta=0.5, temperature=0.9, sft_alpha=0.0, topk_mode=mode, teacher_temperature_applied=True,
                 student_topk=True)
    assert fn.loss_inputs == ("student_topk",)
    extras = {"global_tokens": float(mask.sum()), "temperature": 0.9,
              "student_topk": topk_logprobs(s / 0.9, indices)}
    close(float(fn(None, batch, extras)[0]), float(want))  # a mean over the loss tokens, as the step
    with pytest.raises(ValueError, match="trainer's temperature 1.0; train at the loss temperature 0.9"):
        fn(None, batch, {**extras, "temperature": 1.0})
    with pytest.raises(ValueError, match="sft_alpha > 0 needs the full logits"):
        GKDLoss(beta=0.5, temperature=0.9, sft_alpha=0.1, topk_mode=mode, student_topk=True)



@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("mode", ["renorm", "tail"])
def test_gkd_topk_matches_reference(beta, mode):
    s, t, mask = _gkd_inputs(seed=1)
    values, indices = torch.topk(torch.log_softmax(t, dim=-1), k=4, dim=-1)
    loss, m = gkd(s, values, mask, teacher_indices=indices, beta=beta, topk_mode=mode)
    close(float(loss), reference_topk(s, t, mask, indices, beta, 1.0, mode))
    keep = mask > 0
    close(m["teacher_topk_mass"], float(values.exp().sum(-1)[keep].mean()))
    if mode == "renorm":
        loss, _ = gkd(s, values, mask, teacher_indices=indices, beta=beta, topk_mode=mode, temperature=1.5)
        close(float(loss), reference_topk(s, t, mask, indices, beta, 1.5, mode))


def test_gkd_masks_exclude_padding_and_gradients_flow():
    s, t, mask = _gkd_inputs()
    tl = torch.log_softmax(t, dim=-1)
    expected = reference_jsd(s, t, mask, 0.5, 1.0)
    # Garbage at masked positions (nan teacher, huge student) changes neither loss nor gradients.
    tl_bad = tl.clone()
    tl_bad[mask == 0] = float("nan")
    s_bad = s.clone()
    s_bad[mask == 0] = 1e30
    for mode, teacher, idx in [("full", tl_bad, None), ("tail", *torch.topk(tl, k=3, dim=-1))]:
        if mode == "tail":
            teacher = teacher.clone()
            teacher[mask == 0] = float("nan")
        student = s_bad.clone().requires_grad_(True)
        loss, _ = gkd(student, teacher, mask, teacher_indices=idx, beta=0.5,
                      topk_mode="tail" if idx is not None else "renorm")
        if idx is None:
            close(loss, expected)
        loss.backward()
        assert torch.isfinite(student.grad).all()
        assert student.grad[mask == 0].abs().max() == 0
        assert student.grad[mask > 0].abs().max() > 0


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gkd_zero_when_student_equals_teacher(beta):
    s, _, mask = _gkd_inputs()
    tl = torch.log_softmax(s, dim=-1)
    assert abs(float(gkd(s, tl, mask, beta=beta, temperature=0.8)[0])) < 1e-12
    values, indices = torch.topk(tl, k=4, dim=-1)
    for mode in ("renorm", "tail"):
        assert abs(float(gkd(s, values, mask, teacher_indices=indices, beta=beta, topk_mode=mode)[0])) < 1e-12


# ----------------------------------------------------------------------------- Trainer callables

def _gkd_batch(V=9, topk=None):
    g = torch.Generator().manual_seed(3)
    B, T = 2, 6
    ids = torch.randint(0, V, (B, T), generator=g)
    loss_mask = torch.tensor([[0.0, 0, 1, 1, 1, 0], [0.0, 0, 0, 1, 1, 1]])
    student_raw = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    teacher_raw = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    # Aligned fields: position t holds the distribution over token t (from raw output t-1).
    aligned = torch.zeros(B, T, V, dtype=torch.float64)
    aligned[:, 1:] = torch.log_softmax(teacher_raw[:, :-1], dim=-1)
    values, indices = (aligned, None) if topk is None else torch.topk(aligned, k=topk, dim=-1)
    batch = Batch(input_ids=ids, attention_mask=torch.ones(B, T, dtype=torch.long), loss_mask=loss_mask,
                  teacher_logprobs=values, teacher_indices=indices)
    student_aligned = torch.zeros_like(student_raw)
    student_aligned[:, 1:] = student_raw[:, :-1]
    return batch, student_raw, teacher_raw, student_aligned


def test_gkd_callable_rescales_trainer_temperature_and_adds_sft():
    batch, student_raw, teacher_raw, student_aligned = _gkd_batch()
    mask = batch.loss_mask[:, 1:]
    jsd = reference_jsd(student_raw[:, :-1], teacher_raw[:, :-1], mask, 0.5, 0.9)
    # NLL of the batch tokens at temperature 1, written out: -log softmax(raw[t-1])[ids[t]].
    p = _softmax(student_raw[:, :-1])
    nll = -torch.log(p.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1))
    nll_mean = float(nll[mask > 0].mean())
    # The trainer hands over logits divided by its own temperature (here 0.5).
    extras = {"logits": student_aligned / 0.5, "temperature": 0.5, "global_tokens": 12.0}
    fn = make_loss("gkd", beta=0.5, temperature=0.9, sft_alpha=0.3, topk_mode="renorm", reduction="mean")
    assert fn.loss_inputs == ("logits",)
    loss, m = fn(torch.zeros(2, 6), batch, extras)
    close(loss, jsd + 0.3 * nll_mean)
    close(m["sft_nll"], nll_mean)
    fn_global = pickle.loads(pickle.dumps(make_loss("gkd", beta=0.5, temperature=0.9, sft_alpha=0.3,
                                                    topk_mode="renorm")))
    share, _ = fn_global(torch.zeros(2, 6), batch, extras)
    assert fn_global.denominator(batch) == 6.0
    close(share, float(loss) * 6 / 12)
    with pytest.raises(ValueError, match="logits"):
        fn(torch.zeros(2, 6), batch, {})


def test_gkd_sft_term_skips_rows_the_student_wrote():
    """sft_weight 0 (the driver's mark for on-policy rows) leaves a row out of the NLL term;
    the JSD term still counts it."""
    batch, student_raw, teacher_raw, student_aligned = _gkd_batch()
    mask = batch.loss_mask[:, 1:]
    jsd = reference_jsd(student_raw[:, :-1], teacher_raw[:, :-1], mask, 0.5, 0.9)
    p = _softmax(student_raw[:, :-1])
    nll = -torch.log(p.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1))
    extras = {"logits": student_aligned, "temperature": 1.0}
    fn = make_loss("gkd", beta=0.5, temperature=0.9, sft_alpha=0.3, topk_mode="renorm", reduction="mean")
    batch.sft_weight = torch.tensor([0.0, 1.0])
    loss, _ = fn(torch.zeros(2, 6), batch, extras)
    close(loss, jsd + 0.3 * float((nll[1] * mask[1]).sum() / mask.sum()))
    batch.sft_weight = torch.zeros(2)
    close(fn(torch.zeros(2, 6), batch, extras)[0], jsd)


def test_gkd_callable_topk():
    batch, student_raw, teacher_raw, student_aligned = _gkd_batch(topk=4)
    idx = batch.teacher_indices[:, 1:]
    expected = reference_topk(student_raw[:, :-1], teacher_raw[:, :-1], batch.loss_mask[:, 1:], idx, 1.0, 1.0,
                              "tail")
    fn = GKDLoss(beta=1.0, temperature=1.0, sft_alpha=0.0, topk_mode="tail", reduction="mean")
    close(fn(torch.zeros(2, 6), batch, {"logits": student_aligned})[0], expected)


def _grpo_batch(rows=slice(None)):
    logprobs, adv, mask, old = _grpo_inputs()
    batch = Batch(input_ids=torch.zeros(2, 4, dtype=torch.long)[rows], attention_mask=torch.ones(2, 4)[rows],
                  loss_mask=mask[rows], old_logprobs=old[rows], advantages=adv[rows])
    return logprobs[rows], batch


def test_grpo_callable_and_factory():
    logprobs, batch = _grpo_batch()
    fn = pickle.loads(pickle.dumps(make_loss("grpo", epsilon=0.2, epsilon_high=None, beta=0.0, loss_type="dapo",
                                             reduction="mean")))
    assert isinstance(fn, GRPOLoss) and fn.denominator(batch) == 5.0
    loss, m = fn(logprobs, batch, {"entropy": torch.ones(2, 4)})
    close(loss, -0.4 / 5)
    close(m["entropy"], 1.0)
    with pytest.raises(ValueError, match="advantages"):
        fn(logprobs, Batch(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           loss_mask=batch.loss_mask), {})
    with pytest.raises(ValueError, match="unknown loss"):
        make_loss("ppo")
    with pytest.raises(ValueError, match="does not take"):
        make_loss("grpo", lmbda=0.5)
    with pytest.raises(ValueError, match="global_micro_batches"):
        make_loss("grpo", epsilon=0.2, epsilon_high=None, beta=0.0, loss_type="bnpo")(
            logprobs, batch, {"global_tokens": 5.0, "global_sequences": 2.0})
    # The algorithm's settings have no defaults in the loss: GRPOAlgorithm holds them.
    with pytest.raises(ValueError, match=r"needs \['epsilon', 'epsilon_high', 'loss_type'\]"):
        make_loss("grpo", beta=0.0)
    assert isinstance(make_loss("sft"), SFTLoss)


@pytest.mark.parametrize("loss_type, expected", [
    ("grpo", (-0.9 + 1.15) / 2), ("dr_grpo", -0.4 / 8), ("dapo", -0.4 / 5), ("bnpo", (-0.9 + 1.15) / 2),
])
def test_grpo_global_reduction_over_micro_batches(loss_type, expected):
    # Each sequence its own micro-batch (as on two ranks); the shares sum to the step loss.
    extras = {"global_tokens": 5.0, "global_sequences": 2.0, "global_micro_batches": 2.0}
    fn = make_loss("grpo", epsilon=0.2, epsilon_high=None, beta=0.0, loss_type=loss_type,
                   max_completion_length=4)
    shares = [fn(*_grpo_batch(slice(i, i + 1)), extras)[0] for i in range(2)]
    close(float(sum(shares)), expected)
