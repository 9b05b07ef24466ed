"""A planned step's loss carries no autograd edge per parameter unless a hook waits for one
(executor.replay.gradient_edges): what eager gives stays given, and what the replay cannot give is refused, not
answered with None or nothing, however the loss is combined before the call."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from executor.errors import ReplayError  # noqa: E402
from executor.replay.gradient_edges import PlannedLoss, edge_anchor  # noqa: E402
from tests.test_replay_python_state import data, planned_pair, step_equal  # noqa: E402


def _edges(loss: torch.Tensor) -> list:
    return [node for node, _ in loss.grad_fn.next_functions]


def test_a_step_without_hooks_has_one_edge_and_trains_as_plain_pytorch():
    model, plain, planned, _ = planned_pair()
    x, y = data(1)
    loss = planned(x, y)
    assert isinstance(loss, PlannedLoss) and len(_edges(loss)) == 1
    assert _edges(loss)[0].variable is edge_anchor()
    loss.backward()
    assert edge_anchor().grad is None
    assert step_equal(model, plain, planned, 2)
    assert step_equal(model, plain, planned, 3)  # gradients accumulate onto the last ones as in eager: set to None
    scaled_loss, plain_scaled = planned(*data(4)) * 3, F.cross_entropy(plain(data(4)[0]), data(4)[1]) * 3
    for parameter in list(model.parameters()) + list(plain.parameters()):
        parameter.grad = None
    scaled_loss.backward()
    plain_scaled.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters()))


def _calls(model):
    parameters = list(model.parameters())
    other = nn.Parameter(torch.ones(3))
    return parameters, other, [
        ("autograd.grad", lambda loss: torch.autograd.grad(loss, parameters)),
        ("autograd.grad", lambda loss: torch.autograd.grad(loss * 2, parameters[:1], allow_unused=True)),
        ("autograd.grad", lambda loss: torch.autograd.grad(loss + other.sum(), parameters, allow_unused=True,
                                                            materialize_grads=True)),
        ("autograd.grad", lambda loss: torch.autograd.grad(loss, inputs={"a": parameters[0]})),
        ("inputs=", lambda loss: loss.backward(inputs=parameters)),
        ("inputs=", lambda loss: (loss + other.sum()).backward(inputs=[parameters[1]])),
        ("inputs=", lambda loss: torch.autograd.backward([loss / 4], inputs=[parameters[0]])),
    ]


@pytest.mark.parametrize("index", range(7))
def test_every_way_to_ask_for_some_parameters_gradients_is_refused_and_leaves_grad_alone(index):
    """Without the edges, autograd would leave the step out of these calls: None, zeros or nothing, silently."""
    model, _, planned, _ = planned_pair()
    parameters, _, calls = _calls(model)
    kind, call = calls[index]
    match = "torch.autograd.grad on a planned step" if kind == "autograd.grad" else \
        "backward\\(inputs=...\\) on a planned step over its parameters"
    with pytest.raises(ReplayError, match=match):
        call(planned(*data(1)))
    assert all(p.grad is None for p in parameters)


def test_gradients_of_other_tensors_through_a_planned_loss_are_eagers():
    """Asked for another model's parameter only, the call is eager's: the step's gradients are not part of it."""
    model, _, planned, _ = planned_pair()
    other = nn.Parameter(torch.tensor([1.0, 2.0]))
    (gradient,) = torch.autograd.grad(planned(*data(1)) + (other ** 2).sum(), [other])
    assert type(gradient) is torch.Tensor and torch.equal(gradient, torch.tensor([2.0, 4.0]))
    loss = planned(*data(2))
    (loss * 0 + other.sum()).backward(inputs=[other])
    assert torch.equal(other.grad, torch.ones(2)) and all(p.grad is None for p in model.parameters())


def test_a_post_accumulate_hook_gives_every_parameter_its_edge_and_the_old_refusals():
    model, plain, planned, _ = planned_pair()
    seen = []
    model.b.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    loss = planned(*data(1))
    assert type(loss) is torch.Tensor and len(_edges(loss)) == len(list(model.parameters()))
    loss.backward()
    assert len(seen) == 1
    with pytest.raises(ReplayError, match="that leaves out some parameters"):
        planned(*data(2)).backward(inputs=[model.a.weight])


def test_a_hook_registered_between_forward_and_backward_is_refused_before_any_gradient():
    model, _, planned, _ = planned_pair()
    loss = planned(*data(1))
    model.a.bias.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(ReplayError, match="registered .* after this step's forward began"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_double_backward_is_still_refused_on_the_anchor():
    _, _, planned, _ = planned_pair()
    with pytest.raises(ReplayError, match="create_graph=True"):
        planned(*data(1)).backward(create_graph=True)


def test_what_a_loop_keeps_of_the_loss_is_a_plain_tensor_that_loads_anywhere(tmp_path):
    """A logged or saved loss holds nothing of mosos': torch.load's weights_only refuses classes it does not know."""
    _, _, planned, _ = planned_pair()
    loss = planned(*data(1))
    kept = {"detached": loss.detach(), "item": loss.item(), "loss": loss, "scaled": loss * 2}
    assert type(kept["detached"]) is torch.Tensor and isinstance(kept["scaled"], PlannedLoss)
    torch.save(kept, tmp_path / "kept.pt")
    loaded = torch.load(tmp_path / "kept.pt", weights_only=True)
    assert {type(value) for key, value in loaded.items() if key != "item"} == {torch.Tensor}
    assert torch.equal(loaded["detached"], kept["detached"]) and loaded["item"] == kept["item"]
    total = torch.zeros(())
    total += loss.detach()
    assert type(total) is torch.Tensor
    loss.backward()
