"""Multi-turn rollouts (roles/multi_turn.py, roles/schedulers.py) on tiny CPU models: token-exact
trajectories through a chat template, the trajectory budget, tools, math_tip_trick, environments
that fail, and ms-swift's frozen-lake GRPO file with the ported plugin."""
import asyncio
import json
import math
import string
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from algorithms import grpo
from algorithms.config.swift_keys import translate
from algorithms.runtime.trajectories import env_rewards, failed_rows
from roles.batch import SamplingParams, batch_from_completions
from roles.engines.torch_engine import token_logprobs
from roles.multi_turn import Choice, Message, Request
from roles.plugins import Env, GymEnv, envs, tools
from roles.rollout import Rollout
from roles.schedulers import MathTipsScheduler, ToolScheduler

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread
# The frozen-lake plugin `rayroles example` writes beside ms-swift's frozen-lake file.
PLUGIN = (Path(__file__).parent.parent / "algorithms" / "config" / "ms_swift_examples" / "examples" / "megatron" / "grpo"
          / "multi_turn" / "frozen_lake_plugin.py")
PROMPTS = [[{"role": "user", "content": "2+3"}], [{"role": "user", "content": "7*8-1"}]]


class Counter(GymEnv):
    """Says how many replies it has seen; done after two; reward 1 per turn (plain methods)."""

    def reset(self, row):
        self.turns = 0
        return f"start {row['solution']}"

    def step(self, action):
        self.turns += 1
        return f"seen {self.turns}", 1.0, self.turns >= 2, {}


class Raises(Env):
    async def reset(self, request):
        return "go", {}, ""

    async def step(self, messages):
        raise ValueError("broken board")


class WrongType(Env):
    def reset(self, request):
        return "go", {}, ""

    def step(self, messages):
        return "not a tuple"


class Hangs(Env):
    def reset(self, request):
        return "go", {}, ""

    def step(self, messages):
        time.sleep(30)


envs.update(counter=Counter, raises=Raises, wrong_type=WrongType, hangs=Hangs)


@pytest.fixture(scope="module")
def rollout():
    return Rollout("tiny_qwen2", config={"device": "cpu"})


def segments(mask):
    """(start, stop, value) of each run of equal values in a 0/1 mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def gym(env, **kw):
    return {"scheduler": "gym_scheduler", "gym_env": env, "max_turns": 3, **kw}


def test_trajectories_are_token_exact_through_the_chat_template(rollout):
    """Greedy trajectories: each model segment is exactly what the engine generates from the
    ids before it, each environment segment is the template's rendering of its message, and the
    trainer's batch holds prompt + completion with the loss mask on the model's tokens only."""
    tok = rollout.tokenizer
    # A turn also ends at any letter (the random model rarely says <eos>): short turns, many of them.
    letters = tuple(tok.convert_tokens_to_ids(list(string.ascii_letters)))
    greedy = SamplingParams(max_new_tokens=200, temperature=0, stop_token_ids=letters)
    out = rollout.generate_trajectories(PROMPTS, greedy, gym("counter"), [{"solution": "5"}, {"solution": "55"}])
    batch = batch_from_completions(out, rollout.pad_id)
    for i in range(len(out)):
        p, c, m = out.prompt_ids[i], out.completion_ids[i], out.completion_mask[i]
        assert tok.decode(p) == f"<bos><|user|>start {['5', '55'][i]}<eos><|assistant|>"
        n = len(p) + len(c)
        assert batch.input_ids[i, :n].tolist() == p + c
        assert batch.loss_mask[i, :n].tolist() == [0.0] * len(p) + [float(x) for x in m]
        assert batch.loss_mask[i, n:].sum() == 0
        seen = 0
        for start, stop, model in segments(m):
            if model:  # the engine, asked again from the same ids, gives the same tokens
                again = rollout.generate([p + c[:start]], greedy)
                assert again.completion_ids[0][:stop - start] == c[start:stop]
            else:  # the template's end of turn unless the model said it, then the next user turn
                seen += 1
                end = "" if c[start - 1] == tok.eos_token_id else "<eos>"
                assert tok.decode(c[start:stop]) == f"{end}<|user|>seen {seen}<eos><|assistant|>"
        assert seen == out.rollout_infos[i]["num_turns"] - 1 == 1
    assert all(r in ("stop", "length") for r in out.finish_reasons)


def test_the_trainer_scores_the_rollouts_tokens_and_logprobs(rollout):
    out = rollout.generate_trajectories(PROMPTS, SamplingParams(max_new_tokens=120, temperature=1.0, n=2, seed=5),
                                        gym("counter"), [{"solution": "5"}, {"solution": "55"}])
    batch = batch_from_completions(out, rollout.pad_id)
    assert len(out) == 4 and out.prompt_index == [0, 0, 1, 1]
    with torch.no_grad():
        logits = rollout.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    mine = token_logprobs(logits, batch.input_ids, 1.0)
    model = batch.loss_mask > 0
    assert model.sum() > 0 and (batch.loss_mask.sum() < batch.attention_mask.sum())
    torch.testing.assert_close(mine[model], batch.old_logprobs[model], atol=1e-4, rtol=0)
    assert (batch.old_logprobs[(batch.loss_mask == 0)] == 0).all()  # environment tokens carry none
    assert env_rewards(out, "sum").tolist() == [sum(i["step_rewards"]) for i in out.rollout_infos]


def test_chatml_delta_adds_what_the_model_did_not_generate():
    """Qwen-style ChatML: after the model's <|im_end|> the template's newline, then the turn."""
    r = Rollout("tiny_qwen2_gpt2", config={"device": "cpu"})
    from roles.multi_turn import Delta
    d = Delta(r.tokenizer, True, {})
    im_end = r.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = d.ids([{"role": "user", "content": "seen 1"}], im_end)
    assert r.tokenizer.decode(ids) == "\n<|im_start|>user\nseen 1<|im_end|>\n<|im_start|>assistant\n"
    cut = d.ids([{"role": "user", "content": "x"}], 42)  # a reply cut without its end of turn
    assert r.tokenizer.decode(cut).startswith("<|im_end|>\n<|im_start|>user\nx")


def test_the_budget_spans_turns_and_cuts_with_length(rollout):
    out = rollout.generate_trajectories(PROMPTS[:1], SamplingParams(max_new_tokens=30, temperature=1.0, n=4, seed=1),
                                        gym("counter"), [{"solution": "5"}])
    assert all(len(c) <= 30 for c in out.completion_ids)
    for c, reason in zip(out.completion_ids, out.finish_reasons):
        assert reason == "length" if len(c) == 30 else reason == "stop"
    assert "length" in out.finish_reasons


def test_max_turn_tokens_cuts_each_turn_and_the_trajectory_goes_on(rollout):
    """Three turns of exactly 5 model tokens each (no eos): a turn cut at max_turn_tokens is
    followed by the environment's turn and the next model turn."""
    sampling = SamplingParams(max_new_tokens=200, temperature=1.0, n=2, seed=3, ignore_eos=True)
    out = rollout.generate_trajectories(PROMPTS[:1], sampling, gym("counter", max_turn_tokens=5),
                                        [{"solution": "5"}])
    for mask in out.completion_mask:
        model = [(a, b) for a, b, v in segments(mask) if v == 1]
        assert [b - a for a, b in model] == [5, 5]  # Counter is done after two replies
    # Without the cap the first turn takes the whole budget.
    whole = rollout.generate_trajectories(PROMPTS[:1], sampling, gym("counter"), [{"solution": "5"}])
    assert all(len(c) == 200 and sum(m) == 200 for c, m in zip(whole.completion_ids, whole.completion_mask))


@pytest.mark.parametrize("env,words", [("raises", "ValueError: broken board"), ("wrong_type", "returned str"),
                                       ("hangs", "took longer than env_timeout_s=0.5")])
def test_an_environment_that_fails_drops_its_row_naming_env_row_and_turn(rollout, env, words):
    out = rollout.generate_trajectories(PROMPTS, SamplingParams(max_new_tokens=20, temperature=0),
                                        gym(env, env_timeout_s=0.5), [{}, {}])
    assert out.finish_reasons == ["error", "error"]
    error = out.rollout_infos[1]["error"]
    assert f"environment '{env}'" in error and "row 1-0" in error and "turn 1" in error and words in error
    assert all(sum(m) == 0 for m in out.completion_mask)
    with pytest.raises(RuntimeError, match="every trajectory of the step failed"):
        failed_rows(out, torch.zeros(2), 2)


def test_a_failed_row_leaves_its_group_statistics():
    from roles.batch import Completions
    comps = Completions([0] * 3, [[1]] * 3, [[2]] * 3, [""] * 3, [[0.0]] * 3, ["stop", "error", "stop"])
    comps.rollout_infos = [{}, {"error": "x"}, {}]
    assert failed_rows(comps, torch.tensor([1.0, 9.0, 0.0]), 3).tolist() == [1.0, 0.5, 0.0]


def test_tools_are_called_from_hermes_json_and_errors_become_turns():
    tools["add"] = lambda a, b: a + b

    def boom(**_):
        raise ZeroDivisionError("no")
    tools["boom"] = boom
    s = ToolScheduler(max_turns=3, tools=["add", "boom"], tool_role="tool")
    req = Request([{"role": "user", "content": "q"}], {}, "0-0", 1)
    text = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>{"name": "boom", "arguments": {}}</tool_call><tool_call>{"name": "nope"}</tool_call>')
    choice = Choice(Message("assistant", text), [1, 2], [0.0, 0.0], "stop")
    assert not s.check_finished(req, choice, 1)
    ret = asyncio.run(s.step(req, choice, 1))
    assert [m["content"] for m in req.messages[1:]][0] == "5"
    assert req.messages[2]["content"] == "error: ZeroDivisionError: no" and req.messages[2]["role"] == "tool"
    assert req.messages[3]["content"].startswith("error: KeyError")
    assert ret["rollout_infos"] == {"tool_calls": 3, "tool_errors": 2}
    assert s.check_finished(req, Choice(Message("assistant", "#### 5"), [1], [0.0], "stop"), 1)


def test_math_tip_trick_continues_the_reply_after_its_tip(rollout):
    tok = rollout.tokenizer
    s = MathTipsScheduler(max_turns=2, tokenizer=tok)
    req = Request([{"role": "user", "content": "2+3"}, {"role": "assistant", "content": "#### 6"}],
                  {"solution": "5"}, "0-0", 1)
    ids = tok("#### 6", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    choice = Choice(Message("assistant", "#### 6"), ids, [-0.5] * len(ids), "stop")
    assert not s.check_finished(req, choice, 1)
    ret = s.step(req, choice, 1)
    tip = tok(s.tips_prompt, add_special_tokens=False)["input_ids"]
    assert ret["response_token_ids"] == ids[:-1] + tip  # the end of turn goes, the reply continues
    assert ret["response_loss_mask"] == [1] * (len(ids) - 1) + [0] * len(tip)
    assert req.messages[-1]["content"] == "#### 6" + s.tips_prompt
    assert s.check_finished(req, choice, 2)  # the tip is given once
    right = Request([{"role": "assistant", "content": "#### 5"}], {"solution": "5"}, "0-1", 1)
    assert s.check_finished(right, choice, 1)


def test_ms_swift_multi_turn_keys_map(tmp_path):
    from algorithms.gkd import GKDConfig
    from algorithms.grpo import GRPOConfig
    from omegaconf import OmegaConf
    file = {"external_plugins": str(PLUGIN), "multi_turn_scheduler": "gym_scheduler", "gym_env": "frozen_lake",
            "use_gym_env": True, "max_turns": 3}
    _, out, _ = translate(file, "grpo", OmegaConf.structured(GRPOConfig))
    assert out["algorithm.multi_turn.scheduler"] == "gym_scheduler" and out["algorithm.multi_turn.max_turns"] == 3
    assert out["algorithm.multi_turn.plugins"] == [str(PLUGIN)] and out["algorithm.multi_turn.env_reward"] == "sum"
    _, out, _ = translate({"multi_turn_scheduler": "math_tip_trick", "max_turns": 2}, "gkd",
                          OmegaConf.structured(GKDConfig))
    assert out == {"algorithm.multi_turn.scheduler": "math_tip_trick", "algorithm.multi_turn.max_turns": 2,
                   "algorithm.multi_turn.plugins": []}


def test_frozen_lake_grpo_config_file_runs_two_steps(tmp_path, monkeypatch):
    """ms-swift's frozen-lake keys with the ported plugin, on the tiny model, in-process."""
    from algorithms import grpo
    from algorithms.config.schema import prepare
    from algorithms.records.trackers import read_metrics
    from roles.models import build_model, load_tokenizer, save_checkpoint
    from tests.driver_helpers import composed

    save_checkpoint(build_model("tiny_qwen2"), load_tokenizer("tiny_qwen2"), tmp_path / "student")
    with open(tmp_path / "frozen_lake.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"messages": [{"role": "user", "content": "<placeholder>"}],
                                "env_config": {"seed": i, "size": 3}}) + "\n")
    file = {"rlhf_type": "grpo", "model": str(tmp_path / "student"), "dataset": str(tmp_path / "frozen_lake.jsonl"),
            "external_plugins": str(PLUGIN), "split_dataset_ratio": 0, "multi_turn_scheduler": "gym_scheduler",
            "gym_env": "frozen_lake", "use_gym_env": True, "max_turns": 3, "num_generations": 4,
            "global_batch_size": 8, "train_iters": 2, "max_completion_length": 160, "temperature": 1.0,
            "beta": 0.0, "lr": 1e-3, "colocate_groups": [["train", "rollout"]], "train": {"gpus": 1},
            "rollout": {"gpus": 1}}
    (tmp_path / "fl.yaml").write_text(yaml.safe_dump(file))
    monkeypatch.chdir(tmp_path)
    overrides = [f"config_file={tmp_path / 'fl.yaml'}", "backend.workers=local", "rollout.max_batch_size=8"]
    typed, plan = prepare(composed(grpo.GRPOConfig, overrides), grpo.GRPOConfig, cli=overrides)
    assert typed.algorithm.multi_turn.gym_env == "frozen_lake" and typed.algorithm.reward_funcs == []
    grpo.validate(typed, plan)
    grpo.run(typed, plan, tmp_path / "run")
    steps = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if m.get("step", 0) > 0]
    assert [m["step"] for m in steps] == [1, 2]
    assert max(m["multi_turn/turns"] for m in steps) > 1  # the environment answered and the model moved again
    assert all(m["multi_turn/env_tokens"] > 0 and m["multi_turn/failed"] == 0 for m in steps)


def test_gkd_on_policy_multi_turn_with_math_tip_trick(tmp_path):
    """ms-swift's multi_turn_colocate.yaml settings (math_tip_trick, max_turns 2) in a local GKD run:
    the student's trajectories train with the teacher's signal on the student's tokens."""
    from algorithms import gkd
    from algorithms.records.trackers import read_metrics
    from tests.driver_helpers import TINY_GKD, prepared

    overrides = ["+experiment=gkd_quickstart", *TINY_GKD, "backend=local", "run.steps=2", "algorithm.lmbda=1.0",
                 "algorithm.multi_turn.scheduler=math_tip_trick", "algorithm.multi_turn.max_turns=2",
                 f"teacher.cache_dir={tmp_path / 'teachers'}"]
    _, typed, plan = prepared(gkd.GKDConfig, overrides)
    gkd.validate(typed, plan)
    gkd.run(typed, plan, tmp_path / "run")
    steps = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if m.get("step", 0) > 0]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["gkd/on_policy"] == 1.0 and 1 <= m["multi_turn/turns"] <= 2 for m in steps)
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in steps)


def test_grpo_multi_turn_on_ray_with_separate_devices_and_trajectories_ahead(ray_cluster, tmp_path):
    """Trainer and rollout as Ray actors on devices of their own: the rollout runs step k+1's
    turn loop (its environments in the rollout's process) while the trainer trains on step k's
    trajectories (max_staleness=1), whose ratios use the trajectories' own logprobs."""
    from algorithms.records.trackers import read_metrics
    from tests.driver_helpers import prepared

    _, typed, plan = prepared(grpo.GRPOConfig, [
        "+experiment=grpo_quickstart", "placement.colocate_groups=[]", "placement.offload_model=false",
        "placement.offload_optimizer=false", "placement.sleep_level=0", "run.steps=3", "run.prompts_per_step=2",
        "data.train_size=8", "data.eval_size=2", "run.eval_max_new_tokens=4", "algorithm.num_generations=2",
        "algorithm.max_new_tokens=24", "algorithm.warmup_sft_steps=0", "trainer.warmup_steps=0",
        "algorithm.max_staleness=1", "algorithm.multi_turn.scheduler=gym_scheduler",
        "algorithm.multi_turn.gym_env=arithmetic_retry", "algorithm.multi_turn.max_turns=2",
        "algorithm.multi_turn.max_turn_tokens=8", "run.save_final=false"])
    grpo.validate(typed, plan)
    assert "rollout" not in plan["train"].colocated_with
    grpo.run(typed, plan, tmp_path)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["multi_turn/env_tokens"] > 0 and math.isfinite(r["train/loss"]) for r in rows)
    assert [r["staleness/max"] for r in rows] == [0.0, 1.0, 1.0]  # later steps train on one-version-old trajectories


def test_a_hook_that_outlives_its_timeout_ends_quietly(monkeypatch):
    """A plain hook still running when its timeout cancels the call finishes later without an
    exception in its thread (its result is dropped)."""
    from roles.schedulers import call_hook

    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))

    def slow(value):
        time.sleep(0.3)
        return value

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(asyncio.TimeoutError):
            loop.run_until_complete(call_hook(slow, 1, timeout=0.05))
    finally:
        loop.close()
    time.sleep(0.6)
    assert raised == []
