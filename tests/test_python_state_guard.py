"""The fingerprint's tensors part: given again where Dynamo's TensorGuards passes, read in Python otherwise; the
two must always agree, so that a change to a parameter's trainability, dtype, shape or layout is never missed."""

from __future__ import annotations

import sys

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from executor.capture import python_state  # noqa: E402


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


CHANGES = [
    ("trainable", lambda m: m[0].weight.requires_grad_(False)),
    ("dtype", lambda m: setattr(m[0].weight, "data", m[0].weight.data.double())),
    ("shape", lambda m: setattr(m[2].bias, "data", torch.zeros(3))),
    ("strides", lambda m: setattr(m[2].weight, "data", torch.zeros(8, 2).t())),
    ("buffer", lambda m: setattr(m[1], "running_mean", torch.zeros(8, dtype=torch.float64))),
    ("a parameter more", lambda m: m[0].register_parameter("extra", nn.Parameter(torch.ones(1)))),
]


@pytest.mark.parametrize("what, change", CHANGES, ids=[c[0] for c in CHANGES])
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "python"])
def test_every_change_to_a_tensor_is_seen_with_the_guard_and_without(what, change, guarded, monkeypatch):
    if not guarded:
        monkeypatch.setitem(sys.modules, "torch._C._dynamo.guards", None)  # the import fails: no guard
    python_state._TENSOR_STATES.clear()
    model = _model()
    before = python_state.python_state(model, None)
    assert python_state.python_state(model, None) == before  # given again (guarded) or read again
    assert bool(python_state._TENSOR_STATES) is guarded
    change(model)
    after = python_state.python_state(model, None)
    assert after != before
    parameters = list(model.parameters())
    buffers = list(model.buffers())
    assert after[1] == python_state._tensors_state_in_python(parameters, buffers)


def test_two_models_of_the_same_count_never_share_a_state():
    python_state._TENSOR_STATES.clear()
    first, second = _model(), _model()
    second[2].bias.data = torch.zeros(5)
    assert python_state.python_state(first, None)[1] != python_state.python_state(second, None)[1]
    assert python_state.python_state(first, None)[1] == python_state._tensors_state_in_python(
        list(first.parameters()), list(first.buffers()))
