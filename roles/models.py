"""Model factory: HF causal LMs from a local checkpoint directory or from tiny presets.

`build_model(spec)` and `load_tokenizer(spec)` take the same spec:

* a local directory with `config.json` + safetensors (any Qwen2/Llama-family checkpoint
  saved by plain `transformers`), loaded with `local_files_only=True`;
* a preset name, i.e. a file `conf/model/<name>.yaml` (tiny Qwen2/Llama/Qwen3/Qwen3.5 models
  whose weights are initialised from a seed, so CPU training takes seconds);
* a `ModelConfig` (what Hydra composes under `model:`), or a mapping of its fields.

Everything written with `save_checkpoint` loads back with `AutoModelForCausalLM` and
`AutoTokenizer` alone (no flags) and encodes as in training. No Ray here: roles build their
models through this module.
"""
from __future__ import annotations

import inspect
import json
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
from omegaconf import OmegaConf
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig,
                          LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config, Qwen3_5TextConfig,
                          Qwen3Config)
from transformers.cache_utils import LinearAttentionCacheLayerMixin
from transformers.utils import logging as hf_logging

from roles.hub import find_model, hf_hub_cache, is_repo_id, missing_model
from roles.tokenizers import BUILDERS, build_tokenizer, save_tokenizer

# transformers draws a bar for every shard it loads or writes ("Loading weights", "Writing
# model shards"): dozens per run, interleaved with the run's own progress. The run reports.
hf_logging.disable_progress_bar()

# Smallest head size vLLM's CPU attention kernels accept.
MIN_HEAD_DIM = 32
# A preset's arch -> its transformers config; qwen3_5 is Qwen3.5's text model (Qwen3_5ForCausalLM:
# Gated DeltaNet linear-attention blocks between full-attention ones).
ARCHS = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_5": Qwen3_5TextConfig}
# Files of which a saved tokenizer has at least one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Attention kernels transformers takes by name (model.attn_implementation).
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
# Sizes of a preset that must be positive.
PRESET_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings")


@dataclass
class ModelConfig:
    # Preset name (a file conf/model/<name>.yaml) or a label for a checkpoint; shown in logs.
    name: str = "tiny_qwen2"
    # Local HF checkpoint directory (config.json + safetensors); set, it replaces the preset
    # and the architecture fields below are ignored.
    path: Optional[str] = None
    # Tokenizer of a preset, and of a checkpoint without tokenizer files of its own:
    # "char", "gpt2", or a directory saved with save_pretrained; None: "char".
    tokenizer: Optional[str] = None
    # Architecture of a preset: "qwen2", "llama", "qwen3" or "qwen3_5" (Qwen3.5's text model).
    arch: str = "qwen2"
    # Width of the residual stream.
    hidden_size: int = 128
    # Width of the MLP's hidden layer.
    intermediate_size: int = 256
    # Number of transformer blocks.
    num_hidden_layers: int = 4
    # Query heads; head size is hidden_size / num_attention_heads and must be >= 32.
    num_attention_heads: int = 4
    # Key/value heads (grouped-query attention); must divide num_attention_heads.
    num_key_value_heads: int = 2
    # Longest sequence (prompt + completion) in tokens.
    max_position_embeddings: int = 1024
    # RoPE base frequency.
    rope_theta: float = 10000.0
    # Epsilon of the RMS norms.
    rms_norm_eps: float = 1e-6
    # Share the input embedding with the output head (halves the parameters of tiny models).
    tie_word_embeddings: bool = True
    # Embedding rows; None: the tokenizer's size.
    vocab_size: Optional[int] = None
    # Seed of the weight initialisation of a preset (the global RNG is left untouched).
    seed: int = 0
    # Weight dtype: "float32", "bfloat16", "float16", or "auto" (a checkpoint's own dtype).
    dtype: str = "float32"
    # Attention kernel passed to transformers: "sdpa" or "eager".
    attn_implementation: str = "sdpa"
    # Further fields of a preset's transformers config, passed as they are: e.g. qwen3_5's
    # layer_types (which blocks are linear_attention, which full_attention; unset: every fourth
    # full) and linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
    # linear_value_head_dim (its defaults are sized for billions of parameters).
    arch_fields: Dict[str, Any] = field(default_factory=dict)


ModelSpec = Union[str, os.PathLike, ModelConfig, Mapping[str, Any]]


class ModelFieldError(ValueError):
    """A model field that cannot build: its ModelConfig `field`, `value`, what is wrong with it
    (`problem`) and what to set instead (`fix`); the drivers' checks name it as a config key."""

    def __init__(self, field: str, value: Any, problem: str, fix: str):
        super().__init__(f"model.{field}={value!r} {problem}; {fix}")
        self.field, self.value, self.problem, self.fix = field, value, problem, fix


def preset_dir() -> Path:
    """Folder of the preset files (conf/model/, shipped with the package)."""
    return Path(str(resources.files("conf") / "model"))


def preset_names() -> List[str]:
    """Names of the presets in conf/model/."""
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))


def resolve_config(spec: ModelSpec) -> ModelConfig:
    """A ModelConfig from a directory, a preset name, a ModelConfig or a mapping."""
    if isinstance(spec, ModelConfig):
        return spec
    schema = OmegaConf.structured(ModelConfig)
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        if os.path.isdir(text):
            # Absolute: a worker process may not share the driver's working directory.
            return ModelConfig(name=os.path.basename(os.path.normpath(text)), path=os.path.abspath(text))
        preset = preset_dir() / f"{text}.yaml"
        cached = None if preset.is_file() else hub_cache_dir(text)
        if cached is not None:
            return ModelConfig(name=text, path=cached)
        if not preset.is_file():
            raise ValueError(f"model '{text}' is neither a local directory, a preset ({preset_names()}, files in "
                             f"{preset_dir()}), nor a model in the local Hugging Face cache ({hub_cache_root()}) "
                             "or ModelScope cache: " + (missing_model(text) if is_repo_id(text) else
                                                        "Fix: give a folder written by save_pretrained, or a preset"))
        return OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.load(preset)))
    # A mapping or DictConfig; unknown keys and wrong types fail here with the key's name.
    return OmegaConf.to_object(OmegaConf.merge(schema, spec))


# A hub id's folder is found by roles/hub.py; the checks and the schema name these two.
hub_cache_root = hf_hub_cache
hub_cache_dir = find_model


def has_tokenizer_files(directory: str) -> bool:
    """Whether a folder holds a saved tokenizer (one of TOKENIZER_FILES)."""
    return any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES)


def check_config(cfg: ModelConfig) -> None:
    """Reject preset shapes that cannot build or that vLLM's CPU kernels refuse."""
    if cfg.arch not in ARCHS:
        raise ModelFieldError("arch", cfg.arch, "is not supported", f"choose one of {sorted(ARCHS)}")
    for name in PRESET_SIZES:
        if getattr(cfg, name) < 1:
            raise ModelFieldError(name, getattr(cfg, name), "must be >= 1", f"set model.{name} to a positive size")
    for name in ("rope_theta", "rms_norm_eps"):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value > 0):
            raise ModelFieldError(name, value, "must be a finite number > 0", f"set model.{name} as the preset had it")
    if cfg.vocab_size is not None and cfg.vocab_size < 0:
        raise ModelFieldError("vocab_size", cfg.vocab_size, "is negative", "set it to the tokenizer's size or more, "
                              "or null for the tokenizer's size")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ModelFieldError("hidden_size", cfg.hidden_size, "is not divisible by "
                              f"model.num_attention_heads={cfg.num_attention_heads}",
                              "use a multiple of the head count")
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    if head_dim < MIN_HEAD_DIM:
        raise ModelFieldError("num_attention_heads", cfg.num_attention_heads, f"gives a head size {head_dim} "
                              f"(model.hidden_size / model.num_attention_heads), below {MIN_HEAD_DIM}",
                              "use fewer heads or a wider model")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelFieldError("num_key_value_heads", cfg.num_key_value_heads, "must divide "
                              f"model.num_attention_heads={cfg.num_attention_heads}", "use a divisor of it")
    unknown = sorted(set(cfg.arch_fields) - set(ARCHS[cfg.arch]().to_dict()))
    if unknown:
        raise ModelFieldError("arch_fields", dict(cfg.arch_fields), f"names {unknown}, which a {cfg.arch} config "
                              f"({ARCHS[cfg.arch].__name__}) does not have", "remove them or correct their names")
    check_load_options(cfg)


def check_load_options(cfg: ModelConfig) -> None:
    """The fields every model (preset or checkpoint) is built with: weight dtype, attention kernel."""
    if cfg.dtype != "auto" and cfg.dtype not in DTYPES:
        raise ModelFieldError("dtype", cfg.dtype, "is not a weight dtype", f"choose one of {sorted(DTYPES)} or 'auto'")
    if cfg.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ModelFieldError("attn_implementation", cfg.attn_implementation, "is not an attention kernel of "
                              "transformers", f"choose one of {list(ATTN_IMPLEMENTATIONS)}")


def _plain_fast_tokenizer(directory: str) -> bool:
    """A tokenizer.json saved from a generic fast tokenizer (as this project's tokenizers are)."""
    config = os.path.join(directory, "tokenizer_config.json")
    if not (os.path.isfile(config) and os.path.isfile(os.path.join(directory, "tokenizer.json"))):
        return False
    with open(config) as f:
        cls = json.load(f).get("tokenizer_class")
    return cls in ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(spec: ModelSpec):
    """The tokenizer of a model spec: a checkpoint's own (it matches the embeddings, so it
    wins even over a preset's `tokenizer` field), else `ModelConfig.tokenizer`."""
    cfg = resolve_config(spec)
    builders = f"one of {sorted(BUILDERS)} or a directory saved with save_pretrained"
    if cfg.path is not None and has_tokenizer_files(cfg.path):
        kind, field = cfg.path, "path"
    elif cfg.path is not None and cfg.tokenizer is None:
        raise ModelFieldError("path", cfg.path, f"holds no tokenizer files ({', '.join(TOKENIZER_FILES)})",
                              f"save one there, or set model.tokenizer to {builders}")
    else:
        kind, field = cfg.tokenizer or "char", "tokenizer"
    if kind in BUILDERS:
        return build_tokenizer(kind)
    if not os.path.isdir(kind):
        raise ModelFieldError(field, kind, f"is neither {sorted(BUILDERS)} nor a directory", f"set it to {builders}")
    # Without tokenizer files transformers builds an empty tokenizer instead of failing.
    if not has_tokenizer_files(kind):
        raise ModelFieldError(field, kind, f"holds no tokenizer files ({', '.join(TOKENIZER_FILES)})",
                              f"save one there, or set model.tokenizer to {builders}")
    try:
        if _plain_fast_tokenizer(kind):
            # tokenizer.json as written: AutoTokenizer rebuilds Qwen2Tokenizer's pipeline
            # next to a qwen2 config.json, right for this project's tokenizers only.
            return PreTrainedTokenizerFast.from_pretrained(kind, local_files_only=True)
        return AutoTokenizer.from_pretrained(kind, local_files_only=True)
    except Exception as err:  # damaged files: transformers and tokenizers raise assorted types
        raise ModelFieldError(field, kind, f"holds a tokenizer that cannot be loaded ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})",
                              f"save it again (tokenizer.save_pretrained), or set model.tokenizer to {builders}") \
            from err


def preset_config(cfg: ModelConfig) -> Any:
    """The transformers config of a preset (its shape, and its tokenizer's size and ids)."""
    check_config(cfg)
    tokenizer = load_tokenizer(cfg)
    cls = ARCHS[cfg.arch]
    # Configs whose head size is a field of its own (qwen3's default is 128) get the preset's.
    head_dim = {"head_dim": cfg.hidden_size // cfg.num_attention_heads} \
        if "head_dim" in inspect.signature(cls.__init__).parameters else {}
    fields = dict(
        vocab_size=cfg.vocab_size or len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        # The arch's own RoPE settings (qwen3_5 rotates a quarter of each head) with the preset's base.
        rope_parameters={**(cls().rope_parameters or {}), "rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **head_dim,
    )
    try:
        hf_config = cls(**{**fields, **cfg.arch_fields})
    except Exception as err:  # transformers' own checks (e.g. layer_types of another length) raise assorted types
        cause = str(err).strip().splitlines()[-1].strip() if str(err).strip() else type(err).__name__
        raise ModelFieldError("arch_fields", dict(cfg.arch_fields), f"does not build a {cfg.arch} config ({cause})",
                              "correct the values") from err
    hf_config._attn_implementation = cfg.attn_implementation
    return hf_config


def model_config(spec: ModelSpec) -> Any:
    """The transformers config of a model spec: a checkpoint's config.json, or a preset's."""
    cfg = resolve_config(spec)
    return AutoConfig.from_pretrained(cfg.path, local_files_only=True) if cfg.path else preset_config(cfg)


def recurrent_blocks(hf_config: Any) -> List[int]:
    """Blocks whose cache is a recurrent state instead of every position's keys and values
    (Qwen3.5's Gated DeltaNet linear attention), as transformers builds the model's cache."""
    layers = DynamicCache(config=hf_config).layers
    return [i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


def model_skeleton(spec: ModelSpec) -> PreTrainedModel:
    """The model's modules on the meta device (no weights, nothing read but its config): what
    checks of module names need, at no cost for a large model."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config(spec))


def build_model(spec: ModelSpec) -> PreTrainedModel:
    """A causal LM on CPU in eval mode: loaded from `path`, or a preset built from a seed."""
    cfg = resolve_config(spec)
    if cfg.path is not None:
        if not os.path.isfile(os.path.join(cfg.path, "config.json")):
            raise ValueError(f"model.path={cfg.path} has no config.json; expected a directory "
                             "written by save_pretrained")
        check_load_options(cfg)
        dtype = "auto" if cfg.dtype == "auto" else DTYPES[cfg.dtype]
        model = AutoModelForCausalLM.from_pretrained(
            cfg.path, local_files_only=True, dtype=dtype, attn_implementation=cfg.attn_implementation)
        return model.eval()
    hf_config = preset_config(cfg)
    # Fork the RNG so that building a model never shifts the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(hf_config)
    if cfg.dtype not in ("auto", "float32"):
        model = model.to(DTYPES[cfg.dtype])
    return model.eval()


def save_checkpoint(model: PreTrainedModel, tokenizer, out_dir: Union[str, os.PathLike]) -> Path:
    """Write model (safetensors), generation_config.json and tokenizer so plain
    `from_pretrained(out_dir)` loads each and `generate` stops at the tokenizer's eos."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = model.generation_config or GenerationConfig.from_model_config(model.config)
    # Fill only what is missing: a checkpoint's own (e.g. several eos ids) stays as it is.
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(gen, key) is None and getattr(tokenizer, key) is not None:
            setattr(gen, key, getattr(tokenizer, key))
    model.generation_config = gen
    model.save_pretrained(out)
    gen.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    return out
