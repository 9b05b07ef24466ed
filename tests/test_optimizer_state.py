"""The optimizer's state against what the plan counted (executor.replay.optimizer_state).

optimize() counts the optimizer's state as fixed memory from its `optimizer=` ("sgd" by default: none). AdamW
stepped under such a plan held 2x the parameters more than the budget allowed for, with no message (22% over the
budget on a small model). Now the first step of an optimizer holding more state than counted is refused."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import executor  # noqa: E402
from executor.errors import ReplayError  # noqa: E402


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 64), nn.Tanh()]
    for _ in range(6):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 4))


def _data():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2048, 16, generator=generator), torch.randint(0, 4, (2048,), generator=generator)


def _planned(model, **options):
    x, y = _data()
    options = {"memory_ratio": 0.8} | options
    return executor.optimize(model, (x,), F.cross_entropy, targets=y, time_limit_s=3, workers=1, cache=False,
                             progress=False, timed_steps=0, **options)


def _step(planned, optimizer):
    x, y = _data()
    planned(x, y).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_adamw_under_a_plan_that_counted_no_state_is_refused_before_it_allocates_any():
    model = _model()
    planned = _planned(model)  # optimizer="sgd", the default: no state counted
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ReplayError, match=r"AdamW would keep \d+ bytes .* its plan counted 0 bytes .* "
                                          r"optimize\(\.\.\., optimizer=opt\) \(or name its kind, optimizer='adamw'\)"):
        _step(planned, optimizer)
    assert not optimizer.state  # refused before the step: no moment allocated, no weight changed
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_an_optimizer_passed_to_optimize_or_named_is_counted_and_steps():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    planned = _planned(model, optimizer=optimizer)
    for _ in range(2):
        _step(planned, optimizer)
    model = _model()
    planned = _planned(model, optimizer="momentum")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(planned, optimizer)
    with pytest.raises(ReplayError, match="Adam would keep"):  # a second optimizer on the same parameters: its own
        _step(planned, torch.optim.Adam(model.parameters()))


class _Averaging(torch.optim.Optimizer):
    """A kind optimize() does not know: keeps a running average of every parameter."""

    def __init__(self, parameters, lr=0.1):
        super().__init__(parameters, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                average = self.state[p].setdefault("average", torch.zeros_like(p))
                average.mul_(0.9).add_(p, alpha=0.1)
                p.add_(p.grad, alpha=-group["lr"])


def test_an_optimizer_of_an_unknown_kind_is_measured_on_a_probe_before_its_first_step():
    model = _model()
    planned = _planned(model)
    optimizer = _Averaging(model.parameters())
    with pytest.raises(ReplayError, match=r"_Averaging would keep \d+ bytes .*optimizer=opt\), and the plan"):
        _step(planned, optimizer)
    assert not optimizer.state


class _NeedsAClosure(_Averaging):
    """A kind whose fresh copy cannot be stepped on a probe: measured after its first step instead."""

    def step(self, closure=None):
        if closure is None:
            raise RuntimeError("this optimizer needs a closure")
        return super().step()


def test_an_optimizer_that_cannot_be_probed_is_measured_after_its_first_step():
    model = _model()
    planned = _planned(model)
    x, y = _data()
    planned(x, y).backward()
    optimizer = _NeedsAClosure(model.parameters())
    with pytest.raises(ReplayError, match=r"_NeedsAClosure keeps \d+ bytes"):
        optimizer.step(closure=lambda: None)


def test_without_a_budget_nothing_is_checked():
    model = _model()
    x, y = _data()
    planned = executor.optimize(model, (x,), F.cross_entropy, targets=y, budget=None, strategy="keep-all",
                                cache=False, progress=False)
    _step(planned, torch.optim.AdamW(model.parameters(), lr=1e-3))


def test_an_optimizer_of_a_kind_not_listed_is_counted_when_passed_to_optimize():
    """Adadelta (2 buffers a parameter) was refused by optimize() as an unknown optimizer whatever one passed, so
    no budget could be kept with it; passed itself, its state is measured on a probe parameter and counted."""
    from executor.measure.profiler import optimizer_state_bytes

    model = _model()
    optimizer = torch.optim.Adadelta(model.parameters())
    assert optimizer_state_bytes(optimizer, 1000) == 2000
    assert optimizer_state_bytes(_Averaging(model.parameters()), 1000) == 1000
    planned = _planned(model, optimizer=optimizer)
    for _ in range(2):
        _step(planned, optimizer)


def test_a_model_planned_again_is_checked_against_its_newest_plan():
    """The first plan (no state counted) may still be alive when the model is planned again for AdamW: only the
    newest plan of a model speaks for its optimizer."""
    model = _model()
    first = _planned(model)  # kept alive on purpose
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    second = _planned(model, optimizer=optimizer)
    _step(second, optimizer)
    assert first.schedule is not None


def _frozen_midway(optimizer_option):
    """Two steps of AdamW, then five of the six middle layers frozen (as after loading a whole model's checkpoint to
    fine-tune part of it): the optimizer keeps their moments. Planned then at the smallest budget."""
    from planner.errors import BudgetError

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _data()
    for _ in range(2):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for layer in list(model)[2:12]:
        layer.requires_grad_(False)
    option = optimizer if optimizer_option == "the optimizer" else optimizer_option
    with pytest.raises(BudgetError) as below:
        _planned(model, optimizer=option, budget=1, memory_ratio=None)
    planned = _planned(model, optimizer=option, budget=below.value.minimum_budget_bytes, memory_ratio=None)
    return model, planned, optimizer


def test_the_state_an_optimizer_keeps_for_parameters_frozen_after_it_stepped_is_counted():
    """A model planned again because parameters were frozen counted state for the trainable ones only, while AdamW
    still held its moments for the frozen ones: a tiny GPT-2 went 2.3 MB over its budget every step, silently."""
    from executor.measure.allocations import AllocationTrace
    from executor.measure.profiler import distinct_storage_bytes

    model, planned, optimizer = _frozen_midway("the optimizer")
    x, y = _data()
    resident = distinct_storage_bytes([*model.parameters(), x, y, *(v for s in optimizer.state.values()
                                                                     for v in s.values() if torch.is_tensor(v))])
    with AllocationTrace() as trace:
        planned(x, y).backward()
    optimizer.step()
    held = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert planned.profile.fixed_memory.optimizer_state_bytes == distinct_storage_bytes(held)
    assert resident + trace.peak_bytes <= planned.schedule.budget_bytes


def test_a_kind_that_leaves_out_the_frozen_parameters_state_is_refused_without_advice_that_fails():
    model, planned, optimizer = _frozen_midway("adamw")
    with pytest.raises(ReplayError, match=r"AdamW would keep .* frozen, whose state it still holds.* "
                                          r"optimize\(\.\.\., optimizer=opt\), and the plan") as refused:
        _step(planned, optimizer)
    assert "optimizer='adamw'" not in str(refused.value)


def _planned_tightly(model, optimizer):
    """Planned at the smallest budget that works, so that state beyond what was counted breaks it."""
    from planner.errors import BudgetError

    with pytest.raises(BudgetError) as below:
        _planned(model, optimizer=optimizer, budget=1, memory_ratio=None)
    return _planned(model, optimizer=optimizer, budget=below.value.minimum_budget_bytes, memory_ratio=None)


def test_state_that_comes_after_the_first_step_is_checked_when_it_comes():
    """The state was checked at an optimizer's first step only: a param group added later (the backbone, after the
    head was fine-tuned alone) or momentum turned on later went 10-15% over the budget, silently."""
    model = _model()
    head, backbone = list(model)[-1], list(model)[:-1]
    adding = torch.optim.AdamW(head.parameters(), lr=1e-3)
    planned = _planned_tightly(model, adding)
    _step(planned, adding)
    _step(planned, adding)  # the same optimizer, unchanged: not refused, not looked at again
    adding.add_param_group({"params": [p for layer in backbone for p in layer.parameters()], "lr": 1e-4})
    with pytest.raises(ReplayError, match=r"AdamW would keep \d+ bytes .* its plan counted \d+ bytes"):
        _step(planned, adding)

    model = _model()
    momentum = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.0)
    planned = _planned_tightly(model, momentum)
    _step(planned, momentum)
    momentum.param_groups[0]["momentum"] = 0.9
    with pytest.raises(ReplayError, match=r"SGD would keep \d+ bytes .*\(with its settings now: momentum, "
                                          r"nesterov\), but its plan counted 0 bytes"):
        _step(planned, momentum)


def test_the_state_of_every_optimizer_stepping_the_module_is_counted_together():
    """Two optimizers over two halves of a model, the first passed to optimize(): each held less than the plan
    counted for the first, so neither was refused, while together they went 9% over the budget."""
    model = _model()
    layers = list(model)
    first = torch.optim.AdamW([p for layer in layers[:8] for p in layer.parameters()], lr=1e-3)
    second = torch.optim.AdamW([p for layer in layers[8:] for p in layer.parameters()], lr=1e-3)
    planned = _planned_tightly(model, first)
    x, y = _data()
    planned(x, y).backward()
    first.step()
    with pytest.raises(ReplayError, match=r"AdamW would keep \d+ bytes .*, and the other optimizers stepping the "
                                          r"module hold \d+ bytes .* optimize\(\) takes one optimizer"):
        second.step()
    assert not second.state


def test_a_parameter_that_gets_no_gradient_gets_no_state():
    """A parameter read under no_grad only has no gradient, so SGD keeps no momentum for it; the check counted one
    and refused a step that fits, telling the user to pass the optimizer they had passed."""

    class PartlyFrozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.shift = _model(), nn.Parameter(torch.zeros(256, 1024))

        def forward(self, x):
            with torch.no_grad():
                hint = self.shift[0, :16]
            return self.body(x + hint)

    model = PartlyFrozen()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    planned = _planned_tightly(model, optimizer)
    _step(planned, optimizer)
    _step(planned, optimizer)
    assert model.shift.grad is None and model.shift not in optimizer.state


@pytest.mark.parametrize("copied_by", ["deepcopy", "pickle"])
def test_a_copy_of_a_planned_module_has_its_optimizer_checked_too(copied_by):
    import copy
    import pickle

    planned = _planned(_model())  # optimizer="sgd": no state counted
    copied = copy.deepcopy(planned) if copied_by == "deepcopy" else pickle.loads(pickle.dumps(planned))
    optimizer = torch.optim.AdamW(copied.model.parameters(), lr=1e-3)
    with pytest.raises(ReplayError, match=r"AdamW would keep \d+ bytes .* its plan counted 0 bytes"):
        _step(copied, optimizer)
