"""On-policy distillation as RL in the GRPO driver (algorithm.teacher_kl_coef): the per-token
advantage by hand, the teacher's logprob of each token against a direct forward, the checks
before start, the ms-swift key, and two-step runs with a teacher role and with the LoRA base as
the teacher."""
import math

import pytest
import torch

from algorithms import grpo
from algorithms.config.schema import LoopConfig
from algorithms.config.swift_keys import translate
from algorithms.objectives.advantages import teacher_token_advantages
from algorithms.records.trackers import read_metrics
from orchestration.config import ConfigError
from orchestration.planner import make_plan
from roles.batch import Batch, pad_sequences
from roles.models import build_model, load_tokenizer
from roles.teacher import Teacher, TeacherConfig
from tests.driver_helpers import prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

# (sequence advantages [B], teacher logprobs [B, T], student logprobs [B, T], mask [B, T], coef,
#  expected [B, T]): A_t = A + coef * (teacher_t - student_t) on the mask, A elsewhere.
CASES = [
    # One row, prompt at position 0, two completion tokens.
    ([0.5], [[0.0, -1.0, -2.0]], [[0.0, -1.5, -1.0]], [[0, 1, 1]], 1.0, [[0.5, 1.0, -0.5]]),
    # The coefficient scales the log-ratio only; the sequence advantage stays as it is.
    ([0.5], [[0.0, -1.0, -2.0]], [[0.0, -1.5, -1.0]], [[0, 1, 1]], 0.5, [[0.5, 0.75, 0.0]]),
    # Padding and prompt positions keep the sequence's advantage whatever they hold there.
    ([-1.0, 2.0], [[-3.0, -0.2, 0.0], [0.0, -0.1, -0.4]], [[-1.0, -0.7, 9.0], [0.0, -0.3, -0.4]],
     [[0, 1, 0], [0, 1, 1]], 2.0, [[-1.0, 0.0, -1.0], [2.0, 2.4, 2.0]]),
    # Pure distillation: no reward signal (advantage 0), the teacher's signal alone.
    ([0.0], [[0.0, -0.25]], [[0.0, -1.25]], [[0, 1]], 1.0, [[0.0, 1.0]]),
]


@pytest.mark.parametrize("adv,teacher,student,mask,coef,expected", CASES)
def test_per_token_advantages_by_hand(adv, teacher, student, mask, coef, expected):
    got = teacher_token_advantages(torch.tensor(adv), torch.tensor(teacher), torch.tensor(student),
                                   torch.tensor(mask, dtype=torch.float32), coef)
    assert torch.allclose(got, torch.tensor(expected), atol=1e-6), got


def test_per_token_advantages_take_per_token_ones_and_refuse_mismatched_shapes():
    base = torch.tensor([[1.0, 2.0]])
    got = teacher_token_advantages(base, torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, -2.0]]),
                                   torch.tensor([[0.0, 1.0]]), 1.0)
    assert got.tolist() == [[1.0, 3.0]]
    with pytest.raises(ValueError, match="must all be"):
        teacher_token_advantages(torch.zeros(1), torch.zeros(1, 3), torch.zeros(1, 2), torch.zeros(1, 2), 1.0)


@pytest.mark.parametrize("options", [{}, {"chunked_logprobs": True}, {"packing": True}])
def test_teacher_token_logprobs_equal_a_direct_forward(options):
    tok = load_tokenizer("small_qwen2")
    seqs = [tok("1+2=3", add_special_tokens=False)["input_ids"], tok("45+6", add_special_tokens=False)["input_ids"]]
    ids, mask = pad_sequences(seqs, tok.pad_token_id)
    batch = Batch(input_ids=ids, attention_mask=mask, loss_mask=mask.float())
    teacher = Teacher("small_qwen2", TeacherConfig(device="cpu", micro_batch_per_device=1, **options))
    got = teacher.token_logprobs(batch, temperature=0.7)
    with torch.no_grad():
        logits = build_model("small_qwen2")(input_ids=ids, attention_mask=mask).logits
    want = torch.log_softmax(logits[:, :-1].float() / 0.7, -1).gather(-1, ids[:, 1:, None])[..., 0]
    real = mask[:, 1:].bool()
    assert torch.allclose(got[:, 1:][real], want[real], atol=1e-5)
    assert (got[:, 0] == 0).all() and (got[:, 1:][~real] == 0).all()
    # The same values as the full-vocabulary logits at each token.
    full = teacher.logits(batch, topk=None, temperature=0.7)
    assert torch.allclose(got[:, 1:][real], full[:, 1:].gather(-1, ids[:, 1:, None])[..., 0][real], atol=1e-5)


COLOCATED = {"train": {"gpus": 1}, "rollout": {"gpus": 1}, "colocate_groups": [["train", "rollout"]]}


def config(**algo):
    return grpo.GRPOConfig(run=LoopConfig(prompts_per_step=4), algorithm=grpo.GRPOAlgorithm(**algo))


def test_checks_before_start():
    plain, with_teacher = make_plan(COLOCATED), make_plan({**COLOCATED, "teacher_model": "small_qwen2"})
    with pytest.raises(ConfigError, match="'algorithm.teacher_kl_coef'=1.0 needs a teacher model"):
        grpo.validate(config(teacher_kl_coef=1.0), plain)
    with pytest.raises(ConfigError, match="'placement.teacher_model'='small_qwen2' plans a teacher that GRPO does "
                                          "not use"):
        grpo.validate(config(), with_teacher)
    with pytest.raises(ConfigError, match="'algorithm.teacher_kl_coef'=-1.0 must be a finite number >= 0"):
        grpo.validate(config(teacher_kl_coef=-1.0), with_teacher)
    bad_engine = config(teacher_kl_coef=1.0)
    bad_engine.backend.teacher = "vllm"
    with pytest.raises(ConfigError, match="'backend.teacher'='vllm' cannot give the teacher's logprob"):
        grpo.validate(bad_engine, with_teacher)
    # Pure distillation (ms-swift's OPD-RL example): one completion per prompt, no reward function.
    grpo.validate(config(teacher_kl_coef=1.0, num_generations=1, reward_funcs=[]), with_teacher)
    with pytest.raises(ConfigError, match="'algorithm.num_generations'=1"):
        grpo.validate(config(num_generations=1), plain)
    with pytest.raises(ConfigError, match="'algorithm.leave_one_out'=True needs num_generations >= 2"):
        grpo.validate(config(teacher_kl_coef=1.0, num_generations=1, leave_one_out=True), with_teacher)


def test_the_swift_key_maps_and_a_file_without_rewards_distills_alone():
    cfg = grpo.GRPOConfig()
    _, out, _ = translate({"rlhf_type": "grpo", "teacher_kl_coef": 1.0, "num_generations": 1}, "grpo", cfg)
    assert out["algorithm.teacher_kl_coef"] == 1.0 and out["algorithm.reward_funcs"] == []
    _, out, _ = translate({"rlhf_type": "grpo", "teacher_kl_coef": 0.5, "reward_funcs": ["accuracy"]}, "grpo", cfg)
    assert out["algorithm.teacher_kl_coef"] == 0.5 and out["algorithm.reward_funcs"] == ["accuracy"]


def run_two_steps(tmp_path, *overrides):
    _, typed, plan = prepared(grpo.GRPOConfig, [
        "+experiment=grpo_quickstart", "backend=local", "algorithm.warmup_sft_steps=0", "run.steps=2",
        "run.prompts_per_step=2", "data.eval_size=2", "run.eval_max_new_tokens=8", "algorithm.max_new_tokens=8",
        "trainer.warmup_steps=0", "algorithm.teacher_kl_coef=1.0", "algorithm.num_generations=2", *overrides])
    grpo.validate(typed, plan)
    record = grpo.run(typed, plan, tmp_path)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2]
    return record, rows


def test_a_teacher_role_scores_and_the_policy_moves(tmp_path):
    record, rows = run_two_steps(tmp_path, "placement.teacher_model=small_qwen2")
    for r in rows:
        assert math.isfinite(r["grpo/teacher_log_ratio"]) and r["grpo/teacher_log_ratio"] != 0
        assert math.isfinite(r["grpo/teacher_kl"]) and r["grpo/teacher_kl"] > 0
        assert "time/teacher" in r and math.isfinite(r["train/loss"])
    start = build_model("tiny_qwen2").state_dict()
    trained = build_model(str(record["checkpoint"])).state_dict()
    assert any(not torch.equal(start[k], trained[k]) for k in start)


def test_the_lora_base_as_teacher_starts_no_teacher_role(tmp_path):
    # The policy's own model as the teacher under LoRA: the adapter off is the teacher; the
    # adapter starts at zero, so the first step's log-ratio is 0, the next one's is not.
    _, rows = run_two_steps(tmp_path, "trainer.lora.rank=4", "placement.teacher_model=tiny_qwen2")
    assert rows[0]["grpo/teacher_log_ratio"] == 0 and rows[0]["grpo/teacher_kl"] == 0
    assert rows[1]["grpo/teacher_log_ratio"] != 0 and math.isfinite(rows[1]["grpo/teacher_kl"])
    assert not any(k.startswith("mem/teacher") for r in rows for k in r)
