"""GRPO's training-inference mismatch correction (ms-swift's rollout_importance_sampling_mode):
the four modes' loss and gradient and the rollout_correction metrics against values worked out
by hand, the loss unchanged without a mode, the ms-swift keys, the checks, the driver's calls
with fake roles, and one real tiny run."""
import math

import pytest
import torch
from omegaconf import OmegaConf

from algorithms import grpo
from algorithms.config.checks import check_rollout_correction
from algorithms.config.schema import LoopConfig
from algorithms.config.swift_keys import translate
from algorithms.objectives.losses import GRPOLoss
from algorithms.objectives.rollout_correction import RolloutCorrection
from algorithms.records.trackers import read_metrics
from orchestration.config import ConfigError
from orchestration.planner import make_plan
from roles.batch import Batch
from tests.driver_helpers import run_one_thread
from tests.test_grpo import COLOCATED, calls, fake_run

C = 2.0
# Two completions: row 0 has loss tokens at positions 1-3, row 1 at 1-2 (position 3 is padding).
MASK = [[0, 1, 1, 1], [0, 1, 1, 0]]
ROLLOUT = [[0.0, -1.0, -2.0, -0.5], [0.0, -0.7, -1.2, -1e9]]  # padding may hold anything
# trainer - rollout log-ratio per loss token: w = exp of it is 1.22, 2.72 (> C), 0.74 and 2.46 (> C), 1.82;
# per row the geometric mean: exp(0.3) = 1.35 (<= C) and exp(0.75) = 2.12 (> C).
LOG_RATIO = [[0.0, 0.2, 1.0, -0.3], [0.0, 0.9, 0.6, 0.0]]
# current - trainer old logprob: the PPO ratio exp(0.1) and exp(-0.05), both inside the clip.
STEP = [[0.0, 0.1, 0.0, -0.05], [0.0, 0.0, 0.1, 0.0]]
ADVANTAGES = [1.0, -0.5]
EPS = 0.2


def tokens(row):
    return [t for t in range(4) if MASK[row][t]]


def trainer_old(b, t):
    return ROLLOUT[b][t] + LOG_RATIO[b][t] if MASK[b][t] else 0.0


def hand_weights(mode):
    """{(row, position): weight} as ms-swift's four modes define them."""
    out = {}
    for b in range(2):
        w = {t: math.exp(LOG_RATIO[b][t]) for t in tokens(b)}
        seq = math.exp(sum(LOG_RATIO[b][t] for t in tokens(b)) / len(tokens(b)))
        for t in tokens(b):
            out[b, t] = {"token_truncate": min(w[t], C), "token_mask": w[t] if w[t] <= C else 0.0,
                         "sequence_truncate": min(seq, C), "sequence_mask": w[t] if seq <= C else 0.0}[mode]
    return out


def batch_and_logprobs(with_rollout=True):
    old = torch.tensor([[trainer_old(b, t) for t in range(4)] for b in range(2)])
    current = (old + torch.tensor(STEP)).requires_grad_(True)
    batch = Batch(input_ids=torch.ones(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.long),
                  loss_mask=torch.tensor(MASK, dtype=torch.float32), advantages=torch.tensor(ADVANTAGES),
                  old_logprobs=old, rollout_logprobs=torch.tensor(ROLLOUT) if with_rollout else None)
    return batch, current


def grpo_loss_of(correction, batch, current, loss_type="grpo"):
    fn = GRPOLoss(epsilon=EPS, epsilon_high=None, beta=0.0, loss_type=loss_type, correction=correction,
                  reduction="mean")
    loss, metrics = fn(current, batch, {})
    loss.backward()
    return loss.detach(), current.grad, metrics


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_each_mode_weighs_the_loss_and_its_gradient_as_worked_out_by_hand(mode):
    batch, current = batch_and_logprobs()
    loss, grad, metrics = grpo_loss_of(RolloutCorrection(mode, C, False, None), batch, current)
    w = hand_weights(mode)
    # grpo: the mean over rows of each row's token mean of -w * r * A (every ratio r inside the clip,
    # so d/dlogp = -w * r * A / (tokens of the row * rows)).
    want_loss, want_grad = 0.0, torch.zeros(2, 4)
    for b in range(2):
        n = len(tokens(b))
        for t in tokens(b):
            r = math.exp(STEP[b][t])
            want_loss += -w[b, t] * r * ADVANTAGES[b] / n / 2
            want_grad[b, t] = -w[b, t] * r * ADVANTAGES[b] / n / 2
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert torch.allclose(grad, want_grad, atol=1e-6)
    assert metrics["rollout_correction/is_weight_mean"] == pytest.approx(sum(w.values()) / 5, rel=1e-5)
    # Tokens above C (token modes), or rows whose geometric mean is above C (sequence modes).
    clipped = 2 / 5 if mode.startswith("token") else 1 / 2
    assert float(metrics["rollout_correction/clipped_frac"]) == pytest.approx(clipped)


def test_the_metrics_match_their_definitions():
    batch, current = batch_and_logprobs()
    _, _, m = grpo_loss_of(RolloutCorrection("token_truncate", C, False, None), batch, current)
    m = {k.split("/", 1)[1]: float(v) for k, v in m.items() if k.startswith("rollout_correction/")}
    lr = [LOG_RATIO[b][t] for b in range(2) for t in tokens(b)]
    train_mean = [sum(trainer_old(b, t) for t in tokens(b)) / len(tokens(b)) for b in range(2)]
    rollout_mean = [sum(ROLLOUT[b][t] for t in tokens(b)) / len(tokens(b)) for b in range(2)]
    diff = [r - t for r, t in zip(rollout_mean, train_mean)]
    seq_lr = [sum(LOG_RATIO[b][t] for t in tokens(b)) / len(tokens(b)) for b in range(2)]
    w = [min(math.exp(x), C) for x in lr]
    w_ess = [min(max(x, 1 / C), C) for x in w]
    mean_ess = sum(w_ess) / 5
    want = {"kl": sum(-x for x in lr) / 5, "k3_kl": sum(math.exp(x) - x - 1 for x in lr) / 5,
            "training_ppl": sum(math.exp(-x) for x in train_mean) / 2, "training_log_ppl": -sum(train_mean) / 2,
            "rollout_ppl": sum(math.exp(-x) for x in rollout_mean) / 2, "rollout_log_ppl": -sum(rollout_mean) / 2,
            "log_ppl_diff": sum(diff) / 2, "log_ppl_abs_diff": sum(abs(x) for x in diff) / 2,
            "ppl_ratio": sum(math.exp(x) for x in diff) / 2,
            "chi2_token": sum(math.exp(2 * x) for x in lr) / 5 - 1, "chi2_seq": sum(math.exp(2 * x) for x in seq_lr) / 2 - 1,
            "is_weight_mean": sum(w) / 5, "ess": 1 / (sum((x / mean_ess) ** 2 for x in w_ess) / 5), "clipped_frac": 0.4,
            "ratio_max": math.exp(max(lr)), "inverse_ratio_max": math.exp(-min(lr))}
    assert m.keys() == want.keys()
    for k, v in want.items():
        assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    assert 0 < m["ess"] < 1  # unequal weights


def test_without_a_mode_the_loss_is_unchanged_and_the_metrics_are_optional():
    batch, current = batch_and_logprobs(with_rollout=False)
    batch.old_logprobs = torch.tensor(ROLLOUT) * torch.tensor(MASK)  # today: the rollout's as the old policy
    base_loss, base_grad, base_metrics = grpo_loss_of(None, batch, current)
    assert not any(k.startswith("rollout_correction/") for k in base_metrics)
    current.grad = None
    loss, grad, metrics = grpo_loss_of(RolloutCorrection("none", C, True, None), batch, current)
    assert float(loss) == float(base_loss) and torch.equal(grad, base_grad)
    # The trainer's side is the current logprobs; no weights, so no weight figures.
    kl = -sum(float(current[b, t].detach()) - ROLLOUT[b][t] for b in range(2) for t in tokens(b)) / 5
    assert float(metrics["rollout_correction/kl"]) == pytest.approx(kl, rel=1e-5)
    assert "rollout_correction/is_weight_mean" not in metrics
    assert grpo.rollout_correction(grpo.GRPOAlgorithm()) is None  # the default builds the loss as before


def test_a_mode_without_the_rollouts_logprobs_is_refused_by_the_loss():
    batch, current = batch_and_logprobs(with_rollout=False)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        grpo_loss_of(RolloutCorrection("token_mask", C, False, None), batch, current)


def test_off_policy_sequence_mask_drops_drifted_rows_with_negative_advantage():
    # A delta just below row 1's mean (rollout - current) logprob: row 1 (advantage < 0) leaves the loss.
    batch, current = batch_and_logprobs()
    drift = [sum(ROLLOUT[b][t] - float(current[b, t]) for t in tokens(b)) / len(tokens(b)) for b in range(2)]
    delta = drift[1] - 0.01
    assert drift[0] > delta  # row 0 drifted as far, but its advantage is positive: kept
    loss, grad, metrics = grpo_loss_of(RolloutCorrection("none", C, False, delta), batch, current)
    assert float(metrics["off_policy_masked"]) == pytest.approx(0.5)
    assert grad[1].abs().sum() == 0 and grad[0].abs().sum() > 0
    want = sum(-math.exp(STEP[0][t]) * ADVANTAGES[0] / 3 for t in tokens(0)) / 2  # row 1 counts as 0
    assert float(loss) == pytest.approx(want, rel=1e-5)


def test_the_ms_swift_keys_map():
    file = {"rollout_importance_sampling_mode": "sequence_mask", "rollout_importance_sampling_threshold": 3,
            "log_rollout_offpolicy_metrics": True, "off_policy_sequence_mask_delta": 0.1}
    _, out, no_effect = translate(file, "grpo", OmegaConf.structured(grpo.GRPOConfig))
    assert out == {"algorithm.rollout_importance_sampling_mode": "sequence_mask",
                   "algorithm.rollout_importance_sampling_threshold": 3.0,
                   "algorithm.log_rollout_offpolicy_metrics": True, "algorithm.off_policy_sequence_mask_delta": 0.1}
    assert no_effect == []
    _, out, _ = translate({"rollout_importance_sampling_mode": None, "off_policy_sequence_mask_delta": None}, "grpo",
                          OmegaConf.structured(grpo.GRPOConfig))
    assert out == {"algorithm.rollout_importance_sampling_mode": "none", "algorithm.off_policy_sequence_mask_delta": None}


def test_bad_settings_are_refused_naming_the_key():
    plan = make_plan(COLOCATED)

    def validate(**algo):
        grpo.validate(grpo.GRPOConfig(run=LoopConfig(prompts_per_step=4), algorithm=grpo.GRPOAlgorithm(**algo)), plan)

    validate(rollout_importance_sampling_mode="token_mask", max_staleness=0)
    with pytest.raises(ConfigError, match="'algorithm.rollout_importance_sampling_mode'='token_clip' is not a "
                                          "correction mode.*token_truncate"):
        validate(rollout_importance_sampling_mode="token_clip")
    with pytest.raises(ConfigError, match="'algorithm.rollout_importance_sampling_threshold'=0.0"):
        validate(rollout_importance_sampling_mode="token_mask", rollout_importance_sampling_threshold=0.0)
    # (The teacher's own checks come first in validate: the correction's check alone.)
    with pytest.raises(ConfigError, match="'algorithm.off_policy_sequence_mask_delta'=0.1 needs one advantage"):
        check_rollout_correction(grpo.GRPOAlgorithm(off_policy_sequence_mask_delta=0.1, teacher_kl_coef=1.0))


def test_the_driver_keeps_the_rollouts_logprobs_and_takes_the_trainers_once_per_generation(tmp_path):
    log, _ = fake_run(tmp_path, lambda q, i, rounds: 2, steps_per_generation=2,
                      rollout_importance_sampling_mode="token_truncate")
    methods = [m for role, m, _ in log if role == "train"]
    first = methods.index("train_step")
    assert methods[first - 1] == "logprobs" and methods[first:first + 2] == ["train_step", "train_step"]
    assert methods.count("logprobs") == 1
    for batch, _ in calls(log, "train_step"):
        real = batch.loss_mask > 0
        assert batch.rollout_logprobs[real].eq(-0.5).all()  # the fake rollout's sampling logprobs
        assert batch.old_logprobs[real].eq(0.0).all()  # the fake trainer's logprobs
    # One update per generation: no extra forward, the old policy is the detached current one.
    log, _ = fake_run(tmp_path / "one", lambda q, i, rounds: 2, rollout_importance_sampling_mode="token_truncate")
    assert "logprobs" not in [m for role, m, _ in log if role == "train"]
    (batch, _), = calls(log, "train_step")
    assert batch.old_logprobs is None and batch.rollout_logprobs[batch.loss_mask > 0].eq(-0.5).all()


def test_a_tiny_grpo_run_logs_the_correction_metrics(tmp_path):
    run_one_thread(grpo, grpo.GRPOConfig, [
        "+experiment=grpo_quickstart", "backend=local", "algorithm.warmup_sft_steps=0", "run.steps=2",
        "run.prompts_per_step=2", "algorithm.num_generations=4", "algorithm.max_new_tokens=12",
        "data.eval_size=2", "run.eval_max_new_tokens=4", "run.save_final=false", "trainer.warmup_steps=0",
        "algorithm.steps_per_generation=2", "algorithm.rollout_importance_sampling_mode=sequence_truncate"], tmp_path)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] >= 1]
    assert [r["step"] for r in records][-2:] == [1, 2]
    names = ("kl", "k3_kl", "training_ppl", "rollout_ppl", "log_ppl_diff", "chi2_token", "chi2_seq",
             "is_weight_mean", "ess", "clipped_frac")
    for r in records[-2:]:
        figures = {n: r[f"train/rollout_correction/{n}"] for n in names}
        assert all(math.isfinite(v) for v in figures.values()), figures
        assert figures["training_ppl"] > 1 and figures["rollout_ppl"] > 1 and 0 < figures["ess"] <= 1 + 1e-6
        assert "time/old_logprobs" in r and math.isfinite(r["train/loss"])


def test_a_peak_metric_is_the_steps_largest_not_its_mean():
    """A loss metric ending in _max (ratio_max) reaches the step's metrics as the largest value
    over micro-batches; the others stay token-weighted means."""
    from roles.trainer import Trainer

    def loss_fn(logprobs, batch, extras):
        first = float(batch.input_ids[0, 0])
        loss = -(logprobs * batch.loss_mask).sum() / extras["global_tokens"]
        return loss, {"probe_max": torch.tensor(first), "probe": torch.tensor(first)}

    trainer = Trainer("tiny_qwen2", {"device": "cpu", "micro_batch_per_device": 1, "lr": 1e-4}, loss_fn=loss_fn)
    ids = torch.tensor([[5, 6, 7, 8], [9, 6, 7, 8], [3, 6, 7, 8]])
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones(3, 4))
    out = trainer.train_step(batch)
    assert out["probe_max"] == 9.0
    assert out["probe"] == pytest.approx((5 + 9 + 3) / 3)


def test_old_logprobs_from_the_trainer_asks_the_rollout_for_none():
    """algorithm.old_logprobs=trainer: the rollout is asked for no logprobs, and the ratio's old
    policy is the trainer's (one forward before two updates; none with one update)."""
    import tempfile
    from pathlib import Path
    from tests.test_grpo import training_generates

    with tempfile.TemporaryDirectory() as tmp:
        log, _ = fake_run(Path(tmp), lambda q, i, rounds: 2, steps_per_generation=2, old_logprobs="trainer")
        (_, sampling), = training_generates(log)
        assert sampling.logprobs is False
        methods = [m for role, m, _ in log if role == "train"]
        assert methods.count("logprobs") == 1 and methods[methods.index("train_step") - 1] == "logprobs"
        for batch, _ in calls(log, "train_step"):
            assert batch.old_logprobs[batch.loss_mask > 0].eq(0.0).all()  # the fake trainer's
        log, _ = fake_run(Path(tmp) / "one", lambda q, i, rounds: 2, old_logprobs="trainer")
        assert "logprobs" not in [m for role, m, _ in log if role == "train"]
        (batch, _), = calls(log, "train_step")
        assert batch.old_logprobs is None
    plan = make_plan(COLOCATED)
    for bad, key in (({"log_rollout_offpolicy_metrics": True}, "log_rollout_offpolicy_metrics"),
                     ({"rollout_importance_sampling_mode": "token_mask"}, "rollout_importance_sampling_mode"),
                     ({"off_policy_sequence_mask_delta": 0.1}, "off_policy_sequence_mask_delta")):
        with pytest.raises(ConfigError, match=f"'algorithm.old_logprobs'='trainer' leaves no rollout logprobs, "
                                              f"which algorithm.{key} read"):
            grpo.validate(grpo.GRPOConfig(run=LoopConfig(prompts_per_step=4), algorithm=grpo.GRPOAlgorithm(
                old_logprobs="trainer", **bad)), plan)
    with pytest.raises(ConfigError, match="'algorithm.old_logprobs'='engine' is not a source"):
        grpo.validate(grpo.GRPOConfig(run=LoopConfig(prompts_per_step=4),
                                      algorithm=grpo.GRPOAlgorithm(old_logprobs="engine")), plan)
