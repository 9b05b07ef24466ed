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


WORKLOAD = (
    "import torch\n"
    "def build(batch_size=512):\n"
    "    torch.manual_seed(0)\n"
    "    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),\n"
    "                                torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),\n"
    "                                torch.nn.GELU(), torch.nn.Linear(64, 3))\n"
    "    inputs = torch.randn(batch_size, 16)\n"
    "    targets = torch.randint(0, 3, (batch_size,))\n"
    "    return model, inputs, targets, torch.nn.functional.cross_entropy\n"
)


def _train(arguments, pythonpath=None):
    import os

    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(REPO / "examples" / "train.py"), *arguments, "--time-limit", "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


def test_train_takes_a_users_workload_as_a_file_or_a_module(tmp_path):
    (tmp_path / "my_workload.py").write_text(WORKLOAD)
    for spec, pythonpath in ((f"{tmp_path / 'my_workload.py'}:build", None), ("my_workload:build", tmp_path)):
        result = _train(["--model", spec, "--memory-ratio", "0.8", "--steps", "2"], pythonpath)
        assert result.returncode == 0, result.stderr[-2000:]
        rows = [line.split() for line in result.stdout.splitlines() if re.match(r"^\s+\d+\s+-?\d", line)]
        assert len(rows) == 2 and all(row[1] == row[2] for row in rows), result.stdout


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_here:build", "no module named 'no_such_module_here'"),
    ("{tmp}/my_workload.py:nope", "defines no 'nope'"),
    ("{tmp}/missing.py:build", "does not exist"),
])
def test_train_refuses_a_bad_workload_spec_with_a_message(tmp_path, spec, message):
    (tmp_path / "my_workload.py").write_text(WORKLOAD)
    result = _train(["--model", spec.format(tmp=tmp_path)])
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
