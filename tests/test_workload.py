"""Loading a user's training workload from `file.py:build` or `package.module:build`."""

from __future__ import annotations

import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from models.workload import Workload, WorkloadError, load_workload, looks_like_spec, reference_workload, split_spec  # noqa: E402

GOOD = """
import torch
from torch import nn
import torch.nn.functional as F

def build(batch_size=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    return {"model": model, "inputs": torch.randn(batch_size, 8), "targets": torch.randint(3, (batch_size,)),
            "loss_fn": F.cross_entropy}

def as_tuple():
    model = nn.Linear(8, 3)
    return model, (torch.randn(2, 8),), torch.randn(2, 3), F.mse_loss

def fixed():
    return {"model": nn.Linear(2, 1), "inputs": [torch.randn(5, 2)], "loss": lambda out: out.sum()}

def broken():
    return helper()

def helper():
    raise ValueError("no such dataset")

def wrong():
    return [1, 2]

def not_a_model():
    return {"model": "resnet", "inputs": torch.randn(1), "loss_fn": F.mse_loss}

def unknown_key():
    return {"model": nn.Linear(1, 1), "inputs": torch.randn(1, 1), "loss_fn": F.mse_loss, "optimiser": "adam"}

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent(GOOD))
    return path


def test_a_file_spec_gives_a_workload_that_trains(user_file):
    workload = load_workload(f"{user_file}:build")
    assert isinstance(workload, Workload)
    assert workload.inputs[0].shape == (4, 8)
    loss = workload.loss()
    loss.backward()
    assert loss.dim() == 0 and all(p.grad is not None for p in workload.model.parameters())


def test_batch_size_is_passed_when_asked(user_file):
    assert load_workload(f"{user_file}:build", batch_size=7).inputs[0].shape == (7, 8)
    assert load_workload(f"{user_file}:build", batch_size=7).batch_size == 7


def test_tuple_and_loss_key_forms(user_file):
    workload = load_workload(f"{user_file}:as_tuple")
    assert workload.targets.shape == (2, 3)
    fixed = load_workload(f"{user_file}:fixed")
    assert fixed.targets is None and fixed.loss().dim() == 0


def test_a_module_spec(tmp_path, monkeypatch, user_file):
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_model", None)
    assert load_workload("my_model:build").inputs[0].shape == (4, 8)


@pytest.mark.parametrize(
    "suffix, message",
    [
        (":broken", "broken() raised ValueError: no such dataset (in helper, my_model.py:"),
        (":wrong", "returned a list; return a dict with model, inputs, targets and loss_fn"),
        (":not_a_model", "a model that is a str, not a torch.nn.Module"),
        (":unknown_key", "unknown key(s) ['optimiser']"),
        (":missing", "defines no 'missing' (it defines: "),
        (":NOT_CALLABLE", "'NOT_CALLABLE' in"),
    ],
)
def test_every_mistake_is_a_message(user_file, suffix, message):
    with pytest.raises(WorkloadError) as caught:
        load_workload(f"{user_file}{suffix}")
    assert message in str(caught.value)


def test_a_fixed_batch_build_refuses_another_batch(user_file):
    with pytest.raises(WorkloadError, match=r"takes no batch_size parameter.*def fixed\(batch_size=...\)"):
        load_workload(f"{user_file}:fixed", batch_size=8)


def test_specs_that_cannot_be_loaded(tmp_path):
    with pytest.raises(WorkloadError, match="is not a workload spec"):
        split_spec("my_model.py")
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(f"{tmp_path}/nothing.py:build")
    with pytest.raises(WorkloadError, match="is a directory"):
        load_workload(f"{tmp_path}/:build")
    with pytest.raises(WorkloadError, match="no module named 'no_such_package_x'"):
        load_workload("no_such_package_x:build")
    bad = tmp_path / "syntax.py"
    bad.write_text("def build(:\n")
    with pytest.raises(WorkloadError, match=r"importing .*syntax.py failed: SyntaxError: .*\(syntax.py:1: def build\(:\)"):
        load_workload(f"{bad}:build")  # where the parser stopped, not an importlib frame
    # sys.exit ended mosos with exit code 0 and nothing written, as if it had succeeded
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\ndef build(batch_size=2):\n    sys.exit(0)\n")
    with pytest.raises(WorkloadError, match=r"build\(\) called sys.exit\(0\) instead of returning the model"):
        load_workload(f"{exits}:build")
    script = tmp_path / "script.py"
    script.write_text("import sys\nsys.exit()\ndef build(batch_size=2):\n    pass\n")
    with pytest.raises(WorkloadError, match=r"importing .*script.py called sys.exit\(\); keep the training script"):
        load_workload(f"{script}:build")
    assert looks_like_spec("a.py:build") and not looks_like_spec("vgg19")


def test_reference_networks_are_workloads_too():
    workload = reference_workload("vgg16", 2, small=True)
    assert workload.inputs[0].shape[0] == 2 and workload.loss().dim() == 0
    with pytest.raises(WorkloadError, match="unknown model 'vgg99'"):
        reference_workload("vgg99", 2)
