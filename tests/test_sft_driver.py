"""SFT driver: the call order with fake roles (train steps, evaluator weight sync before every
eval, checkpoint cadence). Its real run on Ray is in tests/test_deepspeed_engine.py."""
import pytest

from algorithms import sft
from algorithms.sft import SFTConfig
from algorithms.config.schema import as_dict
from algorithms.data.loading import load_task
from algorithms.records.trackers import read_metrics
from roles.models import load_tokenizer
from tests.driver_helpers import TINY, FakeGroup, FakeRollout, FakeTrainer, MarkedLog, by_step, prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread


def test_sft_call_order(tmp_path):
    """A train_step per step; the evaluator gets the trainer's weights (version == step) before
    every eval; checkpoints every save_every steps and at the end."""
    _, typed, plan = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, "placement.train.gpus=2",
                                             "run.steps=4", "run.eval_every=2", "run.save_every=3"])
    calls = []
    trainer = FakeGroup("train", [FakeTrainer() for _ in range(2)], calls)
    evaluator = FakeGroup("evaluator", [FakeRollout()], calls)
    train_set, eval_set, _ = load_task(typed.data)
    log = MarkedLog(tmp_path, typed.run.steps, calls)
    record = sft.train(typed, plan, trainer, evaluator, train_set, eval_set, load_tokenizer(as_dict(typed.model)), log)
    log.close()
    n, n_eval = typed.run.prompts_per_step, typed.data.eval_size
    segments = by_step(calls)
    for step, got in enumerate(segments[:-1]):
        want = [("train", "train_step", n)] if step > 0 else []
        if step in (0, 2, 4):
            want += [("train", "state_dict_buckets", None), ("evaluator", "update_weights", step),
                     ("evaluator", "generate", n_eval)]
        if step == 3:
            want += [("train", "save", "step_3")]
        assert got == want, f"step {step}"
    assert segments[-1] == [("train", "save", "step_4")]
    assert record["checkpoint"].endswith("step_4") and 0.0 <= record["eval/accuracy"] <= 1.0
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["train/loss"] for r in records[1:]] == [1.0, 0.5, round(1 / 3, 6), 0.25]


def test_sft_last_checkpoint_is_written_once(tmp_path):
    """save_every dividing run.steps with save_final: the last step is saved once, not twice."""
    _, typed, plan = prepared(SFTConfig, ["+experiment=sft_quickstart", *TINY, "run.steps=4",
                                             "run.eval_every=0", "run.save_every=2"])
    calls = []
    trainer = FakeGroup("train", [FakeTrainer()], calls)
    evaluator = FakeGroup("evaluator", [FakeRollout()], calls)
    train_set, eval_set, _ = load_task(typed.data)
    log = MarkedLog(tmp_path, typed.run.steps, calls)
    sft.train(typed, plan, trainer, evaluator, train_set, eval_set, load_tokenizer(as_dict(typed.model)), log)
    log.close()
    assert [c[2] for c in calls if c[1] == "save"] == ["step_2", "step_4"]


# The SFT driver on Ray (the Llama preset, eval_every=2, checkpoint):
# tests/test_deepspeed_engine.py::test_sft_driver_end_to_end_with_zero3_on_two_ranks.
