"""`mosos estimate` without torch: a clear message and exit code 2, and the planner CLI still loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
sys.modules["torch"] = None  # makes `import torch` fail as if it were not installed
from typer.testing import CliRunner
from cli import app
result = CliRunner().invoke(app, ["estimate", "--model", "vgg16", "--batch", "1", "--gpu", "p40", "-o", "x.json"])
print(result.exit_code)
print(result.output)
"""


def test_estimate_without_torch_says_what_to_install(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    code, _, output = done.stdout.partition("\n")
    assert code == "2"
    assert "needs torch" in output and "pip install torch" in output
    assert "Traceback" not in output + done.stderr
    assert not (tmp_path / "x.json").exists()
