"""GRPO driver: call order and grouping with fake roles. The real tiny run on Ray (SFT warm
start, KL to the reference role, steps_per_generation=2, every metric) is
tests/test_engines_e2e.py's."""
import io

import pytest
import torch

from algorithms import grpo
from algorithms.objectives.advantages import group_advantages
from algorithms.config.schema import LoopConfig
from algorithms.records.runlog import RunLog
from algorithms.data.tasks import Example
from orchestration.config import ConfigError
from orchestration.planner import make_plan
from roles.batch import Completions

G = 4
COLOCATED = {"train": {"gpus": 1}, "rollout": {"gpus": 1}, "colocate_groups": [["train", "rollout"]],
             "offload_model": True, "offload_optimizer": True, "sleep_level": 1}


class Tokenizer:
    pad_token_id, eos_token_id = 0, 0


class FakeGroup:
    """Records every call as (role, method, args) in a shared log; answers like the real role."""

    def __init__(self, role, log, correct=None):
        # correct(question, position in the request, training round) -> right samples of its group
        self.role, self.log, self.correct, self.rounds, self.version = role, log, correct, 0, 0

    deferred = ()  # (method, args) that ride on the next call, as a real group's `defer` queues them
    tails = ()  # (method, args) that run after the next call's method (`then`)

    def defer(self, method, *args):
        self.deferred = (*self.deferred, (method, args))

    def then(self, method, *args):
        self.tails = (*self.tails, (method, args))

    def drop_deferred(self):
        queued, self.deferred, self.tails = bool(self.deferred or self.tails), (), ()
        return queued

    def deferred_results(self):
        return []

    def after(self, futures):  # calls here finish at once: nothing to wait for
        pass

    def async_call(self, method, *args, **kwargs):
        value = self.call(method, *args, **kwargs)
        return type("Done", (), {"get": lambda self, timeout=None: value, "ready": lambda self: True})()

    def call(self, method, *args, **kwargs):
        if method == "memory":  # per-step figures; not part of the call order under test
            return {"rss_bytes": 1}
        self.log.extend((self.role, m, a) for m, a in self.deferred)
        self.log.append((self.role, method, args))
        self.log.extend((self.role, m, a) for m, a in self.tails)
        self.deferred = self.tails = ()
        if method == "update_weights":
            self.version = args[1]
        if method == "generate":
            prompts, sampling = args
            self.rounds += sampling.n > 1
            texts = []
            for i, messages in enumerate(prompts):
                q = messages[-1]["content"]
                k = self.correct(q, i, self.rounds) if sampling.n > 1 else 1  # eval (greedy) is always right
                texts += [f"#### {ANSWERS[q] if j < k else 999}" for j in range(sampling.n)]
            n = len(texts)
            ids = [[1, 2, 3][: 1 + i % 3] for i in range(n)]
            return Completions(list(range(n)), [[5, 6]] * n, ids, texts, [[-0.5] * len(c) for c in ids],
                               ["stop"] * n, [self.version] * n)
        if method == "train_step":
            return {"loss": 0.0, "step": float(sum(1 for e in self.log if e[1] == "train_step"))}
        if method == "state_dict_buckets":
            return []
        if method == "logprobs":
            return torch.zeros(args[0].input_ids.shape)
        return None


ANSWERS = {f"q{i}": str(i) for i in range(40)}
EXAMPLES = [Example(prompt=q, solution=f"#### {a}", answer=a) for q, a in ANSWERS.items()]


def fake_run(tmp_path, correct, steps=1, placement=None, loop=None, **algo):
    cfg = grpo.GRPOConfig(run=LoopConfig(**{"steps": steps, "prompts_per_step": 4, "save_final": False,
                                               **(loop or {})}),
                             algorithm=grpo.GRPOAlgorithm(num_generations=G, **algo))
    plan = make_plan({**COLOCATED, **(placement or {})})
    log = []
    trainer, rollout = FakeGroup("train", log), FakeGroup("rollout", log, correct)
    reference = FakeGroup("reference", log) if cfg.algorithm.beta else None
    rewards = grpo.Rewards(grpo.reward_specs(cfg.algorithm), {})
    run_log = RunLog(tmp_path, steps, LoopConfig(), stream=io.StringIO())
    record = grpo.train(cfg, plan, trainer, rollout, reference, rewards, EXAMPLES, EXAMPLES[:3], Tokenizer(), run_log)
    run_log.close()
    return log, record


def calls(log, method):
    return [args for _, m, args in log if m == method]


def training_generates(log):
    return [args for args in calls(log, "generate") if args[1].n > 1]


def test_one_step_call_order_groups_and_advantages(tmp_path):
    def correct(q, i, rounds):  # question qN: N % 5 of its 4 samples right
        return int(q[1:]) % (G + 1)

    log, record = fake_run(tmp_path, correct, scale_rewards="group")
    methods = [m for _, m, _ in log]
    i = next(i for i, (_, m, a) in enumerate(log) if m == "generate" and a[1].n > 1)
    # Generate awake, sleep, train, sync weights, then offload; evals at steps 0 and 1 around it.
    assert methods[:3] == ["wake_up", "generate", "sleep"]
    assert methods[i - 1:i + 7] == ["wake_up", "generate", "sleep", "onload", "train_step", "state_dict_buckets",
                                    "update_weights", "offload"]
    assert methods[i + 7:] == ["wake_up", "generate", "sleep"]
    (prompts, sampling), = training_generates(log)
    assert sampling.n == G and sampling.temperature == 1.0
    (batch, temperature), = calls(log, "train_step")
    assert len(batch) == 4 * G and temperature == 1.0
    # Completion j belongs to prompt j // G; its advantage is relative to that prompt's group.
    ks = [correct(m[-1]["content"], 0, 1) for m in prompts]
    expected = torch.tensor([float(j < k) for k in ks for j in range(G)])
    assert torch.equal(batch.rewards, expected)
    assert torch.allclose(batch.advantages, group_advantages(expected, G, "group", False))
    assert torch.allclose(batch.advantages.view(-1, G).sum(1), torch.zeros(4), atol=1e-4)
    assert batch.old_logprobs[batch.loss_mask > 0].eq(-0.5).all()
    assert calls(log, "update_weights")[-1][1] == 1  # the weight version is the step
    assert record["rollout/accuracy"] == pytest.approx(float(expected.mean()))
    assert record["grpo/zero_std_groups"] == pytest.approx(sum(k in (0, G) for k in ks) / 4)
    assert record["eval/accuracy"] == 1.0 and "train/loss" in record


def test_sleep_level_2_sends_the_weights_again_before_a_generate_after_a_sleep(tmp_path):
    """Level 2 drops the rollout's weights: after the step-0 eval's sleep and after every
    eval, a generate must come after an update_weights (a regression: step 1 generated from
    dropped weights)."""
    log, _ = fake_run(tmp_path, lambda q, i, rounds: 1, steps=3, placement={"sleep_level": 2})
    methods = [m for _, m, _ in log if m in ("sleep", "wake_up", "update_weights", "generate")]
    synced = True  # the rollout starts with the trainer's weights
    for m in methods:
        synced = (synced and m != "sleep") or m == "update_weights"
        if m == "generate":
            assert synced, methods
    assert [a[0] for a in calls(log, "sleep")] == [2] * len(calls(log, "sleep"))
    # One sync per training step, plus one after the step-0 eval's sleep; none twice in a row.
    assert len(calls(log, "update_weights")) == 3 + 1
    assert ("update_weights", "update_weights") not in set(zip(methods, methods[1:]))


@pytest.mark.parametrize("save_final", [True, False])
def test_the_last_checkpoint_is_written_once_by_an_onloaded_trainer(tmp_path, save_final):
    """save_every landing on the last step and save_final wrote step_2 twice (a regression)."""
    log, record = fake_run(tmp_path, lambda q, i, rounds: 1, steps=2,
                           loop={"save_every": 1, "save_final": save_final})
    saves = [(role, m, a) for role, m, a in log if m == "save"]
    # Ranks write into step_N.tmp, renamed to step_N once complete.
    assert [a[0].rsplit("/", 1)[-1] for _, _, a in saves] == ["step_1.tmp", "step_2.tmp"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_1", "step_2"]
    for _, _, a in saves:  # each save between an onload and the same offload as the loop's
        at = log.index(("train", "save", a))
        assert log[at - 1] == ("train", "onload", ()) and log[at + 1] == ("train", "offload", (True, True))
    assert ("checkpoint" in record) == save_final


def test_steps_per_generation_splits_and_syncs_each_step(tmp_path):
    log, _ = fake_run(tmp_path, lambda q, i, rounds: 1 + i % (G - 1), steps=2, steps_per_generation=2, beta=0.1)
    parts = [b for b, _ in calls(log, "train_step")]
    assert [len(b) for b in parts] == [2 * G] * 4
    methods = [m for _, m, _ in log]
    starts = [i for i, m in enumerate(methods) if m == "logprobs"]
    assert len(starts) == 2
    # Each step: reference logprobs of the whole batch, two updates on its halves, one weight sync.
    for start in starts:
        assert methods[start + 1:start + 6] == ["onload", "train_step", "train_step", "state_dict_buckets",
                                                 "update_weights"]
    whole = torch.cat([parts[0].advantages, parts[1].advantages])
    assert torch.allclose(whole.view(-1, G).sum(1), torch.zeros(4), atol=1e-4)
    assert all(p.ref_logprobs is not None for p in parts)


def test_dynamic_sample_drops_zero_variance_groups(tmp_path):
    def correct(q, i, rounds):  # round 1: groups 0 and 1 all wrong / all right; else 2 of 4 right
        return {0: 0, 1: G}.get(i, 2) if rounds == 1 else 2

    log, record = fake_run(tmp_path, correct, dynamic_sample=True)
    assert len(training_generates(log)) == 2 and record["grpo/generation_rounds"] == 2
    assert record["grpo/zero_std_groups"] == 0.5
    (batch, _), = calls(log, "train_step")
    assert len(batch) == 4 * G
    assert (batch.rewards.view(-1, G).std(1) > 0).all()  # only groups with variance are trained
    # Without it the flat groups stay, with zero advantages.
    log, _ = fake_run(tmp_path, correct)
    (batch, _), = calls(log, "train_step")
    assert (batch.advantages.view(-1, G).abs().sum(1) == 0).sum() == 2


def test_check_rejects_bad_settings():
    plan = make_plan(COLOCATED)
    ok = grpo.GRPOConfig(run=LoopConfig(prompts_per_step=4))
    grpo.validate(ok, plan)
    for algo in [dict(num_generations=1), dict(scale_rewards="std"), dict(loss_type="ppo"),
                 dict(reward_funcs=["nope"]), dict(reward_weights=[1.0, 2.0]), dict(steps_per_generation=0)]:
        with pytest.raises(ConfigError):
            grpo.validate(grpo.GRPOConfig(run=LoopConfig(prompts_per_step=4), algorithm=grpo.GRPOAlgorithm(**algo)), plan)
    # The warm start runs on the trainer's ranks: each needs a share of every SFT batch.
    two = make_plan({"train": {"gpus": 2}, "rollout": {"gpus": 1}})
    with pytest.raises(ConfigError, match="warmup_sft_batch"):
        grpo.validate(grpo.GRPOConfig(run=LoopConfig(prompts_per_step=4), algorithm=grpo.GRPOAlgorithm(
            warmup_sft_steps=5, warmup_sft_batch=1)), two)


def test_reward_functions_weighted_in_process():
    algo = grpo.GRPOAlgorithm(reward_funcs=["accuracy", "format", "prm"], reward_weights=[1.0, 0.1, 0.5])
    rewards = grpo.Rewards(grpo.reward_specs(algo), {})
    total, means = rewards.score(["(1+2)+3"] * 3, ["1+2=3\n3+3=6\n#### 6", "1+2=4\n4+3=6\n#### 6", "6"],
                                 ["6"] * 3)
    assert total.tolist() == pytest.approx([1.6, 1.1, 0.0])
    assert means == pytest.approx({"accuracy": 2 / 3, "format": 2 / 3, "prm": 1 / 3})


def test_planned_orm_and_prm_roles_score_the_rewards():
    from orchestration.launch import driver_group
    from roles.orm import ORM
    from roles.prm import PRM

    plan = make_plan({"device_groups": {
        "nproc_per_node": 1, "gen": {"device": "GPU", "ranks": [0], "workers": ["train", "rollout"]},
        "rm": {"device": "CPU", "ranks": 1, "workers": ["orm", "prm"]}}})
    algo = grpo.GRPOAlgorithm(reward_funcs=["accuracy", "format", "prm"], reward_weights=[1.0, 0.1, 0.5])
    grpo.validate(grpo.GRPOConfig(run=LoopConfig(prompts_per_step=4), algorithm=algo), plan)
    specs = grpo.reward_specs(algo)
    configs = grpo.planned_reward_configs(specs, plan)
    assert configs["orm"]["kind"] == "combined" and configs["orm"]["weights"] == {"numeric": 1.0, "format": 0.1}
    groups = {"orm": driver_group(ORM, {"config": configs["orm"]}), "prm": driver_group(PRM, {"config": configs["prm"]})}
    total, means = grpo.Rewards(specs, groups).score(["(1+2)+3"] * 2, ["1+2=3\n3+3=6\n#### 6", "1+2=4\n#### 6"],
                                                     ["6"] * 2)
    assert total.tolist() == pytest.approx([1.6, 1.1]) and means == pytest.approx({"orm": 1.1 + 0.0, "prm": 0.5})


def test_overlong_filter_takes_cut_completions_out_of_the_loss():
    """ms-swift's overlong_filter: a completion that hit max_new_tokens keeps its place in the
    group's advantages but contributes no loss token."""
    from algorithms.data.prompts import batch_of
    from roles.models import load_tokenizer

    comps = Completions([0, 0, 1], [[5, 6]] * 3, [[7, 8, 9], [7, 2], [9, 9, 9]], ["a", "b", "c"],
                        [[-0.5] * 3, [-0.5] * 2, [-0.5] * 3], ["length", "stop", "length"])
    batch = batch_of(load_tokenizer("tiny_qwen2"), comps)
    kept = batch.loss_mask.sum(1).clone()
    assert grpo.filter_overlong(batch, comps.finish_reasons) == pytest.approx(2 / 3)
    assert batch.loss_mask.sum(1).tolist() == [0.0, kept[1].item(), 0.0] and kept[1] > 0
