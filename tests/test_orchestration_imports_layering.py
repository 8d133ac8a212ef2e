"""orchestration/ imports one way: no circle between its modules, no project import inside a
function (a circle patched by a local import is a seam that was not cut), never a role or an
algorithm module; and the names other packages import from it stay where they are."""
import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "orchestration"
PROJECT = ("orchestration", "roles", "algorithms")


def modules() -> dict[str, ast.Module]:
    return {f"orchestration.{p.stem}": ast.parse(p.read_text()) for p in sorted(PACKAGE.glob("*.py"))
            if p.stem != "__init__"}


def imported(node: ast.AST) -> list[str]:
    """The modules an import statement names (`from orchestration import dispatch` names
    orchestration.dispatch)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        if node.module == "orchestration":
            return [f"orchestration.{a.name}" for a in node.names]
        return [node.module]
    return []


def test_no_project_import_inside_a_function():
    local = []
    for name, tree in modules().items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                local += [f"{name}:{n.lineno} {m}" for n in ast.walk(fn) for m in imported(n)
                          if m.split(".")[0] in PROJECT]
    assert not local, f"move these imports to the module top: {local}"


def test_never_imports_roles_or_algorithms():
    wrong = [f"{name}:{n.lineno} {m}" for name, tree in modules().items() for n in ast.walk(tree)
             for m in imported(n) if m.split(".")[0] in ("roles", "algorithms")]
    assert not wrong, wrong


def test_module_imports_form_no_circle():
    mods = modules()
    edges = {name: {m for n in ast.walk(tree) for m in imported(n) if m in mods} for name, tree in mods.items()}
    done: set = set()

    def visit(name: str, path: tuple) -> None:
        if name in path:
            raise AssertionError(f"import circle: {' -> '.join(path[path.index(name):] + (name,))}")
        if name in done:
            return
        for dep in sorted(edges[name]):
            visit(dep, path + (name,))
        done.add(name)

    for name in sorted(mods):
        visit(name, ())


def test_placement_vocabulary_sits_below_config_and_planner():
    """plan_types (names, Plan, PlanError) imports no project module; config imports no planner."""
    mods = modules()
    deps = {name: {m for n in ast.walk(tree) for m in imported(n) if m.split(".")[0] in PROJECT}
            for name, tree in mods.items()}
    assert deps["orchestration.plan_types"] == set()
    assert deps["orchestration.config"] == {"orchestration.plan_types"}
    assert "orchestration.planner" not in deps["orchestration.device_groups"]


# The names other packages (algorithms, benchmarks, tests) import, by module.
PUBLIC = {
    "orchestration.config": ["ConfigError", "WeightSyncConfig", "ClusterConfig", "BackendConfig", "PlacementConfig",
                             "PlanConfig", "register_schema", "checked_command_line", "placement_dict", "validate",
                             "apply_placement", "read_config_file", "split_config_file", "PLACEMENT_KEYS",
                             "unknown_override"],
    "orchestration.planner": ["make_plan", "Plan", "PlanError", "as_started", "with_colocated_role"],
    "orchestration.device_groups": ["parse_ranks"],
}


@pytest.mark.parametrize("module", PUBLIC)
def test_public_names_stay_importable(module):
    found = importlib.import_module(module)
    assert [n for n in PUBLIC[module] if not hasattr(found, n)] == []


def test_no_private_name_crosses_modules():
    """Modules use each other's public names only."""
    crossing = [f"{name}:{n.lineno} {n.module}.{a.name}" for name, tree in modules().items() for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("orchestration")
                for a in n.names if a.name.startswith("_")]
    assert not crossing, crossing
