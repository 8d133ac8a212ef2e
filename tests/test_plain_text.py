"""data.chat: plain-text prompts for a model whose tokenizer has no chat template (or when
data.chat=false). The prompt is the user text, the training text prompt + reply + eos, and
every role sees those ids: SFT's trainer, GRPO's rollout and trainer, through the real
drivers' loops with real tiny roles in this process."""
import io

import pytest

from algorithms import grpo, sft
from algorithms.sft import SFTConfig
from algorithms.config.schema import as_dict
from algorithms.data.loading import load_task, row_limits
from algorithms.objectives.losses import make_loss
from algorithms.records.runlog import RunLog
from algorithms.records.trackers import read_metrics
from algorithms.data.tasks import Example
from algorithms.data.prompts import chat_prompt, chat_texts, encode_examples
from algorithms.config.schema import rollout_section
from algorithms.config.schema import LoopConfig
from orchestration.config import ConfigError
from orchestration.launch import driver_group
from roles.models import build_model, load_tokenizer
from roles.rollout import Rollout
from roles.tokenizers import save_tokenizer
from roles.trainer import Trainer
from tests.driver_helpers import TINY, prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

# Markers of tiny_qwen2's chat template (roles/tokenizers.py).
TEMPLATE_MARKERS = ("<|user|>", "<|assistant|>")
EX = Example(prompt="2+3", solution="2+3=5\n#### 5", answer="5")


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """tiny_qwen2 saved to a folder with its tokenizer's chat template removed."""
    path = tmp_path_factory.mktemp("plain_model")
    build_model("tiny_qwen2").save_pretrained(path)
    tok = load_tokenizer("tiny_qwen2")
    tok.chat_template = None
    save_tokenizer(tok, path)
    assert not load_tokenizer(str(path)).chat_template
    return str(path)


def plain_ids(tok, ex: Example) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids + eos) of an example as plain text."""
    return tok(ex.prompt)["input_ids"], tok(ex.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_plain_encoding_and_rollout_prompts_agree(plain_model):
    templated = load_tokenizer("tiny_qwen2")
    for tok, chat in ((load_tokenizer(plain_model), None), (load_tokenizer(plain_model), False), (templated, False)):
        prompt, reply = plain_ids(tok, EX)
        enc = encode_examples(tok, [EX], pretrain=False, chat=chat)
        assert (enc.prompt_ids, enc.completion_ids) == ([prompt], [reply])
        assert chat_texts(tok, EX, chat) == (EX.prompt, EX.prompt + EX.solution)
        rollout = Rollout(plain_model if tok is not templated else "tiny_qwen2", config={"chat": chat})
        out = rollout.generate([EX.prompt_messages()], {"temperature": 0.0, "max_new_tokens": 2})
        assert out.prompt_ids == [prompt]
    # A conversation's contents joined by newlines; the template is used when asked and there.
    turns = Example(prompt="and 3+4?", solution="7", answer="7",
                    context=[{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"},
                             {"role": "user", "content": "and 3+4?"}])
    assert chat_prompt(templated, turns, False) == "2+3?\n5\nand 3+4?"
    assert all(m in chat_prompt(templated, turns, None) for m in TEMPLATE_MARKERS)
    with pytest.raises(ConfigError, match=r"config key 'data.chat'=True .*no chat template.*Fix:"):
        encode_examples(load_tokenizer(plain_model), [EX], pretrain=False, chat=True)


class Recorder:
    """A real worker group that keeps what went into and came out of its calls."""

    def __init__(self, group):
        self.group, self.calls = group, []

    def call(self, method, *args, **kwargs):
        out = self.group.call(method, *args, **kwargs)
        self.calls.append((method, args, out))
        return out

    def async_call(self, method, *args, **kwargs):
        future = self.group.async_call(method, *args, **kwargs)
        self.calls.append((method, args, future))
        return future

    def outputs(self, method: str) -> list:
        return [out.result() if hasattr(out, "result") else out for m, _, out in self.calls if m == method]

    def __getattr__(self, name):
        return getattr(self.group, name)


def no_markers(tok, ids: list[int]) -> bool:
    text = tok.decode(ids)
    return not any(m in text for m in TEMPLATE_MARKERS)


@pytest.mark.parametrize("model", ["plain", "tiny_qwen2"])
def test_sft_trains_on_plain_text(tmp_path, plain_model, model):
    """data.chat=false: the SFT trainer's sequences are prompt + reply + eos as plain text (for a
    tokenizer without a template, and for one with a template it must not use)."""
    spec = [f"model.path={plain_model}", "model.tokenizer=null"] if model == "plain" else ["model=tiny_qwen2"]
    _, cfg, plan = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, "backend=local", "run.steps=2",
                                           "data.chat=false", *spec])
    train_set, eval_set, _ = load_task(cfg.data, row_limits(cfg, replies=True))
    loss = make_loss("sft")
    trainer = Recorder(driver_group(Trainer, {"model": as_dict(cfg.model), "config": as_dict(cfg.trainer),
                                              "loss_fn": loss, "loss_inputs": loss.loss_inputs}, "train"))
    evaluator = Recorder(driver_group(Rollout, {"model": as_dict(cfg.model), "config": rollout_section(cfg)},
                                      "evaluator"))
    tok = load_tokenizer(as_dict(cfg.model))
    log = RunLog(tmp_path, cfg.run.steps, LoopConfig(), stream=io.StringIO())
    try:
        sft.train(cfg, plan, trainer, evaluator, train_set, eval_set, tok, log)
    finally:
        log.close()
        trainer.group.shutdown()
        evaluator.group.shutdown()
    want = {tuple(p + r) for p, r in (plain_ids(tok, ex) for ex in train_set)}
    batches = [args[0] for method, args, _ in trainer.calls if method == "train_step"]
    assert len(batches) == 2
    for batch in batches:
        for ids, mask in zip(batch.input_ids.tolist(), batch.attention_mask.tolist()):
            seq = [t for t, m in zip(ids, mask) if m]
            assert tuple(seq) in want and seq[-1] == tok.eos_token_id and no_markers(tok, seq)
    evals = evaluator.outputs("generate")
    assert evals and all(out.prompt_ids == [tok(ex.prompt)["input_ids"] for ex in eval_set] for out in evals)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "eval/accuracy" in r] == [0, 2]


def test_grpo_generates_and_trains_on_plain_text(tmp_path, plain_model):
    _, cfg, plan = prepared(grpo.GRPOConfig, ["+experiment=grpo_quickstart", *TINY, "backend=local", "run.steps=2",
                                            "algorithm.num_generations=2", "algorithm.max_new_tokens=4",
                                            f"model.path={plain_model}", "model.tokenizer=null", "data.chat=null",
                                            "data.check=last_number"])
    grpo.validate(cfg, plan)
    train_set, eval_set, _ = load_task(cfg.data, row_limits(cfg, cfg.algorithm.max_new_tokens))
    a = cfg.algorithm
    loss = make_loss("grpo", epsilon=a.epsilon, epsilon_high=a.epsilon_high, beta=a.beta, loss_type=a.loss_type,
                     max_completion_length=a.max_new_tokens)
    trainer = Recorder(driver_group(Trainer, {"model": as_dict(cfg.model), "config": as_dict(cfg.trainer),
                                              "loss_fn": loss, "loss_inputs": ("entropy",)}, "train"))
    rollout = Recorder(driver_group(Rollout, {"model": as_dict(cfg.model), "config": rollout_section(cfg)},
                                    "rollout"))
    rewards = grpo.Rewards(grpo.reward_specs(a, cfg.data), {})
    tok = load_tokenizer(as_dict(cfg.model))
    log = RunLog(tmp_path, cfg.run.steps, LoopConfig(), stream=io.StringIO())
    try:
        record = grpo.train(cfg, plan, trainer, rollout, None, rewards, train_set, eval_set, tok, log)
    finally:
        log.close()
        rewards.shutdown()
        trainer.group.shutdown()
        rollout.group.shutdown()
    plain_prompts = {tuple(tok(ex.prompt)["input_ids"]) for ex in train_set + eval_set}
    generated = rollout.outputs("generate")
    assert generated and all(tuple(p) in plain_prompts and no_markers(tok, p) for out in generated
                             for p in out.prompt_ids)
    batch = next(args[0] for method, args, _ in trainer.calls if method == "train_step")
    sampled = next(out for out in generated if len(out.prompt_ids) == cfg.run.prompts_per_step * 2)
    rows = [[t for t, m in zip(ids, mask) if m] for ids, mask in
            zip(batch.input_ids.tolist(), batch.attention_mask.tolist())]
    assert rows == [p + c for p, c in zip(sampled.prompt_ids, sampled.completion_ids)]
    assert "eval/accuracy" in record and "rollout/accuracy" in record
