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


def test_planner_imports_none_of_the_other_packages():
    """planner/ is the library the CLI, the service and the executor use: it imports none of them, not even lazily."""
    import ast

    others = {"api", "cli", "executor", "models"}
    found = []
    for path in sorted((REPO / "planner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{path.relative_to(REPO)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in others]
    assert not found, "\n".join(found)
