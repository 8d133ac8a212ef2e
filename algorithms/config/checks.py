"""The checks every driver runs before anything starts (no Ray, no actor, no file written).

Each driver's `validate(cfg, plan)` calls `check_run` for the sections all drivers share and
then checks its own `algorithm` section with `require`. Every refusal is one ConfigError
`config key 'X'=V <problem>. Fix: <what to set>`, naming a key the user can set; the drivers'
entry point prints it as one line and exits 2. The roles keep only the checks that guard
their own constructors when they are used without a driver.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import transformers
from safetensors import safe_open
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from algorithms.config.engine_checks import check_engine_options, check_vllm_tensor_parallel
from algorithms.config.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, SEED, UNSET_OR_AT_LEAST_1, require, require_all
from algorithms.data.loading import check_data_files, system_text
from algorithms.data.prompts import template_on
from algorithms.data.tasks import arithmetic_space
from algorithms.objectives.rollout_correction import ROLLOUT_CORRECTIONS
from algorithms.records.checkpoints import find_resume
from algorithms.records.trackers import LOGGERS, MODULES
from orchestration.cluster import check_log_level
from orchestration.config import ConfigError, check_cluster
from orchestration.launch import check_local_backend
from orchestration.planner import Plan
from orchestration.weight_sync import check_settings as check_weight_sync
from roles.engines.megatron_lora import PROJECTIONS as MEGATRON_PROJECTIONS
from roles.engines.options import ROLLOUT_ENGINES, TEACHER_ENGINES, TRAIN_ENGINES
from roles.orm import ANSWER_KINDS, compile_pattern
from roles.plugins import PluginError, envs, is_plugin_spec, load_plugin, multi_turns, orms
from roles.multi_turn import ENV_REWARDS
from roles.schedulers import resolve_tool
from roles.engines.vllm_build import LORA_RANKS
from roles.lora import ALL_LINEAR, lora_problems, unknown_targets
from roles.models import (TOKENIZER_FILES, ModelFieldError, check_load_options, has_tokenizer_files,
                          hub_cache_root, load_tokenizer, model_skeleton, preset_config, resolve_config)
from roles.engines.torch_trainer import OPTIMIZERS
from roles.trainer_config import COMPUTE_DTYPES, KERNEL_OPTIONS, SCHEDULES

DATA_TASKS = ("arithmetic", "gsm", "files")
MODEL_DTYPES = (None, "float32", "bfloat16", "float16")


def check_run(cfg: Any, plan: Plan, updates: Optional[int] = None, classes: Optional[dict] = None) -> None:
    """The sections every driver shares: run loop, trainer, model(s), data, engines, weight
    sync, rollout, cluster. `updates`: optimizer updates of the run (default run.steps);
    `classes`: {role: role class} the driver starts (backend.workers=local builds them all in
    this process, which ranks that meet in collectives cannot share)."""
    require_all(cfg.run, "run", {"steps": AT_LEAST_1, "prompts_per_step": AT_LEAST_1, "eval_every": NON_NEGATIVE,
                                 "save_every": NON_NEGATIVE, "eval_max_new_tokens": AT_LEAST_1,
                                 "keep_last": NON_NEGATIVE, "max_restarts": NON_NEGATIVE,
                                 "log_every": NON_NEGATIVE})
    require(cfg.run.epochs is None or (math.isfinite(cfg.run.epochs) and cfg.run.epochs > 0), "run.epochs",
            cfg.run.epochs, "must be a finite number > 0 (or null)",
            "set the passes over the training rows, e.g. run.epochs=1, or null to run run.steps steps")
    for key, section in (("run", cfg.run), ("trainer", cfg.trainer), ("rollout", cfg.rollout), ("data", cfg.data)):
        require_all(section, key, {"seed": SEED})
    check_loggers(cfg.run.loggers)
    check_log_level(cfg.run.log_level)
    if cfg.run.resume not in (None, "", "auto"):
        find_resume(None, cfg.run.resume)  # a named checkpoint must be complete
    ranks = max((plan[r].world_size for r in ("train", "default") if r in plan.roles), default=1)
    # A rank without a share would wait forever in the gradient all-reduce.
    require(cfg.run.prompts_per_step >= ranks, "run.prompts_per_step", cfg.run.prompts_per_step,
            f"is below the {ranks} trainer ranks", f"raise it to at least {ranks}")
    check_trainer(cfg.trainer, "trainer", updates or cfg.run.steps, "run.steps")
    for key in KERNEL_OPTIONS:
        require(cfg.backend.train == "torch" or not getattr(cfg.trainer, key), f"trainer.{key}", True,
                f"needs the torch engine (backend.train={cfg.backend.train})",
                f"set backend.train=torch, or trainer.{key}=false")
    check_model("model", cfg.model)
    for role, entry in plan.roles.items():
        if entry.model is not None:
            colocated_teacher = role == "teacher" and "train" in entry.colocated_with
            key = "placement.teacher_model" if colocated_teacher else f"placement.{role}.model"
            check_model(key, entry.model)
    check_data(cfg.data)
    if cfg.model.path is None or os.path.isdir(cfg.model.path):  # a missing folder is named above
        check_chat(cfg)
    for role, choices in (("train", TRAIN_ENGINES), ("rollout", ROLLOUT_ENGINES), ("teacher", TEACHER_ENGINES)):
        value = getattr(cfg.backend, role)
        require(value in choices, f"backend.{role}", value, "is not an engine", f"use one of {list(choices)}")
    check_engine_options(cfg, plan)
    check_weight_sync(cfg.weight_sync)
    check_lora(cfg, plan)
    check_vllm_tensor_parallel(cfg, plan)
    require_all(cfg.rollout, "rollout", {"max_batch_size": AT_LEAST_1})
    require(cfg.backend.rollout == "torch" or not cfg.rollout.compile_decode, "rollout.compile_decode", True,
            f"compiles the torch engine's decode step; backend.rollout={cfg.backend.rollout} compiles its own",
            "set rollout.compile_decode=false (vLLM: vllm.enforce_eager=false compiles with CUDA graphs)")
    require(cfg.rollout.dtype in MODEL_DTYPES, "rollout.dtype", cfg.rollout.dtype, "is not a weight dtype",
            f"use one of {list(MODEL_DTYPES)}")
    check_cluster(cfg.cluster)
    if cfg.backend.workers == "local" and classes:
        check_local_backend(plan, {role: cls for role, cls in classes.items() if role in plan.roles})


def check_trainer(t: Any, prefix: str, updates: int, updates_key: str) -> None:
    """A trainer section (`prefix`: its config key) over `updates` optimizer updates."""
    require_all(t, prefix, {"lr": POSITIVE, "weight_decay": NON_NEGATIVE, "warmup_steps": NON_NEGATIVE,
                            "grad_clip": NON_NEGATIVE, "micro_batch_per_device": NON_NEGATIVE,
                            "micro_batch_memory_mb": POSITIVE})
    require(0.0 <= t.min_lr <= t.lr, f"{prefix}.min_lr", t.min_lr, f"must be in [0, {prefix}.lr={t.lr}]",
            f"set it below {prefix}.lr, or 0")
    require(t.warmup_ratio is None or 0.0 <= t.warmup_ratio < 1.0, f"{prefix}.warmup_ratio", t.warmup_ratio,
            "must be in [0, 1)", f"set a fraction of the run's updates, e.g. 0.05, or null for {prefix}.warmup_steps")
    require(t.schedule in SCHEDULES, f"{prefix}.schedule", t.schedule, "is not a schedule", f"use one of {SCHEDULES}")
    require(t.optimizer in OPTIMIZERS, f"{prefix}.optimizer", t.optimizer, "is not an optimizer",
            f"use one of {list(OPTIMIZERS)}")
    require(math.isfinite(t.adam_eps) and t.adam_eps > 0, f"{prefix}.adam_eps", t.adam_eps,
            "must be a finite number > 0", f"set {prefix}.adam_eps=1e-8")
    require(t.dtype in COMPUTE_DTYPES, f"{prefix}.dtype", t.dtype, "is not a compute dtype",
            f"use one of {COMPUTE_DTYPES}")
    require(t.compile or not t.cuda_graphs, f"{prefix}.cuda_graphs", True, "replays compiled graphs",
            f"set {prefix}.compile=true too, or {prefix}.cuda_graphs=false")
    require(len(t.betas) == 2 and all(0.0 <= b < 1.0 for b in t.betas), f"{prefix}.betas", list(t.betas),
            "must be two values in [0, 1)", f"set {prefix}.betas=[0.9,0.999]")
    require(t.schedule == "constant" or t.warmup_steps < updates, f"{prefix}.warmup_steps", t.warmup_steps,
            f"reaches the run's {updates} updates ({updates_key}), so the {t.schedule} schedule would never decay",
            f"set it below {updates}, or {prefix}.schedule=constant")


def check_lora(cfg: Any, plan: Plan) -> None:
    """trainer.lora against its own values, the trainer's engine, the model's modules and
    weight_sync.lora (the adapter-only sync and what the rollout can serve)."""
    lora, sync = cfg.trainer.lora, cfg.weight_sync.lora
    problems = lora_problems(lora)
    require(not problems, "trainer.lora", f"rank={lora.rank}", "; ".join(problems), "correct those fields")
    if not lora.rank:
        require(sync == "merged", "weight_sync.lora", sync, "sends a LoRA adapter, but trainer.lora.rank=0 trains "
                "full parameters", "set trainer.lora.rank (e.g. 8, or tuner_type: lora), or weight_sync.lora=merged")
        return
    if cfg.backend.train == "megatron":
        other = [t for t in lora.target_modules if t not in (ALL_LINEAR, *MEGATRON_PROJECTIONS)]
        require(not other and not lora.modules_to_save, "trainer.lora", f"target_modules={list(lora.target_modules)} "
                f"modules_to_save={list(lora.modules_to_save)}", f"asks the megatron engine for adapters it does not "
                f"map ({other + list(lora.modules_to_save)}; it adapts {list(MEGATRON_PROJECTIONS)})",
                f"set target_modules to [{ALL_LINEAR}] or some of those and modules_to_save to [], or "
                "backend.train=torch or deepspeed")
    unknown = unknown_targets(model_skeleton(cfg.model), lora)
    require(not unknown, "trainer.lora", f"target_modules={list(lora.target_modules)} modules_to_save="
            f"{list(lora.modules_to_save)}", f"names modules {unknown} that {cfg.model.name} does not have (target_modules: "
            "as linear layers)", f"use target_modules [{ALL_LINEAR}] or its linear layers (q_proj, k_proj, v_proj, "
            "o_proj, gate_proj, up_proj, down_proj); an embedding trains whole in modules_to_save")
    if sync == "adapter":
        sleep = plan["rollout"].sleep_level if "rollout" in plan.roles else 0
        require(sleep != 2, "weight_sync.lora", sync, "merges each adapter onto the rollout's base weights, which "
                "placement.sleep_level=2 drops", "use placement.sleep_level=1, or weight_sync.lora=merged")
        if cfg.backend.rollout == "vllm":
            require(not lora.modules_to_save, "weight_sync.lora", sync, "serves the adapter in vLLM, which takes no "
                    f"modules_to_save ({list(lora.modules_to_save)})",
                    "set weight_sync.lora=merged, or trainer.lora.modules_to_save=[]")
            require(lora.rank <= LORA_RANKS[-1], "trainer.lora.rank", lora.rank, f"exceeds the largest rank vLLM "
                    f"serves ({LORA_RANKS[-1]})", "lower it, or set weight_sync.lora=merged")


def check_model(key: str, spec: Any) -> None:
    """A model spec (preset name, local HF directory, or a model section) that can build: a
    preset's shape, or a checkpoint folder transformers loads (config.json of a causal LM,
    weights, tokenizer), and the tokenizer and options either is built with."""
    try:
        cfg = resolve_config(spec)
    except ValueError as e:
        problem, _, fix = str(e).partition(". Fix: ")
        raise ConfigError(f"config key '{key}'={spec if isinstance(spec, str) else getattr(spec, 'name', spec)!r}: "
                          f"{problem}. Fix: {fix or 'name a preset or a local directory holding a saved model'}") \
            from None
    try:
        if cfg.path is not None:
            shown = f"{key}.path" if not isinstance(spec, str) else key
            check_checkpoint(shown, cfg.path)
            require(cfg.tokenizer is not None or has_tokenizer_files(cfg.path), shown, cfg.path,
                    f"holds no tokenizer files ({', '.join(TOKENIZER_FILES)})", "save the tokenizer there "
                    "(tokenizer.save_pretrained), or set model.tokenizer to a folder holding one")
            check_load_options(cfg)
            load_tokenizer(cfg)  # its own, or the one it borrows (model.tokenizer): files that load
            return
        preset_config(cfg)  # check_config, then the transformers config it builds (model.arch_fields)
        size = len(load_tokenizer(cfg))
        if cfg.vocab_size and cfg.vocab_size < size:
            raise ModelFieldError("vocab_size", cfg.vocab_size, f"is below the tokenizer's {size} tokens",
                                  f"set it to {size} or more, or null for the tokenizer's size")
    except ModelFieldError as e:
        if isinstance(spec, str):  # a preset or folder by name: the field is in its file
            raise ConfigError(f"config key '{key}'={spec!r}: its model.{e.field}={e.value!r} {e.problem}. "
                              f"Fix: {e.fix}") from None
        raise ConfigError(f"config key '{key}.{e.field}'={e.value!r} {e.problem}. Fix: {e.fix}") from None


# A saved model's weights: one of these files (or shards named by the index files).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def check_checkpoint(key: str, path: str) -> None:
    """A checkpoint folder `AutoModelForCausalLM.from_pretrained` loads (its weights unread):
    config.json of a causal LM this transformers knows, and weight files."""
    require(os.path.isdir(path), key, path,
            f"is neither a local directory nor a model in the local Hugging Face cache ({hub_cache_root()})",
            "give a local folder written by save_pretrained (config.json, weights, tokenizer), or put the hub "
            f"model in that cache first (`huggingface-cli download {path}` where a network is)")
    config = Path(path) / "config.json"
    require(config.is_file(), key, path, "holds no config.json", "give a folder written by save_pretrained")
    try:
        fields = json.loads(config.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        fields = e
    require(isinstance(fields, dict), key, path, f"holds a config.json that is not a JSON object "
            f"({fields if isinstance(fields, Exception) else type(fields).__name__})",
            "save the model again with save_pretrained")
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers' errors for an unknown model_type or a damaged config vary
        require(False, key, path, f"holds a config.json transformers {transformers.__version__} cannot read "
                f"(model_type {fields.get('model_type')!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__})",
                "give a model of a type this transformers knows, or install a transformers that knows it")
    require(type(hf_config) in MODEL_FOR_CAUSAL_LM_MAPPING, key, path,
            f"holds a {hf_config.model_type!r} model, which transformers has no causal-LM class for",
            "give a causal language model (one AutoModelForCausalLM loads)")
    shards = sorted(Path(path).glob("*.safetensors"))
    require(any((Path(path) / name).is_file() for name in WEIGHT_FILES) or bool(shards),
            key, path, f"holds no weights ({', '.join(WEIGHT_FILES)})", "give a folder written by save_pretrained")
    for shard in shards:  # the header only: names, shapes and offsets of the tensors
        try:
            with safe_open(str(shard), framework="pt"):
                pass
        except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
            require(False, key, path, f"holds a weight file that cannot be read ({shard.name}: {e})",
                    "save the model again with save_pretrained (or finish copying it)")


def vocab_size(spec: Any) -> int:
    """Rows of a model's output layer: config.json's vocab_size for a saved model, else the
    preset's vocab_size or its tokenizer's length (what build_model uses)."""
    cfg = resolve_config(spec)
    if cfg.path is not None:  # check_checkpoint has read its config.json
        return int(AutoConfig.from_pretrained(cfg.path, local_files_only=True).get_text_config().vocab_size)
    return cfg.vocab_size or len(load_tokenizer(cfg))


def check_data(d: Any) -> None:
    require(d.task in DATA_TASKS, "data.task", d.task, "is not a task", f"use one of {list(DATA_TASKS)}")
    require_all(d, "data", {"eval_size": AT_LEAST_1})
    if d.task != "files":
        require_all(d, "data", {"train_size": AT_LEAST_1})
    require(d.max_length is None or d.max_length >= 0, "data.max_length", d.max_length, "is negative",
            "a token count, or 0 (or null) for the model's context")
    validate_check(d)
    check_data_files(d)
    system_text(d.system)  # a .txt file that cannot be read
    if d.task == "arithmetic":
        a = d.arithmetic
        require_all(a, "data.arithmetic", {"min_operands": (lambda v: v >= 2, ">= 2"), "min_digits": AT_LEAST_1,
                                           "heldout_fraction": (lambda v: 0.0 < v < 1.0, "in (0, 1)")})
        require(a.max_operands >= a.min_operands, "data.arithmetic.max_operands", a.max_operands,
                f"is below min_operands={a.min_operands}", "raise it")
        require(a.max_digits >= a.min_digits, "data.arithmetic.max_digits", a.max_digits,
                f"is below min_digits={a.min_digits}", "raise it")
        require(bool(a.ops) and set(a.ops) <= set("+-*"), "data.arithmetic.ops", a.ops,
                "must be made of + - *", 'e.g. data.arithmetic.ops="+-"')
        # Training and held-out problems are distinct draws of one finite space.
        space = arithmetic_space(a, d.train_size + d.eval_size)
        for key, n in (("eval_size", d.eval_size), ("train_size", d.train_size + d.eval_size)):
            require(n <= space, f"data.{key}", getattr(d, key),
                    f"asks for more problems than data.arithmetic makes: {space} distinct ones at most "
                    f"({a.min_operands}-{a.max_operands} operands of {a.min_digits}-{a.max_digits} digits, ops "
                    f"{a.ops!r}), shared by data.train_size={d.train_size} and data.eval_size={d.eval_size}",
                    "lower data.train_size / data.eval_size, or raise data.arithmetic.max_digits or max_operands")


def check_importable(key: str, path: str) -> None:
    """A dotted path 'pkg.mod.fn' to a function this process can import, or '<plugin file>.py:<name>'
    of a reward class the plugin file registers in algorithms.plugins.orms."""
    if is_plugin_spec(path):
        file, _, name = path.rpartition(":")
        try:
            registered = load_plugin(file)
        except PluginError as e:
            raise ConfigError(f"config key '{key}'={path!r}: the plugin file {e}. Fix: correct the file, or "
                              "remove it from external_plugins") from None
        require(name in orms, key, path, f"names no reward of the plugin file (it registers {sorted(registered)})",
                "register the class with orms['<name>'] = Class in the file, or name one it registers")
        return
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"config key '{key}': cannot import module {module_name!r} of {path!r} ({e}). Fix: "
                          "install it or put it on PYTHONPATH (Ray workers get the driver's working directory)") \
            from None
    require(callable(getattr(module, attr, None)), key, path, f"names no function in module {module_name!r}",
            "give 'pkg.mod.fn' of a function fn(prompts, completions, references) -> list[float]")


def check_scorer(section: Any, key: str, kinds: tuple, needs_fn: bool = True) -> None:
    """An ORM/PRM section (`key`: orm or prm): its kind, a custom function that imports, a
    reward model that builds."""
    require(section.kind in kinds, f"{key}.kind", section.kind, "is not a kind", f"use one of {list(kinds)}")
    if section.kind == "custom" and needs_fn:
        require(bool(section.reward_fn), f"{key}.reward_fn", section.reward_fn, "is unset with kind=custom",
                f"set {key}.reward_fn=pkg.mod.fn")
        check_importable(f"{key}.reward_fn", section.reward_fn)
    if section.kind == "model":
        require(section.model is not None, f"{key}.model", None, "is unset with kind=model",
                f"set {key}.model to a preset or a local checkpoint")
        check_model(f"{key}.model", section.model)
    require_all(section, key, {"micro_batch": AT_LEAST_1, "lr": POSITIVE})


def check_chat(cfg: Any) -> None:
    """data.chat against the tokenizer's template (data.chat=true needs one), data.enable_thinking
    against plain-text prompts, and rollout.chat / rollout.enable_thinking against data's: every
    rollout and sampler of a run renders prompts as training does."""
    chat, own = cfg.data.chat, cfg.rollout.chat
    require(own is None or own == chat, "rollout.chat", own, f"differs from data.chat={chat}; a run renders its "
            "prompts as data.chat says", f"set data.chat={str(own).lower()} and leave rollout.chat unset")
    thinking, own = cfg.data.enable_thinking, cfg.rollout.enable_thinking
    require(own is None or own == thinking, "rollout.enable_thinking", own, f"differs from data.enable_thinking="
            f"{thinking}; a run renders its prompts as data says", f"set data.enable_thinking={str(own).lower()} "
            "and leave rollout.enable_thinking unset")
    try:
        tokenizer = load_tokenizer(cfg.model)
    except ModelFieldError as e:
        raise ConfigError(f"config key 'model.{e.field}'={e.value!r} {e.problem}. Fix: {e.fix}") from None
    require(template_on(tokenizer, chat) or thinking is None, "data.enable_thinking", thinking, "is a switch of the "
            "chat template, but prompts are plain text here (data.chat=false, or a tokenizer without a template)",
            "leave data.enable_thinking unset, or set data.chat=true with a tokenizer whose template reads it")


def validate_check(data: Any, check: Optional[str] = None) -> None:
    """data.check (or `check`, a GRPO reward named by kind) can score: a known kind, a regex
    that compiles, a dotted path that imports."""
    check = check or data.check
    require(check != "model", "data.check", check, "is not offered: a reward model's score ranks replies, it does "
            "not say right or wrong", "use a dotted path 'pkg.mod.fn' to fn(prompts, completions, references) -> "
            "list[float] giving 1.0 for a right reply (it may ask a judge model)")
    require(check in ANSWER_KINDS or "." in check, "data.check", check, "is not a check",
            f"use one of {list(ANSWER_KINDS)} or a dotted path 'pkg.mod.fn' to fn(prompts, completions, "
            "references) -> list[float]")
    if check not in ANSWER_KINDS:
        check_importable("data.check", check)
    if check == "regex":
        try:
            compile_pattern(data.check_pattern, "data.check_pattern")
        except ValueError as e:
            require(False, "data.check_pattern", data.check_pattern, f"does not serve check=regex ({e})",
                    r"set it to a regular expression whose first group is the answer, e.g. 'answer: (\S+)'")


def check_loggers(loggers: Any, key: str = "run.loggers") -> None:
    """Refuse unknown or repeated logger names, a list without jsonl, and a tracker whose
    package is not installed, as one ConfigError naming `key`."""
    names = list(loggers)
    for name in names:
        require(name in LOGGERS, key, names, f"names an unknown logger {name!r}",
                f"list some of {list(LOGGERS)}, e.g. {key}=[jsonl,tensorboard]")
    require(len(set(names)) == len(names), key, names, "names a logger twice", "list each logger once")
    require("jsonl" in names, key, names, "leaves out jsonl (metrics.jsonl, which resume reads back)",
            f"keep it in the list, e.g. {key}=[jsonl,{','.join(n for n in names if n != 'jsonl') or 'tensorboard'}]")
    for name in names:
        for package in LOGGERS[name]:
            require(importlib.util.find_spec(MODULES.get(package, package)) is not None, key, names,
                    f"needs the Python package '{package}', which is not installed",
                    f"pip install -c constraints.txt {' '.join(LOGGERS[name])} (or the '.[trackers]' extra), "
                    f"or drop {name} from {key}")


def check_staleness(max_staleness: int, plan: Plan, key: str = "algorithm.max_staleness") -> None:
    """Refuse a negative bound, and overlap where the rollout takes turns with a role on its
    devices: it sleeps there, or the trainer or teacher beside it offloads (nothing could run
    meanwhile). Colocated roles that all stay on the devices run at once there."""
    require(max_staleness >= 0, key, max_staleness, "must be >= 0",
            "set it to 0 (strictly on-policy) or to the weight versions a sample may lag")
    if not max_staleness or "rollout" not in plan.roles:
        return
    rollout = plan["rollout"]
    shared = sorted(set(rollout.colocated_with) & {"train", "teacher"})
    turns = [f"the rollout sleeps (placement.sleep_level={rollout.sleep_level})"] if rollout.sleep_level else []
    offloads = {"train": "the trainer offloads (placement.offload_model/offload_optimizer)",
                "teacher": "the teacher offloads (placement.offload_teacher_model)"}
    turns += [offloads[role] for role in shared if plan[role].offload_model or plan[role].offload_optimizer]
    require(not (shared and turns), key, max_staleness, f"overlaps generation with training, but the placement "
            f"colocates rollout with {shared} (placement.colocate_groups / device_groups) and they take turns "
            f"there: {'; '.join(turns)}", f"set {key}=0; or keep every role on the shared devices "
            "(placement.sleep_level=0 and no offload: their memory is then needed at once); or give the rollout "
            "its own devices (separate placement)")


def check_opd_teacher(cfg: Any, plan: Plan, key: str = "algorithm.teacher_kl_coef") -> None:
    """GRPO's teacher signal (on-policy distillation as RL): a finite weight >= 0; above 0 a
    teacher model in the placement, scoring on the torch engine, whose vocabulary holds every
    token of the policy's tokenizer; at 0 no planned teacher (it would sit unused)."""
    coef = cfg.algorithm.teacher_kl_coef
    require(math.isfinite(coef) and coef >= 0, key, coef, "must be a finite number >= 0",
            f"set {key}=0 (off), or a weight such as 1.0")
    entry = plan.roles.get("teacher")
    if not coef:
        where = "placement.teacher_model" if entry is not None and "train" in entry.colocated_with else "placement.teacher"
        require(entry is None, where, entry.model if entry is not None else None,
                f"plans a teacher that GRPO does not use while {key}=0",
                f"set {key}=1.0 (ms-swift's weight with a teacher) to distill from it, or remove it from the placement")
        return
    require(entry is not None and entry.model is not None, key, coef, "needs a teacher model, and the placement "
            "names none", "set placement.teacher_model=NAME (a preset or local folder, colocated with the trainer; "
            f"ms-swift: teacher_model), or placement.teacher.gpus=N with placement.teacher.model=NAME, or {key}=0")
    require(cfg.backend.teacher == "torch", "backend.teacher", cfg.backend.teacher,
            f"cannot give the teacher's logprob of each sampled token ({key} > 0 needs it)", "set backend.teacher=torch")
    words, rows = len(load_tokenizer(cfg.model)), vocab_size(entry.model)
    require(words <= rows, key, coef, f"needs a teacher that scores every token of the policy's {words}-token "
            f"tokenizer, but {entry.model} has {rows} output rows", "use a teacher with the policy's tokenizer")


def check_multi_turn(mt: Any, key: str = "algorithm.multi_turn") -> None:
    """A multi-turn section (roles.multi_turn.MultiTurnConfig): its plugin files import, its
    scheduler, environment and tools are registered, its numbers are in range."""
    for path in mt.plugins:
        try:
            load_plugin(path)
        except PluginError as e:
            require(False, f"{key}.plugins", list(mt.plugins), f"holds a plugin file that fails: {e}",
                    "correct the file or its path")
    if not mt.enabled:
        return
    require_all(mt, key, {"max_turns": AT_LEAST_1, "env_timeout_s": POSITIVE, "max_turn_tokens": UNSET_OR_AT_LEAST_1})
    require(mt.env_reward in ENV_REWARDS, f"{key}.env_reward", mt.env_reward, "is not a way to reward",
            f"use one of {list(ENV_REWARDS)}")
    require(mt.scheduler_name in multi_turns, f"{key}.scheduler", mt.scheduler, "is registered nowhere",
            f"use one of {sorted(multi_turns)}, or register yours in multi_turns in a plugin file ({key}.plugins)")
    if mt.scheduler_name == "gym_scheduler":
        require(mt.gym_env in envs, f"{key}.gym_env", mt.gym_env, "is no registered environment",
                f"use one of {sorted(envs)}, or register yours in envs in a plugin file ({key}.plugins)")
    for tool in mt.tools:
        try:
            resolve_tool(tool)
        except (KeyError, ImportError, AttributeError, ValueError) as e:
            require(False, f"{key}.tools", list(mt.tools), f"names a tool that cannot be found ({e})",
                    "register it with tools['name'] = fn in a plugin file, or give its dotted path 'pkg.mod.fn'")


def check_rollout_correction(a: Any, key: str = "algorithm") -> None:
    """GRPO's training-inference mismatch correction (ms-swift's keys): a known mode, a finite
    threshold > 0, a finite off-policy sequence mask delta, and that mask only with
    per-sequence advantages (as ms-swift, not with a teacher's per-token signal)."""
    mode = a.rollout_importance_sampling_mode
    require(mode in ROLLOUT_CORRECTIONS, f"{key}.rollout_importance_sampling_mode", mode, "is not a correction mode",
            f"use one of {list(ROLLOUT_CORRECTIONS)} (none: the ratio against the rollout's logprobs, as without it)")
    threshold = a.rollout_importance_sampling_threshold
    require(math.isfinite(threshold) and threshold > 0, f"{key}.rollout_importance_sampling_threshold", threshold,
            "must be a finite number > 0", "set it to e.g. 2.0 (ms-swift's default)")
    delta = a.off_policy_sequence_mask_delta
    require(delta is None or math.isfinite(delta), f"{key}.off_policy_sequence_mask_delta", delta,
            "must be a finite number", "set a mean log-ratio such as 0.1, or null (off)")
    require(delta is None or not a.teacher_kl_coef, f"{key}.off_policy_sequence_mask_delta", delta,
            f"needs one advantage per completion, but {key}.teacher_kl_coef={a.teacher_kl_coef} makes them per "
            "token (ms-swift refuses the two together too)",
            f"set {key}.off_policy_sequence_mask_delta=null, or {key}.teacher_kl_coef=0")
