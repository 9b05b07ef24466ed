"""The planner, its strategies and the CLI import and run on a machine without torch."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

HIDE_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("torch is hidden for this test", name=name)
sys.meta_path.insert(0, _NoTorch())
"""


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", HIDE_TORCH + code], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_planner_imports_without_torch():
    result = run_without_torch(
        "import planner, cli, planner.strategies\n"
        "planner.strategies.load_all()\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_cli_help_without_torch():
    result = run_without_torch("sys.argv = ['mosos', '--help']\nfrom cli import main\nmain()\n")
    assert result.returncode == 0, result.stderr
    assert "plan" in result.stdout and "simulate" in result.stdout


def _imports_of(folder: str, packages: set[str]) -> list[str]:
    """Every import (top level or inside a function) of one of `packages` in the .py files under `folder`."""
    import ast

    found = []
    for path in sorted((REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in packages]
    return found


def test_planner_imports_none_of_the_other_packages():
    """planner/ is the library the CLI, the service and the executor use: it imports none of them, not even lazily."""
    found = _imports_of("planner", {"api", "cli", "executor", "models"})
    assert not found, "\n".join(found)


def test_models_import_no_executor():
    """models/ (reference networks, the GPU table, the estimator) never imports executor/, not even lazily: what
    needs the profiler or the capture (measured profiles of a workload, estimates of a user's model) lives there."""
    found = _imports_of("models", {"executor", "api", "cli"})
    assert not found, "\n".join(found)


def test_the_import_scan_sees_lazy_imports(tmp_path, monkeypatch):
    """The scan is not vacuous: an import inside a function of a file under the folder is found."""
    import tests.test_no_torch as this

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def f():\n    from executor.measure.profiler import profile_model\n")
    monkeypatch.setattr(this, "REPO", tmp_path)
    assert this._imports_of("pkg", {"executor"}) == ["pkg/m.py:2 imports executor.measure.profiler"]
