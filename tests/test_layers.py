"""The executor's stages import one way: capture, then the step engine, then measure, then plan and replay. A module
that imports a stage above its own (at the top or inside a function) fails here, with where."""

from __future__ import annotations

import ast
from pathlib import Path

EXECUTOR = Path(__file__).resolve().parent.parent / "executor"
ORDER = ["capture", "engine", "measure", "plan", "replay"]
# plan/ hands its plan to replay/'s PlannedModule (optimize() builds one): the one import upward, until optimize()
# moves above both
ALLOWED_UP = {("plan", "replay")}


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
