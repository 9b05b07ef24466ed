"""The executor's stages import one way: capture, then the step engine, then measure, then plan and replay. A module
that imports a stage above its own (at the top or inside a function) fails here, with where."""

from __future__ import annotations

import ast
from pathlib import Path

EXECUTOR = Path(__file__).resolve().parent.parent / "executor"
ORDER = ["capture", "engine", "measure", "plan", "replay"]
ALLOWED_UP: set[tuple[str, str]] = set()  # none: optimize() lives in replay/, above the plan cache it uses


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        stages = {parts[1] for parts in (name.split(".") for name in names)
                  if len(parts) >= 2 and parts[0] == "executor" and parts[1] in ORDER}
        for stage in sorted(stages):
            yield node.lineno, stage


def test_the_executor_stages_import_one_way():
    wrong = []
    for stage in ORDER:
        for path in sorted((EXECUTOR / stage).glob("*.py")):
            for line, imported in _imports(path):
                if ORDER.index(imported) > ORDER.index(stage) and (stage, imported) not in ALLOWED_UP:
                    wrong.append(f"{path.relative_to(EXECUTOR.parent)}:{line} imports executor.{imported}")
    assert not wrong, "\n".join(wrong)


def test_the_check_finds_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from executor.replay.replay import PlannedModule\n")
    assert list(_imports(module)) == [(2, "replay")]


def test_the_import_contracts_hold():
    """pyproject.toml's import-linter contracts (planner below everything, the packages and the executor's stages
    one way), as CI's `lint-imports` checks them."""
    import subprocess
    import sys

    lint_imports = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint_imports), "--no-cache"], capture_output=True, text=True, cwd=EXECUTOR.parent,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def _imports_inside_functions(path: Path, packages: tuple[str, ...]):
    tree = ast.parse(path.read_text())
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            module = node.module if isinstance(node, ast.ImportFrom) else (
                node.names[0].name if isinstance(node, ast.Import) else None)
            if module and module.split(".")[0] in packages:
                yield node.lineno, module


def test_the_planner_hides_no_import_inside_a_function():
    """Its shared names live on the ground floor (planner.errors, planner.options), so no module of the planner
    imports another inside a function to dodge a circle."""
    planner = EXECUTOR.parent / "planner"
    found = [f"{path.relative_to(planner.parent)}:{line} imports {module}"
             for path in sorted(planner.rglob("*.py")) for line, module in _imports_inside_functions(path, ("planner",))]
    assert not found, "\n".join(found)


def test_the_function_import_check_finds_one(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import planner.errors\n\ndef f():\n    from planner.planning import plan\n")
    assert list(_imports_inside_functions(module, ("planner",))) == [(4, "planner.planning")]


def test_an_import_kept_inside_a_function_says_why():
    """Outside the planner, a module may defer an import to a function for start-up time (OR-Tools, torch, Ray,
    matplotlib load in a second or more); a comment says so. The executor's stages and the planner defer none."""
    root = EXECUTOR.parent
    missing = []
    for package in ("api", "cli", "cluster", "models", "executor"):
        for path in sorted((root / package).rglob("*.py")):
            found = list(_imports_inside_functions(path, ("planner", "executor", "api", "cli", "cluster", "models")))
            if not found:
                continue
            text = path.read_text()
            lazy_package = path.name == "__init__.py" and "def __getattr__" in text  # attributes loaded on first use
            if not lazy_package and "deferred for start-up time" not in text:
                missing.append(f"{path.relative_to(root)}:{found[0][0]} imports {found[0][1]} inside a function")
    assert not missing, "\n".join(missing)
