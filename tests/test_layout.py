"""The layout holds: imports run one way (no circles, no arrow from a lower room to a higher
one), project modules are imported at the top of a module (a function-local import is only
for an optional heavy dependency, said so in a comment), and the docs name only modules,
classes and functions that exist.

The rooms, lowest first (docs/ARCHITECTURE.md draws them):

    roles | orchestration            never each other, never algorithms or benchmarks
    algorithms.data                  tasks, user files, prompt rendering, answer checking
    algorithms.plugins               what an ms-swift plugin file imports (registries: roles/plugins.py)
    algorithms.objectives            losses, advantages, rewards
    algorithms.records               run log, trackers, plots, checkpoints
    algorithms.config                schema, ms-swift key tables, checks
    algorithms.runtime               turn-taking, weight sync, generation ahead, driver entry
    algorithms.<driver>              grpo, gkd, sft, distill
    algorithms.cli                   the rayroles command
    benchmarks                       scripts over everything
"""
from __future__ import annotations

import ast
import builtins
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("roles", "orchestration", "algorithms", "conf")
DRIVERS = ("grpo", "gkd", "sft", "distill")

# Room of a module -> its height; an import may only go to a room of the same height or lower.
ROOMS = [
    ("roles", 0), ("orchestration", 0), ("conf", 0),
    ("algorithms.data", 1), ("algorithms.plugins", 1), ("algorithms.objectives", 2), ("algorithms.records", 3), ("algorithms.config", 4),
    ("algorithms.runtime", 5), *[(f"algorithms.{d}", 6) for d in DRIVERS], ("algorithms.cli", 7),
    ("benchmarks", 8),
]
# Rooms of one height that must not import each other at all.
APART = {("roles", "orchestration"), ("orchestration", "roles")}


def modules() -> dict[str, Path]:
    """Every project module by dotted name; a benchmark script by `benchmarks.<file>`."""
    found = {}
    for pkg in PACKAGES + ("benchmarks",):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


MODULES = modules()
SCRIPTS = {name.split(".", 1)[1]: name for name in MODULES if name.startswith("benchmarks.")}


def room(module: str) -> tuple[str, int]:
    if module == "algorithms":  # the package itself imports nothing
        return module, 0
    for prefix, height in ROOMS:
        if module == prefix or module.startswith(prefix + "."):
            return prefix, height
    raise AssertionError(f"{module} is in no room of tests/test_layout.py ROOMS: give its folder a room")


def target(name: str, importer: str) -> str | None:
    """The project module an imported name resolves to (a benchmark imports its siblings by file name)."""
    if importer.startswith("benchmarks.") and name.split(".")[0] in SCRIPTS:
        return SCRIPTS[name.split(".")[0]]
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module: str, path: Path):
    """(imported module, line, inside a function, the statement's comment) of each project import."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        comment = " ".join(lines[i] for i in range(max(node.lineno - 2, 0), node.end_lineno) if "#" in lines[i])
        for name in names:
            found = target(name, module)
            if found is not None and found != module:
                yield found, node.lineno, id(node) in local, comment


EDGES = {m: list(imports(m, p)) for m, p in MODULES.items()}


def test_no_import_circles():
    graph = defaultdict(set)
    for m, edges in EDGES.items():
        graph[m] |= {t for t, *_ in edges}
    circles, state = [], {}

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                circles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_imports_never_run_up_a_room():
    upward = []
    for m, edges in EDGES.items():
        (here, height) = room(m)
        for t, line, _, _ in edges:
            (there, other) = room(t)
            if other > height or (here, there) in APART:
                upward.append(f"{MODULES[m].relative_to(ROOT)}:{line} imports {t} ({there} is above {here})")
    assert not upward, "\n".join(upward)


def test_project_modules_are_imported_at_the_top():
    """A function-local import of a project module is a seam that was not cut; the only kind
    kept imports an engine module that pulls an optional heavy dependency (vllm, deepspeed,
    megatron) at import time, and says so in a comment holding 'lazy'."""
    local = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t} inside a function"
             for m, edges in EDGES.items() for t, line, inside, comment in edges
             if inside and "lazy" not in comment.lower()]
    assert not local, "\n".join(local)


def test_every_algorithms_file_has_a_room():
    """A newcomer places every file of algorithms/ by its folder: drivers and the command at the
    top, the rest in the rooms."""
    top = {p.stem for p in (ROOT / "algorithms").glob("*.py")} - {"__init__"}
    assert top == set(DRIVERS) | {"cli"}, f"files at the top of algorithms/ that belong in a room: {top - set(DRIVERS) - {'cli'}}"
    for folder in (p for p in (ROOT / "algorithms").iterdir() if p.is_dir() and p.name != "__pycache__"):
        if any(folder.glob("*.py")):
            init = folder / "__init__.py"
            assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), \
                f"{folder.relative_to(ROOT)}/__init__.py must say what the room owns"


# ----------------------------------------------------------------------------- docs

DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
DOTTED = re.compile(r"^(algorithms|roles|orchestration|benchmarks|conf|tests)[./][\w./]*$")
CODE_NAME = re.compile(r"^(?:[A-Z][a-z0-9]+[A-Z]\w*|[A-Z][A-Z0-9]*_[A-Z0-9_]+|[a-z_][a-z0-9_]*_[a-z0-9_]*\(\))$")
# Names the docs cite from other projects (each a real name there).
ELSEWHERE = {
    "GRPOTrainer", "GKDTrainer", "RayHelper", "LoRARequest", "PeftModel", "AutoModelForCausalLM", "GPTModel",
    "PlacementGroupSchedulingStrategy", "HydraConfig", "DictConfig", "ConfigStore", "DeepSpeedEngine",
    "LLM.generate", "SamplingParams", "CUDA_VISIBLE_DEVICES", "VLLM_ENABLE_V1_MULTIPROCESSING",
    "RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "DS_BUILD_OPS", "OPENBLAS_CORETYPE", "MASTER_ADDR",
    "MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE", "MLFLOW_TRACKING_URI", "HF_HOME", "HF_HUB_CACHE",
    "NCCL_P2P_DISABLE", "WANDB_MODE", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_LOGS", "RAY_ADDRESS",
    "TOKENIZERS_PARALLELISM", "OMP_NUM_THREADS", "CUDA_LAUNCH_BLOCKING", "from_pretrained()",
    "save_pretrained()", "apply_chat_template()", "reload_weights()", "collective_rpc()",
    "load_state_dict()", "state_dict()", "init_process_group()", "get_rank()", "all_reduce()",
    "RemoteFunction", "ActorHandle", "ObjectRef", "ObjectStore", "MKL_NUM_THREADS", "RayTaskError",
    "DynamicCache", "AutoTokenizer", "ray_inited()",
}


def defined_names() -> set[str]:
    """Every class, function and module-level name defined in the project, the builtins, and
    every identifier the code spells as a string (the environment variables it sets or reads)."""
    names = set(dir(builtins))
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def resolves(token: str) -> bool:
    """A dotted module (with an attribute or a method after it) or a repository path."""
    path = token.rstrip("/").split("::")[0]
    if "/" in path:
        return (ROOT / path).exists() or (ROOT / path).with_suffix(".py").exists()
    parts = path.rstrip("()").split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in MODULES or (ROOT / Path(*parts[:cut])).is_dir():
            rest = parts[cut:]
            return not rest or all(r in NAMES for r in rest)
    return False


NAMES = defined_names()


def doc_tokens():
    for path in DOCS + [p for p in MODULES.values()]:
        text = path.read_text()
        if path.suffix == ".py":  # docstrings and comments only say what exists too
            text = "\n".join(ast.get_docstring(n) or "" for n in ast.walk(ast.parse(text))
                             if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)))
        for token in re.findall(r"`([^`\n]+)`", text):
            yield path, token.strip()


def test_docs_name_only_what_exists():
    missing = set()
    for path, token in doc_tokens():
        if DOTTED.match(token):
            if not resolves(token):
                missing.add(f"{path.relative_to(ROOT)}: `{token}`")
        elif CODE_NAME.match(token) and token not in ELSEWHERE and token.rstrip("()") not in NAMES:
            missing.add(f"{path.relative_to(ROOT)}: `{token}`")
    assert not missing, "docs name what does not exist:\n" + "\n".join(sorted(missing))


def test_no_docstring_cites_a_file_outside_the_repository():
    cites = [f"{p.relative_to(ROOT)}" for p in MODULES.values() if re.search(r"DESIGN\s*§", p.read_text())]
    assert not cites, f"these cite DESIGN §N, which is not in the repository: {cites}"


@pytest.mark.parametrize("package", ["algorithms", "roles", "roles.engines", "orchestration"])
def test_each_package_says_what_it_owns(package):
    init = ROOT / Path(*package.split(".")) / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and len(doc.splitlines()) >= 3, f"{init.relative_to(ROOT)}: a docstring of a few lines saying what it owns"
