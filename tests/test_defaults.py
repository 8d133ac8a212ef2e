"""Each default in exactly one place: the typed config dataclasses.

The config dataclasses are the schemas the entry points register (`register_schema(X)`,
`ConfigStore...store(node=X)`) and every dataclass reachable from them through field types
and base classes. For each of their fields with a default, the source tree is scanned (`ast`)
for the same key given a literal default anywhere else:
* a keyword default of a function, method or lambda (`def f(lr=1e-5)`),
* an annotated field of another class (`lr: float = 1e-5`, `field(default=...)`),
* a mapping read with a fallback (`options.get("lr", 1e-5)`),
* a config section built or changed in code with a literal (`TrainerConfig(lr=1e-5)`,
  `replace(cfg.trainer, schedule="cosine")`), outside benchmarks/ (whose settings are the
  benchmark's own choices).
Not counted: None (it says "not given", the callee then reads the config or derives a value),
a literal of a type the setting cannot hold (a flag `seed: bool = False` is no seed), and two
config fields of one name (`run.seed`, `data.seed`: two keys, each with its one default).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("algorithms", "orchestration", "roles", "benchmarks")
NUMBER = (int, float)

# Literal defaults that are not a default of the config field with their name, each with why.
# Keyed by (file, function or class, key).
EXCEPTIONS = {
    # 1.0 leaves the model's distribution as it is (SFT, eval and reference logprobs use it);
    # the drivers pass algorithm.temperature where they sample or distill.
    ("roles/trainer.py", "Trainer.train_step", "temperature"): "untempered",
    ("roles/trainer.py", "Trainer.logprobs", "temperature"): "untempered",
    ("roles/teacher.py", "Teacher.logits", "temperature"): "untempered",
    ("roles/trainer.py", "Trainer.base_logprobs", "temperature"): "untempered",
    # Attention dropout of the kernels (off in every forward here), not the LoRA adapter's dropout.
    ("roles/engines/torch_decode.py", "_static_attention", "dropout"): "attention dropout",
    ("roles/engines/train_kernels.py", "_packed_attention", "dropout"): "attention dropout",
    # A vLLM engine serves no LoRA adapter unless a rollout asks (a teacher never does).
    ("roles/engines/vllm_build.py", "engine_kwargs", "lora_rank"): "no adapter served",
    ("roles/engines/vllm_engine.py", "VLLMEngine.__init__", "lora_rank"): "no adapter served",
    # No adapter: what "every weight trains" means, not a default of trainer.lora.rank.
    ("roles/trainer_config.py", "every_weight", "rank"): "no adapter",
    # The rank of a process in its tensor-parallel engine, not a LoRA rank.
    ("roles/engines/vllm_build.py", "EngineGroup", "rank"): "a process rank",
    # The scale of the logits the trainer handed over (extras['temperature']), 1 when absent;
    # GKD's own temperature is GKDLoss.temperature, required.
    ("algorithms/objectives/losses.py", "GKDLoss._student_logits", "temperature"): "untempered",
    # A request that sets nothing samples the model's distribution unchanged, as in vLLM.
    ("roles/batch.py", "SamplingParams", "temperature"): "untempered",
    ("roles/batch.py", "SamplingParams", "top_p"): "no nucleus cut",
    ("roles/batch.py", "SamplingParams", "top_k"): "no top-k cut",
    # The role contract's offload(model: bool, optimizer: bool): flags, not the model setting.
    ("roles/trainer.py", "Trainer.offload", "model"): "a flag",
    # The tensor-parallel group's rendezvous address from the worker's environment, not the
    # Ray cluster's address.
    ("roles/engines/vllm_build.py", "EngineGroup", "address"): "another address",
    # The teacher's Megatron forward keeps every position: sequence parallelism is the trainer's.
    ("roles/engines/megatron_trainer.py", "to_megatron", "sequence_parallel"): "the teacher's: off",
    # The device kind of a Swift-Ray device group (GPU/CPU), which no dataclass types.
    ("orchestration/device_groups.py", "plan_device_groups", "device"): "device kind of a group",
    # The torch engine's plain forward when nobody asks for more (benchmarks and tests build the
    # engine alone); a run's choice is TrainerConfig's, which the Trainer always passes.
    ("roles/engines/train_kernels.py", "TrainKernelOptions", "packing"): "the plain forward",
    ("roles/engines/train_kernels.py", "TrainKernelOptions", "compile"): "the plain forward",
    ("roles/engines/train_kernels.py", "TrainKernelOptions", "activation_checkpointing"): "the plain forward",
    ("roles/engines/train_kernels.py", "TrainKernelOptions", "cuda_graphs"): "the plain forward",
    ("roles/engines/train_kernels.py", "TrainKernelOptions", "fused_logprobs"): "the plain forward",
    # Settings that follow from what the code does, not defaults of the config field:
    # distill's SFT phase reads the JSONL file the sampling phase wrote;
    ("algorithms/distill.py", "run", "task"): "the phase's own input",
    # a run restarted after a lost trainer rank continues from its newest checkpoint;
    ("algorithms/runtime/entry.py", "run_with_restarts", "resume"): "what a restart is",
    # GRPO's reference policy never steps (no optimizer), never sleeps, and is one process a rank;
    ("orchestration/planner.py", "with_colocated_role", "offload_optimizer"): "the reference has no optimizer",
    ("orchestration/planner.py", "with_colocated_role", "sleep_level"): "only a rollout sleeps",
    ("orchestration/planner.py", "with_colocated_role", "tensor_parallel_size"): "one process a rank",
    # a checkpoint's weights are read in float32 (the master weights) whatever the compute dtype.
    ("roles/trainer.py", "Trainer.load", "dtype"): "the master weights' dtype",
}

# Repeated defaults not removed yet: an entry goes together with its default. Each names the
# config field it repeats.
TO_REMOVE: dict = {}


@dataclass(frozen=True)
class Finding:
    path: str
    scope: str  # Class.method, function or class holding the default
    name: str
    value: Any
    line: int

    @property
    def key(self) -> Tuple[str, str, str]:
        return self.path, self.scope, self.name


# ----------------------------------------------------------------------------- config fields

def source_files() -> Dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def schema_roots(sources: Dict[str, str]) -> List[type]:
    """The classes that `register_schema(X)`, `.store(..., node=X)` and the drivers'
    `driver_main(X, ...)` calls name (a module-level name)."""
    roots = []
    for path, text in sources.items():
        for call in ast.walk(ast.parse(text)):
            if not isinstance(call, ast.Call):
                continue
            func = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
            if func in ("register_schema", "driver_main"):
                args = call.args[:1]
            elif func == "store":
                args = [k.value for k in call.keywords if k.arg == "node"]
            else:
                continue
            names = [a.id for a in args if isinstance(a, ast.Name)]
            if names:
                module = importlib.import_module(path[:-3].replace("/", "."))
                roots += [getattr(module, n) for n in names if isinstance(getattr(module, n, None), type)]
    return roots


def config_classes(roots: List[type]) -> List[type]:
    """`roots` and every dataclass reachable from them through field types and base classes."""
    seen: List[type] = []
    todo = list(roots)
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        todo += [b for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)]
        for hint in typing.get_type_hints(cls).values():
            todo += [t for t in (hint, *typing.get_args(hint)) if isinstance(t, type) and dataclasses.is_dataclass(t)]
    return seen


def _kinds(hint: Any) -> Optional[tuple]:
    """Python types a literal default of this annotation can have; None: any."""
    if hint is Any:
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin is typing.Union or (origin is not None and origin.__name__ == "UnionType"):
        parts = [_kinds(a) for a in args]
        return None if None in parts else sum(parts, ())
    base = origin or hint
    if base in (list, tuple):
        return (list, tuple)
    if base in NUMBER:
        return NUMBER
    return (base,) if isinstance(base, type) else None


def config_settings(classes: List[type]) -> Dict[str, List[tuple]]:
    """Field name -> [(Class.field, default, literal types it can hold)] of every field with a
    default that is a value (not a nested section)."""
    settings: Dict[str, List[tuple]] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default_factory):
                default = f.default_factory()
            else:
                continue
            settings.setdefault(f.name, []).append((f"{cls.__name__}.{f.name}", default, _kinds(hints[f.name])))
    return settings


def class_locations(classes: List[type]) -> set:
    return {(str(Path(inspect.getsourcefile(c)).resolve().relative_to(ROOT)), c.__name__) for c in classes}


# ----------------------------------------------------------------------------- the scan

def _literal(node: Optional[ast.AST]) -> Tuple[bool, Any]:
    if node is None:
        return False, None
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "field":  # field(default=, default_factory=)
        for k in node.keywords:
            if k.arg == "default":
                return _literal(k.value)
            if k.arg == "default_factory" and isinstance(k.value, ast.Lambda):
                return _literal(k.value.body)
        return False, None
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _fits(value: Any, kinds: Optional[tuple]) -> bool:
    if kinds is None:
        return True
    if isinstance(value, bool):
        return bool in kinds
    return isinstance(value, kinds)


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str, settings: Dict[str, List[tuple]], skip: set):
        self.path, self.settings, self.skip = path, settings, skip
        self.scope: List[str] = []
        self.found: List[Finding] = []

    def _check(self, name: str, node: Optional[ast.AST], line: int) -> None:
        ok, value = _literal(node)
        if ok and value is not None and name in self.settings and any(
                _fits(value, kinds) for _, _, kinds in self.settings[name]):
            self.found.append(Finding(self.path, ".".join(self.scope), name, value, line))

    def _arguments(self, node) -> None:
        a = node.args
        positional = a.posonlyargs + a.args
        for arg, default in zip(positional[len(positional) - len(a.defaults):], a.defaults):
            self._check(arg.arg, default, node.lineno)
        for arg, default in zip(a.kwonlyargs, a.kw_defaults):
            self._check(arg.arg, default, node.lineno)

    def visit_FunctionDef(self, node) -> None:
        self.scope.append(node.name)
        self._arguments(node)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node) -> None:
        self.scope.append("<lambda>")
        self._arguments(node)
        self.generic_visit(node)
        self.scope.pop()

    def visit_ClassDef(self, node) -> None:
        self.scope.append(node.name)
        if (self.path, node.name) not in self.skip:  # a config dataclass holds the defaults
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    self._check(stmt.target.id, stmt.value, stmt.lineno)
        self.generic_visit(node)
        self.scope.pop()

    def visit_Call(self, node) -> None:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if not self.path.startswith("benchmarks/") and (name == "replace" or name.endswith(("Config", "Options"))):
            for k in node.keywords:
                if k.arg is not None:
                    self._check(k.arg, k.value, node.lineno)
        if (isinstance(node.func, ast.Attribute) and node.func.attr == "get" and len(node.args) == 2
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            self._check(node.args[0].value, node.args[1], node.lineno)
        self.generic_visit(node)


def repeated_defaults(sources: Dict[str, str], settings: Dict[str, List[tuple]], skip: set) -> List[Finding]:
    """Literal defaults in `sources` ({path: text}) of the keys in `settings`, outside the
    classes in `skip` ({(path, class name)}: the config dataclasses)."""
    found = []
    for path, text in sources.items():
        scanner = _Scanner(path, settings, skip)
        scanner.visit(ast.parse(text))
        found += scanner.found
    return found


# ----------------------------------------------------------------------------- tests

def _describe(f: Finding, settings: Dict[str, List[tuple]]) -> str:
    where = ", ".join(f"{owner}={default!r}" for owner, default, _ in settings[f.name])
    return f"{f.path}:{f.line} {f.scope}: {f.name}={f.value!r} (config: {where})"


def test_each_default_in_one_place():
    sources = source_files()
    roots = schema_roots(sources)
    # The drivers' and the plan CLI's schemas at least; a lost root would hide its fields.
    assert {"GRPOConfig", "GKDConfig", "SFTConfig", "DistillConfig", "PlanConfig"} <= {
        r.__name__ for r in roots}
    classes = config_classes(roots)
    settings = config_settings(classes)
    found = repeated_defaults(sources, settings, class_locations(classes))
    listed = {**EXCEPTIONS, **TO_REMOVE}
    new = sorted({_describe(f, settings) for f in found if f.key not in listed})
    assert not new, ("literal defaults repeating a config field; drop them and pass the config's value "
                     "(or list a true exception in EXCEPTIONS, saying why):\n  " + "\n  ".join(new))
    stale = sorted(set(listed) - {f.key for f in found})
    assert not stale, f"entries that no longer match a default; delete them: {stale}"


@dataclass
class _ToyConfig:
    # The setting under test.
    lr: float = 1e-5
    # A second one, to catch keyword-only and dataclass-field repeats.
    mode: str = "fast"
    # A seed, to check that a flag of another type is not taken for it.
    seed: int = 0
    # A list setting, given by default_factory.
    tags: List[str] = field(default_factory=lambda: ["a"])


TOY_SOURCE = '''
from dataclasses import dataclass, field


@dataclass
class ToyConfig:
    lr: float = 1e-5


def build(model, lr: float = 3e-4, seed=None, *, mode="fast", verbose=True, tags=("a",)):
    return options.get("lr", 1e-5), options.get("other", 1), options.get("lr", default)


class Engine:
    def __init__(self, seed: int = 0, debug: bool = False):
        self.seed = seed


@dataclass
class Request:
    mode: str = field(default="slow")
    seed: bool = False
    lr: float = LR
'''


def test_scanner_reports_a_repeated_default():
    settings = config_settings(config_classes([_ToyConfig]))
    found = repeated_defaults({"toy.py": TOY_SOURCE}, settings, {("toy.py", "ToyConfig")})
    assert sorted((f.scope, f.name, f.value) for f in found) == [
        ("Engine.__init__", "seed", 0),
        ("Request", "mode", "slow"),
        ("build", "lr", 1e-5),        # options.get("lr", 1e-5)
        ("build", "lr", 3e-4),        # another value is still a second default
        ("build", "mode", "fast"),
        ("build", "tags", ("a",)),
    ]
    # The real settings include the loss's and the roles' keys this test guards.
    real = config_settings(config_classes(schema_roots(source_files())))
    assert {"beta", "temperature", "epsilon", "lr", "bucket_mb", "tensor_parallel_size"} <= set(real)
