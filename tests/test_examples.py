"""The README's training example runs as written, and its planned losses equal plain PyTorch's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]


def test_the_readme_training_command_trains_with_the_plain_losses():
    readme = (REPO / "README.md").read_text()
    match = re.search(r"^\.venv/bin/python (examples/train\.py [^\n]+)$", readme, re.MULTILINE)
    assert match, "the README no longer shows the examples/train.py command"
    arguments = match.group(1).split()[1:] + ["--time-limit", "10"]
    result = subprocess.run([sys.executable, str(REPO / "examples" / "train.py"), *arguments], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"^\s+\d+\s+-?\d", line)]
    steps = int(arguments[arguments.index("--steps") + 1])
    assert len(rows) == steps, result.stdout
    for row in rows:
        assert row[1] == row[2], row  # plain loss == planned loss, as printed
