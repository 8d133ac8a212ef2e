"""OPSD in the GKD driver: rows with a `teacher_prompt` show the teacher that prompt followed by
the student's own response ids; its distributions over the response land on the student's
positions. Checked against the teacher run by hand on that prompt + response, and end to end
(the teacher_prompt column read from a user's file changes what the student is trained on)."""
import json
import math

import pytest
import torch

from algorithms import gkd
from algorithms.data.tasks import Example
from algorithms.data.user_data import load_user_data
from algorithms.records.runlog import RunLog
from roles.batch import Batch, Completions, batch_from_completions, pad_sequences
from roles.models import load_tokenizer
from roles.teacher import Teacher, TeacherConfig
from tests.driver_helpers import TINY_GKD, prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

STUDENT = "tiny_qwen2"
TEACHER = "small_qwen2"  # the same character tokenizer


class Data:
    chat, enable_thinking = None, None


def render(tok, messages):
    """A prompt by hand: the chat template with the generation prompt, as token ids."""
    return tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"]


def test_the_teacher_sees_its_prompt_and_the_same_response():
    tok = load_tokenizer(STUDENT)
    examples = [Example(prompt="12+5", solution="", answer="17",
                        context=[{"role": "system", "content": "add"}, {"role": "user", "content": "12+5"}],
                        columns={"teacher_prompt": "12+5 (the sum is 17)"}),
                Example(prompt="3+4", solution="", answer="7"),
                Example(prompt="9+9", solution="", answer="18", columns={"teacher_prompt": "  "})]
    responses = [tok("17#", add_special_tokens=False)["input_ids"], tok("7", add_special_tokens=False)["input_ids"],
                 tok("18", add_special_tokens=False)["input_ids"]]
    prompts = [render(tok, ex.prompt_messages()) for ex in examples]
    comps = Completions([0, 1, 2], prompts, responses, ["17#", "7", "18"], [], ["stop"] * 3)
    batch = batch_from_completions(comps, tok.pad_token_id)
    view = gkd.teacher_view(tok, examples, comps, Data())
    assert view.rows == 1  # a blank teacher_prompt is none
    teacher = Teacher(TEACHER, TeacherConfig(device="cpu"))
    moved = gkd.to_student_frame(teacher.logits(view.batch, topk=5, temperature=0.9), view, batch)

    # By hand: each row's teacher sequence scored alone (the system turn stays, the last user
    # turn becomes the teacher_prompt; the response ids are the student's own).
    privileged = render(tok, [{"role": "system", "content": "add"}, {"role": "user", "content": "12+5 (the sum is 17)"}])
    assert privileged != prompts[0]
    for i, own in enumerate([privileged, prompts[1], prompts[2]]):
        ids, mask = pad_sequences([own + responses[i]], tok.pad_token_id)
        values, indices = teacher.logits(Batch(input_ids=ids, attention_mask=mask, loss_mask=mask.float()), topk=5,
                                         temperature=0.9)
        n, s, t = len(responses[i]), len(prompts[i]), len(own)
        assert torch.allclose(moved[0][i, s:s + n], values[0, t:t + n], atol=1e-5)
        assert torch.equal(moved[1][i, s:s + n], indices[0, t:t + n])
        # Everything off the response is 0.
        assert (moved[0][i, :s] == 0).all() and (moved[0][i, s + n:] == 0).all()
    # Without any teacher_prompt there is no view: plain GKD.
    assert gkd.teacher_view(tok, examples[1:2], Completions([0], prompts[1:2], responses[1:2], ["7"], [], ["stop"]),
                            Data()) is None


def test_full_vocabulary_answers_move_too():
    answer = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    batch = Batch(input_ids=torch.zeros(2, 4, dtype=torch.long),
                  attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), loss_mask=torch.zeros(2, 4))
    view = gkd.TeacherView(batch, student_starts=[2, 1], teacher_starts=[3, 1], rows=1)
    moved = gkd.to_student_frame(answer, view, batch)
    assert torch.equal(moved[0, 2:4], answer[0, 3:5]) and torch.equal(moved[1, 1:3], answer[1, 1:3])
    assert (moved[0, :2] == 0).all() and (moved[1, 3] == 0).all()


ROWS = [(f"{a}+{b}", a + b) for a in range(1, 6) for b in range(1, 5)]


def write_rows(path, privileged: bool):
    with open(path, "w") as f:
        for question, total in ROWS:
            row = {"prompt": question, "solution": f"{question}={total}\n#### {total}"}
            if privileged:
                row["teacher_prompt"] = f"{question} (reference: {question}={total}, #### {total})"
            f.write(json.dumps(row) + "\n")
    return path


def test_teacher_prompt_column_is_kept_from_a_users_file(tmp_path):
    data = load_user_data(write_rows(tmp_path / "rows.jsonl", privileged=True))
    assert gkd.privileged_prompt(data.examples[0]) == "1+1 (reference: 1+1=2, #### 2)"


def run_two_steps(tmp_path, data_file, monkeypatch, *overrides):
    records: list = []
    step = RunLog.step
    monkeypatch.setattr(RunLog, "step", lambda self, *a, **k: records.append(step(self, *a, **k)) or records[-1])
    _, typed, plan = prepared(gkd.GKDConfig, [
        "+experiment=gkd_quickstart", *TINY_GKD, "backend=local", "teacher.warmup_steps=0", "run.steps=2",
        f"placement.teacher_model={TEACHER}", "trainer.warmup_steps=0", "run.save_final=false", "data.task=files",
        f"data.paths=[{data_file}]", "algorithm.logits_topk=8", *overrides])
    gkd.validate(typed, plan)
    gkd.run(typed, plan, tmp_path)
    return [r for r in records if r["step"] > 0]


@pytest.mark.parametrize("lmbda", [0, 1])
def test_gkd_steps_with_teacher_prompt_rows(tmp_path, monkeypatch, lmbda):
    """Off-policy (dataset replies) and on-policy (the student's samples): the same first step
    with and without the teacher_prompt column differs only in what the teacher saw."""
    losses = {}
    for privileged in (True, False):
        rows = run_two_steps(tmp_path / str(privileged), write_rows(tmp_path / f"{privileged}.jsonl", privileged),
                             monkeypatch, f"algorithm.lmbda={lmbda}")
        assert len(rows) == 2 and all(math.isfinite(r["train/loss"]) for r in rows)
        assert all(r["gkd/opsd_rows"] == (1.0 if privileged else 0.0) for r in rows)
        losses[privileged] = rows[0]["train/loss"]
    assert losses[True] != losses[False]


def test_gkd_opsd_with_the_lora_base_as_teacher(tmp_path, monkeypatch):
    """The student's own model under LoRA: the trainer scores the teacher's sequences with its
    adapter off, in the train turn."""
    rows = run_two_steps(tmp_path, write_rows(tmp_path / "rows.jsonl", True), monkeypatch, "algorithm.lmbda=0",
                         "trainer.lora.rank=4", f"placement.teacher_model={STUDENT}")
    assert all(r["gkd/opsd_rows"] == 1.0 and math.isfinite(r["train/loss"]) for r in rows)
    # The adapter starts at zero: the student matches the base on its own prompt, not on the
    # teacher's, so the divergence is above 0 from the first step.
    assert rows[0]["train/loss"] > 0
