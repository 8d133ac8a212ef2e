"""ms-swift YAML files as their users write them: every key translated, without effect, or
refused in one error before anything starts; the shipped example files run unchanged."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from algorithms.config import swift_keys as swift_args, swift_values
from algorithms.gkd import GKDConfig
from algorithms.config.schema import DriverConfig, fit_epochs, prepare
from algorithms.grpo import GRPOConfig
from algorithms.cli import config_of, driver_of, write_example
from algorithms.records.trackers import read_metrics
from algorithms.config.swift_keys import NO_EFFECT, REFUSED, known_keys, output_run_dir, translate
from orchestration.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "algorithms" / "ms_swift_examples"
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "HYDRA_FULL_ERROR": "0"}


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """`rayroles example`: a student and a teacher folder, a dataset and the example YAMLs."""
    return write_example(str(tmp_path_factory.mktemp("example")))


def defaults(schema=GRPOConfig):
    return OmegaConf.structured(schema)


def test_the_gkd_example_maps_every_key(example, monkeypatch):
    monkeypatch.chdir(example)
    file = yaml.safe_load((example / "gkd_colocated_teacher.yaml").read_text())
    placement, out, no_effect = translate(file, "gkd", defaults(GKDConfig))
    assert placement["colocate_groups"] == [["train", "rollout"]] and placement["teacher_model"] == "./teacher"
    assert placement["train"] == {"gpus": 1} and placement["rollout"] == {"gpus": 1, "vllm_tensor_parallel_size": 1}
    assert out["trainer.lr"] == 1e-4 and out["trainer.min_lr"] == 1e-5 and out["trainer.warmup_ratio"] == 0.0
    assert out["run.prompts_per_step"] == 16 and out["trainer.micro_batch_per_device"] == 8
    assert out["run.steps"] == 4 and out["run.log_every"] == 1 and out["run.seed"] == 42
    assert out["algorithm.lmbda"] == 1 and out["algorithm.beta"] == 0.5 and out["algorithm.max_new_tokens"] == 24
    assert out["data.task"] == "files" and out["data.paths"] == [str(example / "data" / "train.jsonl")]
    assert out["data.val_split"] == 0.05 and out["data.max_length"] == 256 and out["backend.rollout"] == "torch"
    # A role section's own keys: the rollout's vLLM settings.
    assert out["vllm.roles.rollout.gpu_memory_utilization"] == 0.4 and out["vllm.roles.rollout.max_model_len"] == 512
    assert {"padding_free", "attention_backend", "finetune", "recompute_granularity"} <= set(no_effect)
    assert "train.output_dir" not in no_effect  # it is the run directory (output_run_dir)


@pytest.mark.parametrize("yaml_file,driver", [("gkd_colocated_teacher", "gkd"), ("gkd_teacher_group", "gkd"),
                                              ("grpo_colocate", "grpo"), ("grpo_separate", "grpo")])
def test_each_example_prepares_and_validates_before_anything_starts(example, monkeypatch, yaml_file, driver):
    import importlib

    monkeypatch.chdir(example)
    module = importlib.import_module(f"algorithms.{driver}")
    schema = GKDConfig if driver == "gkd" else GRPOConfig
    assert driver_of(f"{yaml_file}.yaml") == driver
    typed, plan = prepare({"config_file": f"{yaml_file}.yaml"}, schema, cli=[])
    module.validate(typed, plan)
    assert typed.model.path == str(example / "student") and typed.run.steps == 4
    assert typed.trainer.total_steps == 4 and typed.trainer.min_lr > 0


@pytest.mark.parametrize("key,value,driver,want", [
    ("learning_rate", 3e-4, "sft", {"trainer.lr": 3e-4}),
    ("lr_decay_style", "linear", "sft", {"trainer.schedule": "linear"}),
    ("lr_warmup_iters", 5, "sft", {"trainer.warmup_steps": 5}),
    ("max_steps", 9, "sft", {"run.steps": 9}),
    ("num_train_epochs", 2, "sft", {"run.epochs": 2.0}),
    ("save_steps", 50, "gkd", {"run.save_every": 50}),
    ("save_interval", 50, "gkd", {"run.save_every": 50}),
    ("save_total_limit", 2, "gkd", {"run.keep_last": 2}),
    ("eval_steps", 7, "grpo", {"run.eval_every": 7}),
    ("eval_interval", 7, "grpo", {"run.eval_every": 7}),
    ("clip_grad", 0.5, "grpo", {"trainer.grad_clip": 0.5}),
    ("adam_beta2", 0.95, "sft", {"trainer.betas": [0.9, 0.95]}),
    ("adam_epsilon", 1e-6, "sft", {"trainer.adam_eps": 1e-6}),
    ("optim", "adamw_torch_fused", "sft", {"trainer.optimizer": "adamw_fused"}),
    ("report_to", ["tensorboard", "wandb"], "sft", {"run.loggers": ["jsonl", "tensorboard", "wandb"]}),
    ("report_to", "none", "sft", {"run.loggers": ["jsonl"]}),
    ("torch_dtype", "bfloat16", "sft", {"model.dtype": "bfloat16"}),
    ("bf16", True, "sft", {"trainer.dtype": "bfloat16"}),
    ("attn_impl", "sdpa", "sft", {"model.attn_implementation": "sdpa"}),
    ("deepspeed", "zero3_offload", "sft", {"backend.train": "deepspeed", "deepspeed.zero_stage": 3,
                                           "deepspeed.offload_optimizer": True, "deepspeed.offload_param": True}),
    ("tensor_model_parallel_size", 2, "gkd", {"backend.train": "megatron", "megatron.tensor_parallel_size": 2}),
    ("tensor_model_parallel_size", 1, "gkd", {}),
    ("use_vllm", True, "grpo", {"backend.rollout": "vllm"}),
    ("use_ray", False, "distill", {"backend.workers": "local"}),
    ("vllm_tensor_parallel_size", 2, "grpo", {"placement.rollout.vllm_tensor_parallel_size": 2}),
    ("vllm_engine_kwargs", '{"max_logprobs": 32}', "gkd", {"vllm.max_logprobs": 32}),
    ("columns", '{"question": "query"}', "sft", {"data.columns": {"question": "query"}}),
    ("val_dataset", "/no/such/val.jsonl", "sft", {"data.val_paths": ["/no/such/val.jsonl"]}),
    ("split_dataset_ratio", 0, "sft", {"data.val_split": 0.0}),
    # '#N': N rows drawn from each dataset (kept on its entry); no ratio in the file: ms-swift's 0.
    ("dataset", ["/d/a.jsonl#100", "/d/b.jsonl#100"], "sft", {"data.task": "files", "data.val_split": 0.0,
                                                             "data.paths": ["/d/a.jsonl#100", "/d/b.jsonl#100"],
                                                             "data.truncation_strategy": "delete"}),
    ("num_generations", 4, "grpo", {"algorithm.num_generations": 4}),
    ("async_generate", True, "grpo", {"algorithm.max_staleness": 1, "placement.sleep_level": 0}),
    ("async_generate", False, "grpo", {"algorithm.max_staleness": 0}),
    ("generation_batch_size", 32, "grpo", {"run.prompts_per_step": 4}),  # 32 completions / 8 per prompt
    ("scale_rewards", False, "grpo", {"algorithm.scale_rewards": "none"}),
    ("advantage_estimator", "rloo", "grpo", {"algorithm.leave_one_out": True}),
    ("reward_funcs", "accuracy", "grpo", {"algorithm.reward_funcs": ["accuracy"]}),
    ("seq_kd", False, "gkd", {"algorithm.seq_kd": False}),
    ("num_sampling_batch_size", 4, "distill", {"run.prompts_per_step": 4}),
    ("sampler_engine", "vllm", "distill", {"backend.rollout": "vllm"}),
])
def test_each_key_lands_on_its_counterpart(key, value, driver, want):
    _, out, _ = translate({key: value}, driver, defaults())
    assert out == want


def test_grpo_global_batch_counts_completions():
    """ms-swift's global_batch_size is completions per update: prompts = gbs * spg / G."""
    _, out, _ = translate({"global_batch_size": 16, "num_generations": 4, "steps_per_generation": 2}, "grpo",
                          defaults())
    assert out["run.prompts_per_step"] == 8
    with pytest.raises(ConfigError, match="global_batch_size=10.*not a whole number of prompts"):
        translate({"global_batch_size": 10, "num_generations": 4}, "grpo", defaults())


def test_every_key_that_cannot_be_honoured_is_in_one_error_with_its_fix():
    file = {"rlhf_type": "gkd", "learning_rat": 1e-5, "tuner_type": "longlora", "lora_rank": 8, "lmbda": 0.5,
            "vllm_mode": "server", "global_batch_size": 16, "train": {"gpus": 1, "pipeline_model_parallel_size": 2}}
    with pytest.raises(ConfigError) as info:
        translate(file, "grpo", defaults())
    message = str(info.value)
    assert "\n" not in message and "has 6 key(s)" in message and "nothing has started" in message
    assert message.count("; ") == 5  # one part per key
    assert "rlhf_type='gkd': is 'gkd' but this is the grpo driver (python -m algorithms.gkd runs it)" in message
    assert "learning_rat: unknown to the grpo driver, did you mean 'learning_rate'?" in message
    assert "tuner_type='longlora': 'longlora': the tuners here are ['lora', 'full']" in message
    assert "lmbda: unknown to the grpo driver (it is a key of the gkd driver)" in message
    assert "vllm_mode='server'" in message and "train.pipeline_model_parallel_size=2" in message


def test_train_iters_wins_over_epochs_and_epochs_set_steps_from_the_rows():
    _, out, _ = translate({"num_train_epochs": 1, "train_iters": 5}, "sft", defaults())
    assert out == {"run.steps": 5}
    run = OmegaConf.to_object(OmegaConf.merge(defaults(DriverConfig), {"run": {"epochs": 2.0, "prompts_per_step": 16},
                                                                      "trainer": {"warmup_ratio": 0.1}}))
    run = fit_epochs(run, 100)
    assert run.run.steps == 13 and run.trainer.total_steps == 13 and run.trainer.warmup_steps == 1  # ceil(200/16)


def test_documented_keys_are_the_keys_read():
    """docs/ms_swift.md lists every key the translation knows, and no other."""
    doc = (ROOT / "docs" / "ms_swift.md").read_text()
    listed = {line.split("`")[1] for line in doc.splitlines() if line.startswith("| `")}
    read = set(NO_EFFECT) | set(REFUSED)
    for driver in swift_values.DRIVERS:
        read |= set(known_keys(driver))
    assert listed == read, (sorted(read - listed), sorted(listed - read))


def test_output_dir_becomes_the_run_directory(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("train: {gpus: 1, output_dir: out/run}\n")
    argv = output_run_dir(["m", f"config_file={path}", "run.steps=2"])
    assert argv[-1].startswith(f"hydra.run.dir={os.path.abspath('out/run')}/${{now:")
    assert output_run_dir(["m", f"config_file={path}", "hydra.run.dir=/x"])[-1] == "hydra.run.dir=/x"
    assert config_of(["--config", "a.yaml", "run.steps=2"]) == ("a.yaml", ["run.steps=2"])


# ----------------------------------------------------------------------------- before anything starts

def rayroles(*args, cwd, timeout=600):
    return subprocess.run([sys.executable, "-m", "algorithms.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env={**ENV, "PYTHONPATH": str(ROOT)}, timeout=timeout)


BAD_FILES = [
    ({"model": "./no_student"}, "config key 'model.path'='./no_student' is neither a local directory nor a model in "
                                "the local Hugging Face cache"),
    ({"teacher_model": "./no_teacher"}, "config key 'placement.teacher_model'"),
    ({"dataset": "./data/missing.jsonl"}, "data.paths"),
    ({"dataset": "AI-ModelScope/alpaca-gpt4-data-en#2000"},
     "is no local path, and the dataset AI-ModelScope/alpaca-gpt4-data-en is in no local cache"),
    ({"rollout": {"gpus": 1, "vllm_gpu_memory_utilisation": 0.4}}, "rollout.vllm_gpu_memory_utilisation: unknown"),
    # tensor_model_parallel_size: 2 picks Megatron, whose LoRA adapts the attention and MLP projections.
    ({"train": {"gpus": 2, "tuner_type": "lora", "tensor_model_parallel_size": 2, "modules_to_save": ["lm_head"]},
      "rollout": {"gpus": 2}}, "asks the megatron engine for adapters it does not map (['lm_head']"),
    ({"train": {"gpus": 1, "tuner_type": "lora", "target_modules": ["c_attn"]}}, "names modules ['c_attn']"),
    ({"vllm_enable_lora": True, "train": {"gpus": 1, "tuner_type": "full"}}, "config key 'weight_sync.lora'"),
]


def bad_file(example, change):
    file = {**yaml.safe_load((example / "gkd_colocated_teacher.yaml").read_text()), **change}
    path = example / f"bad_{abs(hash(json.dumps(change, sort_keys=True)))}.yaml"
    path.write_text(yaml.safe_dump(file))
    return path


@pytest.mark.parametrize("change,message", BAD_FILES)
def test_a_bad_file_is_refused_by_the_checks_before_start(example, monkeypatch, change, message):
    """prepare + validate: what the driver runs before any actor, file or cluster exists."""
    from algorithms import gkd

    monkeypatch.chdir(example)
    with pytest.raises(ConfigError) as info:
        gkd.validate(*prepare({"config_file": bad_file(example, change).name}, GKDConfig, cli=[]))
    assert message in str(info.value) and "Fix:" in str(info.value)


def test_the_command_line_stops_a_bad_file_in_one_line(example):
    path = bad_file(example, {"learning_rat": 1e-4})
    out = rayroles("run", "--config", path.name, cwd=example, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "did you mean 'learning_rate'" in lines[0] and "Fix:" in lines[0], out.stderr[-2000:]
    assert not list((example / "output").glob("gkd_colocated_teacher/*/metrics.jsonl"))


def test_a_missing_tokenizer_is_named_before_start(example, tmp_path):
    import shutil

    bare = tmp_path / "no_tokenizer"
    shutil.copytree(example / "student", bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    with pytest.raises(ConfigError, match="holds no tokenizer files"):
        from algorithms.config.checks import check_model

        check_model("model.path", str(bare))


# ----------------------------------------------------------------------------- the examples run

def test_the_teacher_group_example_runs_unchanged_from_the_command_line(example):
    """The shipped file, verbatim, run by `rayroles run` on Ray with its local folders; the run
    lands in the file's output_dir; the recorded config holds the file's values."""
    yaml_file = "gkd_teacher_group"
    out = rayroles("run", "--config", f"{yaml_file}.yaml", "run.steps=2", cwd=example)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["eval/accuracy"] >= 0.0
    runs = sorted((example / "output" / yaml_file).iterdir())
    resolved = yaml.safe_load((runs[-1] / "resolved_config.yaml").read_text())
    assert resolved["run"]["steps"] == 2 and resolved["trainer"]["min_lr"] > 0  # the command line's, the file's
    assert resolved["model"]["path"] == str(example / "student")
    assert (runs[-1] / "metrics.jsonl").is_file() and (runs[-1] / "curves.png").is_file()


@pytest.mark.parametrize("yaml_file", ["grpo_colocate", "gkd_colocated_teacher", "grpo_separate"])
def test_the_other_example_yamls_run_unchanged_in_process(example, monkeypatch, tmp_path, yaml_file):
    """The other shipped files, verbatim, with their local folders: prepared as the driver's main
    does (backend.workers=local), validated and run in-process; the recorded config holds the
    command line's and the file's values, and the run writes its metrics and curves."""
    import importlib

    from tests.driver_helpers import composed

    monkeypatch.chdir(example)
    driver = driver_of(f"{yaml_file}.yaml")
    module = importlib.import_module(f"algorithms.{driver}")
    schema = GKDConfig if driver == "gkd" else GRPOConfig
    overrides = [f"config_file={yaml_file}.yaml", "run.steps=2", "backend.workers=local"]
    typed, plan = prepare(composed(schema, overrides), schema, cli=overrides)
    module.validate(typed, plan)
    run = tmp_path / "run"
    assert module.run(typed, plan, run)["eval/accuracy"] >= 0.0
    resolved = yaml.safe_load((run / "resolved_config.yaml").read_text())
    assert resolved["run"]["steps"] == 2 and resolved["trainer"]["min_lr"] > 0  # the command line's, the file's
    assert resolved["model"]["path"] == str(example / "student")
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")][-1] == 2 and (run / "curves.png").is_file()


def test_a_system_prompt_goes_before_rows_without_one(tmp_path):
    from algorithms.data.loading import DataConfig, load_task

    rows = [{"messages": [{"role": "user", "content": f"{i}+1?"}, {"role": "assistant", "content": f"{i + 1}"}]}
            for i in range(6)] + [{"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "a"}]}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "system.txt").write_text("Answer with a number.\n")
    _, out, _ = translate({"system": str(tmp_path / "system.txt")}, "sft", defaults())
    train, held, _ = load_task(DataConfig(task="files", paths=[str(data)], eval_size=2, system=out["data.system"]))
    assert train[0].prompt_messages() == [{"role": "system", "content": "Answer with a number."},
                                          {"role": "user", "content": "0+1?"}]
    assert held[-1].prompt_messages()[0] == {"role": "system", "content": "own"}  # a row's own system turn wins
    with pytest.raises(ConfigError, match="data.system"):
        load_task(DataConfig(task="files", paths=[str(data)], eval_size=2, system=str(tmp_path / "none.txt")))


def test_the_planner_reads_an_example_with_role_section_keys(example):
    """`rayroles plan config_file=X` takes the placement and names the keys it does not read."""
    out = rayroles("plan", f"config_file={example / 'gkd_teacher_group.yaml'}", "hydra.run.dir=.",
                   "hydra.output_subdir=null", cwd=example, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "teacher  GPU     1" in out.stdout and "'train.tuner_type'" in out.stderr


def test_lora_keys_mean_what_they_mean_in_ms_swift():
    """tuner_type: lora takes ms-swift's LoRA defaults unless the file sets them; under full the
    LoRA keys have no effect (as there); vllm_enable_lora picks the adapter-only sync."""
    _, out, _ = translate({"train": {"gpus": 1, "tuner_type": "lora", "lora_rank": 16}}, "grpo", defaults())
    assert (out["trainer.lora.rank"], out["trainer.lora.alpha"], out["trainer.lora.dropout"]) == (16, 32.0, 0.05)
    _, out, _ = translate({"tuner_type": "lora", "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0,
                           "vllm_enable_lora": True, "modules_to_save": "lm_head"}, "sft", defaults())
    assert out["trainer.lora.target_modules"] == ["q_proj", "v_proj"] and out["trainer.lora.dropout"] == 0.0
    assert out["trainer.lora.modules_to_save"] == ["lm_head"] and out["weight_sync.lora"] == "adapter"
    _, out, _ = translate({"tuner_type": "full", "lora_rank": 8, "target_modules": ["all-linear"]}, "sft", defaults())
    assert out == {"trainer.lora.rank": 0}
    _, out, _ = translate({"lora_rank": 8}, "sft", defaults())  # no tuner_type: full parameters here
    assert "trainer.lora.rank" not in out


def test_steps_on_the_command_line_win_over_the_files_epochs(tmp_path):
    """`run.steps=2` on the command line stops a file with num_train_epochs after 2 steps."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"query": f"{i}+1?", "response": f"{i + 1}"}) + "\n" for i in range(40)))
    path = tmp_path / "sft.yaml"
    path.write_text(f"model: tiny_qwen2\ndataset: {data}\nnum_train_epochs: 3\nper_device_train_batch_size: 2\n")
    from algorithms.sft import SFTConfig
    from tests.driver_helpers import composed

    args = [f"config_file={path}", "run.steps=2"]
    typed, _ = prepare(composed(SFTConfig, args), SFTConfig, cli=args)
    assert typed.run.steps == 2 and typed.run.epochs is None
    typed, _ = prepare(composed(SFTConfig, args[:1]), SFTConfig, cli=args[:1])
    assert typed.run.epochs == 3.0


def test_flash_attn_runs_as_sdpa_where_flash_attn_is_not_installed(capsys):
    import importlib.util

    _, out, _ = translate({"attn_impl": "flash_attn"}, "sft", defaults())
    if importlib.util.find_spec("flash_attn") is None:
        assert out["model.attn_implementation"] == "sdpa" and "flash-attn is not installed" in capsys.readouterr().out
    else:
        assert out["model.attn_implementation"] == "flash_attention_2"


def test_async_generate_keeps_the_colocated_rollout_awake_and_refuses_an_offloading_trainer(example, monkeypatch):
    """ms-swift's async_generate: one step of staleness and sleep_level 0 (its own override of
    the file's sleep_level); beside the rollout the trainer must then stay on the device too."""
    from algorithms import grpo

    monkeypatch.chdir(example)
    file = {**yaml.safe_load((example / "grpo_colocate.yaml").read_text()), "async_generate": True}
    for offload, path in ((False, "async_resident.yaml"), (True, "async_offload.yaml")):
        (example / path).write_text(yaml.safe_dump({**file, "offload_model": offload, "offload_optimizer": offload}))
    typed, plan = prepare({"config_file": "async_resident.yaml"}, GRPOConfig, cli=[])
    assert typed.algorithm.max_staleness == 1 and plan["rollout"].sleep_level == 0
    assert plan["rollout"].colocated_with == ("train",)
    grpo.validate(typed, plan)
    with pytest.raises(ConfigError, match=r"max_staleness'=1 overlaps generation with training.*the trainer "
                                          r"offloads.*Fix"):
        grpo.validate(*prepare({"config_file": "async_offload.yaml"}, GRPOConfig, cli=[]))
