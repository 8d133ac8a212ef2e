"""Bad data files, model folders and ms-swift values, as a user gives them: each ends in one
ConfigError `config key 'X'=V <problem>. Fix: <what to set>` naming the key, before any role
starts (read by the checks or by `load_task`, which runs before the roles), never a traceback
from deeper down. In-process, no Ray; the command-line forms are in tests/test_invalid_configs.py."""
from __future__ import annotations

import json
import shutil
import time

import pytest
from omegaconf import OmegaConf

from algorithms.config.checks import check_data, check_model
from algorithms.config.swift_keys import translate
from algorithms.data.loading import DataConfig, load_task
from algorithms.data.tasks import ArithmeticConfig, arithmetic_examples
from algorithms.distill import DistillConfig
from algorithms.gkd import GKDConfig
from algorithms.grpo import GRPOConfig
from orchestration.config import ConfigError
from roles.models import ModelConfig, ModelFieldError, build_model, check_config, load_tokenizer, save_checkpoint

# 1-digit chains of 2-3 operands with '+': 1100 problems, about 110 of them held out.
SMALL = ArithmeticConfig(min_operands=2, max_operands=3, min_digits=1, max_digits=1, ops="+")


def refused(call, key: str) -> str:
    """The one-line ConfigError `call()` raises, naming config key `key`."""
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"config key '{key}'") and ". Fix: " in message and "\n" not in message, message
    return message


def rows(path, n: int = 8):
    path.write_text("".join(json.dumps({"query": f"{i}+1=", "response": f"#### {i + 1}"}) + "\n" for i in range(n)))
    return str(path)


# ----------------------------------------------------------------------------- data files

@pytest.mark.parametrize("name,text", [("empty.jsonl", ""), ("blank.jsonl", "\n  \n\n"),
                                       ("header.csv", "query,response\n")])
def test_a_file_without_rows_is_named(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    message = refused(lambda: load_task(DataConfig(task="files", paths=[str(tmp_path / name)], eval_size=2)),
                      "data.paths")
    assert "holds no rows" in message


def test_held_out_files_without_usable_rows_name_val_paths(tmp_path):
    train = rows(tmp_path / "train.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    refused(lambda: load_task(DataConfig(task="files", paths=[train], val_paths=[str(tmp_path / "empty.jsonl")])),
            "data.val_paths")
    (tmp_path / "bad.jsonl").write_text('{"foo": 1}\nnot json\n')
    message = refused(lambda: load_task(DataConfig(task="files", paths=[train],
                                                   val_paths=[str(tmp_path / "bad.jsonl")])), "data.val_paths")
    assert "wrong_type 1" in message and "not_json 1" in message


def test_rows_without_known_columns_say_which_columns_were_found(tmp_path):
    (tmp_path / "cols.jsonl").write_text("".join(json.dumps({"q": i, "a": i}) + "\n" for i in range(5)))
    message = refused(lambda: load_task(DataConfig(task="files", paths=[str(tmp_path / "cols.jsonl")], eval_size=2)),
                      "data.paths")
    assert "no known columns (got ['a', 'q']" in message and "data.columns" in message


def test_a_binary_file_is_named_not_raised(tmp_path):
    for name in ("x.csv", "x.parquet", "x.jsonl"):
        (tmp_path / name).write_bytes(bytes(range(256)) * 4)
        refused(lambda: load_task(DataConfig(task="files", paths=[str(tmp_path / name)], eval_size=2)), "data.paths")


def test_an_unusable_cache_dir_is_named(tmp_path):
    (tmp_path / "a_file").write_text("")
    data = DataConfig(task="files", paths=[rows(tmp_path / "train.jsonl")], eval_size=2,
                      cache_dir=str(tmp_path / "a_file" / "cache"))
    refused(lambda: load_task(data), "data.cache_dir")


def test_arithmetic_beyond_its_problems_is_refused_before_start_and_never_hangs():
    refused(lambda: check_data(DataConfig(train_size=100_000, arithmetic=SMALL)), "data.train_size")
    refused(lambda: check_data(DataConfig(train_size=10, eval_size=5000, arithmetic=SMALL)), "data.eval_size")
    # Within the bound of the whole space, but more than its held-out share: named by load_task.
    refused(lambda: load_task(DataConfig(train_size=10, eval_size=500, arithmetic=SMALL)), "data.eval_size")
    start = time.monotonic()
    with pytest.raises(ValueError, match="distinct"):
        arithmetic_examples(10**7, seed=0, config=SMALL)  # a budget of 5e8 draws, stopped once the space is used up
    assert time.monotonic() - start < 20


def test_data_max_length_is_checked_for_every_driver():
    refused(lambda: check_data(DataConfig(max_length=-5)), "data.max_length")


# ----------------------------------------------------------------------------- model folders

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "good"
    save_checkpoint(build_model("tiny_qwen2"), load_tokenizer("tiny_qwen2"), out)
    return out


def broken(checkpoint, tmp_path, change):
    folder = tmp_path / "broken"
    shutil.copytree(checkpoint, folder)
    change(folder)
    return str(folder)


def set_config(**fields):
    def change(folder):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return change


@pytest.mark.parametrize("change,problem", [
    (lambda f: (f / "config.json").write_text("{not json"), "config.json that is not a JSON object"),
    (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json that is not a JSON object (list)"),
    (set_config(model_type="bogus_arch"), "model_type 'bogus_arch'"),
    (set_config(model_type="vit"), "no causal-LM class"),
    (lambda f: (f / "model.safetensors").unlink(), "holds no weights"),
    (lambda f: (f / "model.safetensors").write_bytes(b"garbage"), "weight file that cannot be read"),
    (lambda f: (f / "tokenizer.json").write_text('{"version": "1.0"}'), "tokenizer that cannot be loaded"),
])
def test_a_broken_model_folder_is_named_before_start(checkpoint, tmp_path, change, problem):
    path = broken(checkpoint, tmp_path, change)
    message = refused(lambda: check_model("model", ModelConfig(path=path)), "model.path")
    assert problem in message, message
    check_model("model", ModelConfig(path=str(checkpoint)))  # the unbroken folder passes


def test_a_model_folder_named_directly_and_its_options(checkpoint, tmp_path):
    path = broken(checkpoint, tmp_path, lambda f: (f / "config.json").write_text("{"))
    refused(lambda: check_model("placement.teacher_model", path), "placement.teacher_model")
    refused(lambda: check_model("model", ModelConfig(path=str(checkpoint), dtype="float8")), "model.dtype")
    refused(lambda: check_model("model", ModelConfig(path=str(checkpoint), attn_implementation="flash")),
            "model.attn_implementation")
    bare = broken(checkpoint, tmp_path / "b", lambda f: [(f / n).unlink() for n in ("tokenizer.json",
                                                                                  "tokenizer_config.json")])
    refused(lambda: check_model("model", ModelConfig(path=bare, tokenizer="/nonexistent/tok")), "model.tokenizer")


def test_roles_refuse_bad_fields_as_value_errors_naming_the_field(checkpoint):
    """Without a driver (a role built directly) the same inputs raise ModelFieldError, a
    ValueError naming the model field, never ZeroDivisionError or KeyError."""
    for fields, field in (({"num_attention_heads": 0}, "num_attention_heads"),
                          ({"num_key_value_heads": 0}, "num_key_value_heads"), ({"rope_theta": 0.0}, "rope_theta"),
                          ({"dtype": "int8"}, "dtype")):
        with pytest.raises(ModelFieldError) as info:
            check_config(ModelConfig(**fields))
        assert info.value.field == field
    with pytest.raises(ModelFieldError, match="model.dtype='float8'"):
        build_model(ModelConfig(path=str(checkpoint), dtype="float8"))
    with pytest.raises(ModelFieldError, match="model.tokenizer='/nonexistent/tok'"):
        load_tokenizer(ModelConfig(tokenizer="/nonexistent/tok"))


# ----------------------------------------------------------------------------- ms-swift values

@pytest.fixture
def existing(tmp_path):
    return rows(tmp_path / "train.jsonl")


BAD_VALUES = [
    ({"lr": "fast"}, "sft", "lr='fast': must be a finite number"),
    ({"lr": float("nan")}, "sft", "lr=nan: must be a finite number"),
    ({"num_train_epochs": float("inf")}, "sft", "num_train_epochs=inf: must be a finite number"),
    ({"seed": 1.5}, "sft", "seed=1.5: must be a whole number"),
    ({"num_generations": [1, 2]}, "grpo", "num_generations=[1, 2]: must be a whole number"),
    ({"num_generations": 0, "global_batch_size": 16}, "grpo", "needs num_generations >= 1"),
    ({"num_generations": 0, "generation_batch_size": 16}, "grpo", "needs num_generations >= 1"),
    ({"dataset": 5}, "sft", "dataset=5: must be a file path"),
    ({"dataset": []}, "sft", "dataset=[]: must be a file path"),
    ({"dataset": None}, "sft", "dataset=None: must be a file path"),
    ({"split_dataset_ratio": 2}, "sft", "split_dataset_ratio=2: must be a fraction in [0, 1)"),
    ({"torch_dtype": "int8"}, "sft", "torch_dtype='int8': the weight dtypes here are"),
    ({"deepspeed": "zero9"}, "sft", "deepspeed='zero9': 'zero9': name a ZeRO preset"),
    ({"deepspeed": "zero1"}, "sft", "the DeepSpeed engine here runs ZeRO-2 or ZeRO-3"),
    ({"attn_impl": "flashy"}, "sft", "attn_impl='flashy': the attention kernels here are"),
    ({"use_ray": "maybe"}, "sft", "use_ray='maybe': must be true or false"),
    ({"bf16": "maybe"}, "sft", "bf16='maybe': must be true or false"),
    ({"optim": ["adamw"]}, "sft", "optim=['adamw']"),
    ({"system": ["a"]}, "sft", "system=['a']: must be text"),
    ({"model": 5}, "sft", "model=5: must be the path of a local model folder"),
    ({"tensor_model_parallel_size": 0}, "gkd", "tensor_model_parallel_size=0: must be a whole number >= 1"),
    ({"vllm_engine_kwargs": [1]}, "gkd", "must map vLLM argument names to values"),
    ({"vllm_engine_kwargs": {"max_num_seqs": "many"}}, "gkd", "max_num_seqs='many' must be a whole number"),
    ({"reward_weights": "abc"}, "grpo", "reward_weights='abc': must be a list of finite numbers"),
    ({"reward_funcs": {"a": 1}}, "grpo", "reward_funcs={'a': 1}: must be a name or a list of names"),
    ({"num_return_sequences": "many"}, "distill", "num_return_sequences='many': must be a whole number"),
    ({"rlhf_type": ["grpo"]}, "grpo", "rlhf_type=['grpo']: must name the algorithm"),
]
SCHEMAS = {"sft": GRPOConfig, "grpo": GRPOConfig, "gkd": GKDConfig, "distill": DistillConfig}


@pytest.mark.parametrize("file,driver,problem", BAD_VALUES, ids=[f"{d}:{list(f)}" for f, d, _ in BAD_VALUES])
def test_a_value_of_the_wrong_kind_is_one_error_naming_the_file_key(file, driver, problem):
    cfg = OmegaConf.structured(SCHEMAS[driver])
    cfg.config_file = "swift.yaml"
    message = refused(lambda: translate(file, driver, cfg), "config_file")
    assert message.startswith("config key 'config_file'='swift.yaml' has 1 key(s)") and problem in message, message


@pytest.mark.parametrize("suffix", ["abc", "-3", "0"])
def test_a_dataset_row_count_that_is_no_count_is_refused(existing, suffix):
    message = refused(lambda: translate({"dataset": f"{existing}#{suffix}"}, "sft", OmegaConf.structured(GRPOConfig)),
                      "config_file")
    assert f"'#{suffix}' after" in message and "is no row count" in message


@pytest.mark.parametrize("file,driver,want", [
    ({"vllm_enable_prefix_caching": "false"}, "sft", {"vllm.enable_prefix_caching": False}),
    ({"seq_kd": "no"}, "gkd", {"algorithm.seq_kd": False}),
    ({"lr": "5e-5"}, "sft", {"trainer.lr": 5e-5}),  # YAML 1.1 reads 5e-5 as text
    ({"seed": "7"}, "sft", {"run.seed": 7, "data.seed": 7, "trainer.seed": 7}),
    ({"max_length": 512.0}, "sft", {"data.max_length": 512}),
    ({"easy_query_threshold": None}, "distill", {"algorithm.easy_query_threshold": None}),
    ({"scale_rewards": True}, "grpo", {"algorithm.scale_rewards": "group"}),
    ({"reward_weights": 2}, "grpo", {"algorithm.reward_weights": [2.0]}),
])
def test_values_ms_swift_takes_keep_their_meaning(file, driver, want):
    """A quoted "false" is false (bool("false") would be true), numbers written as text are numbers."""
    _, out, _ = translate(file, driver, OmegaConf.structured(SCHEMAS[driver]))
    assert out == want
