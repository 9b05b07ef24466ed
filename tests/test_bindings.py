"""The generated step calls ATen through torch's public bindings where they call exactly the node's overload with
the node's arguments (a microsecond or two less a call than the operator's own entry), and never where a public
binding would choose another overload."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.fx as fx  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import executor  # noqa: E402
from executor.engine.bindings import public_binding  # noqa: E402

ATEN = torch.ops.aten


def _node(target, args, value=None):
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 6, device="meta")
    args = tuple(x if a == "x" else a for a in args)
    node = graph.call_function(target, args)
    node.meta["val"] = torch.empty(4, 6, device="meta") if value is None else value
    return node


def test_a_public_binding_is_used_where_it_dispatches_the_same_overload_with_the_same_arguments():
    assert public_binding(_node(ATEN.mul.Tensor, ("x", "x"))) is torch._C._VariableFunctions.mul
    assert public_binding(_node(ATEN.sum.dim_IntList, ("x", [0], True), torch.empty(1, 6, device="meta"))) \
        is torch._C._VariableFunctions.sum
    assert public_binding(_node(ATEN.view.default, ("x", [24]), torch.empty(24, device="meta"))) \
        is torch._C.TensorBase.view


def test_a_public_binding_that_would_call_anything_else_is_not_used():
    """torch.add(x, 1) is add.Tensor with a wrapped number, not add.Scalar: another overload. torch._C._nn.mse_loss
    called with the node's two arguments dispatches mse_loss with reduction 0 (none), where the operator's default is
    1 (mean): the same overload, other arguments. Both keep the operator's own entry."""
    assert public_binding(_node(ATEN.add.Scalar, ("x", 1))) is None
    loss = _node(ATEN.mse_loss.default, ("x", "x"), torch.empty((), device="meta"))
    assert public_binding(loss) is None
    assert public_binding(_node(ATEN.mul.Tensor, ("x", 2.0))) is torch._C._VariableFunctions.mul  # the same call


def test_a_planned_step_calls_its_elementwise_operators_through_public_bindings_and_matches_eager():
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(3) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())])
    plain = copy.deepcopy(model)
    x, t = torch.randn(4, 8), torch.randn(4, 8)
    planned = executor.optimize(model, (x,), F.mse_loss, targets=t, strategy="keep-all", budget=None,
                                progress=False, timed_steps=0, cache=False)
    loss = planned(x, t)
    loss.backward()
    operators = [value for name, value in planned._prepared.program.constants.items() if name.startswith("op_")]
    owners = (torch._C._VariableFunctions, torch._C._nn, torch._C.TensorBase)
    public = {value.__name__ for value in operators
              if any(getattr(owner, getattr(value, "__name__", ""), None) is value for owner in owners)}
    assert {"tanh", "mm", "sum", "view"} <= public, public
    reference = F.mse_loss(plain(x), t)
    reference.backward()
    assert torch.equal(loss, reference)
    for mine, theirs in zip(model.parameters(), plain.parameters()):
        assert torch.equal(mine.grad, theirs.grad)
