"""Inside orchestration/: the placement vocabulary (plan_types) sits below config and the
planner, and modules use each other's public names only. (No circle, no function-local
import, no import of roles or algorithms: tests/test_layout.py, for every package.)"""
import ast
from pathlib import Path

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


def test_placement_vocabulary_sits_below_config_and_planner():
    """plan_types (names, Plan, PlanError) imports no project module; config imports no planner."""
    mods = modules()
    deps = {name: {m for n in ast.walk(tree) for m in imported(n) if m.split(".")[0] in PROJECT}
            for name, tree in mods.items()}
    assert deps["orchestration.plan_types"] == set()
    assert deps["orchestration.config"] == {"orchestration.plan_types"}
    assert "orchestration.planner" not in deps["orchestration.device_groups"]


def test_no_private_name_crosses_modules():
    """Modules use each other's public names only."""
    crossing = [f"{name}:{n.lineno} {n.module}.{a.name}" for name, tree in modules().items() for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("orchestration")
                for a in n.names if a.name.startswith("_")]
    assert not crossing, crossing
