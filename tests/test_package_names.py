"""A user's own module named like one of mosos's top-level packages, beside their script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_users_models_py_beside_the_script_is_named_not_a_bare_import_error(tmp_path):
    """`models` is mosos's package of reference networks; a user's models.py beside their training script came
    first on sys.path and optimize() failed deep inside with "'models' is not a package"."""
    (tmp_path / "models.py").write_text("MINE = 1\n")
    script = tmp_path / "train.py"
    script.write_text(f"import sys\nsys.path.insert(1, {str(ROOT)!r})\nimport executor\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "ImportError: mosos's executor needs its own package 'models'" in last, result.stderr[-800:]
    assert str(tmp_path / "models.py") in last and "rename yours" in last
    (tmp_path / "models.py").unlink()
    assert subprocess.run([sys.executable, str(script)], capture_output=True, cwd=tmp_path, timeout=120).returncode == 0
