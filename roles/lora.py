"""LoRA adapters on a trainer's model (peft): the `trainer.lora` section, the adapter put into
the model in place, and the three forms its weights travel in.

    peft_model = add_adapter(model, LoraConfig(rank=8))  # `model` keeps its class, gains adapters
    merged = merged_weights(named, scalings(model))      # HF names: base + scale * B @ A
    adapter = adapter_weights(named)                      # PEFT's own names, the adapter alone

The adapted model's state_dict names a LoRA linear `X` as `X.base_layer.weight` (the frozen
base), `X.lora_A.default.weight` [r, in] and `X.lora_B.default.weight` [out, r]; a module in
`modules_to_save` as `X.original_module.*` (frozen) and `X.modules_to_save.default.*` (trained).
The functions here read those names from (name, tensor) pairs, so they work on the host copies
of an offloaded model too. No Ray here.
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import peft
import torch
from peft.tuners.lora import LoraLayer

ADAPTER = "default"  # peft's name of the one adapter
# What a weight sync with LoRA carries (`Trainer.state_dict_buckets` part=):
#   full: every weight under its HF name, the adapter merged in;
#   adapted: the same, only the tensors the adapter changes (LoRA linears, modules_to_save);
#   adapter: the adapter's own tensors under PEFT's names (the receiver merges or serves them).
PARTS = ("full", "adapted", "adapter")
ALL_LINEAR = "all-linear"


@dataclass
class LoraConfig:
    # Rank r of the adapter matrices A [r, in] and B [out, r]; 0: no adapter (full-parameter training).
    rank: int = 0
    # Scale of the update: W + (alpha / rank) * B @ A.
    alpha: float = 32.0
    # Dropout on the adapter's input while training (0 makes train and eval forwards equal).
    dropout: float = 0.05
    # Modules that get an adapter, by name suffix (q_proj, v_proj, ...), or ["all-linear"]: every
    # linear layer but the output head.
    target_modules: List[str] = field(default_factory=lambda: [ALL_LINEAR])
    # Modules trained in full beside the adapters and saved with them (e.g. [lm_head, embed_tokens]).
    modules_to_save: List[str] = field(default_factory=list)


def lora_problems(cfg: LoraConfig) -> list[str]:
    """What is wrong with a LoRA section (empty when it is off or fine); each names its field."""
    if cfg.rank == 0:
        return []
    problems = []
    if cfg.rank < 0:
        problems.append(f"lora.rank={cfg.rank} must be >= 1 (0: full-parameter training)")
    if not cfg.alpha > 0:
        problems.append(f"lora.alpha={cfg.alpha} must be > 0")
    if not 0.0 <= cfg.dropout < 1.0:
        problems.append(f"lora.dropout={cfg.dropout} must be in [0, 1)")
    if not cfg.target_modules:
        problems.append(f"lora.target_modules is empty; use [{ALL_LINEAR}] or module names such as [q_proj, v_proj]")
    return problems


def _peft_config(cfg: LoraConfig, tied: bool) -> peft.LoraConfig:
    """peft's LoraConfig; `tied`: the model ties its output head to its embedding, and a trained
    copy of either (modules_to_save) stays shared by both."""
    targets = ALL_LINEAR if list(cfg.target_modules) == [ALL_LINEAR] else list(cfg.target_modules)
    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                           modules_to_save=list(cfg.modules_to_save) or None, bias="none",
                           ensure_weight_tying=tied and bool(cfg.modules_to_save))


def unknown_targets(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """Names in target_modules that match no linear layer of `model`, and in modules_to_save
    that match no module (a meta-device copy serves: only names and types are read). An
    embedding trains whole, through modules_to_save."""
    def matches(name: str, wanted: str) -> bool:
        return name == wanted or name.endswith("." + wanted)

    modules = list(model.named_modules())
    linear = [n for n, m in modules if isinstance(m, torch.nn.Linear)]
    return ([t for t in cfg.target_modules if t != ALL_LINEAR and not any(matches(n, t) for n in linear)]
            + [t for t in cfg.modules_to_save if not any(matches(n, t) for n, _ in modules)])


def add_adapter(model: torch.nn.Module, cfg: LoraConfig) -> peft.PeftModel:
    """Adapters put into `model` in place (its class, forward and HF weights stay; the base is
    frozen, only adapters and modules_to_save train); returns the PeftModel around it, which
    saves the adapter and turns it off (`adapter_off`)."""
    unknown = unknown_targets(model, cfg)
    if unknown:
        raise ValueError(f"trainer.lora names modules {unknown} that {type(model).__name__} does not have (as linear "
                         f"layers, for target_modules); use [{ALL_LINEAR}] or its linear layers (e.g. q_proj, "
                         "v_proj), and modules_to_save for an embedding")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return peft.get_peft_model(model, _peft_config(cfg, tied))


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """alpha / rank of each LoRA layer, by its module name (the prefix of its weights' names)."""
    return {name: float(module.scaling[ADAPTER]) for name, module in model.named_modules()
            if isinstance(module, LoraLayer) and ADAPTER in module.scaling}


def adapter_off(peft_model: Optional[peft.PeftModel]):
    """A context in which the model computes as its base (the adapters add nothing); a no-op
    without LoRA."""
    return peft_model.disable_adapter() if peft_model is not None else contextlib.nullcontext()


def _is_adapter(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def hf_name(name: str) -> Optional[str]:
    """The HF name a weight of the adapted model stands for; None for the adapter's own tensors and
    the frozen originals of modules_to_save (the trained copies stand for them)."""
    if _is_adapter(name) or ".original_module." in name:
        return None
    return name.replace(".base_layer.", ".").replace(f".modules_to_save.{ADAPTER}.", ".")


def base_name(name: str) -> Optional[str]:
    """The HF name of a base weight of the adapted model (None for the adapter's tensors and the
    trained copies of modules_to_save: their frozen originals stand for the base)."""
    if _is_adapter(name) or f".modules_to_save.{ADAPTER}." in name:
        return None
    return name.replace(".base_layer.", ".").replace(".original_module.", ".")


def merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """w + scale * B @ A, computed in float32, in w's dtype and on its device."""
    return (w.float() + (b.float() @ a.float()).to(w.device) * scale).to(w.dtype)


def merged_weights(named: Iterable[Tuple[str, torch.Tensor]], scale: Mapping[str, float],
                   only_adapted: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the adapted model's weights with each adapter merged in (base + scale *
    B @ A, computed in float32, returned in the base's dtype); `only_adapted`: just the tensors the
    adapter changes (LoRA linears' weights and modules_to_save)."""
    named = list(named)
    tensors = dict(named)
    for name, t in named:
        target = hf_name(name)
        if target is None:
            continue
        prefix = name[:-len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        if prefix is not None and prefix in scale:
            a = tensors[f"{prefix}.lora_A.{ADAPTER}.weight"]
            b = tensors[f"{prefix}.lora_B.{ADAPTER}.weight"]
            yield target, merged(t, a, b, scale[prefix])
        elif not only_adapted or f".modules_to_save.{ADAPTER}." in name:
            yield target, t


def adapter_weights(named: Iterable[Tuple[str, torch.Tensor]],
                    aliases: Optional[Mapping[str, str]] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """The adapter's tensors under the names PEFT saves them by (`base_model.model.X.lora_A.weight`,
    `...X.weight` for a module of modules_to_save), which `PeftModel.from_pretrained` and vLLM
    read; `aliases` (`tied_aliases`) adds the names of a trained copy that tied modules share."""
    out = {}
    for name, t in named:
        if _is_adapter(name):
            out["base_model.model." + name.replace(f".{ADAPTER}.", ".")] = t
        elif f".modules_to_save.{ADAPTER}." in name:
            out["base_model.model." + name.replace(f".modules_to_save.{ADAPTER}.", ".")] = t
    for alias, name in (aliases or {}).items():
        out[alias] = out[name]
    yield from out.items()


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """PEFT names of a trained copy that tied modules share (modules_to_save on a tied output head
    and embedding): each later name -> the first, which the weight listings carry."""
    first: dict[int, str] = {}
    aliases = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if f".modules_to_save.{ADAPTER}." in name:
            saved = "base_model.model." + name.replace(f".modules_to_save.{ADAPTER}.", ".")
            if id(t) in first:
                aliases[saved] = first[id(t)]
            else:
                first[id(t)] = saved
    return aliases


def adapter_state(pairs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT-named adapter tensors (`adapter_weights`, a saved adapter_model.safetensors) under the
    adapted model's own parameter names: what they are loaded back into."""
    out = {}
    for name, t in pairs.items():
        inner = name.removeprefix("base_model.model.")
        for kind in ("lora_A", "lora_B"):
            if f".{kind}." in inner:
                inner = inner.replace(f".{kind}.", f".{kind}.{ADAPTER}.")
                break
        else:  # a module of modules_to_save: its trained copy
            head, _, leaf = inner.rpartition(".")
            inner = f"{head}.modules_to_save.{ADAPTER}.{leaf}"
        out[inner] = t
    return out


def adapter_config(peft_model: peft.PeftModel, base: Optional[str]) -> dict:
    """adapter_config.json of the adapter, naming `base` (the base model's folder) when known."""
    cfg = peft_model.peft_config[ADAPTER].to_dict()
    cfg["base_model_name_or_path"] = base
    for key, value in cfg.items():  # sets are not JSON
        if isinstance(value, (set, frozenset)):
            cfg[key] = sorted(value)
    return cfg


def write_adapter(folder: Union[str, os.PathLike], pairs: Sequence[Tuple[str, torch.Tensor]], config: dict) -> Path:
    """PEFT's adapter folder: adapter_config.json + adapter_model.safetensors (what
    `PeftModel.from_pretrained(base, folder)` and vLLM's LoRARequest load); written to temporary
    names first, so a reader never sees half a folder."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().cpu().clone() for n, t in pairs}, out / ".adapter_model.safetensors.tmp")  # (no shared storage)
    (out / ".adapter_config.json.tmp").write_text(json.dumps(config, indent=2))
    os.replace(out / ".adapter_model.safetensors.tmp", out / "adapter_model.safetensors")
    os.replace(out / ".adapter_config.json.tmp", out / "adapter_config.json")
    return out


def merge_into(base: Callable[[str], torch.Tensor], adapter: Iterable[Tuple[str, torch.Tensor]],
               scale: float) -> Iterator[Tuple[str, torch.Tensor]]:
    """(HF name, merged tensor) for every tensor an adapter (PEFT names, as `adapter_weights`
    gives them) changes: base(HF name) + scale * B @ A, in the base's dtype and device; what a
    receiver that holds the base computes itself. A module of modules_to_save comes whole."""
    pairs = dict(adapter)
    for name, t in pairs.items():
        hf = name.removeprefix("base_model.model.")
        if ".lora_A." in hf:
            prefix = hf[:hf.index(".lora_A.")]
            b = pairs[name.replace(".lora_A.", ".lora_B.")]
            w = base(f"{prefix}.weight")
            yield f"{prefix}.weight", merged(w, t, b, scale)
        elif ".lora_B." not in hf:
            yield hf, t


def served_config(pairs: Iterable[Tuple[str, torch.Tensor]], rank: int, alpha: float) -> dict:
    """adapter_config.json for adapter tensors a receiver got (PEFT names): its rank, alpha and
    the module names they adapt (what vLLM's LoRARequest reads from the folder)."""
    targets = sorted({n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in pairs if ".lora_A." in n})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(rank), "lora_alpha": float(alpha),
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "base_model_name_or_path": None}
