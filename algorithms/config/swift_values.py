"""How the value of each ms-swift key becomes this project's: the converters that
algorithms/config/swift_keys.py's key tables name (paths with ms-swift's '#N' row counts, dataset
columns, dtypes, the DeepSpeed preset, vLLM arguments, batch sizes, ...). Each takes the
key's value, the whole file and the composed config, and returns {our dotted key: value}, or
raises `Unsupported` with why and what to use."""
from __future__ import annotations

import importlib.util
import json
import math
import os
from typing import Any, Callable, Mapping, Optional

from roles.hub import HubError, find_model, is_repo_id, missing_model, parse_dataset
from roles.models import hub_cache_dir
from roles.orm import ANSWER_KINDS
from roles.plugins import PluginError, load_plugin
from roles.scorer_model import HEAD_FILE

# (the key's value, the whole file, the composed config) -> {our dotted key: value}
Mapper = Callable[[Any, Mapping, Any], dict]
# The drivers that read a config_file.
DRIVERS = ("grpo", "gkd", "sft", "distill")


class Unsupported(ValueError):
    """A value this project cannot honour; the message says why and what to use."""


def to(*keys: str, convert: Callable[[Any], Any] = lambda v: v) -> Mapper:
    """The value (converted) goes to each of `keys`."""
    return lambda value, file, cfg: {k: convert(value) for k in keys}


def integer(value: Any) -> int:
    """A whole number: a YAML int, a float without fraction, or text of one ("1e3")."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        number = float(value) if isinstance(value, (float, str)) else math.nan
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number.is_integer()):
        raise Unsupported("must be a whole number")
    return int(number)


def number(value: Any) -> float:
    """A finite number: a YAML int or float, or text of one (YAML 1.1 reads 5e-5 as text)."""
    try:
        out = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else math.nan
    except ValueError:
        out = math.nan
    if not math.isfinite(out):
        raise Unsupported("must be a finite number")
    return out


def flag(value: Any) -> bool:
    """true or false (YAML booleans, or the words and 1/0 that ms-swift's command line takes)."""
    if isinstance(value, bool):
        return value
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if isinstance(value, (int, str)) and str(value).strip().lower() in words:
        return words[str(value).strip().lower()]
    raise Unsupported("must be true or false")


def text(value: Any) -> str:
    """One word or sentence: a YAML scalar, not a list or mapping."""
    if value is None or isinstance(value, (list, dict, bool)):
        raise Unsupported(f"must be text, not {'null' if value is None else type(value).__name__}")
    return str(value)


def optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`convert`, with null kept as null."""
    return lambda value: None if value is None else convert(value)


def scale(value: Any) -> str:
    """GRPO's scale_rewards: ms-swift's true/false (group/none) or a scale's name."""
    return {True: "group", False: "none"}[value] if isinstance(value, bool) else text(value)


def listed(convert: Callable[[Any], Any], what: str) -> Callable[[Any], list]:
    """A list of `convert`'s values (one value: a list of one); refused as `what`."""
    def to_list(value: Any) -> list:
        items = value if isinstance(value, list) else [value]
        try:
            return [convert(v) for v in items]
        except Unsupported:
            raise Unsupported(f"must be {what}") from None
    return to_list


numbers = listed(number, "a list of finite numbers")
texts = listed(text, "a name or a list of names")


def path(value: Any) -> str:
    text_ = os.path.expanduser(text(value))
    return os.path.abspath(text_) if os.path.exists(text_) else text_


def split_count(item: str) -> tuple[str, Optional[int]]:
    """'entry#N' -> (entry with any local path made absolute, N): ms-swift's row count after a
    dataset (roles/hub.py parse_dataset reads the whole syntax). A count that is no whole
    number >= 1 is refused."""
    try:
        entry = parse_dataset(item)
    except HubError as e:
        raise Unsupported(str(e)) from None
    source = path(entry.source)  # a local path made absolute; a hub id as it is
    prefix = f"{entry.hub}::" if entry.hub else ""
    subsets = f":{'/'.join(entry.subsets)}" if entry.subsets else ""
    return f"{prefix}{source}{subsets}", entry.count


def paths(value: Any) -> list[str]:
    """A dataset list as data.paths holds it: each entry's path absolute, its '#N' kept (the
    loader draws N rows from that entry alone)."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, str) and v.strip() for v in items):
        raise Unsupported("must be a file path, a folder or a hub id in a local cache, or a list of them (JSONL, "
                          "JSON, CSV, Parquet files; each optionally #N)")
    return [name + ("" if n is None else f"#{n}") for name, n in map(split_count, items)]


def dataset(value: Any, file: Mapping, cfg: Any) -> dict:
    out = {"data.task": "files", "data.paths": paths(value)}
    if "split_dataset_ratio" not in file and not file.get("val_dataset"):
        out["data.val_split"] = 0.0  # ms-swift's split_dataset_ratio default: nothing held out, no evaluation
    if "truncation_strategy" not in file:
        out["data.truncation_strategy"] = "delete"  # ms-swift's default: a row over max_length is dropped
    return out


def split_ratio(value: Any, file: Mapping, cfg: Any) -> dict:
    ratio = number(value)
    if not 0.0 <= ratio < 1.0:
        raise Unsupported("must be a fraction in [0, 1): the share of each dataset's rows held out (0: none, no "
                          "evaluation)")
    # With val_dataset ms-swift sets the ratio to 0: val_dataset's rows are the held-out ones.
    return {} if file.get("val_dataset") else {"data.val_split": ratio}


def columns(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise Unsupported(f"is not a JSON object of old -> new column names ({e.msg})") from None
    if not isinstance(value, dict):
        raise Unsupported("must map old column names to new ones, e.g. {question: query}")
    return dict(value)


def model(value: Any, file: Mapping, cfg: Any) -> dict:
    # The folder (or hub id in a local cache) itself; the drivers resolve and check it.
    if not isinstance(value, str) or not value.strip():
        raise Unsupported("must be the path of a local model folder (or a hub id in a local cache)")
    if is_repo_id(value) and find_model(value) is None:
        raise Unsupported(f"is no local folder, and {missing_model(value)}")
    return {"model.path": path(value), "model.name": os.path.basename(os.path.normpath(value))}


def rlhf_type(driver: str) -> Mapper:
    def check(value: Any, file: Mapping, cfg: Any) -> dict:
        if not isinstance(value, str):
            raise Unsupported(f"must name the algorithm, {driver!r} for this driver")
        if value != driver:
            where = f"python -m algorithms.{value}" if value in DRIVERS else "no driver here"
            raise Unsupported(f"is {value!r} but this is the {driver} driver ({where} runs it), and "
                              f"`python -m algorithms.cli config_file=...` picks the driver from rlhf_type")
        return {}
    return check


def neutral(values: tuple, why: str) -> Mapper:
    """A feature this project does not have: only its neutral values are accepted."""
    def check(value: Any, file: Mapping, cfg: Any) -> dict:
        if value not in values:
            raise Unsupported(f"{why}, only {' or '.join(repr(v) for v in values)} is accepted")
        return {}
    return check


def use_ray(value: Any, file: Mapping, cfg: Any) -> dict:
    return {"backend.workers": "ray" if flag(value) else "local"}


def advantage(value: Any, file: Mapping, cfg: Any) -> dict:
    if not isinstance(value, str) or value not in ("grpo", "rloo"):
        raise Unsupported(f"{value!r}: the estimators here are grpo and rloo (algorithm.leave_one_out)")
    return {"algorithm.leave_one_out": value == "rloo"}


def vllm_engine_kwargs(value: Any, file: Mapping, cfg: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise Unsupported(f"is not a JSON object of vLLM arguments ({e.msg})") from None
    if not isinstance(value, Mapping):
        raise Unsupported("must map vLLM argument names to values, e.g. {max_num_seqs: 256}")
    known = {"max_logprobs": ("vllm.max_logprobs", integer), "max_num_seqs": ("vllm.max_num_seqs", integer),
             "max_num_batched_tokens": ("vllm.max_num_batched_tokens", integer),
             "enforce_eager": ("vllm.enforce_eager", flag)}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise Unsupported(f"{unknown}: the vLLM arguments read here are {sorted(known)} (vllm.*)")
    out = {}
    for name, v in value.items():
        key, convert = known[name]
        try:
            out[key] = convert(v)
        except Unsupported as e:
            raise Unsupported(f"{name}={v!r} {e}") from None
    return out


def sampler_engine(value: Any, file: Mapping, cfg: Any) -> dict:
    engines = {"vllm": "vllm", "transformers": "torch", "pt": "torch"}
    if not isinstance(value, str) or value not in engines:
        raise Unsupported(f"{value!r}: the sampler runs on a local engine here: vllm, or transformers (torch)")
    return {"backend.rollout": engines[value]}


# ms-swift's tuner_type (train_type) values this project trains.
TUNERS = ("lora", "full")
# ms-swift's LoRA defaults (lora_rank, lora_alpha, lora_dropout), used when the file sets tuner_type: lora only.
SWIFT_LORA = {"rank": 8, "alpha": 32.0, "dropout": 0.05}


def tuner(file: Mapping) -> str:
    """The file's tuner_type (or train_type); a file without one trains full parameters here."""
    return text(file.get("tuner_type", file.get("train_type", "full")))


def train_type(value: Any, file: Mapping, cfg: Any) -> dict:
    if not isinstance(value, str) or value not in TUNERS:
        raise Unsupported(f"{value!r}: the tuners here are {list(TUNERS)} (LoRA through peft, or full parameters)")
    if value == "full":
        return {"trainer.lora.rank": 0}
    return {f"trainer.lora.{k}": convert(file.get(f"lora_{k}", SWIFT_LORA[k]))
            for k, convert in (("rank", integer), ("alpha", number), ("dropout", number))}


def lora_key(field: str, convert: Callable[[Any], Any]) -> Mapper:
    """A LoRA key (lora_rank, target_modules, ...): trainer.lora.<field> under tuner_type: lora;
    without effect under tuner_type: full, as in ms-swift."""
    def mapped(value: Any, file: Mapping, cfg: Any) -> dict:
        return {f"trainer.lora.{field}": convert(value)} if tuner(file) == "lora" else {}
    return mapped


def vllm_enable_lora(value: Any, file: Mapping, cfg: Any) -> dict:
    return {"weight_sync.lora": "adapter" if flag(value) else "merged"}


def loggers(value: Any, file: Mapping, cfg: Any) -> dict:
    names = texts(value) if isinstance(value, list) else [v.strip() for v in text(value).split(",")]
    if names in (["none"], []):
        return {"run.loggers": ["jsonl"]}
    if names == ["all"]:
        names = ["tensorboard", "wandb"]
    unknown = [n for n in names if n not in ("jsonl", "tensorboard", "wandb", "mlflow")]
    if unknown:
        raise Unsupported(f"{unknown}: the trackers here are tensorboard, wandb and mlflow (run.loggers)")
    return {"run.loggers": ["jsonl"] + [n for n in names if n != "jsonl"]}


def use_vllm(value: Any, file: Mapping, cfg: Any) -> dict:
    return {"backend.rollout": "vllm" if flag(value) else "torch"}


def async_generate(value: Any, file: Mapping, cfg: Any) -> dict:
    """ms-swift's async rollout: each batch sampled with the previous step's weights while the
    trainer trains, the rollout awake throughout (ms-swift sets sleep_level 0 with it)."""
    if not flag(value):
        return {"algorithm.max_staleness": 0}
    return {"algorithm.max_staleness": 1, "placement.sleep_level": 0}


def vllm_mode(value: Any, file: Mapping, cfg: Any) -> dict:
    if value != "colocate":
        raise Unsupported(f"{value!r}: the rollout is a role on planned devices, never an external vLLM "
                          "server: place it on its own devices instead (colocate_groups without rollout, "
                          "or its own device group)")
    return {}


def deepspeed(value: Any, file: Mapping, cfg: Any) -> dict:
    name = text(value)
    stages = {"zero2": 2, "zero3": 3}
    base = name.removesuffix("_offload")
    if base in ("zero0", "zero1"):
        raise Unsupported(f"{name!r}: the DeepSpeed engine here runs ZeRO-2 or ZeRO-3 (zero2 shards the optimizer "
                          "state as zero1 does, and the gradients too): use zero2, zero3, zero2_offload or "
                          "zero3_offload")
    if base not in stages:
        raise Unsupported(f"{name!r}: name a ZeRO preset (zero2, zero3, zero2_offload, zero3_offload), "
                          "a DeepSpeed JSON file is not read, set deepspeed.* keys instead")
    out = {"backend.train": "deepspeed", "deepspeed.zero_stage": stages[base]}
    if name.endswith("_offload"):
        out["deepspeed.offload_optimizer"] = True
        out["deepspeed.offload_param"] = base == "zero3"
    return out


def dtype(value: Any) -> str:
    names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "auto", "bfloat16": "bfloat16",
             "float16": "float16", "float32": "float32"}
    if not isinstance(value, str) or value not in names:
        raise Unsupported(f"the weight dtypes here are {sorted(names)}")
    return names[value]


def flag_dtype(name: str) -> Mapper:
    return lambda value, file, cfg: {"trainer.dtype": name} if flag(value) else {}


def attn(value: Any) -> str:
    names = {"flash_attn": "flash_attention_2", "flash_attention_2": "flash_attention_2",
             "flash_attention_3": "flash_attention_3", "sdpa": "sdpa", "eager": "eager",
             "flex_attention": "flex_attention"}
    if not isinstance(value, str) or value not in names:
        raise Unsupported(f"the attention kernels here are {sorted(names)}")
    kernel = names[value]
    if kernel.startswith("flash_attention") and importlib.util.find_spec("flash_attn") is None:
        # A file written for GPUs with flash-attn, run where it is not installed (a CPU machine):
        # the same attention through torch's kernel, said in one line.
        print(f"attn_impl={value}: flash-attn is not installed here, torch's sdpa attention runs instead")
        return "sdpa"
    return kernel


def positive(value: Any) -> int:
    """A whole number >= 1 (a count of ranks or devices)."""
    out = integer(value)
    if out < 1:
        raise Unsupported("must be a whole number >= 1")
    return out


def tensor_parallel(value: Any, file: Mapping, cfg: Any) -> dict:
    if positive(value) == 1:
        return {}
    return {"backend.train": "megatron", "megatron.tensor_parallel_size": positive(value)}


def vllm_tp(value: Any, file: Mapping, cfg: Any) -> dict:
    if "device_groups" in file:
        raise Unsupported("with device_groups, set vllm_tensor_parallel_size inside the rollout's device group")
    return {"placement.rollout.vllm_tensor_parallel_size": positive(value)}


def global_batch(driver: str) -> Mapper:
    """global_batch_size: sequences per optimizer update. GRPO's are completions: prompts per
    step = global_batch_size * steps_per_generation / num_generations."""
    def convert(value: Any, file: Mapping, cfg: Any) -> dict:
        if driver != "grpo":
            return {"run.prompts_per_step": positive(value)}
        G, spg = group_size(file, cfg), per_generation(file, cfg)
        completions = positive(value) * spg
        if completions % G:
            raise Unsupported(f"{value} * steps_per_generation {spg} = {completions} completions per generation "
                              f"is not a whole number of prompts of num_generations={G}, use a multiple of {G}")
        return {"run.prompts_per_step": completions // G}
    return convert


def group_size(file: Mapping, cfg: Any) -> int:
    """GRPO's completions per prompt: the file's num_generations, else the composed config's."""
    try:
        return positive(file.get("num_generations", cfg.algorithm.num_generations))
    except Unsupported:
        raise Unsupported(f"needs num_generations >= 1 to count prompts (the file has "
                          f"{file.get('num_generations')!r})") from None


def per_generation(file: Mapping, cfg: Any) -> int:
    """GRPO's optimizer updates per generation: the file's steps_per_generation, else the config's."""
    try:
        return positive(file.get("steps_per_generation", cfg.algorithm.steps_per_generation))
    except Unsupported:
        raise Unsupported(f"needs steps_per_generation >= 1 (the file has "
                          f"{file.get('steps_per_generation')!r})") from None


def generation_batch(value: Any, file: Mapping, cfg: Any) -> dict:
    G = group_size(file, cfg)
    if positive(value) % G:
        raise Unsupported(f"{value} completions is not a whole number of prompts of num_generations={G}")
    return {"run.prompts_per_step": positive(value) // G}


def no_key(value: Any, file: Mapping, cfg: Any) -> dict:
    # Read before Hydra starts (`output_run_dir`): the run directory is <value>/<time>.
    return {}


def beta(index: int) -> Mapper:
    """adam_beta1 / adam_beta2: one of trainer.betas (the other from the file or the config)."""
    def convert(value: Any, file: Mapping, cfg: Any) -> dict:
        betas = [float(cfg.trainer.betas[i]) for i in (0, 1)]
        betas[index] = number(value)
        other = f"adam_beta{2 - index}"
        if other in file:  # the other key reports its own bad value
            try:
                betas[1 - index] = number(file[other])
            except Unsupported:
                pass
        return {"trainer.betas": betas}
    return convert


def optim(value: Any, file: Mapping, cfg: Any) -> dict:
    kernels = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw_fused", "adamw": "adamw", "adam": "adamw"}
    if not isinstance(value, str) or value not in kernels:
        raise Unsupported(f"{value!r}: the optimizer here is AdamW (adamw_torch, adamw_torch_fused; "
                          "trainer.optimizer picks its kernel)")
    return {"trainer.optimizer": kernels[value]}


def warmup_fraction(value: Any, file: Mapping, cfg: Any) -> dict:
    ratio = number(value)
    if not 0.0 <= ratio < 1.0:
        raise Unsupported("must be a fraction in [0, 1) of the run's updates")
    return {"trainer.warmup_ratio": ratio}


# ms-swift's built-in `format` reward (swift/rewards/orm.py): the whole completion is
# <think>...</think> then <answer>...</answer>; `\A` with re.search is its re.match.
SWIFT_FORMAT = r"(?s)\A<think>.*?</think>\s*<answer>.*?</answer>(?![\s\S])"
# ms-swift's other built-in rewards, and why they are not offered here.
SWIFT_ONLY_REWARDS = {
    "react_format": "ms-swift's ReAct format check is not implemented here (a plugin ORM can be)",
    "cosine": "the length-scaled cosine reward is not implemented here",
    "repetition": "the n-gram repetition penalty is not implemented here",
    "soft_overlong": "the soft overlong penalty is not implemented here (overlong_filter drops cut completions)",
    "toolbench": "the ToolBench ReAct reward is not implemented here",
    "math": "ms-swift's math ORM scores its sampler's requests, not GRPO completions (orm_model: math in distill)",
}
# This project's reward names a config_file may also use (algorithm.reward_funcs).
OWN_REWARDS = ("accuracy", "format", "prm", *ANSWER_KINDS)


def plugin_paths(file: Mapping) -> list[str]:
    """The file's external_plugins as absolute paths (one path or a list)."""
    value = file.get("external_plugins") or []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) and v.strip() for v in items):
        raise Unsupported("must be the path of a plugin .py file or a list of them")
    return [os.path.abspath(os.path.expanduser(v)) for v in items]


def plugin_rewards(file: Mapping) -> dict[str, str]:
    """{reward name: '<plugin file>:<name>'} of every class the file's external_plugins register
    in orms, imported in order (a later file's registration of a name wins, as in ms-swift)."""
    out = {}
    for path in plugin_paths(file):
        try:
            out.update({name: f"{path}:{name}" for name in load_plugin(path)})
        except PluginError as e:
            raise Unsupported(f"plugin file {e}") from None
    return out


def external_plugins(value: Any, file: Mapping, cfg: Any) -> dict:
    # Imported now, before anything starts; their rewards travel as '<file>:<name>' names
    # (reward_funcs, orm_model), and each role scoring with one imports the file itself.
    plugin_rewards(file)
    return {}


def multi_turn(field: str, convert: Callable[[Any], Any]) -> Mapper:
    """A multi-turn key: algorithm.multi_turn.<field>, and the file's external_plugins as the
    files the rollout imports for their schedulers and environments."""
    def mapper(value: Any, file: Mapping, cfg: Any) -> dict:
        return {f"algorithm.multi_turn.{field}": convert(value), "algorithm.multi_turn.plugins": plugin_paths(file)}
    return mapper


def use_gym_env(value: Any, file: Mapping, cfg: Any) -> dict:
    """ms-swift adds the environment's total reward as a reward column: here env_reward sum;
    false: the reward functions alone."""
    return {"algorithm.multi_turn.env_reward": "sum" if flag(value) else "none"}


def reward_funcs(value: Any, file: Mapping, cfg: Any) -> dict:
    """ms-swift's reward names: a plugin's registration first, then its built-ins as they mean
    there (format: <think>/<answer> tags), then this project's names and pkg.mod.fn paths."""
    try:
        plugins = plugin_rewards(file)
    except Unsupported:
        plugins = {}  # external_plugins reports the file
    out: dict = {"algorithm.reward_funcs": []}
    for name in texts(value):
        if name in plugins:
            out["algorithm.reward_funcs"].append(plugins[name])
        elif name in SWIFT_ONLY_REWARDS:
            raise Unsupported(f"{name!r}: {SWIFT_ONLY_REWARDS[name]}")
        elif name in OWN_REWARDS or "." in name:
            out["algorithm.reward_funcs"].append(name)
            if name == "format":
                out["algorithm.format_pattern"] = SWIFT_FORMAT
        else:
            raise Unsupported(f"{name!r} is registered by no file of external_plugins "
                              f"({len(plugin_paths(file))} given) and is no reward here: use {list(OWN_REWARDS)}, "
                              "a class a plugin file registers in orms, or pkg.mod.fn")
    return out


def orm_model(value: Any, file: Mapping, cfg: Any) -> dict:
    """distill's ORM: ms-swift's built-in `math`, or a reward class of an external_plugins file."""
    name = text(value)
    try:
        plugins = plugin_rewards(file)
    except Unsupported:
        plugins = {}  # external_plugins reports the file
    if name in plugins:
        return {"orm.kind": "plugin", "orm.plugin": plugins[name]}
    if name == "math":
        return {"orm.kind": "math"}
    raise Unsupported(f"{name!r}: the ORMs here are ms-swift's math, or a class an external_plugins file "
                      "registers in orms (orm.kind: see docs/ms_swift.md)")


def prm_model(value: Any, file: Mapping, cfg: Any) -> dict:
    """distill's PRM: a local folder (or a hub id in the local cache, as `model`) holding a PRM
    saved here (PRM.save: a causal LM and its scalar step head)."""
    name = os.path.expanduser(text(value))
    folder = os.path.abspath(name) if os.path.isdir(name) else hub_cache_dir(name)
    if folder is None:
        raise Unsupported("is neither a local folder nor a model in the local Hugging Face cache: give the folder "
                          "of a PRM saved here (PRM.save)")
    if not os.path.isfile(os.path.join(folder, HEAD_FILE)):
        raise Unsupported(f"{folder} holds no {HEAD_FILE}: the model PRM here is a causal LM with this project's "
                          "step head, saved by PRM.save; a hub PRM with its own head class (e.g. "
                          "Qwen2.5-Math-PRM-7B) is not read. Use a PRM saved here, or leave prm_model out "
                          "(prm.kind=arithmetic)")
    return {"prm.kind": "model", "prm.model": folder}


CLIENT = ("calls an OpenAI-compatible API model; nothing here calls an external API: use sampler_engine: vllm "
          "or pt with a local model folder as `model`")


def local_sampler(value: Any, file: Mapping, cfg: Any) -> dict:
    """sampler_engine: a local engine; ms-swift's `client` (an API model such as qwen-max) is refused."""
    if value == "client":
        raise Unsupported(f"'client' {CLIENT}")
    return sampler_engine(value, file, cfg)


def engine_kwargs(value: Any, file: Mapping, cfg: Any) -> dict:
    """The sampler engine's own arguments: vLLM's (as vllm_engine_kwargs) for sampler_engine: vllm."""
    engine = file.get("sampler_engine", "transformers")
    if engine == "client":
        raise Unsupported("configure the API client of sampler_engine: client, refused there")
    if engine != "vllm":
        raise Unsupported(f"no {engine!r} engine arguments are read here (the torch sampler takes rollout.*): "
                          "remove it, or use sampler_engine: vllm with vLLM arguments")
    return vllm_engine_kwargs(value, file, cfg)


def stream(value: Any, file: Mapping, cfg: Any) -> dict:
    if flag(value) and file.get("sampler_engine") == "client":
        raise Unsupported("streams the answers of sampler_engine: client, refused there")
    if flag(value):
        raise Unsupported("a local sampler returns whole candidates, remove it or set false")
    return {}


def accumulation(value: Any, file: Mapping, cfg: Any) -> dict:
    # Sequences per update = per_device_train_batch_size * this * data-parallel ranks; the SFT
    # driver sets run.prompts_per_step from it once its plan (the ranks) is known.
    return {"algorithm.gradient_accumulation_steps": positive(value)}


def loggers_swanlab(value: Any, file: Mapping, cfg: Any) -> dict:
    """report_to, with swanlab (a tracker here when its package is installed)."""
    names = texts(value) if isinstance(value, list) else [v.strip() for v in text(value).split(",")]
    if "swanlab" not in names:
        return loggers(value, file, cfg)
    rest = [n for n in names if n != "swanlab"] or ["none"]
    return {"run.loggers": loggers(rest, file, cfg)["run.loggers"] + ["swanlab"]}


def truncation(value: Any, file: Mapping, cfg: Any) -> dict:
    if value not in ("delete", "left", "right"):
        raise Unsupported(f"{value!r}: the strategies here are delete, left and right ('split' cuts pretraining "
                          "corpora into several rows and is not implemented)")
    return {"data.truncation_strategy": value}
